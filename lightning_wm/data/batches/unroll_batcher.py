"""Unrolls of ``T+1`` rows batched to ``[B, T+1, ...]``, optionally through a small replay
(DI-engine's ``replay_buffer_size`` of unrolls with ``max_use``)."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch

from lightning_wm.tree import first_leaf, tree_map

__all__ = ["UnrollBatcher"]


class UnrollBatcher:
    """Unrolls of ``T+1`` rows batched to ``[B, T+1, ...]``, optionally through a small replay.

    Chunks come time-major ``[T+1, N, ...]`` (``Collector.collect_chunk(T, overlap=True)``:
    consecutive chunks of one env share a row); each env's column becomes one unroll, with an
    id that is never reused.

    Without replay (``capacity = 0``) every unroll is used once, oldest first. With
    ``capacity > 0`` the newest ``capacity`` unrolls are kept and a batch draws ``B``
    distinct ones among those used fewer than ``max_use`` times: uniformly, or with
    ``prioritized`` in proportion to ``priority ** alpha`` (a new unroll gets the largest
    priority seen so far; :meth:`update_priorities` sets them). An unroll leaves after its
    ``max_use``-th use (or when newer ones push it out).

    Every batch carries ``index`` and ``generation`` int64 ``[B]`` (both the unrolls' ids: an id
    names one unroll for ever, so it is its own generation) and, when prioritized, ``weight``
    float32 ``[B]``: the importance weights ``(n * P(i)) ** -beta`` over the ``n`` unrolls
    available, divided by the batch's largest.
    """

    def __init__(
        self,
        batch_size: int,
        capacity: int = 0,
        max_use: int = 1,
        seed: int = 0,
        prioritized: bool = False,
        alpha: float = 0.6,
        beta: float = 0.4,
    ) -> None:
        if batch_size < 1 or max_use < 1 or capacity < 0:
            raise ValueError(
                f"batch_size and max_use must be >= 1 and capacity >= 0, got {batch_size}, {max_use}, {capacity}"
            )
        if 0 < capacity < batch_size:
            raise ValueError(
                f"replay.capacity ({capacity} unrolls) must be 0 (no replay) or at least batch_size ({batch_size})"
            )
        if prioritized and capacity == 0:
            raise ValueError(
                "prioritized sampling draws from a replay: set replay.capacity > 0 (unrolls kept), or prioritized: false"
            )
        if alpha < 0 or beta < 0:
            raise ValueError(f"alpha and beta must be >= 0, got {alpha}, {beta}")
        self.batch_size, self.capacity, self.max_use = batch_size, capacity, max_use
        self.prioritized, self.alpha, self.beta = prioritized, alpha, beta
        self._unrolls: deque[dict[str, Any]] = deque()
        self._uses: deque[int] = deque()
        self._ids: deque[int] = deque()  # increasing along the deque
        self._priority: deque[float] = deque()
        self._next_id = 0
        self._max_priority = 1.0
        self._rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        """Unrolls that can still be used."""
        return len(self._unrolls)

    def add(self, rows: dict[str, Any]) -> None:
        """Add the unrolls of a chunk ``[T+1, N, ...]`` (one per env)."""
        envs = first_leaf(rows).shape[1]
        for j in range(envs):
            self._unrolls.append(tree_map(lambda x: np.ascontiguousarray(x[:, j]), rows))
            self._uses.append(0)
            self._ids.append(self._next_id)
            self._priority.append(self._max_priority)
            self._next_id += 1
        limit = self.capacity or None
        while limit is not None and len(self._unrolls) > limit:
            self._drop(0)

    def _drop(self, i: int) -> None:
        for d in (self._unrolls, self._uses, self._ids, self._priority):
            del d[i]

    def ready(self) -> bool:
        return len(self._unrolls) >= self.batch_size

    def batch(self) -> dict[str, Any]:
        """``B`` unrolls stacked batch-major: every leaf a tensor ``[B, T+1, ...]``, plus ``index``,
        ``generation`` (and ``weight`` when prioritized) ``[B]``."""
        if not self.ready():
            raise ValueError(f"only {len(self._unrolls)} unrolls for a batch of {self.batch_size}")
        weight = None
        if self.capacity == 0:
            which = np.arange(self.batch_size)
        elif self.prioritized:
            p = np.asarray(self._priority, np.float64) ** self.alpha
            p /= p.sum()
            which = np.sort(self._rng.choice(len(p), self.batch_size, replace=False, p=p))
            w = (len(p) * p[which]) ** -self.beta
            weight = (w / w.max()).astype(np.float32)
        else:
            which = np.sort(self._rng.choice(len(self._unrolls), self.batch_size, replace=False))
        picked = [self._unrolls[i] for i in which]
        ids = np.array([self._ids[i] for i in which], np.int64)
        for i in which:
            self._uses[i] += 1
        for i in sorted((int(i) for i in which if self.capacity == 0 or self._uses[i] >= self.max_use), reverse=True):
            self._drop(i)
        out = tree_map(lambda *xs: torch.from_numpy(np.stack(xs)), picked[0], *picked[1:])
        out["index"], out["generation"] = torch.from_numpy(ids), torch.from_numpy(ids.copy())
        if weight is not None:
            out["weight"] = torch.from_numpy(weight)
        return out

    def update_priorities(self, index: Any, priority: Any) -> dict[str, int]:
        """Set the priorities ``[N]`` of the unrolls with ids ``index [N]``; unrolls that left
        the replay since they were sampled are skipped. Returns ``{"applied", "stale"}`` counts."""
        index = np.asarray(index, np.int64).reshape(-1)
        priority = np.asarray(priority, np.float64).reshape(-1)
        if index.shape != priority.shape:
            raise ValueError(f"{len(index)} unroll ids but {len(priority)} priorities")
        if not np.isfinite(priority).all() or (priority < 0).any():
            raise ValueError(f"priorities must be finite and >= 0, got {priority}")
        ids = np.fromiter(self._ids, np.int64, len(self._ids))
        pos = np.searchsorted(ids, index)
        found = (
            (pos < len(ids)) & (ids[np.minimum(pos, len(ids) - 1)] == index) if len(ids) else np.zeros_like(index, bool)
        )
        for i, value in zip(pos[found], priority[found]):
            value = float(value) + 1e-6  # never exactly 0: every unroll stays drawable
            self._priority[int(i)] = value
            self._max_priority = max(self._max_priority, value)
        return {"applied": int(found.sum()), "stale": int((~found).sum())}
