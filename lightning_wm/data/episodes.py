"""EpisodeStore: recorded episodes on disk, one compressed ``.npz`` file each.

Every episode is a mapping of arrays that share their leading length ``T`` (the rows of
the project's row convention: ``obs``, ``reward``, ``is_first``, ...). A file is written
atomically: ``np.savez_compressed`` into a hidden temp file in the same directory,
flushed and fsync'ed, then ``os.replace``'d onto its final name, so a crash never leaves a
half-written episode under a real name (a leftover ``.*.tmp`` file is simply ignored).

File names sort in recording order and carry the length, so :meth:`EpisodeStore.total_steps`
needs no loading::

    20261123T010203-000001-ab12cd34-T500.npz
    <UTC time>      <counter> <random id> <T>

Dict observations are stored flattened as ``'obs/key'`` members and returned nested
again by :meth:`EpisodeStore.load` (one level or more; keys must not contain ``'/'``).
"""
from __future__ import annotations

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

import numpy as np

from lightning_wm.tree import flatten as _flatten, unflatten as _unflatten

__all__ = ["CorruptEpisodeError", "EpisodeStore"]

_NAME = re.compile(r"^(?P<time>\d{8}T\d{6})-(?P<counter>\d{6,})-(?P<id>[0-9a-f]+)-T(?P<length>\d+)\.npz$")
_META = "meta.json"


class CorruptEpisodeError(ValueError):
    """An episode file cannot be read or is inconsistent; the message names the file."""


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable (best effort; not possible on every platform)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class EpisodeStore:
    """A directory of episode files.

    Args:
        directory: where episodes live; created if missing.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        counters = [int(m["counter"]) for m in map(_NAME.match, os.listdir(self.directory)) if m]
        self._counter = max(counters, default=0)

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
        final = self.directory / name
        tmp = self.directory / f".{name}.tmp"
        try:
            with open(tmp, "wb") as f:
                np.savez_compressed(f, **flat)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.directory)
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
    def write_metadata(self, meta: dict) -> None:
        """Write ``meta`` (JSON-serialisable, e.g. env id and spaces) to ``meta.json`` atomically."""
        text = json.dumps(meta, indent=2, sort_keys=True)
        final = self.directory / _META
        tmp = self.directory / f".{_META}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.directory)

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
