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

A second SIGINT raises ``KeyboardInterrupt`` at once (the old Ctrl-C: stop now, no save).
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
    "RunStopped",
    "check_stop_between_batches",
    "stop_on_signals",
    "stop_requested",
    "check_stop",
    "request_stop",
    "clear_stop",
    "requeue_slurm_job",
]

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

_requested: int | None = None


class RunStopped(SystemExit):
    """A stop request reached code that was waiting; carries the signal number. A ``SystemExit``,
    so that Lightning treats it as an interruption (``on_exception`` hooks run) and a caller that
    does not catch it exits with ``128 + signum``."""

    def __init__(self, signum: int, where: str = "") -> None:
        super().__init__(128 + int(signum))
        self.signum, self.where = int(signum), where

    def __str__(self) -> str:
        return f"stopped by {signal_name(self.signum)}" + (f" {self.where}" if self.where else "")


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


def _handler(previous: Any) -> Any:
    def handle(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and _requested is not None:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        request_stop(signum)

    return handle


@contextmanager
def stop_on_signals(signals: tuple[signal.Signals, ...] = HANDLED) -> Iterator[None]:
    """Within the block, ``signals`` request a stop instead of ending the process; the previous
    handlers are restored afterwards. Only the main thread can install handlers: elsewhere this
    does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    clear_stop()
    previous = {s: signal.getsignal(s) for s in signals}
    for s in signals:
        signal.signal(s, _handler(previous[s]))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


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
