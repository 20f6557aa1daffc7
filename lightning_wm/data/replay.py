"""ReplayBuffer: a preallocated ring per stream, with slot generations, priorities and write-back.

Rows follow the project's row convention (see ``docs/architecture.md``): one row per env step with
``obs``, ``reward``, ``is_first``, ``is_last``, ``is_terminal``, ``action`` and any agent
extras. Keys are not fixed in advance; storage for a key is allocated the first time it
is seen. How rows are *read* (sequences, unroll windows, transitions, ...) is the job of the
samplers in :mod:`lightning_wm.data.samplers`; this module stores rows and draws positions.

Layout
------
``capacity // num_streams`` rows per stream. Each key ``k`` is stored in one array of shape
``[num_streams, cap_per_stream, *shape_k]`` (in memory, or a memory-mapped ``.npy`` file
when ``storage_dir`` is given). Every stream has its own write head: :meth:`ReplayBuffer.add`
and :meth:`ReplayBuffer.add_many` may write to some streams only (actors deliver chunks for
their own envs). A row is addressed by its *flat slot index* ``stream * cap_per_stream + slot``;
this is the ``index`` the samplers return and :meth:`ReplayBuffer.update_priorities` /
:meth:`ReplayBuffer.write` accept.

Generations
-----------
Each stream counts the rows ever written to it; a slot stores that counter at the time it was
written (its *generation*, int64, ``-1`` while unwritten). Within a stream generations are the
rows' time order, so ``generation[slot + j] == generation[slot] + j`` exactly when the ``j``
rows after ``slot`` were written after it and have not been overwritten since: samplers use
this to stop windows at the write head. Feedback (new priorities, reanalysed columns) carries
the generations it was computed for, and rows overwritten since they were sampled are skipped.
That keeps late feedback safe, e.g. under Lightning's one-batch prefetch, where batch ``N + 1``
(and the env steps before it) is drawn before the feedback of batch ``N`` arrives.

Nested observations
-------------------
A dict value (e.g. ``obs={'image': ..., 'state': ...}``) is stored under flattened keys
``'obs/image'``, ``'obs/state'`` and returned with the same nesting. Keys therefore must
not contain ``'/'``. Sampler output names (:data:`RESERVED_KEYS` and anything starting with
``next_``) cannot be row keys.

Dtypes
------
Dtypes are kept as given (uint8 pixels stay uint8, bools stay bool, int64 actions stay
int64), except float64 which is stored as float32. Later writes are cast to the stored dtype.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_wm.data.replay_state import ReplayStorage
from lightning_wm.data.sumtree import SumTree
from lightning_wm.tree import flatten, unflatten

__all__ = ["ReplayBuffer", "RESERVED_KEYS", "ENV_KEYS"]

#: keys the samplers add to batches; rows may not use them (nor names starting with ``next_``)
RESERVED_KEYS = ("index", "generation", "row_index", "row_generation", "weight", "mask", "is_real", "age")
#: the row convention's env keys; every other key (action, agent extras) is zeroed on a last row
ENV_KEYS = ("obs", "reward", "is_first", "is_last", "is_terminal")
RANDOM_POLICY_VERSION = -1  # ``policy_version`` of rows made by the random prefill policy
Accept = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _to_numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.dtype == torch.bfloat16:  # numpy has no bfloat16 (e.g. priorities from a bf16-mixed step)
            value = value.float()
        return value.cpu().numpy()
    return np.asarray(value)


def _storage_dtype(key: str, arr: np.ndarray) -> np.dtype:
    if arr.dtype == object:
        raise ValueError(f"key {key!r} has dtype object; give numeric arrays")
    return np.dtype(np.float32) if arr.dtype == np.float64 else arr.dtype


def _top_key(flat_key: str) -> str:
    return flat_key.split("/", 1)[0]


class ReplayBuffer(ReplayStorage):
    """Ring-buffer replay over ``num_streams`` streams (one per env), each with its own write head.

    Args:
        capacity: total number of rows over all streams; each stream gets a ring of
            ``capacity // num_streams`` rows.
        num_streams: number of streams (rings), one per env.
        prioritized: keep a sum tree of priorities and sample proportionally to
            ``priority ** alpha`` (Schaul et al., 2016). New rows get the given priority or
            the largest priority seen so far (1.0 initially).
        alpha: priority exponent (0 = uniform).
        beta: importance-weight exponent; a public attribute, so it can be annealed.
        storage_dir: if given, every key is a memory-mapped ``.npy`` file in this
            directory (created if needed; existing files of the same name are overwritten),
            for buffers larger than RAM.
        seed: seed of the buffer's own ``numpy.random.Generator`` (samplers draw from it).
        checkpoint: whether :class:`~lightning_wm.callbacks.BufferCheckpoint` saves this
            buffer beside the trainer's checkpoints (an imagination buffer opts out).
    """

    def __init__(
        self,
        capacity: int,
        num_streams: int = 1,
        *,
        prioritized: bool = False,
        alpha: float = 0.6,
        beta: float = 0.4,
        storage_dir: str | os.PathLike | None = None,
        seed: int | None = None,
        checkpoint: bool = True,
    ) -> None:
        if num_streams < 1:
            raise ValueError(f"num_streams must be >= 1, got {num_streams}")
        if capacity < num_streams:
            raise ValueError(f"capacity ({capacity}) must be >= num_streams ({num_streams})")
        if alpha < 0 or beta < 0:
            raise ValueError(f"alpha and beta must be >= 0, got alpha={alpha}, beta={beta}")
        self.capacity = int(capacity)
        self.num_streams = int(num_streams)
        self.cap_per_stream = self.capacity // self.num_streams
        self.prioritized = bool(prioritized)
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.checkpoint = bool(checkpoint)
        self.storage_dir = Path(storage_dir) if storage_dir is not None else None
        if self.storage_dir is not None:
            self.storage_dir.mkdir(parents=True, exist_ok=True)
        self._rng = np.random.default_rng(seed)
        self._data: dict[str, np.ndarray] = {}
        self._optional: set[str] = set()  # keys created by write(): rows may leave them out
        S, cap = self.num_streams, self.cap_per_stream
        self._pos = np.zeros(S, np.int64)  # next slot to write, per stream
        self._count = np.zeros(S, np.int64)  # rows stored, per stream
        self._written = np.zeros(S, np.int64)  # rows ever written, per stream (the next generation)
        self._gen = np.full((S, cap), -1, np.int64)
        self._lockstep = True  # every stream has the same write head and count
        self._max_priority = 1.0
        self._tree = SumTree(S * cap) if self.prioritized else None
        self._all_streams = np.arange(S, dtype=np.int64)
        self.revision = 0  # bumped by every change; lets a checkpoint skip rewriting an unchanged buffer

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        """Total rows stored over all streams."""
        return int(self._count.sum())

    def __contains__(self, key: str) -> bool:
        """Whether flat key ``key`` (e.g. ``'is_first'``, ``'obs/image'``) is stored."""
        return key in self._data

    @property
    def keys(self) -> list[str]:
        """Flattened stored keys (e.g. ``'obs/image'`` for dict observations)."""
        return list(self._data)

    @property
    def rows_per_stream(self) -> np.ndarray:
        """Rows currently stored in each stream, int64 ``[num_streams]`` (a copy)."""
        return self._count.copy()

    @property
    def oldest(self) -> np.ndarray:
        """Slot of each stream's oldest stored row, int64 ``[num_streams]``."""
        return (self._pos - self._count) % self.cap_per_stream

    @property
    def newest(self) -> np.ndarray:
        """Slot of each stream's newest row, int64 ``[num_streams]`` (meaningless for empty streams)."""
        return (self._pos - 1) % self.cap_per_stream

    def __repr__(self) -> str:
        kind = "prioritized" if self.prioritized else "uniform"
        return (
            f"ReplayBuffer({len(self)}/{self.num_streams * self.cap_per_stream} rows, "
            f"{self.num_streams} streams, {kind}, keys={self.keys})"
        )

    def column(self, key: str) -> np.ndarray:
        """The storage of flat key ``key``, ``[num_streams, cap_per_stream, *shape]`` (a view:
        read it, do not write to it)."""
        if key not in self._data:
            raise ValueError(f"the replay rows have no {key!r} key (stored keys: {self.keys})")
        return self._data[key]

    # ------------------------------------------------------------------ writing
    def _streams(self, streams: Any) -> np.ndarray:
        if streams is None:
            return self._all_streams
        s = _to_numpy(streams).astype(np.int64, copy=False).reshape(-1)
        if s.size == 0:
            raise ValueError("streams is empty")
        if s.min() < 0 or s.max() >= self.num_streams:
            raise ValueError(f"streams {s.tolist()} out of range [0, {self.num_streams})")
        if np.unique(s).size != s.size:
            raise ValueError(f"streams {s.tolist()} has duplicates")
        return s

    def _check_rows(self, flat: dict[str, Any], lead: tuple[int, ...], what: str) -> dict[str, np.ndarray]:
        """Check every leaf of flattened rows has leading dims ``lead`` and the stored shape."""
        if not flat:
            raise ValueError(f"{what} got no keys")
        arrays: dict[str, np.ndarray] = {}
        for key, value in flat.items():
            stored = self._data.get(key)
            if stored is None and (key in RESERVED_KEYS or key.startswith("next_")):
                raise ValueError(f"row key {key!r} is reserved for sampler output")
            arr = _to_numpy(value)
            if arr.shape[: len(lead)] != lead:
                expected = (
                    f"a leading dimension of {lead[0]} (one row per stream written)"
                    if len(lead) == 1
                    else f"leading dimensions [T, {lead[1]}] (T rows for each stream written)"
                )
                raise ValueError(f"{what} key {key!r}: expected {expected}, got shape {tuple(arr.shape)}")
            if stored is None:
                _storage_dtype(key, arr)  # refuse an unstorable dtype before anything is allocated
            elif arr.shape[len(lead) :] != stored.shape[2:]:
                raise ValueError(
                    f"row key {key!r} changed shape: stored per-row shape {tuple(stored.shape[2:])}, "
                    f"got {tuple(arr.shape[len(lead) :])}"
                )
            arrays[key] = arr
        missing = [k for k in self._data if k not in arrays and k not in self._optional]
        version = arrays.get("policy_version")
        if missing and version is not None and (version == RANDOM_POLICY_VERSION).all():
            # rows of the random prefill have no agent extras: zeros, as on last rows (one actor's
            # prefill may arrive after another's searched rows)
            for key in [k for k in missing if k not in ENV_KEYS]:
                arrays[key] = np.zeros(lead + self._data[key].shape[2:], self._data[key].dtype)
            missing = [k for k in missing if k in ENV_KEYS]
        if missing:
            raise ValueError(f"{what} is missing key(s) {missing} that earlier rows had")
        return arrays

    def add(self, row: Mapping[str, Any], streams: Any = None, priority: Any = None) -> None:
        """Append one row to each of ``streams`` (default: every stream).

        Args:
            row: mapping key -> array ``[S, *shape_k]`` for the ``S`` streams written (numpy
                or torch; nested mappings allowed). After the first add every stored key must
                be present with the same trailing shape; a key seen for the first time later is
                allocated then, with zeros in the rows written before it.
            streams: int ``[S]`` distinct stream ids (default: all, in order).
            priority: scalar or ``[S]`` priorities of the new rows (prioritized buffers only);
                default: the largest priority seen so far.

        Raises:
            ValueError: naming the key, on a wrong leading dimension, a changed shape, a
                missing key or a reserved/invalid key name. Nothing is written then.
        """
        s = self._streams(streams)
        arrays = self._check_rows(flatten(row), (s.size,), "add()")
        if streams is None and self._lockstep:
            self._add_lockstep(arrays, priority)
        else:
            self._write_rows({k: a[None] for k, a in arrays.items()}, s, priority)

    def _add_lockstep(self, arrays: dict[str, np.ndarray], priority: Any) -> None:
        """:meth:`add` of one row to every stream while all write heads are equal (the usual case)."""
        pri = self._new_priorities(priority, (1, self.num_streams))
        p = int(self._pos[0])
        for key, arr in arrays.items():
            if key not in self._data:
                self._data[key] = self._allocate(key, arr.shape[1:], _storage_dtype(key, arr))
        for key, arr in arrays.items():
            self._data[key][:, p] = arr
        for key in self._optional:
            if key not in arrays:
                self._data[key][:, p] = 0
        self._gen[:, p] = self._written
        if self._tree is not None:
            if pri is not None:
                self._max_priority = max(self._max_priority, float(pri.max()))
            values = self._max_priority if pri is None else pri[0]
            self._tree.set_unchecked(self._all_streams * self.cap_per_stream + p, np.power(values, self.alpha))
        self._pos[:] = (p + 1) % self.cap_per_stream
        if self._count[0] < self.cap_per_stream:
            self._count += 1
        self._written += 1
        self.revision += 1

    def add_many(self, chunk: Mapping[str, Any], streams: Any = None, priority: Any = None) -> None:
        """Append ``T`` consecutive rows to each of ``streams``: the same as ``T`` calls of
        :meth:`add`, in one vectorised write.

        Args:
            chunk: mapping key -> array ``[T, S, *shape_k]`` (time-major, as actors send them).
            streams: int ``[S]`` distinct stream ids (default: all, in order).
            priority: scalar or ``[T, S]`` priorities (prioritized buffers only); default: the
                largest priority seen so far.
        """
        s = self._streams(streams)
        flat = flatten(chunk)
        first = _to_numpy(next(iter(flat.values()))) if flat else np.zeros(0)
        if first.ndim < 2:
            raise ValueError(f"add_many() needs leaves of shape [T, streams, ...], got {tuple(first.shape)}")
        arrays = self._check_rows(flat, (first.shape[0], s.size), "add_many()")
        if first.shape[0] > 0:
            self._write_rows(arrays, s, priority)

    def _write_rows(self, arrays: dict[str, np.ndarray], s: np.ndarray, priority: Any) -> None:
        """Write ``[T, S, ...]`` rows to streams ``s`` (checked), oldest first."""
        T = next(iter(arrays.values())).shape[0]
        pri = self._new_priorities(priority, (T, s.size))
        cap = self.cap_per_stream
        gen0 = self._written[s].copy()  # generation of the chunk's first row per stream
        if pri is not None:  # every given priority counts as seen, also of rows the chunk itself overwrites
            self._max_priority = max(self._max_priority, float(pri.max()))
        skip = max(0, T - cap)  # only the last `cap` rows of a long chunk survive
        if skip:
            arrays = {k: a[skip:] for k, a in arrays.items()}
            pri = pri[skip:] if pri is not None else None
        for key, arr in arrays.items():
            if key not in self._data:
                self._data[key] = self._allocate(key, arr.shape[2:], _storage_dtype(key, arr))
        absent = [k for k in self._optional if k not in arrays]
        offsets = np.arange(skip, T, dtype=np.int64)
        slot = (self._pos[s][None, :] + offsets[:, None]) % cap  # [n, S]
        for key, arr in arrays.items():
            self._data[key][s[None, :], slot] = arr
        for key in absent:
            self._data[key][s[None, :], slot] = 0
        self._gen[s[None, :], slot] = gen0[None, :] + offsets[:, None]
        leaves = (s[None, :] * cap + slot).reshape(-1)
        if self._tree is not None:
            values = self._max_priority if pri is None else pri.reshape(-1)
            self._tree.set_unchecked(leaves, np.power(values, self.alpha))
        self._pos[s] = (self._pos[s] + T) % cap
        self._count[s] = np.minimum(self._count[s] + T, cap)
        self._written[s] += T
        self._lockstep = bool((self._pos == self._pos[0]).all() and (self._count == self._count[0]).all())
        self.revision += 1

    def _new_priorities(self, priority: Any, shape: tuple[int, int]) -> np.ndarray | None:
        if priority is None:
            return None
        if self._tree is None:
            raise ValueError("priorities given for a buffer created with prioritized=False")
        pri = _to_numpy(priority).astype(np.float64)
        try:
            pri = np.broadcast_to(pri.reshape(shape) if pri.size == shape[0] * shape[1] else pri, shape)
        except ValueError:
            raise ValueError(f"priority of shape {tuple(pri.shape)} does not fit the new rows {shape}") from None
        if not np.all(np.isfinite(pri)) or np.any(pri < 0):
            raise ValueError("priorities must be finite and >= 0")
        return pri

    def _current(self, index: Any, generation: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
        """Check flat slot ids ``index [N]`` -> (index, bool ``[N]``: the slot still holds
        ``generation`` (or, without one, any written row))."""
        idx = _to_numpy(index).astype(np.int64, copy=False).reshape(-1)
        size = self.num_streams * self.cap_per_stream
        if idx.size and (idx.min() < 0 or idx.max() >= size):
            raise ValueError(f"{what} index out of range [0, {size})")
        stored = self._gen.reshape(-1)[idx]
        if generation is None:
            return idx, stored >= 0
        gen = _to_numpy(generation).astype(np.int64, copy=False).reshape(-1)
        if gen.shape != idx.shape:
            raise ValueError(f"{what}: index has {idx.size} entries but generation has {gen.size}")
        return idx, (stored == gen) & (stored >= 0)

    def update_priorities(self, index: Any, priority: Any, generation: Any = None) -> int:
        """Set the priority of rows ``index`` (flat slot ids ``[N]``) to ``priority`` ``[N]``.

        ``priority ** alpha`` is stored in the sum tree; priorities must be finite and >= 0
        (a row with priority 0 is never sampled; add a small epsilon yourself). With
        ``generation`` ``[N]`` (the ``generation`` of the sampled batch) a row is skipped when
        its slot has been overwritten since; unwritten slots are always skipped.

        Returns:
            the number of rows updated.
        """
        if self._tree is None:
            raise ValueError("update_priorities() needs a buffer created with prioritized=True")
        idx, current = self._current(index, generation, "update_priorities()")
        pri = _to_numpy(priority).astype(np.float64, copy=False).reshape(-1)
        if idx.shape != pri.shape:
            raise ValueError(f"index has {idx.size} entries but priority has {pri.size}")
        if not np.all(np.isfinite(pri)) or np.any(pri < 0):
            raise ValueError("priorities must be finite and >= 0")
        idx, pri = idx[current], pri[current]
        if idx.size:
            self._tree.set(idx, pri**self.alpha)
            self._max_priority = max(self._max_priority, float(pri.max()))
            self.revision += 1
        return int(idx.size)

    def write(self, index: Any, columns: Mapping[str, Any], generation: Any) -> int:
        """Overwrite (or add) columns of stored rows, e.g. reanalysed value targets.

        Args:
            index: flat slot ids ``[N]``.
            columns: key -> ``[N, *shape]`` (nested mappings allowed). A new key is allocated
                (zeros elsewhere; rows added later may leave it out and get zeros); an existing
                key keeps its dtype and per-row shape.
            generation: ``[N]`` generations the values were computed for; rows overwritten
                since are skipped.

        Returns:
            the number of rows written.
        """
        idx, current = self._current(index, generation, "write()")
        flat = flatten(columns)
        arrays: dict[str, np.ndarray] = {}
        for key, value in flat.items():
            if key in RESERVED_KEYS or key.startswith("next_"):
                raise ValueError(f"column {key!r} is reserved for sampler output")
            arr = _to_numpy(value)
            if arr.ndim == 0 or arr.shape[0] != idx.size:
                raise ValueError(f"write() column {key!r}: expected {idx.size} rows, got shape {tuple(arr.shape)}")
            stored = self._data.get(key)
            if stored is None:
                _storage_dtype(key, arr)
            elif arr.shape[1:] != stored.shape[2:]:
                raise ValueError(
                    f"write() column {key!r}: stored per-row shape {tuple(stored.shape[2:])}, "
                    f"got {tuple(arr.shape[1:])}"
                )
            arrays[key] = arr
        stream, slot = np.divmod(idx[current], self.cap_per_stream)
        for key, arr in arrays.items():
            if key not in self._data:
                self._data[key] = self._allocate(key, arr.shape[1:], _storage_dtype(key, arr))
                self._optional.add(key)
            self._data[key][stream, slot] = arr[current]
        self.revision += 1
        return int(stream.size)

    def mark_episode_end(self) -> int:
        """End every stream's current episode at its newest row: set ``is_last`` there and zero
        its action and agent extras (every key but :data:`ENV_KEYS`), as the Collector does on a
        last row. Called on resume, so that the ``is_first`` row acting starts with after a
        restart follows a clean boundary. ``is_terminal`` is left as it is (a restart is a
        truncation, not a termination). Rows that are already last are left alone.

        Returns:
            the number of streams marked.
        """
        if "is_last" not in self._data:
            return 0
        stream = np.flatnonzero(self._count > 0)
        slot = self.newest[stream]
        open_ = ~self._data["is_last"][stream, slot].reshape(stream.size, -1).any(axis=1)
        stream, slot = stream[open_], slot[open_]
        if stream.size == 0:
            return 0
        self._data["is_last"][stream, slot] = True
        for key, arr in self._data.items():
            if _top_key(key) not in ENV_KEYS:
                arr[stream, slot] = 0
        self.revision += 1
        return int(stream.size)

    # ------------------------------------------------------------------ drawing positions
    def generation(self, stream: np.ndarray, slot: np.ndarray) -> np.ndarray:
        """Generations of rows ``(stream, slot)`` (any broadcastable int shapes), int64."""
        return self._gen[stream, slot]

    def rows_written(self, stream: np.ndarray) -> np.ndarray:
        """Rows ever written to each of ``stream`` (int array): the generation the next row gets."""
        return self._written[stream]

    def gather(self, stream: np.ndarray, slot: np.ndarray, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
        """Rows ``(stream, slot)`` (broadcastable int arrays, result shape ``X``) of every key
        (or of the top-level ``keys`` only) as torch tensors ``[*X, *shape_k]``, nested as added."""
        out = {
            key: torch.from_numpy(arr[stream, slot])
            for key, arr in self._data.items()
            if keys is None or _top_key(key) in keys
        }
        return unflatten(out)

    def importance_weights(self, leaf: np.ndarray) -> torch.Tensor:
        """Importance weights ``(N P(i))^-beta`` of flat slots ``leaf [B]``, normalised by the
        batch maximum, float32 ``[B]`` (prioritized buffers only)."""
        if self._tree is None:
            raise ValueError("importance weights need a buffer created with prioritized=True")
        p = self._tree.get(leaf)  # N and the total cancel out in the normalisation
        return torch.from_numpy(((p / p.min()) ** (-self.beta)).astype(np.float32))

    def draw(
        self,
        n: int,
        span: int = 1,
        accept: Accept | None = None,
        what: str = "positions",
    ) -> tuple[np.ndarray, np.ndarray]:
        """Draw ``n`` positions ``(stream [n], slot [n])``, int64.

        A candidate is a stored row of a stream followed by at least ``span - 1`` stored rows
        of the same stream (so a window of ``span`` rows from it never crosses the write head)
        for which ``accept(stream [N], slot [N]) -> bool [N]`` holds. Candidates are drawn
        uniformly or, prioritized, proportionally to ``priority ** alpha`` of the position's
        row. Rejected draws are redrawn (vectorised, a few rounds with growing oversampling);
        if that fails, every candidate is enumerated (O(rows)) and ``n`` are drawn from them.

        Raises:
            ValueError: empty buffer, no stream holding ``span`` rows, every priority 0, or
                no acceptable candidate (the message says ``what`` was looked for).
        """
        n, span = int(n), int(span)
        if n < 1:
            raise ValueError(f"batch_size must be >= 1, got {n}")
        if span < 1:
            raise ValueError(f"span must be >= 1, got {span}")
        most = int(self._count[0]) if self._lockstep else int(self._count.max())
        if most == 0:
            raise ValueError("cannot sample: the replay buffer is empty (0 rows)")
        if most < span:
            raise ValueError(
                f"cannot sample windows of {span} rows: the fullest of the {self.num_streams} streams holds only "
                f"{most} rows ({len(self)} rows in total; ring size {self.cap_per_stream} per stream)"
            )
        if self._tree is None and accept is None and self._lockstep:  # the common case, in Python ints
            stream = self._rng.integers(0, self.num_streams, n)
            offset = self._rng.integers(0, most - span + 1, n)
            return stream, (int(self._pos[0]) - most + offset) % self.cap_per_stream
        if self._tree is not None and self._tree.total <= 0:
            raise ValueError("cannot sample: every stored row has priority 0")
        starts = np.maximum(self._count - span + 1, 0)  # candidate positions per stream
        stream, slot = self._draw_candidates(n, starts, first=True)
        if self._tree is None and accept is None:
            return stream, slot
        ok = self._valid(stream, slot, starts, accept)
        rounds = 0
        while not ok.all():
            missing = int((~ok).sum())
            holes = np.flatnonzero(~ok)
            if rounds >= 4:
                stream[holes], slot[holes] = self._exact(missing, starts, accept, what)
                break
            s, t = self._draw_candidates(max(4 * missing, 32) << rounds, starts, first=False)
            good = np.flatnonzero(self._valid(s, t, starts, accept))[:missing]
            holes = holes[: good.size]
            stream[holes], slot[holes] = s[good], t[good]
            ok[holes] = True
            rounds += 1
        if self._tree is not None:
            order = self._rng.permutation(n)  # stratified draws come out sorted
            stream, slot = stream[order], slot[order]
        return stream, slot

    def _draw_candidates(self, n: int, starts: np.ndarray, first: bool) -> tuple[np.ndarray, np.ndarray]:
        cap = self.cap_per_stream
        if self._tree is not None:
            return np.divmod(self._tree.sample(n, self._rng, stratified=first), cap)
        if self._lockstep:
            stream = self._rng.integers(0, self.num_streams, n)
            offset = self._rng.integers(0, int(starts[0]), n)
            return stream, (int(self._pos[0] - self._count[0]) + offset) % cap
        else:
            ends = np.cumsum(starts)
            flat = self._rng.integers(0, ends[-1], n)
            stream = np.searchsorted(ends, flat, side="right")
            offset = flat - (ends[stream] - starts[stream])
        return stream, (self.oldest[stream] + offset) % cap

    def _valid(self, stream: np.ndarray, slot: np.ndarray, starts: np.ndarray, accept: Accept | None) -> np.ndarray:
        cap = self.cap_per_stream
        valid = (slot - self.oldest[stream]) % cap < starts[stream]
        if self._tree is not None:
            valid &= self._tree.get(stream * cap + slot) > 0  # rounding can land on an empty leaf
        if accept is not None:
            if valid.all():
                valid = accept(stream, slot)
            elif valid.any():
                where = np.flatnonzero(valid)
                valid[where] = accept(stream[where], slot[where])
        return valid

    def _exact(self, n: int, starts: np.ndarray, accept: Accept | None, what: str) -> tuple[np.ndarray, np.ndarray]:
        """Enumerate every candidate and draw ``n`` of them (uniformly or by priority)."""
        cap = self.cap_per_stream
        stream = np.repeat(self._all_streams, starts)
        offset = np.arange(stream.size) - np.repeat(np.cumsum(starts) - starts, starts)
        slot = (self.oldest[stream] + offset) % cap
        keep = np.ones(stream.size, bool) if accept is None else accept(stream, slot)
        p = None
        if self._tree is not None:
            p = self._tree.get(stream * cap + slot)
            keep &= p > 0
            p = p[keep]
        stream, slot = stream[keep], slot[keep]
        if stream.size == 0:
            raise ValueError(
                f"cannot sample {what}: no valid window exists among the {len(self)} stored rows "
                f"({self._count.tolist()} per stream)"
            )
        pick = self._rng.choice(stream.size, size=n, p=None if p is None else p / p.sum())
        return stream[pick], slot[pick]
