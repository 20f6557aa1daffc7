"""What the probes of a stopped run share (``bench/dreamer_probe.py``, ``bench/muzero_probe.py``):
the run's module and replay from its folder, windows of consecutive replay rows, how well a
prediction tells rewarded rows from the others, the real discounted returns a value is set
against, and the table they print."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytorch_lightning as pl
import torch
import yaml
from benchlib import unshadow_minatar

from lightning_wm.callbacks import BufferCheckpoint
from lightning_wm.checkpoints import load_checkpoint, load_module
from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.env_config import EnvConfig
from lightning_wm.envs import env_spec

M = TypeVar("M", bound=pl.LightningModule)


def load_run(cls: type[M], run: Path, checkpoint: Path | None) -> tuple[M, ReplayBuffer]:
    """The run's ``cls`` module (frozen, eval mode) and the replay its checkpoint names (the file
    :class:`~lightning_wm.callbacks.BufferCheckpoint` wrote at the checkpoint's step, beside it)."""
    checkpoint = checkpoint or run / "bench.ckpt"
    config = yaml.safe_load((run / "config.yaml").read_text())
    spec = env_spec(EnvConfig(**config["data"]["init_args"]["env"]))
    module = load_module(cls, checkpoint, env_spec=spec)
    record = load_checkpoint(checkpoint).get("replay_buffers")
    replay = BufferCheckpoint.saved_file(record, "replay", 0, checkpoint)[0] if record else None  # as a resume looks
    if replay is None:
        name = BufferCheckpoint.filename("replay", 0, record["step"]) if record else "no replay_buffers record"
        raise SystemExit(
            f"error: {checkpoint} names no replay file that exists ({name}); "
            f"give a {cls.__name__} run folder saved with its replay (bench/minatar.py --run-dir)"
        )
    return module, ReplayBuffer.load(replay, seed=0)


def probe_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every probe takes: the run folder, its checkpoint, the windows and the seed."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: RUN/bench.ckpt")
    parser.add_argument("--windows", type=int, default=256)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def run_windows(cls: type[M], args: argparse.Namespace, script: str) -> tuple[M, ReplayBuffer, dict[str, torch.Tensor]]:
    """The run's module and replay (:func:`load_run`) and ``args.windows`` seeded windows of it, on
    one thread; ``script`` (the probe's ``__file__``) must not shadow the ``minatar`` package."""
    unshadow_minatar(script)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    module, buffer = load_run(cls, args.run, args.checkpoint)
    return module, buffer, windows(buffer, args.windows, args.length)


def windows(buffer: ReplayBuffer, n: int, length: int) -> dict[str, torch.Tensor]:
    """``n`` windows of ``length`` consecutive rows of one stream each, ``[n, length, ...]``."""
    stream, slot = buffer.draw(n, span=length)
    slots = (slot[:, None] + np.arange(length)[None]) % buffer.cap_per_stream
    return buffer.gather(stream[:, None], slots)


def seen(name: str, predicted: torch.Tensor, reward: torch.Tensor, rewarded: torch.Tensor) -> dict[str, float]:
    """Mean prediction on rewarded rows and elsewhere; the share of rewards predicted at least half;
    the AUC (:func:`auc`). ``predicted``, ``reward``, ``rewarded``: the same shape."""
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


def action_shares(logits: torch.Tensor, action: torch.Tensor) -> dict[str, float]:
    """Each action's share of the policy's argmax (``logits [..., A]``) on the replayed states and
    of the replay's actions."""
    A = logits.shape[-1]
    mode = torch.bincount(logits.argmax(-1).flatten(), minlength=A).float()
    taken = torch.bincount(action.long().flatten(), minlength=A).float()
    return {
        "policy's argmax, share per action": " / ".join(f"{x:.2f}" for x in (mode / mode.sum()).tolist()),
        "replay's actions, share per action": " / ".join(f"{x:.2f}" for x in (taken / taken.sum()).tolist()),
    }


def discounted_returns(
    value: torch.Tensor, reward: torch.Tensor, terminal: torch.Tensor, last: torch.Tensor, discount: float
) -> torch.Tensor:
    """The real discounted return ``G [N, L]`` from every row of windows ``[N, L]``:
    ``G_t = r_{t+1} + γ (1 - terminal_{t+1}) G_{t+1}`` (``reward[:, t]`` is earned entering row
    ``t``), to the window's end (bootstrapped with ``value`` there) or the episode's last row (0 if
    terminal, else ``value``)."""
    end = torch.where(terminal, torch.zeros_like(value), value)  # the return from an episode's last row
    returns = torch.empty_like(value)
    ret = end[:, -1]
    returns[:, -1] = ret
    for t in range(reward.shape[1] - 2, -1, -1):
        ret = reward[:, t + 1] + discount * (~terminal[:, t + 1]).float() * ret
        ret = torch.where(last[:, t], end[:, t], ret)  # the next row starts another episode
        returns[:, t] = ret
    return returns


def print_figures(title: str, figures: dict[str, Any]) -> None:
    """The probe's figures as a two-column markdown table."""
    print(f"| {title} | value |\n| --- | ---: |")
    for name, value in figures.items():
        print(f"| {name} | {_cell(value)} |")


def _cell(value: float | str) -> str:
    if isinstance(value, str):
        return value
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:.4g}"
