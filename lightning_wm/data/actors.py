"""Acting outside the learner: actor processes that each run a :class:`Collector`.

An actor owns a vector env of ``envs_per_actor`` envs (first-reset seeds
``seeding.env_seeds(seed, n, "train", rank, actor)``, distinct across actors and DDP ranks) and
a CPU copy of the agent (``ActingAgent.acting_copy()``, one torch thread). It sends chunks of
rows ``[T, N_envs, ...]`` (the row convention, agent extras and a ``policy_version`` column)
with the episodes it finished, and pulls the newest weights between chunks.

Two backends with one interface (:class:`ActorPool`):

* ``local``: ``spawn``-ed processes; weights in a shared-memory :class:`WeightStore`
  (seqlock: the learner never waits for an actor), chunks through a bounded queue.
* ``ray``: Ray actors (``pip install -e ".[ray]"``) on the machines of a Ray cluster; weights
  through the object store, chunks returned as object refs collected with ``ray.wait``.

Robustness (local backend): actors die with the learner (``PR_SET_PDEATHSIG`` on Linux, and a
parent-pid watch as a fallback), ignore Ctrl-C (the learner shuts them down), never block on a
full queue without checking for shutdown, and beat a heartbeat. The learner turns an actor's
exception (with its traceback), an actor that died, or one whose heartbeat stopped for
``timeout_s`` into one :class:`ActorError` naming the actor, after stopping the others.
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
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import torch.multiprocessing as tmp
from torch import nn

from lightning_wm.data.collector import Collector
from lightning_wm.envs import EnvConfig, EnvSpec, env_spec, make_vector_env
from lightning_wm.policies import RandomAgent
from lightning_wm.seeding import derive_seed, env_seeds

__all__ = ["ActorError", "ActorPool", "Chunk", "WeightStore", "RANDOM_POLICY_VERSION"]

RANDOM_POLICY_VERSION = -1  # ``policy_version`` of rows made by the random prefill policy
STARTUP_GRACE_S = 60.0  # seconds an actor may take to start (spawn, imports, envs) on top of timeout_s


class ActorError(RuntimeError):
    """An actor raised, died or hung. The message names the actor and carries its traceback."""


@dataclass
class Chunk:
    """What an actor sends: rows of ``T`` consecutive steps of each of its ``N`` envs.

    Attributes:
        actor: the actor's index in its pool.
        version: weight version the rows were made with (``-1``: the random prefill policy).
        rows: row-convention leaves ``[T, N, ...]`` (numpy), ``policy_version`` included.
        episodes: episodes finished in the chunk, ``{"return", "length", "env"}``.
        env_steps: rows made anew (``T * N``; an overlap row was counted in the chunk before).
        collect_s: seconds the actor spent acting for it.
    """

    actor: int
    version: int
    rows: dict[str, Any]
    episodes: list[dict[str, float]] = field(default_factory=list)
    env_steps: int = 0
    collect_s: float = 0.0


# ---------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------
# one actor's work, shared by both backends
# ---------------------------------------------------------------------------------------


@dataclass
class ActorConfig:
    """What every actor of a pool is built from (picklable: it travels to the actors)."""

    env: EnvConfig
    envs_per_actor: int
    chunk_length: int
    seed: int
    rank: int = 0
    overlap: bool = False  # unrolls of chunk_length + 1 rows sharing one row (UnrollDataModule)
    random_steps: int = 0  # vector steps per actor taken with the random policy first (prefill)
    explore: bool = True
    initial_version: int = 0  # version of the weights the actors are built with


class _Worker:
    """An actor's Collector: its own vector env, a copy of the agent, random steps first."""

    def __init__(self, actor: int, config: ActorConfig, module: nn.Module) -> None:
        torch.set_num_threads(1)
        self.actor, self.config, self.module = actor, config, module.requires_grad_(False).eval()
        env_cfg = EnvConfig(**{**vars(config.env), "num_envs": config.envs_per_actor})
        self.spec: EnvSpec = env_spec(env_cfg)
        self.collector = Collector(
            make_vector_env(env_cfg),
            module,
            seeds=env_seeds(config.seed, config.envs_per_actor, "train", config.rank, actor),
            spec=self.spec,
        )
        self.random_left = config.random_steps
        if self.random_left > 0:
            seed = derive_seed(config.seed, "prefill", config.rank, actor)
            self.collector.set_agent(RandomAgent(self.spec, seed=seed))

    def chunk(self, version: int) -> Chunk:
        """Act for one chunk with the weights of ``version`` (already in ``module``)."""
        collector, config = self.collector, self.config
        if self.random_left <= 0 and collector.agent is not self.module:
            collector.set_agent(self.module)
        random = self.random_left > 0
        collector.policy_version = RANDOM_POLICY_VERSION if random else version
        steps = min(config.chunk_length, self.random_left) if random and not config.overlap else config.chunk_length
        before = collector.stats.env_steps
        start = time.perf_counter()
        rows = collector.collect_chunk(steps, explore=config.explore, overlap=config.overlap)
        made = collector.stats.env_steps - before
        self.random_left -= made // config.envs_per_actor
        return Chunk(
            self.actor,
            collector.policy_version,
            rows,
            collector.stats.pop_finished(),
            made,
            time.perf_counter() - start,
        )

    def close(self) -> None:
        self.collector.env.close()


