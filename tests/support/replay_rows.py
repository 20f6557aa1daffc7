"""Rows for the replay buffer tests: ``obs`` encodes (stream, time), and the samplers' shortcuts."""

from __future__ import annotations

import numpy as np

from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.data.samplers import RowSampler, SequenceSampler


def make_row(t: int, num_envs: int, is_first=None, pixels: bool = False) -> dict:
    """Row whose obs encodes (stream, time): obs[e] = [e, t]."""
    streams = np.arange(num_envs)
    row = {
        "obs": np.stack([streams, np.full(num_envs, t)], axis=1).astype(np.int64),
        "reward": np.full(num_envs, float(t)),  # float64 in, stored float32
        "is_first": np.zeros(num_envs, bool) if is_first is None else np.asarray(is_first, bool),
        "is_last": np.zeros(num_envs, bool),
        "is_terminal": np.zeros(num_envs, bool),
        "action": np.full(num_envs, t % 3, dtype=np.int64),
    }
    if pixels:
        row["pixels"] = np.full((num_envs, 4, 4, 3), t % 256, dtype=np.uint8)
    return row


def rows(buf: ReplayBuffer, batch_size: int) -> dict:
    return RowSampler().sample(buf, batch_size)


def seqs(buf: ReplayBuffer, batch_size: int, length: int, cross_episodes: bool = True) -> dict:
    return SequenceSampler(length, cross_episodes).sample(buf, batch_size)


def fill(buf: ReplayBuffer, steps: int, **kw) -> None:
    for t in range(steps):
        buf.add(make_row(t, buf.num_streams, **kw))
