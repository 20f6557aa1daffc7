"""How much of a latent store's reward a head could learn: the share of held-out variance an MLP
on ``(z_t, a_t)`` explains of ``r_{t+1}`` and of the mean of the next ``k`` rewards
(``loss.reward_horizon``), the choice between the two targets of M's reward head.

    python bench/reward_predictability.py data/worldmodels/carracing/latents --horizons 1 10

Rows whose next ``k`` rewards hold one below ``--outlier`` (CarRacing's -100 for leaving the
playfield) are left out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from lightning_wm.agents.worldmodels.losses import episode_forward_mean


def load_rows(directory: Path, horizon: int, outlier: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [N, Z + A], target [N])`` over the store's ``t -> t+1`` pairs without an outlier ahead."""
    xs, targets = [], []
    for path in sorted(directory.glob("*.npz")):
        episode = np.load(path)
        reward = torch.as_tensor(episode["reward"]).float()[None]
        is_first = torch.as_tensor(episode["is_first"])[None]
        mean = episode_forward_mean(reward, is_first, horizon)[0, 1:]
        clean = episode_forward_mean((reward < outlier).float(), is_first, horizon)[0, 1:] == 0
        action = episode["action"].reshape(len(reward[0]), -1)
        xs.append(torch.as_tensor(np.concatenate([episode["mu"], action], 1)[:-1]).float()[clean])
        targets.append(mean[clean])
    return torch.cat(xs), torch.cat(targets)


def explained_variance(x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int) -> float:
    """``1 - MSE / Var`` on a held-out tenth of an MLP (2 x 128, Adam 1e-3) fitted on the rest."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(y), generator=g)
    test, train = order[: len(y) // 10], order[len(y) // 10 :]
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(x.shape[1], 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 1),
    )
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    for _ in range(epochs):
        for rows in train[torch.randperm(len(train), generator=g)].split(256):
            loss = (net(x[rows]).squeeze(-1) - y[rows]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        mse = (net(x[test]).squeeze(-1) - y[test]).pow(2).mean().item()
    return 1.0 - mse / y[test].var().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="a latent store (the output of `convert`)")
    parser.add_argument("--horizons", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--outlier", type=float, default=-50.0)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| target | rows | variance | explained (held-out tenth) |\n| --- | ---: | ---: | ---: |")
    for horizon in args.horizons:
        x, y = load_rows(args.directory, horizon, args.outlier)
        share = explained_variance(x, y, args.epochs, args.seed)
        name = "r_{t+1}" if horizon == 1 else f"mean of the next {horizon}"
        print(f"| {name} | {len(y)} | {y.var().item():.3f} | {share:.2f} |")


if __name__ == "__main__":
    main()
