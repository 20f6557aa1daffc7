"""The ``local`` actor backend: ``spawn``-ed processes; weights in a shared-memory
:class:`WeightStore` (seqlock: the learner never waits for an actor), chunks through a bounded queue.

Robustness: actors die with the learner (``PR_SET_PDEATHSIG`` on Linux, and a parent-pid watch as
a fallback), ignore Ctrl-C (the learner shuts them down), never block on a full queue without
checking for shutdown, and beat a heartbeat; the pool turns an actor's exception (with its
traceback), an actor that died, or one whose heartbeat stopped into one error.
"""

from __future__ import annotations

import ctypes
import io
import os
import queue as queue_lib
import signal
import sys
import threading
import time
import traceback
import weakref
from typing import Any

import torch
import torch.multiprocessing as tmp
from torch import nn

from lightning_wm.data.acting.base import Chunk
from lightning_wm.data.acting.worker import STARTUP_GRACE_S, ActorConfig, ActorWorker, acting_copy_ready

__all__ = ["WeightStore", "LocalBackend"]


class WeightStore:
    """A shared-memory copy of an acting module's ``state_dict`` plus a version counter.

    One writer (the learner) and any number of readers (actor processes that received the
    store as a ``spawn`` argument). A sequence lock keeps reads consistent without ever
    making the writer wait: :meth:`publish` makes the sequence odd, copies, sets the version
    and makes it even again; :meth:`pull_into` copies and retries if the sequence was odd or
    changed meanwhile. A reader killed mid-copy therefore cannot block the learner.

    Args:
        module: the acting module whose ``state_dict`` layout (keys, shapes, dtypes) every
            later :meth:`publish` must keep; its weights are the store's first version.
        version: the version of those weights.
    """

    def __init__(self, module: nn.Module, version: int = 0) -> None:
        state = module.state_dict()
        self._tensors = {k: v.detach().to("cpu", copy=True).contiguous().share_memory_() for k, v in state.items()}
        ctx = tmp.get_context("spawn")
        self._seq = ctx.RawValue(ctypes.c_int64, 0)
        self._version = ctx.RawValue(ctypes.c_int64, int(version))

    @property
    def version(self) -> int:
        """The newest published version."""
        return int(self._version.value)

    def publish(self, module: nn.Module, version: int) -> None:
        """Copy ``module``'s ``state_dict`` into the store as ``version``."""
        state = module.state_dict()
        if state.keys() != self._tensors.keys():
            missing, extra = self._tensors.keys() - state.keys(), state.keys() - self._tensors.keys()
            raise ValueError(
                f"acting module's state_dict changed keys (missing {sorted(missing)}, "
                f"new {sorted(extra)}); "
                "acting_copy() must keep the same layout for the weight store"
            )
        self._seq.value += 1  # odd: a write is in progress
        with torch.no_grad():
            for key, target in self._tensors.items():
                target.copy_(state[key])
        self._version.value = int(version)
        self._seq.value += 1  # even: consistent again

    def pull_into(self, module: nn.Module, known_version: int | None = None, timeout_s: float = 10.0) -> int:
        """Copy the newest weights into ``module`` (in place); returns their version.

        Skips the copy when the store holds ``known_version`` already.

        Raises:
            TimeoutError: no consistent copy within ``timeout_s`` (the writer kept writing).
        """
        deadline = time.monotonic() + timeout_s
        targets = module.state_dict()
        while True:
            start = self._seq.value
            if start % 2 == 0:
                version = int(self._version.value)
                if version == known_version:
                    if self._seq.value == start:
                        return version
                    continue
                with torch.no_grad():
                    for key, source in self._tensors.items():
                        targets[key].copy_(source)
                if self._seq.value == start:
                    return version
            if time.monotonic() > deadline:
                raise TimeoutError(f"no consistent read of the weight store within {timeout_s} s")
            time.sleep(0.0005)


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """Be killed when the learner dies, even by ``kill -9``: the kernel's parent-death signal
    (Linux) plus a thread that watches the parent pid (other systems, or a failed prctl)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _module_bytes(module: nn.Module) -> bytes:
    """``module`` pickled by value: a torch tensor handed to a ``spawn`` child as it is would be moved
    to shared memory and stay shared with the learner's module, which keeps training."""
    buffer = io.BytesIO()
    torch.save(module, buffer)
    return buffer.getvalue()


