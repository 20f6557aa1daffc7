"""Run folders: one live fit per folder, and no fit silently overwrites another run's checkpoints.

``lightning_logs/<run_name>/`` holds a run's logs and checkpoints. Two rules:

* **One owner.** A fit holds ``<run>/fit.lock`` while it runs; a second fit in the same folder is
  refused, naming the owner. The lock is atomic and knows where its owner runs:

  - it is written whole into a temp file that is locked (``flock``) and then hard-linked into
    place, so a racer sees either no lock or a complete, locked one (Slurm job arrays sharing a
    ``run_name`` get exactly one owner);
  - it names its owner: host, pid, boot id (``/proc/sys/kernel/random/boot_id``), PID namespace,
    scheduler job (``SLURM_JOB_ID``, with the array task) and the time it was taken; the owner
    touches it every ``lease/4`` seconds (the heartbeat);
  - it is **stale** (taken over with a warning) when: on the same kernel (same boot id, any PID
    namespace: a container restarted in the same pod is pid 1 again) no process holds its
    ``flock``; or it was written by the same scheduler job (Slurm's requeue keeps the job id);
    or by the same host name after a reboot (a Kubernetes StatefulSet pod moved to a new node);
    or its heartbeat is older than the lease (``LIGHTNING_WM_LOCK_LEASE_S``, 120 s), e.g. a
    requeue to another node;
  - ``--resume_if_exists true`` (an unattended requeue) waits up to the lease for a lock of
    another machine whose heartbeat is still fresh to go stale, then takes it over.

* **Say what you mean.** A new fit (no ``--ckpt_path``) in a folder that already holds
  checkpoints is refused with the three choices: resume (``--ckpt_path last`` or
  ``--resume_if_exists true``), a new folder (``--trainer.run_name``), or replacing the old run
  (``--trainer.overwrite true``, which deletes its checkpoints and buffer files first and says
  which).

Only global rank 0 takes the lock and checks the folder (the other DDP ranks are its children).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning_wm.io import DiskFullError, fsync_dir
from lightning_wm.signals import check_stop

__all__ = [
    "RunFolderError",
    "RunFolderLock",
    "RunFolderWarning",
    "LockOwner",
    "check_new_run",
    "is_rank_zero",
    "clear_run",
    "derive_run_name",
    "stale_reason",
]

LOCK_NAME = "fit.lock"
RUN_FILES = ("*.ckpt", "replay_rank*_step*.pt")
LEASE_ENV = "LIGHTNING_WM_LOCK_LEASE_S"
DEFAULT_LEASE_S = 120.0


class RunFolderError(ValueError):
    """The run folder cannot be used as asked; the one-line message says what to do."""


class RunFolderWarning(UserWarning):
    """A run folder was changed for the user: a stale lock taken over, old checkpoints deleted."""


def is_rank_zero() -> bool:
    """True unless the launcher's environment names another global or local rank."""
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "GROUP_RANK"):
        value = os.environ.get(name)
        if value not in (None, "", "0"):
            return False
    return True


def lease_s() -> float:
    """Seconds without a heartbeat after which a lock of another machine is stale."""
    try:
        return max(1.0, float(os.environ.get(LEASE_ENV, DEFAULT_LEASE_S)))
    except ValueError:
        return DEFAULT_LEASE_S


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def scheduler_job() -> str:
    """The scheduler's id of this job (``slurm:1234`` or ``slurm:1234_7`` for an array task), or ""."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array:
        return f"slurm:{array}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
    job = os.environ.get("SLURM_JOB_ID")
    return f"slurm:{job}" if job else ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as err:
        return err.errno == errno.EPERM  # exists, owned by someone else
    return True


@dataclass(frozen=True)
class LockOwner:
    """Who holds a lock: where it runs (host, kernel boot, PID namespace, scheduler job) and its pid."""

    host: str
    pid: int
    boot_id: str = ""
    pid_ns: str = ""
    job: str = ""
    since: float = 0.0

    @classmethod
    def me(cls) -> LockOwner:
        return cls(
            socket.gethostname(),
            os.getpid(),
            _read_text("/proc/sys/kernel/random/boot_id"),
            _pid_namespace(),
            scheduler_job(),
            time.time(),
        )

    @classmethod
    def parse(cls, text: str) -> LockOwner | None:
        """From the lock's JSON, or the older ``host pid`` line; ``None`` if neither."""
        try:
            data = json.loads(text)
            return cls(**{k: data[k] for k in ("host", "pid", "boot_id", "pid_ns", "job", "since") if k in data})
        except (ValueError, TypeError, KeyError):
            pass
        parts = text.split()
        if len(parts) == 2 and parts[1].isdigit():
            return cls(parts[0], int(parts[1]))
        return None

    def text(self) -> str:
        return json.dumps(asdict(self)) + "\n"

    def describe(self) -> str:
        job = f", {self.job.replace('slurm:', 'Slurm job ')}" if self.job else ""
        return f"pid {self.pid} on host {self.host}{job}"


