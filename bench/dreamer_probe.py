"""What a Dreamer run's networks make of its own replay: whether the reward head sees the real
rewards (from the posterior, and from the prior that imagination steps with), how sure the actor
is, how often imagination dreams a reward against the replay's real rate, and the critic's values
against the real discounted returns. For a run that does not learn, it says which part is blind.

    python bench/dreamer_probe.py /work/runs/dr/dreamer-asterix-seed0 --windows 256 --length 64

``RUN`` is a ``bench/minatar.py --run-dir`` run folder (``config.yaml``, ``bench.ckpt`` and the
replay file the checkpoint names) or any folder holding a Dreamer checkpoint (``--checkpoint``),
its ``config.yaml`` and the replay file saved with that checkpoint. Windows of ``--length`` rows are drawn
uniformly from the replay (seeded); a reward counts as seen where the prediction is at least half
of it.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from benchlib import unshadow_minatar

from lightning_wm.agents.dreamer import Dreamer
from lightning_wm.callbacks import BufferCheckpoint
from lightning_wm.checkpoints import load_checkpoint, load_module
from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.env_config import EnvConfig
from lightning_wm.envs import env_spec


def load_run(run: Path, checkpoint: Path | None) -> tuple[Dreamer, ReplayBuffer]:
    """The run's Dreamer (frozen, eval mode) and the replay its checkpoint names (the file
    :class:`~lightning_wm.callbacks.BufferCheckpoint` wrote at the checkpoint's step, beside it)."""
    checkpoint = checkpoint or run / "bench.ckpt"
    config = yaml.safe_load((run / "config.yaml").read_text())
    spec = env_spec(EnvConfig(**config["data"]["init_args"]["env"]))
    module = load_module(Dreamer, checkpoint, env_spec=spec)
    record = load_checkpoint(checkpoint).get("replay_buffers")
    replay = BufferCheckpoint.saved_file(record, "replay", 0, checkpoint)[0] if record else None  # as a resume looks
    if replay is None:
        name = BufferCheckpoint.filename("replay", 0, record["step"]) if record else "no replay_buffers record"
        raise SystemExit(
            f"error: {checkpoint} names no replay file that exists ({name}); "
            "give a Dreamer run folder saved with its replay (bench/minatar.py --run-dir)"
        )
    return module, ReplayBuffer.load(replay, seed=0)


def windows(buffer: ReplayBuffer, n: int, length: int) -> dict[str, torch.Tensor]:
    """``n`` windows of ``length`` consecutive rows of one stream each, ``[n, length, ...]``."""
    stream, slot = buffer.draw(n, span=length)
    slots = (slot[:, None] + np.arange(length)[None]) % buffer.cap_per_stream
    return buffer.gather(stream[:, None], slots)


@torch.no_grad()
def probe(module: Dreamer, batch: dict[str, torch.Tensor]) -> dict[str, float | str]:
    """The probe's figures over the windows ``batch [N, L, ...]``."""
    wm, dist = module.wm, module.actor_distribution
    _, _, post = module.world_model_loss(batch)
    feat = torch.cat([post["h"], post["z"]], -1)  # [N, L, F]
    reward = batch["reward"].float()
    rewarded = reward != 0
    from_post = wm.head_mean(wm.reward_head(feat))
    prior = wm._sample(wm.prior_stats(post["h"]), None, mode=True)  # what imagination steps with
    from_prior = wm.head_mean(wm.first_layer(wm.reward_head, {"h": post["h"], **prior}))
    raw = module.actor_output(feat)
    entropy = dist.entropy_and_log_prob(raw, raw, False)[0]  # the draw is unused without log_prob
    value = wm.head_mean(module.critic(feat))
    figures = {
        "rows": float(reward.numel()),
        "real reward a row": float(reward.mean()),
        "rewarded rows": float(rewarded.float().mean()),
        **_seen("posterior", from_post, reward, rewarded),
        **_seen("prior", from_prior, reward, rewarded),
        "actor entropy (nats)": float(entropy.mean()),
        "actor entropy, of uniform": float(entropy.mean()) / math.log(raw.shape[-1]) if module.discrete else math.nan,
        **(_action_shares(raw, batch["action"]) if module.discrete else {}),
        **_real_returns(value, reward, batch, module.behavior.discount),
    }
    figures.update(_imagined(module, post))
    return figures


