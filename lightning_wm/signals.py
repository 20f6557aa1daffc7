"""Scheduler signals: stop a fit at the next safe point, save, and exit non-zero.

Schedulers end jobs with SIGTERM (``timeout``, Kubernetes, Slurm) and warn with SIGUSR1 (Slurm's
``--signal``); a terminal sends SIGINT. :func:`stop_on_signals` turns each into a *stop request*
instead of killing the process mid-step:

* the training streams check for a request before they make the next batch
  (:func:`check_stop_between_batches`): the step before has run with all its hooks, and
  :class:`RunStopped` unwinds the fit; the checkpoint callback saves ``last.ckpt`` (and the
  replay buffers) at that step in its ``on_exception`` hook, and the datamodule stops its actors;
* code that blocks (waiting for actors' rows, evaluation episodes) calls :func:`check_stop`, so
  a request is seen within a fraction of a second there too;
* the command exits with ``128 + signal number`` (143 for SIGTERM) and one line saying where the
  checkpoint is, so a scheduler sees that the run did not finish.

A second SIGINT ends the command at once (:class:`RunAborted`, exit 130): nothing more is saved,
and the line says which step ``last.ckpt`` holds.

Whatever library replaces the handlers, and wherever the signal lands:

* :func:`reclaim_signals` puts our handlers back where a library replaced them (Ray's
  ``ray.init`` installs ``sys.exit`` for SIGTERM); SDL (pygame) installs none
  (``SDL_NO_SIGNAL_HANDLERS``, see :func:`lightning_wm.console.headless_rendering`);
* a signal to the whole process group (Slurm's ``--signal=USR1@120`` without ``B:``, a terminal's
  Ctrl-C) reaches children too: multiprocessing's resource tracker is started with SIGUSR1
  ignored (:func:`protect_resource_tracker`), env workers and actors ignore SIGINT and SIGUSR1
  (:func:`ignore_stop_signals`) and die with their parent (:func:`die_with_parent`), and a child
  that died of the group's SIGTERM is read as the stop, not as a failure.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch

__all__ = [
    "ActorError",
    "RunStopped",
    "check_stop_between_batches",
    "stop_on_signals",
    "stop_requested",
    "check_stop",
    "request_stop",
    "clear_stop",
    "requeue_slurm_job",
    "RunAborted",
    "reclaim_signals",
    "protect_resource_tracker",
    "ignore_stop_signals",
    "die_with_parent",
]

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

_requested: int | None = None
_active = False  # stop_on_signals is in force (our handlers are installed)


class ActorError(RuntimeError):
    """A source of rows (actor, env group, inference process) raised, died or hung; the message
    names it and carries its traceback. A fit ended by it saves ``last.ckpt`` at the step reached."""


class RunStopped(SystemExit):
    """A stop request reached code that was waiting; carries the signal number. A ``SystemExit``,
    so that Lightning treats it as an interruption (``on_exception`` hooks run) and a caller that
    does not catch it exits with ``128 + signum``."""

    def __init__(self, signum: int, where: str = "") -> None:
        super().__init__(128 + int(signum))
        self.signum, self.where = int(signum), where

    def __str__(self) -> str:
        return f"stopped by {signal_name(self.signum)}" + (f" {self.where}" if self.where else "")


class RunAborted(RunStopped):
    """A second Ctrl-C: end now, at whatever point the command is; exits 130. Nothing more is saved
    (what was saved before stays)."""

    def __str__(self) -> str:
        text = f"stopped at once by a second {signal_name(self.signum)}"
        return text + (f" {self.where}" if self.where else "")


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def stop_requested() -> int | None:
    """The signal number of a pending stop request, or None."""
    return _requested


def request_stop(signum: int) -> None:
    """Record a stop request (what the signal handler does; tests call it directly)."""
    global _requested
    if _requested is None:
        _requested = int(signum)


def clear_stop() -> None:
    global _requested
    _requested = None


def check_stop() -> None:
    """Raise :class:`RunStopped` if a stop was requested (call it inside long waits)."""
    if _requested is not None:
        raise RunStopped(_requested)


def check_stop_between_batches() -> None:
    """:func:`check_stop` where a training stream is about to make the next batch: the step before
    has ended with all its hooks, so a checkpoint taken now equals a periodic one at that step
    (the state Lightning's one-batch prefetch leaves is the same), and resuming from it is exact.
    Under DDP this is left to Lightning, which broadcasts rank 0's SIGTERM so that every rank
    stops at the same step."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            return
    check_stop()


def _handle(signum: int, frame: FrameType | None) -> None:
    if signum == signal.SIGINT and _requested is not None:
        raise RunAborted(signum)  # the second Ctrl-C: stop now
    request_stop(signum)


def _foreign(handler: Any) -> bool:
    """A handler that is not ours and does not call ours (Lightning's SIGTERM handler wraps the one it
    found and keeps its own DDP bookkeeping: it stays)."""
    if handler is _handle:
        return False
    return type(handler).__name__ != "_HandlersCompose"


@contextmanager
def stop_on_signals(signals: tuple[signal.Signals, ...] = HANDLED) -> Iterator[None]:
    """Within the block, ``signals`` request a stop instead of ending the process; the previous
    handlers are restored afterwards. Only the main thread can install handlers: elsewhere this
    does nothing; inside another such block it does nothing either (the outer block's request
    stays pending)."""
    global _active
    if threading.current_thread() is not threading.main_thread() or _active:
        yield
        return
    clear_stop()
    protect_resource_tracker()
    previous = {s: signal.getsignal(s) for s in signals}
    for s in signals:
        signal.signal(s, _handle)
    _active = True
    try:
        yield
    finally:
        _active = False
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def reclaim_signals() -> list[str]:
    """Put our handlers back where a library replaced them (call it after ``ray.init()``, which
    makes SIGTERM ``sys.exit(15)``: no checkpoint). Only within :func:`stop_on_signals`, in the
    main thread. Returns the names of the signals reclaimed."""
    if not _active or threading.current_thread() is not threading.main_thread():
        return []
    reclaimed = []
    for s in HANDLED:
        if _foreign(signal.getsignal(s)):
            signal.signal(s, _handle)
            reclaimed.append(s.name)
    return reclaimed


def protect_resource_tracker() -> None:
    """Start multiprocessing's resource tracker now, with SIGUSR1 ignored (it ignores SIGINT and
    SIGTERM itself; the ignored disposition survives its ``exec``): a SIGUSR1 to the whole process
    group (Slurm's ``--signal=USR1@120``) would kill it, and every shared-memory block it tracked
    would be reported as leaked."""
    if threading.current_thread() is not threading.main_thread():
        return
    from multiprocessing import resource_tracker

    before = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGUSR1, before if before is not None else signal.SIG_DFL)