def stale_reason(
    owner: LockOwner | None, me: LockOwner, unlocked: bool | None, heartbeat_age_s: float, lease: float
) -> str | None:
    """Why a lock held by ``owner`` is stale, or ``None`` if its owner may be running.

    ``unlocked``: nobody holds the lock file's ``flock`` (``None``: flock is not supported there);
    ``heartbeat_age_s``: seconds since the owner last touched the file. The rules, in order: on the
    same kernel (same boot id) the flock decides (a live owner always holds it; an old-format lock
    without a boot id is judged by its pid); a lock of the same scheduler job is a requeue; the
    same host name after a new boot is a restart; else the heartbeat decides.
    """
    if owner is None:
        return "it is unreadable" if unlocked else None
    if owner.boot_id and owner.boot_id == me.boot_id:
        if unlocked:
            return "no process holds it (its fit ended without releasing it)"
        if unlocked is None and owner.pid_ns == me.pid_ns and not _pid_alive(owner.pid):
            return "its process is gone"
        return None
    if not owner.boot_id and owner.host == me.host and unlocked is not False:
        return None if _pid_alive(owner.pid) else "its process is gone"
    if owner.job and owner.job == me.job:
        return f"it was taken by this same scheduler job before a requeue ({owner.job})"
    if owner.host == me.host and owner.boot_id and owner.boot_id != me.boot_id:
        return "its host has restarted since"
    if heartbeat_age_s > lease:
        return f"its heartbeat stopped {heartbeat_age_s:.0f} s ago (lease {lease:.0f} s)"
    return None


def _try_flock(fd: int) -> bool | None:
    """Take ``fd``'s exclusive flock without waiting: True, False (someone holds it), None (no flock here)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EACCES):
            return False
        return None  # ENOLCK, EOPNOTSUPP, ...: the filesystem has no flock
    return True


class RunFolderLock:
    """``<run_dir>/fit.lock`` held for the life of one fit (a context manager); see the module
    docstring for when a lock is stale. ``wait_s``: how long :meth:`acquire` waits for a lock of
    another machine with a fresh heartbeat to go stale (``--resume_if_exists``)."""

    def __init__(self, run_dir: str | os.PathLike, wait_s: float = 0.0) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.wait_s = wait_s
        self.held = False
        self._fd: int | None = None
        self._stop = threading.Event()
        self._waiting = ""  # the foreign lock acquire() waits for

    def acquire(self) -> None:
        """Take the lock, or raise :class:`RunFolderError` naming its live owner (or
        :class:`~lightning_wm.io.DiskFullError`: nothing is left behind)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = LockOwner.me()
        fd, tmp = self._write_own(me)
        deadline = time.monotonic() + self.wait_s
        told = False
        try:
            while True:
                try:
                    os.link(tmp, self.path)
                    break
                except FileExistsError:
                    pass
                taken_over = self._take_over_if_stale(tmp, me, time.monotonic() >= deadline)
                if taken_over:
                    break
                if self._waiting and not told:
                    told = True
                    print(f"{self._waiting}; waiting up to {self.wait_s:.0f} s for it to go stale", file=sys.stderr)
                check_stop()  # a scheduler's stop ends the wait
                time.sleep(1.0)  # waiting for a foreign lock's lease (--resume_if_exists)
        except BaseException:
            os.close(fd)
            raise
        finally:
            Path(tmp).unlink(missing_ok=True)
        fsync_dir(self.path.parent)
        self._fd, self.held = fd, True
        self._stop.clear()
        threading.Thread(target=self._beat, name="run-folder-heartbeat", daemon=True).start()

    def _write_own(self, me: LockOwner) -> tuple[int, str]:
        """A temp file beside the lock holding ``me``, flocked and synced; ``(fd, path)``."""
        tmp = str(self.path.with_name(f".{LOCK_NAME}.{os.getpid()}-{time.monotonic_ns()}.tmp"))
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except OSError as err:
            raise self._error(err) from None
        try:
            _try_flock(fd)
            os.write(fd, me.text().encode("ascii"))
            os.fsync(fd)
        except OSError as err:
            os.close(fd)
            Path(tmp).unlink(missing_ok=True)
            raise self._error(err) from None
        return fd, tmp

    def _error(self, err: OSError) -> Exception:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            return DiskFullError(
                errno.ENOSPC,
                f"no space left on the device for the run folder {str(self.path.parent)!r} (writing {LOCK_NAME}); "
                "free some space or choose another folder with --trainer.default_root_dir",
            )
        return PermissionError(
            f"cannot write the lock {str(self.path)!r} ({err.strerror or type(err).__name__}); fix the run "
            "folder's permissions or choose another folder"
        )

    def _take_over_if_stale(self, tmp: str, me: LockOwner, last_try: bool) -> bool:
        """Replace a stale lock by ours (True), say to wait (False) or refuse (raise)."""
        try:
            old = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False  # released meanwhile: link again
        try:
            unlocked = _try_flock(old)
            info = os.fstat(old)
            try:
                if os.stat(self.path).st_ino != info.st_ino:
                    return False  # replaced while we looked: look again
            except FileNotFoundError:
                return False
            owner = LockOwner.parse(os.read(old, 4096).decode("ascii", "replace"))
            age = time.time() - info.st_mtime
            reason = stale_reason(owner, me, unlocked, age, lease_s())
            if reason is None:
                foreign = owner is not None and owner.boot_id != me.boot_id and unlocked is not False
                if foreign and not last_try:
                    self._waiting = f"the run folder lock is held by {owner.describe()}, heartbeat {age:.0f} s ago"
                    return False
                raise RunFolderError(self._refusal(owner, age, foreign))
            warnings.warn(
                f"taking over the run folder lock {str(self.path)!r} of "
                f"{owner.describe() if owner else 'an unknown fit'}: {reason}",
                RunFolderWarning,
                stacklevel=4,
            )
            os.replace(tmp, self.path)  # atomic; we hold the old lock's flock, racers re-check the inode
            return True
        finally:
            os.close(old)

    def _refusal(self, owner: LockOwner | None, age: float, foreign: bool) -> str:
        folder = str(self.path.parent)
        who = owner.describe() if owner else "another fit"
        if not foreign:
            return (
                f"the run folder {folder!r} is in use by a running fit ({who}); wait for it to end or stop it, "
                "or give this run its own folder with --trainer.run_name NAME"
            )
        return (
            f"the run folder {folder!r} is locked by a fit on another machine ({who}) whose heartbeat is "
            f"{age:.0f} s old; it is taken over once that is older than {lease_s():.0f} s ({LEASE_ENV}): rerun with "
            f"--resume_if_exists true to wait for that, or use --trainer.run_name NAME"
        )

    def _beat(self) -> None:
        every = max(0.5, lease_s() / 4)
        while not self._stop.wait(every):
            fd = self._fd
            if fd is None:
                return
            try:
                os.utime(fd)
            except OSError:  # a full or vanished folder: the fit reports what matters
                pass

    def release(self) -> None:
        """Remove the lock if it is still ours, and let its flock go."""
        if not self.held:
            return
        self._stop.set()
        fd, self._fd, self.held = self._fd, None, False
        try:
            if fd is not None and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                self.path.unlink()
        except OSError:
            pass
        finally:
            if fd is not None:
                os.close(fd)

    def __enter__(self) -> RunFolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _run_files(checkpoint_dir: Path) -> list[Path]:
    return sorted(p for pattern in RUN_FILES for p in checkpoint_dir.glob(pattern))


