"""How well does M dream where a good controller goes? M against real long CartPole episodes.

A controller trained only inside M's dream can only be as good as M is in the states such a
controller visits. M is trained on recorded episodes (random-policy ones at first: about 22
steps each, the pole always falls), so this script plays real pixel CartPole-v1 episodes with a
balancing rule on the env's own state (``theta + 0.3 theta' + 0.02 x + 0.1 x' > 0`` pushes
right, a random action with probability ``--noise``), encodes the frames with V and reports:

* M's done probability along those episodes, teacher-forced (it should stay near 0 while
  the pole is up: a rising value means M counts time instead of reading the state);
* the open-loop error of M's mixture-mean prediction per horizon, from steps 0 / 10 / 40
  under the recorded actions (mean squared error per latent dimension), beside the error of
  "nothing moves" (the start latent held fixed): a dream worse than that has the pole going
  where the real one did not;
* how far apart 10 steps of all-left and all-right take M's prediction (does M respond to
  actions at all).

    python bench/worldmodels_dream_check.py --workdir bench_runs/worldmodels_cartpole
    python bench/worldmodels_dream_check.py --workdir W --memory-run worldmodels-cartpole_pixels-memory-round3

``--workdir`` is a folder of ``bench/worldmodels_cartpole.py`` (its V and M checkpoints).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HORIZONS = (1, 5, 10, 20, 40)
STARTS = (0, 10, 40)
DONE_MARKS = (10, 20, 40, 60, 100, 150, 200, 299)


def balanced_episodes(episodes: int, steps: int, noise: float, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Real pixel episodes (frames ``uint8 [T+1, 64, 64, 3]``, actions ``[T]``) of the balancing
    rule, cropped as ``configs/worldmodels/cartpole_pixels`` records them."""
    from lightning_wm.envs import EnvConfig, make_env

    env = make_env(
        EnvConfig("CartPole-v1", pixels=True, keep_state=True, size=(64, 64), crop=(160, 0, 160, 600), seed=seed)
    )
    rng = np.random.default_rng(seed)
    out = []
    for e in range(episodes):
        obs, _ = env.reset(seed=seed + e)
        frames, actions = [obs["image"]], []
        for _ in range(steps):
            x, x_dot, theta, theta_dot = obs["state"]
            action = int(theta + 0.3 * theta_dot + 0.02 * x + 0.1 * x_dot > 0)
            if rng.random() < noise:
                action = int(rng.integers(2))
            obs, _, terminated, truncated, _ = env.step(action)
            frames.append(obs["image"])
            actions.append(action)
            if terminated or truncated:
                break
        out.append((np.stack(frames), np.array(actions)))
    env.close()
    return out


def mixture_mean(memory, heads: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean of M's predicted mixture ``[B, Z]``."""
    if memory.net.mixture == "per_dim":  # logit_pi [B, Z, K], mu [B, Z, K, 1]
        return (torch.softmax(heads["logit_pi"], -1) * heads["mu"].squeeze(-1)).sum(-1)
    return (torch.softmax(heads["logit_pi"], -1).unsqueeze(-1) * heads["mu"]).sum(-2)  # [B, K] x [B, K, Z]


def warm_up(memory, mu: torch.Tensor, action_in: torch.Tensor, start: int):
    """M's LSTM state after reading the real latents and actions before ``start`` (zeros at 0)."""
    state = memory.initial_state(1, torch.device("cpu"))
    for t in range(start):
        _, state = memory.step(mu[t : t + 1], action_in[t : t + 1], state)
    return state


def open_loop(memory, state, z: torch.Tensor, action_in: torch.Tensor) -> list[torch.Tensor]:
    """M from ``state`` and the real latent ``z [1, Z]``, fed its own mixture means under
    ``action_in [N, A]``: the predicted latents ``[1, Z]`` of the next ``N`` steps.

    (:meth:`Memory.open_loop_dream` is the sampled twin, from a zero state: a dream as the
    controller sees it; here the mean prediction is measured.)"""
    predicted = []
    for a in action_in:
        out, state = memory.step(z, a[None], state)
        z = mixture_mean(memory, memory.heads(out))
        predicted.append(z)
    return predicted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="bench_runs/worldmodels_cartpole")
    p.add_argument("--vision-run", default="worldmodels-cartpole_pixels-vision")
    p.add_argument("--memory-run", default="worldmodels-cartpole_pixels-memory")
    p.add_argument("--episodes", type=int, default=6)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--noise", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=100)
    args = p.parse_args()
    torch.set_num_threads(1)
    from lightning_wm.agents.worldmodels.memory import Memory
    from lightning_wm.agents.worldmodels.vision import Vision

    logs = Path(args.workdir) / "lightning_logs"
    vision = Vision.load_from_checkpoint(logs / args.vision_run / "checkpoints/last.ckpt", map_location="cpu").eval()
    memory = Memory.load_from_checkpoint(logs / args.memory_run / "checkpoints/last.ckpt", map_location="cpu").eval()
    episodes = balanced_episodes(args.episodes, args.steps, args.noise, args.seed)
    print(f"{len(episodes)} real episodes of the balancing rule, lengths {[len(a) for _, a in episodes]}")
    with torch.no_grad():
        encoded = [
            (vision.encode(torch.as_tensor(frames))[0], memory.action_input(torch.as_tensor(actions)))
            for frames, actions in episodes
        ]
        print("\nM's done probability along them (teacher-forced), at step:")
        print("| episode | " + " | ".join(str(t) for t in DONE_MARKS) + " |")
        print("| ---: |" + " ---: |" * len(DONE_MARKS))
        for i, (mu, action_in) in enumerate(encoded):
            out, _ = memory.unroll(mu[None, :-1], action_in[None])
            p_done = torch.sigmoid(memory.next_done_logit(memory.heads(out[0]), mu[1:]))
            print(
                f"| {i} | "
                + " | ".join(f"{float(p_done[t]):.2f}" if t < len(p_done) else "" for t in DONE_MARKS)
                + " |"
            )
        variance = float(torch.cat([mu for mu, _ in encoded]).var(0).mean())
        print(
            f"\nOpen-loop MSE per latent dimension (variance of the latents over these episodes: {variance:.3f});"
            " M's mixture mean / start latent held fixed:"
        )
        print("| from step | " + " | ".join(f"h={h}" for h in HORIZONS) + " | 10 steps left vs right |")
        print("| ---: |" + " --- |" * (len(HORIZONS) + 1))
        for start in STARTS:
            errors = {h: [] for h in HORIZONS}
            frozen = {h: [] for h in HORIZONS}
            spread = []
            for mu, action_in in encoded:
                if len(action_in) < start + max(HORIZONS) + 1:
                    continue
                state, z = warm_up(memory, mu, action_in, start), mu[start : start + 1]
                predicted = open_loop(memory, state, z, action_in[start : start + max(HORIZONS)])
                for h in HORIZONS:
                    real = mu[start + h : start + h + 1]
                    errors[h].append(float((predicted[h - 1] - real).pow(2).mean()))
                    frozen[h].append(float((mu[start : start + 1] - real).pow(2).mean()))
                left, right = (
                    open_loop(memory, state, z, memory.action_input(torch.full((10,), a)))[-1] for a in (0, 1)
                )
                spread.append(float((left - right).pow(2).mean()))
            if spread:
                print(
                    f"| {start} | "
                    + " | ".join(f"{np.mean(errors[h]):.3f} / {np.mean(frozen[h]):.3f}" for h in HORIZONS)
                    + f" | {np.mean(spread):.3f} |"
                )


if __name__ == "__main__":
    main()