def _actor_main(
    actor: int,
    config: ActorConfig,
    module_bytes: bytes,
    store: WeightStore,
    chunks: Any,
    errors: Any,
    stop: Any,
    heartbeat: Any,
    parent_pid: int,
) -> None:
    """Body of actor process ``actor``: chunks into ``chunks`` until ``stop`` is set."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the learner decides
    chunks.cancel_join_thread()  # at exit, never wait for a learner that stopped reading
    worker = None
    try:
        heartbeat[actor] = time.monotonic()
        module = torch.load(io.BytesIO(module_bytes), weights_only=False)
        worker = ActorWorker(actor, config, acting_copy_ready(module))
        version = config.initial_version  # the weights the actor was built with
        while not stop.is_set():
            heartbeat[actor] = time.monotonic()
            if worker.random_left <= 0:
                version = store.pull_into(module, known_version=version)
            chunk = worker.chunk(version)
            while not stop.is_set():
                heartbeat[actor] = time.monotonic()
                try:
                    chunks.put(chunk, timeout=0.25)
                    break
                except queue_lib.Full:
                    continue
    except BaseException:  # noqa: BLE001 - reported to the learner, which raises it
        errors.put((actor, traceback.format_exc()))
        errors.close()
        errors.join_thread()
        _close_quietly(worker)
        os._exit(1)
    _close_quietly(worker)


def _close_quietly(worker: ActorWorker | None) -> None:
    if worker is not None:
        try:
            worker.close()
        except Exception:  # noqa: BLE001 - shutting down
            pass


def _terminate(processes: list[Any], stop: Any) -> None:
    """Stop actor processes: ask, wait briefly, then terminate and kill what is left (the ones that
    started: a failed start leaves the rest unstarted)."""
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


class LocalBackend:
    def __init__(self, config: ActorConfig, module: nn.Module, num_actors: int, queue_size: int) -> None:
        ctx = tmp.get_context("spawn")
        self.store = WeightStore(module, config.initial_version)
        self.chunks = ctx.Queue(maxsize=queue_size)
        self.errors = ctx.Queue()
        self.stop = ctx.Event()
        self.heartbeat = ctx.RawArray(ctypes.c_double, num_actors)
        # the last sign of life of each actor; starting (spawn, imports, env construction) gets a grace
        self.heartbeat[:] = [time.monotonic() + STARTUP_GRACE_S] * num_actors
        weights = _module_bytes(module)
        self.processes = [
            ctx.Process(
                target=_actor_main,
                name=f"lightning_wm-actor-{i}",
                daemon=True,
                args=(i, config, weights, self.store, self.chunks, self.errors, self.stop, self.heartbeat, os.getpid()),
            )
            for i in range(num_actors)
        ]
        self._finalizer = weakref.finalize(self, _terminate, self.processes, self.stop)
        for proc in self.processes:
            proc.start()

    def pids(self) -> list[int | None]:
        return [p.pid for p in self.processes]

    def publish(self, module: nn.Module, version: int) -> None:
        self.store.publish(module, version)

    def get(self, timeout: float) -> Chunk | None:
        try:
            return self.chunks.get(timeout=timeout)
        except queue_lib.Empty:
            return None

    def qsize(self) -> int:
        try:
            return self.chunks.qsize()
        except NotImplementedError:  # macOS
            return -1

    def failure(self, timeout_s: float) -> str | None:
        """A description of the first failed, dead or hung actor, or None."""
        try:
            actor, tb = self.errors.get_nowait()
            return f"actor {actor} (pid {self.processes[actor].pid}) raised:\n{tb.rstrip()}"
        except queue_lib.Empty:
            pass
        now = time.monotonic()
        for i, proc in enumerate(self.processes):
            if proc.exitcode is not None:
                try:  # an actor that raised reports before it exits: give its message a moment
                    actor, tb = self.errors.get(timeout=1.0)
                    return f"actor {actor} (pid {self.processes[actor].pid}) raised:\n{tb.rstrip()}"
                except queue_lib.Empty:
                    pass
                how = (
                    f"was killed by signal {signal.Signals(-proc.exitcode).name}"
                    if proc.exitcode < 0
                    else f"exited with code {proc.exitcode}"
                )
                return f"actor {i} (pid {proc.pid}) {how} without reporting an error"
            silent = now - self.heartbeat[i]
            if silent > timeout_s:
                return (
                    f"actor {i} (pid {proc.pid}) hung: no heartbeat for {silent:.1f} s (acting.timeout_s="
                    f"{timeout_s:g}); it may be stuck in env.step or in the policy"
                )
        return None

    def close(self) -> None:
        self._finalizer()  # runs _terminate once
        for q in (self.chunks, self.errors):
            q.cancel_join_thread()
            q.close()
