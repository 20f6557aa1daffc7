"""Replay batches read as MuZero's unroll windows (pure functions).

A :class:`~lightning_wm.data.samplers.WindowSampler` batch holds, per sample, ``h`` history rows
before the sampled position and ``W = K + n + 1`` rows from it (``K`` unroll steps, ``n`` the
n-step horizon); :func:`read_window` turns it into a :class:`Window`: the model's input at every
row from the position on (frame stacks of ``h + 1`` frames when ``frame_stack > 1``) and the
columns the targets read, without touching the batch. :func:`window_rows` says how many rows the
settings read, :func:`window_fit` whether a sampler's windows fit them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_wm.agents.muzero.settings import ReanalyseSettings, UnrollSettings

__all__ = ["Window", "read_window", "push_frame", "window_stacks", "window_rows", "window_fit", "fitting_sampler"]

NEEDED = ("obs", "action", "reward", "is_last", "is_terminal", "mask")


def push_frame(stack: Tensor, frame: Tensor) -> Tensor:
    """``stack [B, K, ...]`` (oldest first) with ``frame [B, ...]`` appended and the oldest dropped."""
    return torch.cat([stack[:, 1:], frame.unsqueeze(1).to(stack.dtype)], 1)


def window_stacks(obs: Tensor, mask: Tensor, frames: int) -> Tensor:
    """Frame stacks of every row from ``frames - 1`` on: ``obs [B, L, ...]`` with ``mask [B, L]``
    -> ``[B, L - frames + 1, frames, ...]`` (oldest first); frames of masked rows (before the
    episode's first row, after its end) are zeros, as an acting stack starts from zeros."""
    obs = obs * mask.view(*mask.shape, *([1] * (obs.dim() - 2))).to(obs.dtype)
    return obs.unfold(1, frames, 1).movedim(-1, 2)


@dataclass
class Window:
    """A batch of ``B`` unroll windows of ``W`` rows from the sampled positions.

    Attributes:
        obs: ``[B, W, *obs_shape]`` the model's input at each row (a frame stack for frames).
        action, reward: ``[B, W]`` (row convention).
        is_last, is_terminal, mask: ``[B, W]`` bool; ``mask``: the rows that exist and belong to
            the position's episode up to and including its last row.
        visit_probs: ``[B, W, A]`` the stored search policies (zeros where none ran).
        root_value: ``[B, W]`` float, the stored search values (0 where none ran).
        weight: ``[B]`` importance weights (prioritized replay), or None.
        age: ``[B]`` rows written to each position's stream since it, or None.
        row_index, row_generation: ``[B, W]`` the rows' buffer indices and generations, or None.
    """

    obs: Tensor
    action: Tensor
    reward: Tensor
    is_last: Tensor
    is_terminal: Tensor
    mask: Tensor
    visit_probs: Tensor
    root_value: Tensor
    weight: Tensor | None = None
    age: Tensor | None = None
    row_index: Tensor | None = None
    row_generation: Tensor | None = None

    def columns(self) -> dict[str, Tensor]:
        """The columns :func:`~lightning_wm.agents.muzero.targets.muzero_targets` reads."""
        return {
            "reward": self.reward,
            "is_last": self.is_last,
            "is_terminal": self.is_terminal,
            "action": self.action,
            "visit_probs": self.visit_probs,
            "mask": self.mask,
            "root_value": self.root_value,
        }


def read_window(batch: dict[str, Any], frame_stack: int, num_actions: int) -> Window:
    """The :class:`Window` of a WindowSampler ``batch`` (``[B, h + W, ...]`` with ``h =
    frame_stack - 1`` history rows; ``batch`` is not changed). Rows of the random prefill carry
    no search: without ``visit_probs`` / ``root_value`` columns they are zeros.

    Raises:
        ValueError: the batch is not a window batch (keys missing).
    """
    missing = sorted(set(NEEDED) - set(batch))
    if missing:
        raise ValueError(
            f"MuZero trains on WindowSampler batches; the batch lacks {missing} "
            "(set data.init_args.sampler to a WindowSampler)"
        )
    h = frame_stack - 1
    mask = batch["mask"].bool()
    obs = batch["obs"] if frame_stack == 1 else window_stacks(batch["obs"], mask, frame_stack)
    if "visit_probs" in batch:
        visit_probs, root_value = batch["visit_probs"], batch["root_value"]
    else:  # only random-prefill rows so far: no search has run yet
        visit_probs = torch.zeros(*mask.shape, num_actions, device=mask.device)
        root_value = torch.zeros(mask.shape, device=mask.device)

    def forward(key: str) -> Tensor | None:
        return batch[key][:, h:] if key in batch else None

    return Window(
        obs=obs,
        action=batch["action"][:, h:],
        reward=batch["reward"][:, h:],
        is_last=batch["is_last"][:, h:],
        is_terminal=batch["is_terminal"][:, h:],
        mask=mask[:, h:],
        visit_probs=visit_probs[:, h:],
        root_value=root_value[:, h:].float(),
        weight=batch["weight"].float() if "weight" in batch else None,
        age=batch.get("age"),
        row_index=forward("row_index"),
        row_generation=forward("row_generation"),
    )


def window_rows(unroll: UnrollSettings, reanalyse: ReanalyseSettings) -> tuple[int, int]:
    """``(rows, td)``: the rows from the position that training reads, ``K + 1 + td``, and the
    horizon ``td`` (the larger of ``td_steps`` and, with reanalyse, its ``td_steps``); with
    ``td_steps = -1`` (Monte Carlo) ``td`` is -1 and ``rows`` is ``K + 2``, the least a window
    needs (size the sampler's ``td_steps`` to the episode limit)."""
    if unroll.td_steps == -1:
        return unroll.num_unroll_steps + 2, -1
    td = max(unroll.td_steps, reanalyse.td_steps if reanalyse.ratio > 0 else 1)
    return unroll.num_unroll_steps + 1 + td, td


def fitting_sampler(unroll: UnrollSettings, reanalyse: ReanalyseSettings, history: int) -> str:
    """The WindowSampler that fits the settings, as text for messages."""
    _, td = window_rows(unroll, reanalyse)
    return (
        f"WindowSampler(num_unroll_steps={unroll.num_unroll_steps}, "
        f"td_steps={'<episode limit>' if td == -1 else td}, history={history})"
    )


def window_fit(
    length: int, frame_stack: int, unroll: UnrollSettings, reanalyse: ReanalyseSettings
) -> tuple[str, str] | None:
    """Whether windows of ``length`` rows (history included) fit the settings: None, or
    ``("short", message)`` (training cannot read them) or ``("long", message)`` (rows sampled and
    never read, or every row shifted when the history is longer than ``frame_stack - 1``)."""
    h = frame_stack - 1
    width = length - h
    rows, td = window_rows(unroll, reanalyse)
    K = unroll.num_unroll_steps
    if width < rows:
        return (
            "short",
            f"the sampler's windows ({length} rows) are too short for num_unroll_steps "
            f"{K}, td_steps {unroll.td_steps}"
            + (f", reanalyse td_steps {reanalyse.td_steps}" if reanalyse.ratio > 0 else "")
            + f" and frame_stack {frame_stack}: use {fitting_sampler(unroll, reanalyse, h)}",
        )
    if td != -1 and width > rows:
        return (
            "long",
            f"the sampler's windows ({width} rows after the history) are longer than num_unroll_steps "
            f"{K} and td_steps {td} use ({rows}): the extra "
            "rows are sampled and never read (or, if the sampler's history is longer than frame_stack "
            f"- 1 = {h}, every row is shifted); use {fitting_sampler(unroll, reanalyse, h)} (the model's "
            "td_steps and frame_stack and the sampler's go together; leave data.init_args.sampler unset "
            "and the datamodule uses the model's)",
        )
    return None
