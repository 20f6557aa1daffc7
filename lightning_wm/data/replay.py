"""ReplayBuffer: a preallocated ring per env stream, with row and sequence sampling.

Rows follow the project's row convention (see ``DESIGN.md``): one row per env step with
``obs``, ``reward``, ``is_first``, ``is_last``, ``is_terminal``, ``action`` and any agent
extras. Keys are not fixed in advance; storage for a key is allocated the first time it
is seen.

Layout
------
``capacity // num_envs`` rows per stream. Each key ``k`` is stored in one array of shape
``[num_envs, cap_per_stream, *shape_k]`` (in memory, or a memory-mapped ``.npy`` file
when ``storage_dir`` is given). All streams advance together, so there is a single write
position ``pos`` shared by every stream and the same number of stored rows per stream.
A row is addressed by its *flat slot index* ``stream * cap_per_stream + t``; this is the
``index`` returned by the samplers and accepted by :meth:`ReplayBuffer.update_priorities`.

Nested observations
-------------------
A dict value (e.g. ``obs={'image': ..., 'state': ...}``) is stored under flattened keys
``'obs/image'``, ``'obs/state'`` and returned with the same nesting. Keys therefore must
not contain ``'/'`` themselves. ``index`` and ``weight`` are reserved output keys.

Dtypes
------
Dtypes are kept as given (uint8 pixels stay uint8, bools stay bool, int64 actions stay
int64), except float64 which is stored as float32. Later adds are cast to the stored dtype.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np

from lightning_wm.tree import flatten as _flatten, unflatten as _unflatten
import torch

from lightning_wm.data.sumtree import SumTree

__all__ = ["ReplayBuffer"]

_RESERVED = ("index", "weight")
_STATE_VERSION = 1


def _to_numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


class ReplayBuffer:
    """Ring-buffer replay over ``num_envs`` parallel env streams.

    Args:
        capacity: total number of rows over all streams; each stream gets a ring of
            ``capacity // num_envs`` rows.
        num_envs: number of parallel env streams; every :meth:`add` writes one row to each.
        prioritized: keep a sum tree of priorities and sample proportionally to
            ``priority ** alpha`` (Schaul et al., 2016). New rows get the largest priority
            seen so far (1.0 initially).
        alpha: priority exponent (0 = uniform).
        beta: importance-weight exponent; a public attribute, so it can be annealed.
        storage_dir: if given, every key is a memory-mapped ``.npy`` file in this
            directory (created if needed; existing files of the same name are overwritten),
            for buffers larger than RAM.
        seed: seed of the buffer's own ``numpy.random.Generator``.
    """

    def __init__(
        self,
        capacity: int,
        num_envs: int = 1,
        *,
        prioritized: bool = False,
        alpha: float = 0.6,
        beta: float = 0.4,
        storage_dir: str | os.PathLike | None = None,
        seed: int | None = None,
    ) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        if capacity < num_envs:
            raise ValueError(f"capacity ({capacity}) must be >= num_envs ({num_envs})")
        if alpha < 0 or beta < 0:
            raise ValueError(f"alpha and beta must be >= 0, got alpha={alpha}, beta={beta}")
        self.capacity = int(capacity)
        self.num_envs = int(num_envs)
        self.cap_per_stream = self.capacity // self.num_envs
        self.prioritized = bool(prioritized)
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.storage_dir = Path(storage_dir) if storage_dir is not None else None
        if self.storage_dir is not None:
            self.storage_dir.mkdir(parents=True, exist_ok=True)
        self._rng = np.random.default_rng(seed)
        self._data: dict[str, np.ndarray] = {}
        self._pos = 0  # next slot to write, same for all streams
        self._count = 0  # rows stored per stream
        self._max_priority = 1.0
        self._tree = SumTree(self.num_envs * self.cap_per_stream) if self.prioritized else None
        self._stream_base = np.arange(self.num_envs, dtype=np.int64) * self.cap_per_stream

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        """Total rows stored over all streams."""
        return self.num_envs * self._count

    @property
    def num_streams(self) -> int:
        """Number of env streams (rings)."""
        return self.num_envs

    @property
    def keys(self) -> list[str]:
        """Flattened stored keys (e.g. ``'obs/image'`` for dict observations)."""
        return list(self._data)

    @property
    def rows_per_stream(self) -> int:
        """Rows currently stored in each stream."""
        return self._count

    def __repr__(self) -> str:
        kind = "prioritized" if self.prioritized else "uniform"
        return (
            f"ReplayBuffer({len(self)}/{self.num_envs * self.cap_per_stream} rows, "
            f"{self.num_envs} streams, {kind}, keys={self.keys})"
        )

    @property
    def _oldest(self) -> int:
        return (self._pos - self._count) % self.cap_per_stream

    def _allocate(self, key: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        full = (self.num_envs, self.cap_per_stream, *shape)
        if self.storage_dir is None:
            return np.zeros(full, dtype=dtype)  # calloc: pages are touched lazily
        path = self.storage_dir / (quote(key, safe="") + ".npy")
        return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=full)

    def flush(self) -> None:
        """Flush memory-mapped arrays to disk (no-op in memory)."""
        for arr in self._data.values():
            if isinstance(arr, np.memmap):
                arr.flush()

    # ------------------------------------------------------------------ writing
    def add(self, row: Mapping[str, np.ndarray | torch.Tensor]) -> None:
        """Append one row to every stream.

        Args:
            row: mapping key -> array of shape ``[num_envs, *shape_k]`` (numpy or torch;
                nested mappings allowed). After the first add every stored key must be
                present with the same trailing shape; a key seen for the first time later
                is allocated then, with zeros in the rows written before it.

        Raises:
            ValueError: naming the key, on a wrong leading dimension, a changed shape, a
                missing key or a reserved/invalid key name. Nothing is written then.
        """
        flat = _flatten(row)
        if not flat:
            raise ValueError("add() got an empty row")
        arrays: dict[str, np.ndarray] = {}
        for key, value in flat.items():
            if key in _RESERVED:
                raise ValueError(f"row key {key!r} is reserved for sampler output")
            arr = _to_numpy(value)
            if arr.ndim == 0 or arr.shape[0] != self.num_envs:
                raise ValueError(
                    f"row key {key!r}: expected a leading dimension of num_envs={self.num_envs}, "
                    f"got shape {tuple(arr.shape)}"
                )
            stored = self._data.get(key)
            if stored is not None and arr.shape[1:] != stored.shape[2:]:
                raise ValueError(
                    f"row key {key!r} changed shape: stored per-env shape {tuple(stored.shape[2:])}, "
                    f"got {tuple(arr.shape[1:])}"
                )
            arrays[key] = arr
        missing = [k for k in self._data if k not in arrays]
        if missing:
            raise ValueError(f"row is missing key(s) {missing} that earlier rows had")
        for key, arr in arrays.items():
            if key not in self._data:
                dtype = np.dtype(np.float32) if arr.dtype == np.float64 else arr.dtype
                if dtype == object:
                    raise ValueError(f"row key {key!r} has dtype object; give numeric arrays")
                self._data[key] = self._allocate(key, arr.shape[1:], dtype)
        pos = self._pos
        for key, arr in arrays.items():
            self._data[key][:, pos] = arr
        if self._tree is not None:
            self._tree.set_unchecked(self._stream_base + pos, self._max_priority**self.alpha)
        self._pos = (pos + 1) % self.cap_per_stream
        self._count = min(self._count + 1, self.cap_per_stream)

    def update_priorities(self, index: np.ndarray | torch.Tensor, priority: np.ndarray | torch.Tensor) -> None:
        """Set the priority of rows ``index`` (flat slot ids ``[N]``) to ``priority`` ``[N]``.

        ``priority ** alpha`` is stored in the sum tree; priorities must be finite and
        >= 0 (a row with priority 0 is never sampled; add a small epsilon yourself).
        """
        if self._tree is None:
            raise ValueError("update_priorities() needs a buffer created with prioritized=True")
        idx = _to_numpy(index).astype(np.int64, copy=False).reshape(-1)
        pri = _to_numpy(priority).astype(np.float64, copy=False).reshape(-1)
        if idx.shape != pri.shape:
            raise ValueError(f"index has {idx.size} entries but priority has {pri.size}")
        if idx.size == 0:
            return
        if idx.min() < 0 or idx.max() >= self._tree.capacity:
            raise ValueError(f"priority index out of range [0, {self._tree.capacity})")
        if not np.all(np.isfinite(pri)) or np.any(pri < 0):
            raise ValueError("priorities must be finite and >= 0")
        self._tree.set(idx, pri**self.alpha)
        self._max_priority = max(self._max_priority, float(pri.max()))

    # ------------------------------------------------------------------ sampling
    def _check_nonempty(self) -> None:
        if self._count == 0:
            raise ValueError("cannot sample: the replay buffer is empty (0 rows)")

    def _gather(self, stream: np.ndarray, slot: np.ndarray) -> dict[str, Any]:
        out = {key: torch.from_numpy(arr[stream, slot]) for key, arr in self._data.items()}
        return _unflatten(out)

    def _weights(self, leaf: np.ndarray) -> torch.Tensor:
        # w_i = (N P(i))^-beta / max_j w_j over the batch; N and the total cancel out.
        p = self._tree.get(leaf)
        w = (p / p.min()) ** (-self.beta)
        return torch.from_numpy(w.astype(np.float32))

    def sample(self, batch_size: int) -> dict[str, torch.Tensor]:
        """Sample single rows.

        Returns:
            dict with every stored key as ``[B, *shape_k]`` (same nesting as added),
            ``index`` int64 ``[B]`` (flat slot ids) and, if prioritized, ``weight``
            float32 ``[B]`` importance weights normalised by the batch maximum.
        """
        self._check_nonempty()
        B = int(batch_size)
        cap = self.cap_per_stream
        if B < 1:
            raise ValueError(f"batch_size must be >= 1, got {B}")
        if self._tree is None:
            stream = self._rng.integers(0, self.num_envs, B)
            slot = (self._oldest + self._rng.integers(0, self._count, B)) % cap
            leaf = stream * cap + slot
        else:
            if self._tree.total <= 0:
                raise ValueError("cannot sample: every stored row has priority 0")
            leaf = self._tree.sample(B, self._rng)
            bad = self._tree.get(leaf) <= 0  # float rounding can land on an empty leaf
            while bad.any():
                leaf[bad] = self._tree.sample(int(bad.sum()), self._rng, stratified=False)
                bad = self._tree.get(leaf) <= 0
            leaf = self._rng.permutation(leaf)
            stream, slot = np.divmod(leaf, cap)
        out = self._gather(stream, slot)
        out["index"] = torch.from_numpy(leaf.astype(np.int64, copy=False))
        if self._tree is not None:
            out["weight"] = self._weights(leaf)
        return out

    def _valid_starts(self, stream: np.ndarray, start: np.ndarray, length: int, cross_episodes: bool) -> np.ndarray:
        """Which candidate windows ``(stream [N], start slot [N])`` are valid -> bool ``[N]``."""
        cap = self.cap_per_stream
        valid = (start - self._oldest) % cap <= self._count - length  # inside the stored range
        if self._tree is not None:
            valid &= self._tree.get(stream * cap + start) > 0
        if not cross_episodes and length > 1:
            later = (start[:, None] + np.arange(1, length)) % cap
            valid &= ~self._data["is_first"][stream[:, None], later].reshape(len(start), length - 1, -1).any(axis=(1, 2))
        return valid

    def _draw_starts(self, n: int, length: int, first: bool) -> tuple[np.ndarray, np.ndarray]:
        cap = self.cap_per_stream
        if self._tree is None:
            stream = self._rng.integers(0, self.num_envs, n)
            start = (self._oldest + self._rng.integers(0, self._count - length + 1, n)) % cap
        else:
            stream, start = np.divmod(self._tree.sample(n, self._rng, stratified=first), cap)
        return stream, start

    def _exact_starts(self, n: int, length: int, cross_episodes: bool) -> tuple[np.ndarray, np.ndarray]:
        """Fallback: enumerate every valid window and draw ``n`` of them (O(rows))."""
        cap, count, oldest = self.cap_per_stream, self._count, self._oldest
        num_off = count - length + 1
        offsets = np.arange(num_off)
        valid = np.ones((self.num_envs, num_off), dtype=bool)
        if not cross_episodes and length > 1:
            firsts = self._data["is_first"][:, (oldest + np.arange(count)) % cap]
            firsts = firsts.reshape(self.num_envs, count, -1).any(axis=2)
            csum = np.concatenate([np.zeros((self.num_envs, 1), np.int64), np.cumsum(firsts, axis=1)], axis=1)
            valid &= (csum[:, offsets + length] - csum[:, offsets + 1]) == 0
        slots = (oldest + offsets) % cap
        leaves = (self._stream_base[:, None] + slots[None, :])[valid]
        if leaves.size and self._tree is not None:
            p = self._tree.get(leaves)
            leaves, p = leaves[p > 0], p[p > 0]
        if leaves.size == 0:
            why = (
                f"no episode segment without a reset (is_first) spans {length} rows"
                if not cross_episodes
                else "every stored row has priority 0"
            )
            raise ValueError(
                f"cannot sample sequences of length {length}: no valid window exists among the "
                f"{len(self)} stored rows ({count} per stream): {why}"
            )
        if self._tree is None:
            pick = leaves[self._rng.integers(0, leaves.size, n)]
        else:
            pick = self._rng.choice(leaves, size=n, p=p / p.sum())
        return np.divmod(pick, cap)

    def sample_sequences(self, batch_size: int, length: int, cross_episodes: bool = True) -> dict[str, torch.Tensor]:
        """Sample ``batch_size`` windows of ``length`` consecutive rows, each from one stream.

        A window never crosses the ring's write head, so it holds only rows that were
        written and are in time order. With ``cross_episodes=False`` a window may have
        ``is_first`` only at position 0 (rejected windows are redrawn, vectorised; if the
        rejection rounds fail, every valid window is enumerated exactly).
        Prioritized: a window's priority is that of its start row.

        Returns:
            dict with every stored key as ``[B, L, *shape_k]`` (same nesting as added),
            ``index`` int64 ``[B]`` (flat slot id of each window's start) and, if
            prioritized, ``weight`` float32 ``[B]``.

        Raises:
            ValueError: empty buffer, ``length`` larger than the rows per stream, or no
                valid window (``cross_episodes=False`` and all episodes too short).
        """
        self._check_nonempty()
        B, L = int(batch_size), int(length)
        cap = self.cap_per_stream
        if B < 1:
            raise ValueError(f"batch_size must be >= 1, got {B}")
        if L < 1:
            raise ValueError(f"sequence length must be >= 1, got {L}")
        if L > self._count:
            raise ValueError(
                f"cannot sample sequences of length {L}: each of the {self.num_envs} streams holds only "
                f"{self._count} rows ({len(self)} rows in total; ring size {cap} per stream)"
            )
        if not cross_episodes and "is_first" not in self._data:
            raise ValueError("cross_episodes=False needs an 'is_first' key in the rows")
        if self._tree is not None and self._tree.total <= 0:
            raise ValueError("cannot sample: every stored row has priority 0")
        need_check = self._tree is not None or (not cross_episodes and L > 1)
        stream, start = self._draw_starts(B, L, first=True)
        if need_check:
            ok = self._valid_starts(stream, start, L, cross_episodes)
            rounds = 0
            while not ok.all():
                missing = int((~ok).sum())
                if rounds >= 4:
                    s, t = self._exact_starts(missing, L, cross_episodes)
                    stream[~ok], start[~ok] = s, t
                    break
                n = max(4 * missing, 32) << rounds  # oversample more each round
                s, t = self._draw_starts(n, L, first=False)
                good = np.flatnonzero(self._valid_starts(s, t, L, cross_episodes))[:missing]
                holes = np.flatnonzero(~ok)[: good.size]
                stream[holes], start[holes] = s[good], t[good]
                ok[holes] = True
                rounds += 1
            if self._tree is not None:
                order = self._rng.permutation(B)  # stratified draws come out sorted
                stream, start = stream[order], start[order]
        slot = (start[:, None] + np.arange(L)) % cap
        out = self._gather(stream[:, None], slot)
        leaf = stream * cap + start
        out["index"] = torch.from_numpy(leaf.astype(np.int64, copy=False))
        if self._tree is not None:
            out["weight"] = self._weights(leaf)
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything needed to restore the buffer, as torch tensors and Python scalars only
        (loadable with ``torch.load(..., weights_only=True)``).

        While the ring is not full only the written rows are included. Tensors of a full
        buffer share memory with it: save them before adding more rows.
        """
        n = self._count
        full = n == self.cap_per_stream

        def crop(arr: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(arr if full else np.ascontiguousarray(arr[:, :n]))

        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "capacity": self.capacity,
            "num_envs": self.num_envs,
            "prioritized": self.prioritized,
            "alpha": self.alpha,
            "beta": self.beta,
            "pos": self._pos,
            "count": self._count,
            "max_priority": self._max_priority,
            "rng_state": self._rng.bit_generator.state,
            "data": {key: crop(arr) for key, arr in self._data.items()},
        }
        if self._tree is not None:
            leaves = self._tree.leaves.reshape(self.num_envs, self.cap_per_stream)
            state["priorities"] = crop(np.array(leaves))  # copy: the tree keeps changing
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`. ``capacity`` and ``num_envs`` must match.

        Priorities are restored when both sides are prioritized (rescaled if ``alpha``
        differs); a prioritized buffer loading a uniform state gives every row the max
        priority. ``beta`` stays as configured on this buffer.
        """
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported ReplayBuffer state version {state.get('version')!r}")
        if state["capacity"] != self.capacity or state["num_envs"] != self.num_envs:
            raise ValueError(
                f"state is for capacity={state['capacity']}, num_envs={state['num_envs']} but this buffer has "
                f"capacity={self.capacity}, num_envs={self.num_envs}"
            )
        count, pos = int(state["count"]), int(state["pos"])
        self._data = {}
        for key, tensor in state["data"].items():
            arr = tensor.numpy()
            if arr.shape[:2] != (self.num_envs, count):
                raise ValueError(f"state array {key!r} has shape {tuple(arr.shape)}, expected ({self.num_envs}, {count}, ...)")
            self._data[key] = self._allocate(key, arr.shape[2:], arr.dtype)
            self._data[key][:, :count] = arr
        self._count, self._pos = count, pos
        self._max_priority = float(state["max_priority"])
        self._rng.bit_generator.state = state["rng_state"]
        if self._tree is not None:
            leaves = np.zeros((self.num_envs, self.cap_per_stream), dtype=np.float64)
            if state.get("priorities") is not None and float(state["alpha"]) > 0:
                leaves[:, :count] = state["priorities"].numpy() ** (self.alpha / float(state["alpha"]))
            else:
                self._max_priority = 1.0
                leaves[:, :count] = 1.0
            self._tree.set_all(leaves.reshape(-1))

    def save(self, path: str | os.PathLike) -> None:
        """``torch.save`` the state dict to ``path`` (written to a temp file, then renamed)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            torch.save(self.state_dict(), tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | os.PathLike, storage_dir: str | os.PathLike | None = None, seed: int | None = None) -> "ReplayBuffer":
        """Build a buffer from a file written by :meth:`save` (same capacity, streams,
        prioritization, alpha and beta; RNG state restored)."""
        state = torch.load(path, map_location="cpu", weights_only=True)
        buf = cls(
            state["capacity"],
            state["num_envs"],
            prioritized=state["prioritized"],
            alpha=state["alpha"],
            beta=state["beta"],
            storage_dir=storage_dir,
            seed=seed,
        )
        buf.load_state_dict(state)
        return buf
