"""Samplers: how a learner reads rows from a :class:`~lightning_wm.data.replay.ReplayBuffer`.

A sampler draws positions with the buffer's :meth:`~lightning_wm.data.replay.ReplayBuffer.draw`
(uniform or, for a prioritized buffer, proportional to the position's priority; the buffer's
RNG) and gathers rows around them, vectorised over the batch. Every batch carries

* ``index`` int64 ``[B]`` — the flat slot id of each position (``stream * cap_per_stream + slot``),
  what :meth:`~lightning_wm.data.replay.ReplayBuffer.update_priorities` takes;
* ``generation`` int64 ``[B]`` — the position's generation, so that feedback arriving after
  the slot was overwritten is skipped;
* ``row_index`` / ``row_generation`` int64 ``[B, L]`` for multi-row samplers (targets of
  :meth:`~lightning_wm.data.replay.ReplayBuffer.write`);
* ``weight`` float32 ``[B]`` importance weights when the buffer is prioritized.

Choose one in YAML under ``data.init_args.sampler`` (``class_path`` with ``init_args``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.tree import tree_map

__all__ = ["Sampler", "SequenceSampler", "WindowSampler", "RowSampler", "TransitionSampler", "MixedSampler"]


def _flag(buffer: ReplayBuffer, key: str, stream: np.ndarray, slot: np.ndarray, why: str) -> np.ndarray:
    """Boolean row flag ``key`` at ``(stream, slot)`` -> bool array of the index shape."""
    if key not in buffer:
        raise ValueError(f"{why} needs an {key!r} key in the rows")
    column = buffer.column(key)
    values = column[stream, slot]
    if column.ndim == 2 and column.dtype == bool:  # one flag per row, the usual layout
        return values
    return values.reshape(*np.broadcast_shapes(np.shape(stream), np.shape(slot)), -1).any(axis=-1)


class Sampler(ABC):
    """Draws a batch of ``batch_size`` items from a buffer.

    ``span`` is the number of stored rows a position needs from itself on (a window of
    ``span`` rows never crosses a stream's write head).
    """

    span: int = 1

    @abstractmethod
    def sample(self, buffer: ReplayBuffer, batch_size: int) -> dict[str, Any]:
        """A batch dict of torch tensors (see the module docstring for the bookkeeping keys)."""

    def can_sample(self, buffer: ReplayBuffer) -> bool:
        """Whether ``buffer`` holds enough rows for a position (episode constraints aside)."""
        return len(buffer) > 0 and int(buffer.rows_per_stream.max()) >= self.span

    @staticmethod
    def _position(buffer: ReplayBuffer, out: dict[str, Any], stream: np.ndarray, slot: np.ndarray) -> dict[str, Any]:
        """Add ``index``, ``generation`` (and ``weight``) of positions ``(stream [B], slot [B])``."""
        leaf = stream * buffer.cap_per_stream + slot
        out["index"] = torch.from_numpy(leaf.astype(np.int64, copy=False))
        out["generation"] = torch.from_numpy(buffer.generation(stream, slot))
        if buffer.prioritized:
            out["weight"] = buffer.importance_weights(leaf)
        return out

    @staticmethod
    def _rows(
        buffer: ReplayBuffer,
        out: dict[str, Any],
        stream: np.ndarray,
        slot: np.ndarray,
        generation: np.ndarray | None = None,
    ) -> dict[str, Any]:
        """Add ``row_index`` / ``row_generation`` of rows ``(stream [B, 1], slot [B, L])`` (their
        generations looked up unless given)."""
        out["row_index"] = torch.from_numpy(stream * buffer.cap_per_stream + slot)
        out["row_generation"] = torch.from_numpy(buffer.generation(stream, slot) if generation is None else generation)
        return out

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class RowSampler(Sampler):
    """Single rows: every key ``[B, ...]``."""

    def sample(self, buffer: ReplayBuffer, batch_size: int) -> dict[str, Any]:
        stream, slot = buffer.draw(batch_size, what="rows")
        return self._position(buffer, buffer.gather(stream, slot), stream, slot)


class SequenceSampler(Sampler):
    """Windows of ``length`` consecutive rows of one stream: every key ``[B, L, ...]``.

    A window never crosses the write head, so it holds rows written in time order. With
    ``cross_episodes`` (Dreamer) a window may span episode borders (``is_first`` marks the
    resets); without it ``is_first`` may only be true at position 0. Prioritized: a window's
    priority is that of its first row (``index``).

    ``terminal_fraction`` (0: off, uniform windows) of every batch (rounded) are windows that
    hold an ``is_terminal`` row, drawn uniformly among those. Episode ends are rare rows on a
    task whose good episodes are long (one in 500 on a solved CartPole), so a world model's
    continue head and the imagination starts near them see them more often; the rest of the
    batch is drawn as usual. Until the buffer holds such a window, the whole batch is ordinary.
    """

    def __init__(self, length: int = 64, cross_episodes: bool = True, terminal_fraction: float = 0.0) -> None:
        if length < 1:
            raise ValueError(f"sequence length must be >= 1, got {length}")
        if not 0.0 <= terminal_fraction <= 1.0:
            raise ValueError(f"terminal_fraction must be in [0, 1], got {terminal_fraction}")
        self.length, self.cross_episodes = int(length), bool(cross_episodes)
        self.terminal_fraction = float(terminal_fraction)

    @property
    def span(self) -> int:  # type: ignore[override]
        return self.length

    def sample(self, buffer: ReplayBuffer, batch_size: int) -> dict[str, Any]:
        L, cap = self.length, buffer.cap_per_stream
        accept = None
        if not self.cross_episodes and L > 1:
            if "is_first" not in buffer:
                raise ValueError("cross_episodes=False needs an 'is_first' key in the rows")

            def accept(stream: np.ndarray, slot: np.ndarray) -> np.ndarray:
                later = (slot[:, None] + np.arange(1, L)) % cap
                return ~_flag(buffer, "is_first", stream[:, None], later, "cross_episodes=False").any(axis=1)

        what = f"sequences of length {L} without a reset (is_first) inside"
        ends = round(self.terminal_fraction * batch_size) if self.terminal_fraction > 0 else 0
        stream, start = (
            buffer.draw(batch_size - ends, span=L, accept=accept, what=what)
            if ends < batch_size
            else (np.zeros(0, np.int64), np.zeros(0, np.int64))
        )
        if ends:
            stream, start = self._add_terminal_windows(buffer, ends, accept, what, stream, start)
        slot = (start[:, None] + np.arange(L)) % cap
        out = buffer.gather(stream[:, None], slot)
        self._rows(buffer, out, stream[:, None], slot)
        return self._position(buffer, out, stream, start)

    def _add_terminal_windows(
        self, buffer: ReplayBuffer, n: int, accept: Any, what: str, stream: np.ndarray, start: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(stream, start)`` with ``n`` more windows holding an ``is_terminal`` row (ordinary
        ones while the buffer holds none)."""
        L, cap = self.length, buffer.cap_per_stream
        if "is_terminal" not in buffer:
            raise ValueError("terminal_fraction > 0 needs an 'is_terminal' key in the rows")

        def holds_end(s: np.ndarray, t: np.ndarray) -> np.ndarray:
            rows = (t[:, None] + np.arange(L)) % cap
            ok = _flag(buffer, "is_terminal", s[:, None], rows, "terminal_fraction").any(axis=1)
            return ok & accept(s, t) if accept is not None else ok

        try:
            more = buffer.draw(n, span=L, accept=holds_end, what=f"{what} holding an episode end")
        except ValueError:  # no such window yet (no episode has ended, or none fits a window)
            more = buffer.draw(n, span=L, accept=accept, what=what)
        return np.concatenate([stream, more[0]]), np.concatenate([start, more[1]])


class WindowSampler(Sampler):
    """Unroll windows for K-step model learning with n-step targets (MuZero).

    Positions ``t`` are stored rows that are not an episode's last row (nothing is decided
    there). The window is the ``num_unroll_steps + td_steps + 1`` rows from ``t``: keys
    ``[B, W, ...]`` plus ``mask`` bool ``[B, W]``, true for rows that exist and belong to
    ``t``'s episode up to and including its ``is_last`` row. Rows past the episode end, past
    the stream's write head (not written yet) or overwritten are masked instead of rejecting
    the position, so late positions of an episode are sampled as often as early ones. Masked
    rows hold whatever the slots hold: read them only through ``mask``.

    With ``history = h > 0`` the window also holds the ``h`` rows *before* ``t`` (frame stacks:
    the observation at ``t`` stacked with its ``h`` predecessors): keys ``[B, h + W, ...]``,
    the position at index ``h``; ``mask`` is true on a history row that exists and belongs to
    ``t``'s episode (a suffix of the history: rows before the episode's first row are masked).

    Besides the usual bookkeeping every batch carries ``age`` int64 ``[B]``: rows written to the
    position's stream after it (0 for the newest row), what reanalyse's horizon schedule reads.
    """

    def __init__(self, num_unroll_steps: int = 5, td_steps: int = 5, history: int = 0) -> None:
        if num_unroll_steps < 0 or td_steps < 0 or history < 0:
            raise ValueError(
                f"num_unroll_steps, td_steps and history must be >= 0, got {num_unroll_steps}, {td_steps}, {history}"
            )
        self.num_unroll_steps, self.td_steps, self.history = int(num_unroll_steps), int(td_steps), int(history)

    @property
    def window(self) -> int:
        """Rows per window from the position on, ``num_unroll_steps + td_steps + 1``."""
        return self.num_unroll_steps + self.td_steps + 1

    def sample(self, buffer: ReplayBuffer, batch_size: int) -> dict[str, Any]:
        W, h, cap = self.window, self.history, buffer.cap_per_stream
        why = "WindowSampler"
        stream, start = buffer.draw(
            batch_size,
            accept=lambda s, t: ~_flag(buffer, "is_last", s, t, why),
            what="window positions (rows that are not an episode's last row)",
        )
        slot = (start[:, None] + np.arange(-h, W)) % cap
        rows = stream[:, None]
        generation = buffer.generation(rows, slot)
        # written in time order relative to the position, not overwritten
        ok = (generation == generation[:, h : h + 1] + np.arange(-h, W)) & (generation >= 0)
        is_last = _flag(buffer, "is_last", rows, slot, why)
        is_first = _flag(buffer, "is_first", rows, slot, why) if "is_first" in buffer else None
        forward = ok[:, h:]
        forward[:, 1:] &= ~is_last[:, h:-1]  # the episode ended before
        if is_first is not None:  # a new episode began (a restart without a last row)
            forward[:, 1:] &= ~is_first[:, h + 1 :]
        mask = np.empty_like(ok)
        mask[:, h:] = np.logical_and.accumulate(forward, axis=1)
        if h:
            back = ok[:, :h] & ~is_last[:, :h]  # a last row before t ends an earlier episode
            if is_first is not None:  # row j is in t's episode only if no episode began after it
                back &= ~is_first[:, 1 : h + 1]
            mask[:, :h] = np.logical_and.accumulate(back[:, ::-1], axis=1)[:, ::-1]
        out = buffer.gather(rows, slot)
        out["mask"] = torch.from_numpy(mask)
        out["age"] = torch.from_numpy(buffer.rows_written(stream) - 1 - generation[:, h])
        self._rows(buffer, out, rows, slot, generation)
        return self._position(buffer, out, stream, start)


class TransitionSampler(Sampler):
    """One-step transitions: rows ``t`` (not an episode's last row, row ``t + 1`` written) as
    ``[B, ...]`` plus ``next_obs``, ``next_reward``, ``next_is_terminal`` and ``next_is_last``
    from row ``t + 1``."""

    span = 2
    _NEXT = ("obs", "reward", "is_terminal", "is_last")

    def sample(self, buffer: ReplayBuffer, batch_size: int) -> dict[str, Any]:
        why = "TransitionSampler"
        stream, slot = buffer.draw(
            batch_size,
            span=2,
            accept=lambda s, t: ~_flag(buffer, "is_last", s, t, why),
            what="transitions (rows that are not an episode's last row)",
        )
        out = buffer.gather(stream, slot)
        after = buffer.gather(stream, (slot + 1) % buffer.cap_per_stream, keys=self._NEXT)
        missing = [k for k in self._NEXT if k not in after]
        if missing:
            raise ValueError(f"TransitionSampler needs the row keys {missing}")
        out.update({f"next_{k}": after[k] for k in self._NEXT})
        return self._position(buffer, out, stream, slot)


class MixedSampler:
    """Batches from two buffers at a fixed ratio (Dyna: real and imagined rows).

    ``round(real_ratio * B)`` items come from the real buffer and the rest from the imagined
    one (all from the real buffer while the imagined one cannot give a sample, e.g. while it is
    empty), drawn with ``sampler`` from each and concatenated, real first; ``is_real`` bool
    ``[B]`` says which is which (``index``/``generation`` refer to the buffer the item came
    from). If only one of the buffers is prioritized, the other part gets weight 1.
    """

    def __init__(self, sampler: Sampler, real_ratio: float = 0.5) -> None:
        if not 0.0 <= real_ratio <= 1.0:
            raise ValueError(f"real_ratio must be in [0, 1], got {real_ratio}")
        self.sampler, self.real_ratio = sampler, float(real_ratio)

    def sample(self, real: ReplayBuffer, imagined: ReplayBuffer | None, batch_size: int) -> dict[str, Any]:
        B = int(batch_size)
        n_real = B
        if imagined is not None and self.sampler.can_sample(imagined):
            n_real = round(self.real_ratio * B)
        parts = [
            (self.sampler.sample(buf, n), flag, buf.prioritized)
            for buf, n, flag in ((real, n_real, True), (imagined, B - n_real, False))
            if n > 0
        ]
        if any(p[2] for p in parts):
            for batch, _, prioritized in parts:
                if not prioritized:
                    batch["weight"] = torch.ones(len(batch["index"]))
        if len(parts) == 2 and set(parts[0][0]) != set(parts[1][0]):
            a, b = set(parts[0][0]), set(parts[1][0])
            raise ValueError(
                f"real and imagined batches differ in keys: only real {sorted(a - b)}, only imagined {sorted(b - a)}"
            )
        batches = [p[0] for p in parts]
        out = batches[0] if len(batches) == 1 else tree_map(lambda *xs: torch.cat(xs), batches[0], *batches[1:])
        out["is_real"] = torch.cat([torch.full((len(p[0]["index"]),), p[1]) for p in parts])
        return out

    def __repr__(self) -> str:
        return f"MixedSampler(sampler={self.sampler!r}, real_ratio={self.real_ratio})"
