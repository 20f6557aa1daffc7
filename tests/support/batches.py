"""Synthetic replay batches the model tests share (``[B, L, ...]``, the row convention)."""

from __future__ import annotations

import torch


def pendulum_batch(B: int = 3, L: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """``B`` sequences of ``L`` random Pendulum-v1 rows (obs ``[B, L, 3]``, actions in [-2, 2]),
    each starting an episode at its first row, none ending."""
    g = torch.Generator().manual_seed(seed)
    is_first = torch.zeros(B, L, dtype=torch.bool)
    is_first[:, 0] = True
    return {
        "obs": torch.randn(B, L, 3, generator=g),
        "action": torch.rand(B, L, 1, generator=g) * 4 - 2,
        "reward": -torch.rand(B, L, generator=g),
        "is_first": is_first,
        "is_last": torch.zeros(B, L, dtype=torch.bool),
        "is_terminal": torch.zeros(B, L, dtype=torch.bool),
    }