def ignore_stop_signals() -> None:
    """In a child process (env worker, actor): SIGINT and SIGUSR1 that reach the whole process group
    are the parent's to handle (it stops the child); SIGTERM ends the child (``terminate()``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """In a child process: be killed (SIGKILL) when the parent dies, even by ``kill -9``, so that no
    child is left with parent 1 (Linux ``PR_SET_PDEATHSIG``; elsewhere a thread watches the parent
    pid). Exits at once if the parent is already gone."""
    import ctypes
    import sys
    import time

    armed = False
    if sys.platform.startswith("linux"):
        try:
            armed = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)
    if armed:
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def requeue_slurm_job() -> str:
    """Under Slurm, put the job back in the queue after a SIGUSR1 stop (Slurm's warning before the
    time limit, ``#SBATCH --signal=USR1@120``), as Lightning's own Slurm support does: the requeued
    job resumes from ``last.ckpt`` with ``--resume_if_exists true``. Returns a note for the report."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if job else os.environ.get("SLURM_JOB_ID")
    if not job:
        return ""
    import subprocess

    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"; requeueing Slurm job {job} failed ({err})"
    if done.returncode != 0:
        return f"; requeueing Slurm job {job} failed ({done.stderr.strip() or done.returncode})"
    return f"; Slurm job {job} requeued"
