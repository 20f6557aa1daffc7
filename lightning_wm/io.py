"""Files that are either whole or absent: write to a temp file *beside* the target, fsync, rename.

A temp file in the target's own folder is on the same filesystem, so ``os.replace`` is atomic
(a temp dir on tmpfs would make the final rename a copy that ``kill -9`` can cut in half). The
temp names are unique per process and call (two writers never share one) and start with
``.`` and end with ``.tmp``: :func:`clean_stale_temps` removes the ones a killed process left.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = [
    "atomic_write",
    "atomic_torch_save",
    "append_json_line",
    "check_writable",
    "fsync_dir",
    "clean_stale_temps",
    "DiskFullError",
    "TEMP_SUFFIX",
]

TEMP_SUFFIX = ".tmp"


class DiskFullError(OSError):
    """A write failed because the filesystem is full; the one-line message names the file, the
    folder and the bytes free there (the previous version of the file is untouched)."""


def _disk_full(err: BaseException) -> bool:
    """Whether ``err`` or an exception it was raised from is ENOSPC / EDQUOT (torch's writer
    reports a full disk as a RuntimeError raised while handling the OSError)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        err = err.__cause__ or err.__context__
    return False


def _free_bytes(directory: Path) -> int:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return -1


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename inside ``directory`` durable (no-op where directories cannot be opened)."""
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


def _temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{TEMP_SUFFIX}")


def atomic_write(path: str | os.PathLike, write: Callable[[IO[Any]], None], binary: bool = True) -> Path:
    """Call ``write(file)`` on a temp file beside ``path``, fsync it and rename it onto ``path``.

    On any error (or interrupt) the temp file is removed and ``path`` is untouched. Returns the path.
    """
    path = Path(path)
    tmp = _temp_path(path)
    try:
        with open(tmp, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if _disk_full(err):
            free = _free_bytes(path.parent)
            raise DiskFullError(
                errno.ENOSPC,
                f"no space left on the device writing {str(path)!r}: {free:,} bytes free in {str(path.parent)!r} "
                "(the previous file is untouched); free some space or write to another folder",
            ) from None
        raise
    fsync_dir(path.parent)
    return path


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (see :func:`atomic_write`)."""
    import torch

    return atomic_write(path, lambda f: torch.save(obj, f))


def append_json_line(path: str | os.PathLike, record: dict[str, Any]) -> Path:
    """Append ``record`` as one JSON line to ``path`` (created with its folder if missing) and
    fsync it: earlier lines are never rewritten, and a line is on disk when this returns. Values
    JSON does not know (paths, tuples of them) are written as their ``str``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, default=str) + "\n"
    try:
        with open(path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        if _disk_full(err):
            raise DiskFullError(
                errno.ENOSPC, f"no space left on the device appending to {str(path)!r}; free some space"
            ) from None
        raise
    return path


def clean_stale_temps(directory: str | os.PathLike, older_than_s: float = 60.0) -> list[Path]:
    """Remove temp files of :func:`atomic_write` in ``directory`` that are older than
    ``older_than_s`` seconds (left by a killed process; a live writer's file is younger).
    Returns the removed paths."""
    directory = Path(directory)
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    now = time.time()
    for entry in directory.iterdir():
        if not (entry.name.startswith(".") and entry.name.endswith(TEMP_SUFFIX)) or not entry.is_file():
            continue
        try:
            if now - entry.stat().st_mtime >= older_than_s:
                entry.unlink()
                removed.append(entry)
        except FileNotFoundError:
            continue
    return removed


PROBE_BYTES = 64 * 1024


def check_writable(directory: str | os.PathLike, what: str = "folder", hint: str = "") -> Path:
    """Create ``directory`` if needed and prove that files can be written into it: a temp file
    of :data:`PROBE_BYTES` real bytes is written, synced and removed (an empty file can be created
    on a full disk), so that work which will write there fails before it starts.

    Raises:
        DiskFullError: the filesystem is full (one line naming ``what``, the folder, the bytes free).
        PermissionError: one line naming ``what``, the folder and the reason (and ``hint``).
    """
    directory = Path(directory)
    probe = _temp_path(directory / ".write-probe")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        if _disk_full(err):
            raise DiskFullError(
                errno.ENOSPC,
                f"no space left on the device for the {what} {str(directory)!r}: {_free_bytes(directory):,} bytes "
                "free; free some space or choose another folder",
            ) from None
        reason = err.strerror or type(err).__name__
        raise PermissionError(
            f"{what} {str(directory)!r} is not writable ({reason}); fix its permissions or choose another folder"
            + (f" {hint}" if hint else "")
        ) from None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
    return directory
