"""Run folders: one live fit per folder, and no fit silently overwrites another run's checkpoints.

``lightning_logs/<run_name>/`` holds a run's logs and checkpoints. Two rules:

* **One owner.** A fit holds ``<run>/fit.lock`` (its host and pid) while it runs; a second fit in
  the same folder is refused, naming the owner. A lock whose process is gone (same host, dead
  pid) is taken over with a warning.
* **Say what you mean.** A new fit (no ``--ckpt_path``) in a folder that already holds
  checkpoints is refused with the three choices: resume (``--ckpt_path last`` or
  ``--resume_if_exists true``), a new folder (``--trainer.run_name``), or replacing the old run
  (``--trainer.overwrite true``, which deletes its checkpoints and buffer files first).

Only global rank 0 takes the lock and checks the folder (the other DDP ranks are its children).
"""

from __future__ import annotations

import errno
import os
import socket
import warnings
from pathlib import Path
from typing import Any

__all__ = ["RunFolderError", "RunFolderLock", "check_new_run", "is_rank_zero", "clear_run", "derive_run_name"]

LOCK_NAME = "fit.lock"
RUN_FILES = ("*.ckpt", "replay_rank*_step*.pt")


class RunFolderError(ValueError):
    """The run folder cannot be used as asked; the one-line message says what to do."""


def is_rank_zero() -> bool:
    """True unless the launcher's environment names another global or local rank."""
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "GROUP_RANK"):
        value = os.environ.get(name)
        if value not in (None, "", "0"):
            return False
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as err:
        return err.errno == errno.EPERM  # exists, owned by someone else
    return True


class RunFolderLock:
    """``<run_dir>/fit.lock`` held for the life of one fit (a context manager)."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.held = False

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = f"{socket.gethostname()} {os.getpid()}\n"
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                f.write(me)
            self.held = True
            return
        raise RunFolderError(f"could not take the lock {str(self.path)!r}: another fit took it at the same moment")

    def _take_over_if_stale(self) -> None:
        try:
            host, pid = self.path.read_text().split()
            owner = int(pid)
        except (OSError, ValueError):
            host, owner = "", -1  # unreadable or half-written: treated as stale
        if host == socket.gethostname() and owner > 0 and _pid_alive(owner):
            raise RunFolderError(
                f"the run folder {str(self.path.parent)!r} is in use by a running fit (pid {owner}); wait for "
                "it to end or stop it, or give this run its own folder with --trainer.run_name NAME"
            )
        if host and host != socket.gethostname():
            raise RunFolderError(
                f"the run folder {str(self.path.parent)!r} is locked by a fit on host {host} (pid {owner}); if "
                f"that fit has ended, delete {str(self.path)!r}, or use --trainer.run_name NAME"
            )
        warnings.warn(
            f"taking over the stale lock {str(self.path)!r} of a fit that is no longer running (pid {owner})",
            RuntimeWarning,
            stacklevel=3,
        )
        self.path.unlink(missing_ok=True)

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> RunFolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _run_files(checkpoint_dir: Path) -> list[Path]:
    return sorted(p for pattern in RUN_FILES for p in checkpoint_dir.glob(pattern))


def check_new_run(checkpoint_dir: str | os.PathLike, overwrite: bool) -> None:
    """Refuse to start a new run over another run's checkpoints, or clear them when told to.

    Raises:
        RunFolderError: the folder holds checkpoints and ``overwrite`` is false.
    """
    folder = Path(checkpoint_dir)
    found = _run_files(folder) if folder.is_dir() else []
    if not found:
        return
    if overwrite:
        clear_run(folder)
        return
    names = ", ".join(p.name for p in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    raise RunFolderError(
        f"{str(folder)!r} holds another run's checkpoints ({names}): resume it with --ckpt_path last (or "
        "--resume_if_exists true), start a new run in its own folder with --trainer.run_name NAME, or replace "
        "it with --trainer.overwrite true"
    )


def clear_run(checkpoint_dir: str | os.PathLike) -> list[Path]:
    """Delete the checkpoints and buffer files of a run (``--trainer.overwrite true``); returns them."""
    removed = _run_files(Path(checkpoint_dir))
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def derive_run_name(config: Any) -> str:
    """``configs/dreamer/cartpole.yaml`` -> ``dreamer-cartpole``; else the model class name."""
    paths = [str(p) for p in (config.get("config") or []) if p is not None]
    if paths:
        path = Path(os.path.relpath(os.path.abspath(str(paths[0]))))
        parts = [p for p in path.with_suffix("").parts if p not in ("configs", "..", ".")]
        return "-".join(parts[-3:]) or "default"
    class_path = str(config.model.get("class_path", "model")) if config.get("model") else "model"
    return class_path.rsplit(".", 1)[-1].lower()