def check_new_run(checkpoint_dir: str | os.PathLike, overwrite: bool, resume_if_exists: bool = False) -> None:
    """Refuse to start a new run over another run's checkpoints, or clear them when told to
    (``overwrite``; a warning names what was deleted). ``resume_if_exists`` found no checkpoint to
    resume: what the folder holds (replay buffers of a run killed before its first checkpoint) cannot
    be resumed and is cleared too, never refused.

    Raises:
        RunFolderError: the folder holds checkpoints and neither flag is set.
    """
    folder = Path(checkpoint_dir)
    found = _run_files(folder) if folder.is_dir() else []
    if not found:
        return
    names = ", ".join(p.name for p in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    if overwrite or resume_if_exists:
        clear_run(folder)
        why = "--trainer.overwrite true" if overwrite else "--resume_if_exists true found no checkpoint to resume"
        warnings.warn(f"{why}: deleted {names} from {str(folder)!r}", RunFolderWarning, stacklevel=2)
        return
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
    """``configs/dreamer/cartpole.yaml`` -> ``dreamer-cartpole`` (the path after its last
    ``configs`` folder, from wherever it is given: the configs that read another run's checkpoint
    name it so); a config outside a ``configs`` folder: its last parts; else the model class name."""
    paths = [str(p) for p in (config.get("config") or []) if p is not None]
    if paths:
        parts = list(Path(os.path.relpath(os.path.abspath(str(paths[0])))).with_suffix("").parts)
        if "configs" in parts:
            parts = parts[len(parts) - parts[::-1].index("configs") :]
        parts = [p for p in parts if p not in ("..", ".")]
        return "-".join(parts[-3:]) or "default"
    class_path = str(config.model.get("class_path", "model")) if config.get("model") else "model"
    return class_path.rsplit(".", 1)[-1].lower()
