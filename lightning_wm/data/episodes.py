"""EpisodeStore: recorded episodes on disk, one compressed ``.npz`` file each.

Every episode is a mapping of arrays that share their leading length ``T`` (the rows of
the project's row convention: ``obs``, ``reward``, ``is_first``, ...). A file is written
atomically (:func:`lightning_wm.io.atomic_write`: a hidden temp file with a name unique to
the process, fsync, rename), so a crash never leaves a half-written episode under a real
name; temp files that a killed writer left are removed when the store is next opened.

Several processes may record into one store at once: ``meta.json`` is only changed under
the store's lock (``fcntl.flock`` on ``.lock``), :meth:`EpisodeStore.start_recording` refuses
a recording whose env settings differ from the store's and hands each recording its own
range of seed indices, and every store object counts what it wrote itself.

File names sort in recording order and carry the length, so :meth:`EpisodeStore.total_steps`
needs no loading::

    20261123T010203-000001-ab12cd34-T500.npz
    <UTC time>      <counter> <random id> <T>

Dict observations are stored flattened as ``'obs/key'`` members and returned nested
again by :meth:`EpisodeStore.load` (one level or more; keys must not contain ``'/'``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import time
import warnings
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from lightning_wm.io import atomic_write, check_writable, clean_stale_temps
from lightning_wm.tree import flatten as _flatten
from lightning_wm.tree import unflatten as _unflatten

__all__ = ["CorruptEpisodeError", "EpisodeStore", "check_layout", "row_layout"]

_NAME = re.compile(r"^(?P<time>\d{8}T\d{6})-(?P<counter>\d{6,})-(?P<id>[0-9a-f]+)-T(?P<length>\d+)\.npz$")
_META = "meta.json"
_LOCK = ".lock"
# env settings that change which episodes are recorded, not what they look like: a store may mix them
_FREE_ENV_SETTINGS = ("num_envs", "seed", "vectorization")


class CorruptEpisodeError(ValueError):
    """An episode file cannot be read or is inconsistent; the message names the file."""


class EpisodeStore:
    """A directory of episode files.

    Args:
        directory: where episodes live; created if missing.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():  # creating it is the first write: fail here, in one line
            check_writable(self.directory, "episode store")
        with contextlib.suppress(OSError):  # a read-only store keeps its temps; they are ignored anyway
            clean_stale_temps(self.directory)
        counters = [int(m["counter"]) for m in map(_NAME.match, os.listdir(self.directory)) if m]
        self._counter = max(counters, default=0)
        self.episodes_written = 0  # by this object (this process), not by other writers of the store
        self.rows_written = 0

    # ------------------------------------------------------------------ writing
    def add(self, episode: Mapping[str, np.ndarray]) -> Path:
        """Write one episode atomically and return its path.

        Args:
            episode: key -> array ``[T, ...]`` with the same ``T >= 1`` for all keys;
                nested mappings (dict observations) are stored as ``'obs/key'``.

        Raises:
            ValueError: no arrays, mismatched lengths, 0-d or object arrays.
        """
        flat = {k: np.asarray(v.detach().cpu() if hasattr(v, "detach") else v) for k, v in _flatten(episode).items()}
        if not flat:
            raise ValueError("cannot add an empty episode (no arrays)")
        lengths = {}
        for key, arr in flat.items():
            if arr.ndim == 0:
                raise ValueError(f"episode key {key!r} is a scalar; every value must be an array [T, ...]")
            if arr.dtype == object:
                raise ValueError(f"episode key {key!r} has dtype object; give numeric arrays")
            lengths[key] = arr.shape[0]
        if len(set(lengths.values())) != 1:
            raise ValueError(f"episode arrays differ in length T: {lengths}")
        T = next(iter(lengths.values()))
        if T < 1:
            raise ValueError("cannot add an episode of length 0")
        self._counter += 1
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        name = f"{stamp}-{self._counter:06d}-{secrets.token_hex(4)}-T{T}.npz"
        final = atomic_write(self.directory / name, lambda f: np.savez_compressed(f, **flat))
        self.episodes_written += 1
        self.rows_written += T
        return final

    # ------------------------------------------------------------------ listing
    def paths(self) -> list[Path]:
        """Finished episode files in recording order (temp files are ignored)."""
        found = []
        for name in os.listdir(self.directory):
            m = _NAME.match(name)
            if m:
                found.append(((m["time"], int(m["counter"]), m["id"]), self.directory / name))
        return [p for _, p in sorted(found)]

    def __len__(self) -> int:
        """Number of finished episodes."""
        return len(self.paths())

    def lengths(self) -> list[int]:
        """Length ``T`` of each episode in :meth:`paths` order, from the file names."""
        return [int(_NAME.match(p.name)["length"]) for p in self.paths()]

    def total_steps(self) -> int:
        """Sum of episode lengths, read from the file names (nothing is loaded)."""
        return sum(self.lengths())

    # ------------------------------------------------------------------ reading
    def load(self, path: str | os.PathLike, skip_corrupt: bool = False) -> dict[str, np.ndarray] | None:
        """Load one episode -> ``{key: array [T, ...]}`` (dict observations nested again).

        Raises:
            CorruptEpisodeError: the file is truncated/corrupt, its arrays differ in
                length, or the length differs from the one in its name. With
                ``skip_corrupt=True`` a warning naming the file is issued instead and
                ``None`` returned.
        """
        path = Path(path)
        try:
            flat = self._read(path)
        except CorruptEpisodeError as err:
            if not skip_corrupt:
                raise
            warnings.warn(f"skipping {err}", RuntimeWarning, stacklevel=2)
            return None
        return _unflatten(flat)

    def _read(self, path: Path) -> dict[str, np.ndarray]:
        def corrupt(why: str) -> CorruptEpisodeError:
            return CorruptEpisodeError(
                f"episode file {str(path)!r} is corrupt or truncated ({why}); delete it or re-record the episode"
            )

        try:
            with open(path, "rb") as handle, np.load(handle, allow_pickle=False) as npz:
                flat = {key: npz[key] for key in npz.files}  # reading checks each member's CRC
        except FileNotFoundError:
            raise
        except (zipfile.BadZipFile, zlib.error, ValueError, OSError, EOFError, KeyError) as err:
            raise corrupt(f"{type(err).__name__}: {err}") from err
        if not flat:
            raise corrupt("it holds no arrays")
        lengths = {k: (v.shape[0] if v.ndim else None) for k, v in flat.items()}
        if len(set(lengths.values())) != 1 or None in lengths.values():
            raise corrupt(f"arrays differ in length T: {lengths}")
        T = next(iter(lengths.values()))
        m = _NAME.match(path.name)
        if m and int(m["length"]) != T:
            raise corrupt(f"its name says T={m['length']} but the arrays have T={T}")
        return flat

    def episodes(self, skip_corrupt: bool = False) -> Iterator[dict[str, np.ndarray]]:
        """Yield every episode in recording order, loading one at a time."""
        for path in self.paths():
            episode = self.load(path, skip_corrupt=skip_corrupt)
            if episode is not None:
                yield episode

    # ------------------------------------------------------------------ metadata
    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the store's lock (``fcntl.flock`` on ``.lock``; other processes wait)."""
        with open(self.directory / _LOCK, "a+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def write_metadata(self, meta: dict) -> None:
        """Write ``meta`` (JSON-serialisable, e.g. env id and spaces) to ``meta.json`` atomically."""
        text = json.dumps(meta, indent=2, sort_keys=True)
        atomic_write(self.directory / _META, lambda f: f.write(text), binary=False)

    def start_recording(self, env: Mapping[str, Any], episodes: int, streams: int) -> int:
        """Begin recording ``episodes`` episodes over ``streams`` envs of ``env`` into this store.

        Under the store's lock: the env settings are checked against the ones the store was
        recorded with (``num_envs``, ``seed`` and ``vectorization`` may differ; anything else
        is refused, naming both values) and saved if the store has none; then
        ``max(episodes, streams)`` seed indices are reserved. Returns the first one: a recording
        seeds its envs from its own indices, so recording twice (or twice at once) into one
        store continues the seed sequence instead of repeating episodes. An older store without
        a counter continues after the episodes it holds.

        Raises:
            ValueError: the store holds episodes of other env settings.
        """
        env = json.loads(json.dumps(dict(env)))  # tuples as lists, as they are stored
        with self.locked():
            meta = self.read_metadata()
            stored = meta.get("env")
            if stored is not None:
                differing = [
                    k
                    for k in sorted(set(stored) | set(env))
                    if k not in _FREE_ENV_SETTINGS and stored.get(k) != env.get(k)
                ]
                if differing:
                    listed = "; ".join(
                        f"{k}: the store has {stored.get(k)!r}, this run {env.get(k)!r}" for k in differing
                    )
                    raise ValueError(
                        f"episode store {str(self.directory)!r} was recorded with other env settings "
                        f"({listed}); record into another directory or use the store's settings"
                    )
            first = max(int(meta.get("next_seed_index", 0)), len(self))
            meta = {
                **meta,
                "env": stored if stored is not None else env,
                "next_seed_index": first + max(int(episodes), int(streams)),
            }
            self.write_metadata(meta)
        return first

    def read_metadata(self) -> dict:
        """Contents of ``meta.json``; ``{}`` if none was written."""
        path = self.directory / _META
        if not path.exists():
            return {}
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"metadata file {str(path)!r} is not valid JSON ({err}); delete it or rewrite it") from err

    def __repr__(self) -> str:
        return f"EpisodeStore({str(self.directory)!r}, {len(self)} episodes)"


def row_layout(episode: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{key: (per-row shape, dtype)}`` of a (flattened) episode; nested keys as ``'obs/image'``."""
    return {k: (tuple(v.shape[1:]), str(v.dtype)) for k, v in _flatten(episode).items()}


def check_layout(
    episode: Mapping[str, Any], expected: Mapping[str, tuple[tuple[int, ...], str]], path: str | os.PathLike
) -> None:
    """Raise :class:`CorruptEpisodeError` naming ``path`` and the key if ``episode``'s rows differ
    from ``expected`` (:func:`row_layout` of the store's other episodes) in keys, shape or dtype."""
    layout = row_layout(episode)
    for key in sorted(set(layout) | set(expected)):
        if layout.get(key) != expected.get(key):

            def show(entry: Any) -> str:
                return "no such key" if entry is None else f"{entry[0]} {entry[1]}"

            raise CorruptEpisodeError(
                f"episode file {str(path)!r}: key {key!r} has rows of {show(layout.get(key))}, the store's other "
                f"episodes {show(expected.get(key))}; re-record it or move it to a store of its own"
            )
