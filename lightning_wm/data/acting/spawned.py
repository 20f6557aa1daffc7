"""Worker processes that send chunks (actor processes, central env groups, the inference process):
a body runs inside :func:`worker_process` (dies with the learner, ignores Ctrl-C, reports its
exception), beats a heartbeat and puts chunks with :func:`put_chunk` (never blocks past a shutdown);
:class:`SpawnedWorkers` starts them, describes a worker's exception, death or silence, and stops them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue as queue_lib
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as tmp

from lightning_wm.data.acting.base import Chunk
from lightning_wm.data.acting.worker import STARTUP_GRACE_S, ActorWorker
from lightning_wm.signals import die_with_parent, ignore_stop_signals

__all__ = ["Link", "SpawnedWorkers", "heartbeat_of", "hung", "put_chunk", "start_watched", "worker_process"]


@dataclass
class Link:
    """What a worker process shares with the learner (handed over at spawn): the ``chunks`` queue,
    the ``errors`` queue, the ``stop`` event, every worker's ``heartbeat`` (its last sign of life,
    ``time.monotonic()``) and the learner's pid."""

    chunks: Any
    errors: Any
    stop: Any
    heartbeat: Any
    parent_pid: int


def heartbeat_of(heartbeat: Any, index: int) -> Callable[[], None]:
    """Worker ``index``'s beat: it records now as the worker's last sign of life."""

    def beat() -> None:
        heartbeat[index] = time.monotonic()

    return beat


@contextmanager
def worker_process(index: int, link: Link) -> Iterator[tuple[list[ActorWorker | None], Callable[[], None]]]:
    """The frame of a worker process's body: dies with the learner, ignores Ctrl-C, never waits
    at exit for a learner that stopped reading; yields a one-item list the body puts its
    :class:`ActorWorker` in (closed at the end) and the worker's beat (beaten once here). An
    exception is put on ``errors`` with its traceback and the process exits with code 1."""
    die_with_parent(link.parent_pid)
    ignore_stop_signals()  # Ctrl-C and Slurm's SIGUSR1 reach the whole process group: the learner decides
    link.chunks.cancel_join_thread()
    holder: list[ActorWorker | None] = [None]
    beat = heartbeat_of(link.heartbeat, index)
    beat()
    failed = False
    try:
        yield holder, beat
    except BaseException:  # noqa: BLE001 - reported to the learner, which raises it
        link.errors.put((index, traceback.format_exc()))
        link.errors.close()
        link.errors.join_thread()
        failed = True
    if holder[0] is not None:
        with contextlib.suppress(Exception):  # shutting down
            holder[0].close()
    if failed:
        os._exit(1)


def put_chunk(chunk: Chunk, chunks: Any, stop: Any, beat: Callable[[], None]) -> None:
    """Put ``chunk`` on the queue, beating while it is full; gives up when ``stop`` is set."""
    while not stop.is_set():
        beat()
        try:
            chunks.put(chunk, timeout=0.25)
            return
        except queue_lib.Full:
            continue


def hung(label: str, last: float, timeout_s: float, sign: str = "heartbeat") -> str | None:
    """``label`` described as hung if its last sign of life (a ``sign``) at ``last`` is over ``timeout_s`` seconds old."""
    silent = time.monotonic() - last
    if silent <= timeout_s:
        return None
    return f"{label} hung: no {sign} for {silent:.1f} s (acting.timeout_s={timeout_s:g}); it may be stuck in env.step or in the policy"


def _terminate(processes: list[Any], stop: Any, release: threading.Event | None = None) -> None:
    """Stop worker processes: ask, wait briefly, then terminate and kill what is left (the ones that
    started: a failed start leaves the rest unstarted); then set ``release`` (their starter thread ends)."""
    stop.set()
    processes = [proc for proc in processes if proc.pid is not None]
    deadline = time.monotonic() + 2.0
    for proc in processes:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    for proc in processes:
        proc.join(timeout=1.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=1.0)
    if release is not None:
        release.set()


def _exited_children(parent: int) -> set[int]:
    """The pids of ``parent``'s children that have exited and are not yet reaped (Linux ``/proc``;
    an empty set elsewhere)."""
    exited = set()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):  # gone meanwhile, or not ours to read
            continue
        if state == "Z" and int(ppid) == parent:
            exited.add(int(entry))
    return exited