# ---------------------------------------------------------------------------------------
# local backend: spawned processes
# ---------------------------------------------------------------------------------------

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
        worker = _Worker(actor, config, module)
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


def _close_quietly(worker: _Worker | None) -> None:
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


class _LocalBackend:
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
                    f"actor {i} (pid {proc.pid}) hung: no heartbeat for {silent:.1f} s (actor_timeout_s="
                    f"{timeout_s:g}); it may be stuck in env.step or in the policy"
                )
        return None

    def close(self) -> None:
        self._finalizer()  # runs _terminate once
        for q in (self.chunks, self.errors):
            q.cancel_join_thread()
            q.close()


# ---------------------------------------------------------------------------------------
# ray backend
# ---------------------------------------------------------------------------------------


class _RayWorker:
    """The Ray actor: a :class:`_Worker` that loads the weights it is handed, chunk by chunk."""

    def __init__(self, actor: int, config: ActorConfig, module: nn.Module) -> None:
        self.worker = _Worker(actor, config, module)

    def pid(self) -> int:
        return os.getpid()

    def chunk(self, weights: dict[str, torch.Tensor] | None, version: int) -> Chunk:
        if weights is not None:
            self.worker.module.load_state_dict(weights)
        return self.worker.chunk(version)


class _RayBackend:
    """Ray actors with two chunk calls in flight each (one runs while the learner reads the other);
    an actor's results are taken in call order with ``ray.wait`` over each actor's oldest call."""

    def __init__(self, config: ActorConfig, module: nn.Module, num_actors: int, address: str | None) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError('actor_backend: ray needs Ray; install the extra: pip install -e ".[ray]"') from None
        self.ray = ray
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            if address is None:  # a local instance, with room for every actor
                ray.init(
                    num_cpus=max(num_actors, os.cpu_count() or 1), include_dashboard=False, configure_logging=False
                )
            else:
                ray.init(address=address, include_dashboard=False, configure_logging=False)
        remote = ray.remote(num_cpus=1)(_RayWorker)
        self.actors = [remote.remote(i, config, module) for i in range(num_actors)]
        self.weights: Any = None
        self.version = config.initial_version
        self.sent = [config.initial_version] * num_actors  # newest version handed to each actor
        self.calls: list[deque[tuple[Any, float]]] = [deque() for _ in range(num_actors)]  # (ref, submitted at)
        self.last_seen = [time.monotonic() + STARTUP_GRACE_S] * num_actors
        self.closed = False
        for i in range(num_actors):
            for _ in range(2):
                self._submit(i)

    def _submit(self, actor: int) -> None:
        weights = self.weights if self.sent[actor] != self.version else None
        self.sent[actor] = self.version
        self.calls[actor].append((self.actors[actor].chunk.remote(weights, self.version), time.monotonic()))

    def _oldest(self) -> dict[Any, int]:
        return {calls[0][0]: actor for actor, calls in enumerate(self.calls) if calls}

    def pids(self) -> list[int | None]:
        return list(self.ray.get([a.pid.remote() for a in self.actors], timeout=120))

    def publish(self, module: nn.Module, version: int) -> None:
        self.weights = self.ray.put({k: v.detach().cpu().clone() for k, v in module.state_dict().items()})
        self.version = int(version)

    def get(self, timeout: float) -> Chunk | None:
        oldest = self._oldest()
        ready, _ = self.ray.wait(list(oldest), num_returns=1, timeout=timeout)
        if not ready:
            return None
        actor = oldest[ready[0]]
        ref, _ = self.calls[actor].popleft()
        self.last_seen[actor] = time.monotonic()
        try:
            chunk = self.ray.get(ref)
        except self.ray.exceptions.RayActorError as err:
            raise ActorError(f"ray actor {actor} died: {err}") from None
        except self.ray.exceptions.RayTaskError as err:
            raise ActorError(f"ray actor {actor} raised:\n{str(err).rstrip()}") from None
        self._submit(actor)
        return chunk

    def _ready(self) -> list[Any]:
        refs = [ref for calls in self.calls for ref, _ in calls]
        return self.ray.wait(refs, num_returns=len(refs), timeout=0)[0] if refs else []

    def qsize(self) -> int:
        return len(self._ready())

    def failure(self, timeout_s: float) -> str | None:
        now = time.monotonic()
        ready = set(self._ready())
        for actor, calls in enumerate(self.calls):
            if any(ref in ready for ref, _ in calls):
                self.last_seen[actor] = now
            elif calls:
                silent = now - max(calls[0][1], self.last_seen[actor])
                if silent > timeout_s:
                    return (
                        f"ray actor {actor} hung: no chunk for {silent:.1f} s (actor_timeout_s={timeout_s:g}); "
                        "it may be stuck in env.step or in the policy"
                    )
        return None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:  # noqa: BLE001 - already dead
                pass
        for calls in self.calls:
            calls.clear()
        if self.owns_ray:
            self.ray.shutdown()