def _seen(name: str, predicted: torch.Tensor, reward: torch.Tensor, rewarded: torch.Tensor) -> dict[str, float]:
    """Mean prediction on rewarded rows and elsewhere; the share of rewards predicted at least half."""
    if not rewarded.any():
        return {f"{name}: rewarded rows in the windows": 0.0}
    hit = (predicted[rewarded] / reward[rewarded]) >= 0.5
    return {
        f"{name}: predicted on rewarded rows": float(predicted[rewarded].mean()),
        f"{name}: real on rewarded rows": float(reward[rewarded].mean()),
        f"{name}: predicted elsewhere": float(predicted[~rewarded].mean()),
        f"{name}: rewards seen (>= half)": float(hit.float().mean()),
        f"{name}: AUC, rewarded rows above the others": auc(predicted, rewarded),
    }


def auc(score: torch.Tensor, positive: torch.Tensor) -> float:
    """The probability that a positive row's ``score`` is above a negative one's (Mann-Whitney;
    ties count half): 0.5 is a head that tells them apart no better than chance."""
    score, positive = score.flatten().double(), positive.flatten()
    pos, neg = score[positive], score[~positive]
    if not len(pos) or not len(neg):
        return math.nan
    above = (pos[:, None] > neg[None]).double().mean() + 0.5 * (pos[:, None] == neg[None]).double().mean()
    return float(above)


def _action_shares(raw: torch.Tensor, action: torch.Tensor) -> dict[str, float]:
    """Each action's share of the actor's argmax on the replayed states and of the replay's actions."""
    A = raw.shape[-1]
    mode = torch.bincount(raw.argmax(-1).flatten(), minlength=A).float()
    taken = torch.bincount(action.long().flatten(), minlength=A).float()
    return {
        "actor's argmax, share per action": " / ".join(f"{x:.2f}" for x in (mode / mode.sum()).tolist()),
        "replay's actions, share per action": " / ".join(f"{x:.2f}" for x in (taken / taken.sum()).tolist()),
    }


def _real_returns(value: torch.Tensor, reward: torch.Tensor, batch: dict, discount: float) -> dict[str, float]:
    """The critic's value ``[N, L]`` on the first half of each window against the real discounted
    return from there: ``G_t = r_{t+1} + γ (1 - terminal_{t+1}) G_{t+1}``, to the window's end
    (bootstrapped with the critic there) or the episode's last row (0 if terminal, else the
    critic's value)."""
    returns = discounted_returns(value, reward, batch["is_terminal"].bool(), batch["is_last"].bool(), discount)
    half = reward.shape[1] // 2
    return {
        "critic value (first half)": float(value[:, :half].mean()),
        "real discounted return (first half)": float(returns[:, :half].mean()),
    }


def discounted_returns(
    value: torch.Tensor, reward: torch.Tensor, terminal: torch.Tensor, last: torch.Tensor, discount: float
) -> torch.Tensor:
    """``G [N, L]`` of :func:`_real_returns` (``reward[:, t]`` is earned entering row ``t``)."""
    end = torch.where(terminal, torch.zeros_like(value), value)  # the return from an episode's last row
    returns = torch.empty_like(value)
    ret = end[:, -1]
    returns[:, -1] = ret
    for t in range(reward.shape[1] - 2, -1, -1):
        ret = reward[:, t + 1] + discount * (~terminal[:, t + 1]).float() * ret
        ret = torch.where(last[:, t], end[:, t], ret)  # the next row starts another episode
        returns[:, t] = ret
    return returns


def _imagined(module: Dreamer, post: dict[str, Any]) -> dict[str, float]:
    """Imagine the run's horizon from every replayed posterior state with the actor."""
    start = {k: v.reshape(-1, *v.shape[2:]) for k, v in post.items() if k in ("h", "z", "idx")}
    traj = module.imagine(start, torch.ones(start["h"].shape[0]))
    rewards = traj["rewards"]
    return {
        "imagined reward a step": float(rewards.mean()),
        "imagined steps with a reward >= 0.5": float((rewards >= 0.5).float().mean()),
        "imagined λ-return": float(traj["returns"].mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: RUN/bench.ckpt")
    parser.add_argument("--windows", type=int, default=256)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    unshadow_minatar(__file__)  # bench/minatar.py must not shadow the minatar package
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    module, buffer = load_run(args.run, args.checkpoint)
    figures = probe(module, windows(buffer, args.windows, args.length))
    print(f"| {args.run.name} | value |\n| --- | ---: |")
    for name, value in figures.items():
        print(f"| {name} | {_cell(value)} |")


def _cell(value: float | str) -> str:
    if isinstance(value, str):
        return value
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:.4g}"


if __name__ == "__main__":
    main()