def start_watched(processes: list[Any], name: str, release: threading.Event, poll_s: float = 0.5) -> None:
    """Start ``processes`` (worker ``i`` labelled ``name.format(i)``) from a thread that then waits
    for ``release``: a worker dies with the thread that started it (``PR_SET_PDEATHSIG``), so that
    thread lives until the workers are stopped. Raises if a child exits before it has started: a
    spawned child reads its start data (the target and its arguments) from a pipe the parent writes
    while also holding the reading end, so a child that exits before reading it all (its re-import
    of the main module failed, say) would leave ``start()`` blocked for good once the data pass the
    pipe's buffer."""
    before = _exited_children(os.getpid())
    started, failed, current = threading.Event(), [], [0]

    def start_then_wait() -> None:
        try:
            for current[0], proc in enumerate(processes):
                proc.start()
        except BaseException as error:  # noqa: BLE001 - raised below, in the caller's thread
            failed.append(error)
        finally:
            started.set()
        release.wait()

    threading.Thread(target=start_then_wait, name=f"start {name.format('')}", daemon=True).start()
    while not started.wait(poll_s):
        if dead := _exited_children(os.getpid()) - before:
            raise RuntimeError(
                f"{name.format(current[0])} (pid {min(dead)}) exited while starting, before it read its start "
                "data: its error is printed above (a spawned process re-imports the main module: it must "
                "import in a fresh interpreter, from the same sys.path)"
            )
    if failed:
        raise failed[0]


class SpawnedWorkers:
    """``count`` spawned processes running ``target(index, *args, link)`` (a module-level function;
    ``args`` picklable; ``link`` their :class:`Link` with a chunk queue of ``queue_size``);
    ``name.format(i)`` labels worker ``i``."""

    def __init__(self, target: Callable[..., None], args: tuple, count: int, queue_size: int, name: str) -> None:
        ctx = tmp.get_context("spawn")
        self.name = name
        self.chunks = ctx.Queue(maxsize=queue_size)
        self.errors = ctx.Queue()
        self.stop = ctx.Event()
        self.heartbeat = ctx.RawArray(ctypes.c_double, count)
        # the last sign of life of each worker; starting (spawn, imports, env construction) gets a grace
        self.heartbeat[:] = [time.monotonic() + STARTUP_GRACE_S] * count
        link = Link(self.chunks, self.errors, self.stop, self.heartbeat, os.getpid())
        self.processes = [
            ctx.Process(
                target=target,
                name="lightning_wm-" + name.format(i).split(" (")[0].replace(" ", "-"),
                daemon=True,
                args=(i, *args, link),
            )
            for i in range(count)
        ]
        release = threading.Event()  # lets the thread that started the processes end once they are stopped
        self._finalizer = weakref.finalize(self, _terminate, self.processes, self.stop, release)
        start_watched(self.processes, name, release)

    def pids(self) -> list[int | None]:
        return [p.pid for p in self.processes]

    def _raised(self, timeout: float) -> str | None:
        try:
            index, tb = self.errors.get(timeout=timeout) if timeout > 0 else self.errors.get_nowait()
        except queue_lib.Empty:
            return None
        return f"{self.name.format(index)} (pid {self.processes[index].pid}) raised:\n{tb.rstrip()}"

    def failure(self, timeout_s: float) -> str | None:
        """A description of the first worker that raised, died or was silent for ``timeout_s``, or None."""
        raised = self._raised(0.0)
        if raised is not None:
            return raised
        for i, proc in enumerate(self.processes):
            label = f"{self.name.format(i)} (pid {proc.pid})"
            if proc.exitcode is not None:
                raised = self._raised(1.0)  # a worker that raised reports before it exits: give its message a moment
                if raised is not None:
                    return raised
                how = (
                    f"was killed by signal {signal.Signals(-proc.exitcode).name}"
                    if proc.exitcode < 0
                    else f"exited with code {proc.exitcode}"
                )
                return f"{label} {how} without reporting an error"
            if (silent := hung(label, self.heartbeat[i], timeout_s)) is not None:
                return silent
        return None

    def close(self) -> None:
        """Stop the processes and close the queues (idempotent)."""
        self._finalizer()  # runs _terminate once
        for q in (self.chunks, self.errors):
            q.cancel_join_thread()
            q.close()
