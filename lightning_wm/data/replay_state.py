"""Where a :class:`~lightning_wm.data.replay.ReplayBuffer` keeps its rows and how it is saved:
arrays in memory or memory-mapped ``.npy`` files (``storage_dir``), and the state dict that
restores rows, write heads, generations, priorities and the sampling RNG bit for bit."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import numpy as np
import torch

from lightning_wm.io import atomic_torch_save

__all__ = ["ReplayStorage"]

_STATE_VERSION = 2
B = TypeVar("B", bound="ReplayStorage")


class ReplayStorage:
    """The storage and serialization half of :class:`~lightning_wm.data.replay.ReplayBuffer`
    (a mixin: it reads and restores the buffer's rings, heads, generations, sum tree and RNG)."""

    num_streams: int
    cap_per_stream: int
    capacity: int
    prioritized: bool
    alpha: float
    beta: float
    storage_dir: Path | None
    revision: int
    _data: dict[str, np.ndarray]
    _optional: set[str]
    _pos: np.ndarray
    _count: np.ndarray
    _written: np.ndarray
    _gen: np.ndarray
    _lockstep: bool
    _max_priority: float
    _rng: np.random.Generator
    _tree: Any

    def _allocate(self, key: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        full = (self.num_streams, self.cap_per_stream, *shape)
        if self.storage_dir is None:
            return np.zeros(full, dtype=dtype)  # calloc: pages are touched lazily
        path = self.storage_dir / (quote(key, safe="") + ".npy")
        return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=full)

    def flush(self) -> None:
        """Flush memory-mapped arrays to disk (no-op in memory)."""
        for arr in self._data.values():
            if isinstance(arr, np.memmap):
                arr.flush()

    def _used_slots(self) -> int:
        """Slots ``[0, n)`` of every stream hold all its written rows (streams fill from slot 0)."""
        return self.cap_per_stream if (self._written >= self.cap_per_stream).any() else int(self._written.max())

    def state_dict(self) -> dict:
        """Everything needed to restore the buffer (rows, write heads, generations,
        priorities, RNG state), as torch tensors and Python scalars only (loadable with
        ``torch.load(..., weights_only=True)``).

        While no ring has wrapped only the written slots are included. Tensors of a full
        buffer share memory with it: save them before adding more rows.
        """
        n = self._used_slots()
        full = n == self.cap_per_stream

        def crop(arr: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(arr if full else np.ascontiguousarray(arr[:, :n]))

        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "capacity": self.capacity,
            "num_streams": self.num_streams,
            "prioritized": self.prioritized,
            "alpha": self.alpha,
            "beta": self.beta,
            "pos": torch.from_numpy(self._pos.copy()),
            "count": torch.from_numpy(self._count.copy()),
            "written": torch.from_numpy(self._written.copy()),
            "slots": n,
            "max_priority": self._max_priority,
            "rng_state": self._rng.bit_generator.state,
            "optional": sorted(self._optional),
            "generation": torch.from_numpy(np.array(self._gen[:, :n])),
            "data": {key: crop(arr) for key, arr in self._data.items()},
        }
        if self._tree is not None:
            leaves = self._tree.leaves.reshape(self.num_streams, self.cap_per_stream)
            state["priorities"] = torch.from_numpy(np.array(leaves[:, :n]))  # copy: the tree keeps changing
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict` (or a version-1 state of the lockstep buffer).
        ``capacity`` and ``num_streams`` must match.

        Priorities are restored when both sides are prioritized (rescaled if ``alpha``
        differs); a prioritized buffer loading a uniform state gives every row the max
        priority. ``beta`` and ``checkpoint`` stay as configured on this buffer.
        """
        version = state.get("version")
        if version not in (1, _STATE_VERSION):
            raise ValueError(f"unsupported ReplayBuffer state version {version!r}")
        streams = state["num_streams"] if version == 2 else state["num_envs"]
        if state["capacity"] != self.capacity or streams != self.num_streams:
            raise ValueError(
                f"state is for capacity={state['capacity']}, num_streams={streams} but this buffer has "
                f"capacity={self.capacity}, num_streams={self.num_streams}"
            )
        S, cap = self.num_streams, self.cap_per_stream
        if version == 2:
            pos, count, written = (state[k].numpy().astype(np.int64) for k in ("pos", "count", "written"))
            n = int(state["slots"])
            gen = np.full((S, cap), -1, np.int64)
            gen[:, :n] = state["generation"].numpy()
            self._optional = set(state.get("optional", []))
        else:  # one shared head; rebuild generations from the time order of the stored rows
            n = count0 = int(state["count"])
            pos = np.full(S, int(state["pos"]), np.int64)
            count = written = np.full(S, count0, np.int64)
            gen = np.full((S, cap), -1, np.int64)
            gen[:, (pos[0] - count0 + np.arange(count0)) % cap] = np.arange(count0)
            self._optional = set()
        self._data = {}
        for key, tensor in state["data"].items():
            arr = tensor.numpy()
            if arr.shape[:2] != (S, n):
                raise ValueError(f"state array {key!r} has shape {tuple(arr.shape)}, expected ({S}, {n}, ...)")
            self._data[key] = self._allocate(key, arr.shape[2:], arr.dtype)
            self._data[key][:, :n] = arr
        self._pos, self._count, self._written, self._gen = pos.copy(), count.copy(), written.copy(), gen
        self._lockstep = bool((pos == pos[0]).all() and (count == count[0]).all())
        self._max_priority = float(state["max_priority"])
        self._rng.bit_generator.state = state["rng_state"]
        if self._tree is not None:
            leaves = np.zeros((S, cap), dtype=np.float64)
            if state.get("priorities") is not None and float(state["alpha"]) > 0:
                leaves[:, :n] = state["priorities"].numpy() ** (self.alpha / float(state["alpha"]))
            else:
                self._max_priority = 1.0
                leaves[gen >= 0] = 1.0
            self._tree.set_all(leaves.reshape(-1))
        self.revision += 1

    def save(self, path: str | os.PathLike) -> None:
        """``torch.save`` the state dict to ``path`` atomically (memory maps flushed first)."""
        self.flush()
        atomic_torch_save(self.state_dict(), path)

    @classmethod
    def load(
        cls: type[B],
        path: str | os.PathLike,
        storage_dir: str | os.PathLike | None = None,
        seed: int | None = None,
    ) -> B:
        """Build a buffer from a file written by :meth:`save` (same capacity, streams,
        prioritization, alpha and beta; RNG state restored)."""
        state = torch.load(path, map_location="cpu", weights_only=True)
        buf = cls(
            state["capacity"],
            state["num_streams"] if state.get("version") == 2 else state["num_envs"],
            prioritized=state["prioritized"],
            alpha=state["alpha"],
            beta=state["beta"],
            storage_dir=storage_dir,
            seed=seed,
        )
        buf.load_state_dict(state)
        return buf