# ---------------------------------------------------------------------------------------
# the pool
# ---------------------------------------------------------------------------------------


class ActorPool:
    """``num_actors`` actors, each a :class:`Collector` over ``envs_per_actor`` envs, sending
    :class:`Chunk` s of ``chunk_length`` steps made with the newest published weights.

    Args:
        env: the env config (``num_envs`` is replaced by ``envs_per_actor``).
        acting_module: a CPU module implementing the Agent protocol (``acting_copy()``); each
            actor gets a copy and loads every published version into it.
        num_actors, envs_per_actor, chunk_length: pool shape; a chunk has
            ``chunk_length * envs_per_actor`` rows.
        seed, rank: env seeds ``env_seeds(seed, envs_per_actor, "train", rank, actor)``.
        backend: ``local`` (spawned processes) or ``ray`` (Ray actors).
        ray_address: ``None`` starts a local Ray instance; ``auto`` or ``host:port`` joins a
            running cluster (``ray start --head`` on one machine, ``ray start --address=...``
            on the others).
        queue_size: chunks waiting for the learner before actors block (local); default
            ``2 * num_actors``.
        timeout_s: an actor silent for this long is reported as hung (actors beat between
            chunks and while they wait on a full queue: it must exceed the time of one chunk;
            starting gets ``STARTUP_GRACE_S`` more).
        overlap: chunks of ``chunk_length + 1`` rows, consecutive ones sharing a row (unrolls).
        random_steps: vector steps each actor takes with the random policy first (prefill);
            their rows carry ``policy_version`` ``-1``.
        explore: act with exploration.
        initial_version: the version of ``acting_module``'s weights.
    """

    def __init__(
        self,
        env: EnvConfig,
        acting_module: nn.Module,
        num_actors: int,
        envs_per_actor: int = 1,
        chunk_length: int = 64,
        seed: int = 0,
        rank: int = 0,
        backend: Literal["local", "ray"] = "local",
        ray_address: str | None = None,
        queue_size: int | None = None,
        timeout_s: float = 60.0,
        overlap: bool = False,
        random_steps: int = 0,
        explore: bool = True,
        initial_version: int = 0,
    ) -> None:
        if num_actors < 1 or envs_per_actor < 1 or chunk_length < 1:
            raise ValueError(
                f"num_actors, envs_per_actor and chunk_length must be >= 1, got {num_actors}, "
                f"{envs_per_actor}, {chunk_length}"
            )
        if timeout_s <= 0:
            raise ValueError(f"actor timeout_s must be > 0, got {timeout_s}")
        self.num_actors, self.envs_per_actor, self.chunk_length = num_actors, envs_per_actor, chunk_length
        self.timeout_s, self.backend = float(timeout_s), backend
        config = ActorConfig(
            env, envs_per_actor, chunk_length, seed, rank, overlap, random_steps, explore, initial_version
        )
        acting_module = acting_module.cpu().eval().requires_grad_(False)
        if backend == "local":
            self._impl: Any = _LocalBackend(config, acting_module, num_actors, queue_size or 2 * num_actors)
        elif backend == "ray":
            self._impl = _RayBackend(config, acting_module, num_actors, ray_address)
        else:
            raise ValueError(f"actor_backend must be 'local' or 'ray', got {backend!r}")
        self._closed = False
        self._last_check = 0.0

    @property
    def num_streams(self) -> int:
        """Env streams over all actors (actor ``a``'s env ``j`` is stream ``a * envs_per_actor + j``)."""
        return self.num_actors * self.envs_per_actor

    def streams(self, actor: int) -> np.ndarray:
        """The stream indices of ``actor``'s envs."""
        return np.arange(actor * self.envs_per_actor, (actor + 1) * self.envs_per_actor)

    def pids(self) -> list[int | None]:
        """Process ids of the actors (Ray: of the worker processes)."""
        return self._impl.pids()

    def publish(self, module: nn.Module, version: int) -> None:
        """Make ``module``'s weights (an acting copy) the newest, as ``version``."""
        self._impl.publish(module, version)

    def qsize(self) -> int:
        """Chunks waiting for the learner."""
        return self._impl.qsize()

    def get(self, timeout: float = 0.0) -> Chunk | None:
        """The next chunk, waiting up to ``timeout`` seconds; ``None`` if none came.

        Raises:
            ActorError: an actor raised (its traceback in the message), died or hung; the
                pool is closed first.
        """
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            try:
                chunk = self._impl.get(min(0.1, max(0.0, deadline - time.monotonic())))
            except ActorError:
                self.close()
                raise
            if chunk is not None or time.monotonic() >= deadline:
                return chunk

    def check(self, every_s: float = 0.5) -> None:
        """Raise :class:`ActorError` (after closing the pool) if an actor raised, died or hung;
        looks at most every ``every_s`` seconds (``get`` calls it; a learner that holds back
        chunks calls it itself)."""
        if self._closed:
            raise RuntimeError("the actor pool is closed")
        now = time.monotonic()
        if now - self._last_check < every_s:
            return
        self._last_check = now
        failure = self._impl.failure(self.timeout_s)
        if failure is not None:
            self.close()
            raise ActorError(failure)

    def close(self) -> None:
        """Stop every actor (idempotent)."""
        if not self._closed:
            self._closed = True
            self._impl.close()

    def __enter__(self) -> ActorPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
