"""Central acting (``acting.policy: central``): env groups step envs, one batched policy on the
learner's device acts for all of them; no policy copy leaves the learner.

``acting.num_actors`` env groups, each an :class:`~lightning_wm.data.acting.worker.ActorWorker`
(the actors' Collector loop, seeds and random prefill) over its own vector env of
``envs_per_actor`` envs — gymnasium's ``AsyncVectorEnv`` (worker processes, observations through
shared memory) with ``env.vectorization: async``, a ``SyncVectorEnv`` with ``sync`` — run by one
thread each in the learner's process. Their agent is an
:class:`~lightning_wm.data.acting.inference.InferenceClient` of one
:class:`~lightning_wm.data.acting.inference.BatchedInference` that calls the live module
(:func:`~lightning_wm.data.acting.inference.acting_view`) once for all groups that asked. Chunks go
to the batch side as an actor pool's, but a group starts a chunk only with a permit
(:class:`~lightning_wm.data.acting.permits.ChunkPermits`): ``acting.queue_size`` chunks (default
one per group) are queued or being made ahead of the learner, the groups taking turns. Rows carry
the learner's version at act time (``policy_version``), so the policy lag is only the learner
steps taken while a chunk was made and waited. With ``acting.central_groups: processes`` the pool
is a :class:`~lightning_wm.data.acting.central_processes.CentralProcessPool` instead, and with
``acting.central_inference: process`` its policy runs in a process of its own, an acting copy that
takes the weights the learner publishes every ``acting.publish_every`` steps.

Robustness: a group's exception (an env that raised, a worker process that died, the agent's
``act``) or a group silent for ``acting.timeout_s`` becomes one
:class:`~lightning_wm.data.acting.worker.ActorError` naming the group; :meth:`CentralPool.close`
stops the threads and the envs' worker processes; gymnasium's workers end themselves when the
learner dies (their command pipe closes), ``kill -9`` included.
"""

from __future__ import annotations

import math
import queue as queue_lib
import threading
import time
import traceback
from typing import Any

import torch
from torch import nn

from lightning_wm.data.acting.actors import ActorActing
from lightning_wm.data.acting.base import Chunk, wait_for_chunk
from lightning_wm.data.acting.central_processes import CentralProcessPool
from lightning_wm.data.acting.inference import (
    SWITCH_INTERVAL_S,
    BatchedInference,
    InferenceClient,
    InferenceStopped,
    acting_view,
    shorten_switch_interval,
)
from lightning_wm.data.acting.permits import ChunkPermits
from lightning_wm.data.acting.worker import STARTUP_GRACE_S, ActorConfig, ActorError, ActorWorker
from lightning_wm.data.collector import agent_device
from lightning_wm.data.settings import ActingSettings
from lightning_wm.envs import EnvConfig
from lightning_wm.protocols import acting_weights
from lightning_wm.signals import stop_requested

__all__ = ["CentralActing", "CentralPool", "SWITCH_INTERVAL_S"]


class CentralPool:
    """``num_groups`` env groups acting through one :class:`BatchedInference` with ``agent``.

    Args:
        config: what every group is built from (:class:`ActorConfig`; a group is an actor here).
        agent: the agent every group acts with (one call per round, one call at a time).
        num_groups: env groups (``acting.num_actors``).
        deadline_s: how long a round waits for the other groups after its first request.
        version: the learner's weights version now.
        timeout_s: a group silent this long is reported as hung (starting gets ``STARTUP_GRACE_S`` more).
        chunks_ahead: chunks made ahead of the learner, all groups together (:class:`ChunkPermits`;
            default one per group).
    """

    def __init__(
        self,
        config: ActorConfig,
        agent: Any,
        num_groups: int,
        deadline_s: float,
        version: Any,
        timeout_s: float,
        chunks_ahead: int | None = None,
    ) -> None:
        self.num_groups, self.timeout_s = num_groups, float(timeout_s)
        self.permits = ChunkPermits(num_groups, chunks_ahead or num_groups, threading.Semaphore)
        self._restore_switch_interval = shorten_switch_interval()  # called by close()
        self.server = BatchedInference(agent, deadline_s, version, groups=range(num_groups))
        self.chunks: queue_lib.Queue[Chunk] = queue_lib.Queue()  # at most num_groups: one per slot
        self.stop = threading.Event()
        self.errors: list[tuple[int, BaseException]] = []
        self.heartbeat = [time.monotonic() + STARTUP_GRACE_S] * num_groups
        self.workers: list[ActorWorker] = []
        self.threads: list[threading.Thread] = []
        self._closed = False
        try:  # envs built here, in the calling thread, before any group thread runs
            for group in range(num_groups):
                self.workers.append(ActorWorker(group, config, self._client(group)))
        except BaseException:
            self.close()
            raise
        for group, worker in enumerate(self.workers):
            thread = threading.Thread(target=self._run, args=(group, worker), name=f"lightning_wm-group-{group}")
            thread.daemon = True
            self.threads.append(thread)
            thread.start()

    def _client(self, group: int) -> InferenceClient:
        def on_act(version: int) -> None:
            self.heartbeat[group] = time.monotonic()
            self.workers[group].collector.policy_version = version
            if self.stop.is_set() or stop_requested() is not None:
                raise InferenceStopped("central acting is stopping")

        return InferenceClient(self.server, group, on_act)

    def _run(self, group: int, worker: ActorWorker) -> None:
        """Body of group ``group``'s thread: chunks into the queue until stopped."""
        try:
            device = worker.module.device
            if device.type == "cuda":  # a thread starts on the first GPU: the one of this rank instead
                torch.cuda.set_device(device)
            while not self.stop.is_set():
                self.heartbeat[group] = time.monotonic()
                permit = self.permits.semaphores[group]
                if not permit.acquire(blocking=False):  # a chunk starts with a permit (ChunkPermits)
                    self.server.pause(group)  # the others are served without waiting for this group
                    while not permit.acquire(timeout=0.25):
                        self.heartbeat[group] = time.monotonic()
                        if self.stop.is_set() or stop_requested() is not None:
                            return
                chunk = worker.chunk(self.server.version())
                chunk.date_by_oldest_row()
                self.chunks.put(chunk)
        except InferenceStopped:
            return
        except BaseException as error:  # noqa: BLE001 - reported to the learner by check()
            # kept, not formatted here: Python 3.11's traceback parses source, and ast is not thread-safe
            if not self.stop.is_set():
                self.errors.append((group, error))
            self.server.pause(group)

    def get(self, timeout: float = 0.0) -> Chunk | None:
        """The next chunk, waiting up to ``timeout`` seconds; ``None`` if none came.

        Raises:
            ActorError: a group raised or hung (the pool is closed first).
            RunStopped: a stop was requested while waiting.
        """
        chunk = wait_for_chunk(self._take, self.check, timeout)
        if chunk is not None:
            self.permits.taken(chunk.actor)  # the next group in turn may start a chunk
        return chunk

    def _take(self, timeout: float) -> Chunk | None:
        try:
            return self.chunks.get(timeout=timeout)
        except queue_lib.Empty:
            return None

    def check(self) -> None:
        """Raise :class:`ActorError` (after closing the pool) if a group raised or hung."""
        if self._closed:
            raise RuntimeError("the central acting pool is closed")
        failure = None
        if self.errors:
            group, error = self.errors[0]
            tb = "".join(traceback.format_exception(error)).rstrip()
            failure = f"env group {group} (central acting) raised:\n{tb}"
        else:
            now = time.monotonic()
            for group, beat in enumerate(self.heartbeat):
                if now - beat > self.timeout_s:
                    failure = (
                        f"env group {group} (central acting) hung: no step for {now - beat:.1f} s (acting.timeout_s="
                        f"{self.timeout_s:g}); it may be stuck in env.step or in the policy"
                    )
                    break
        if failure is not None:
            self.close()
            raise ActorError(failure)

    def qsize(self) -> int:
        return self.chunks.qsize()

    def pids(self) -> list[int]:
        """Process ids of the groups' env workers (none for sync groups)."""
        return [p.pid for w in self.workers for p in getattr(w.collector.env, "processes", [])]

    def close(self) -> None:
        """Stop the groups and the inference, then close the envs (their worker processes end); idempotent."""
        if self._closed:
            return
        self._closed = True
        self.stop.set()
        self.server.close()
        self._restore_switch_interval()
        for thread in self.threads:
            thread.join(timeout=10.0)
        force = {group for group, thread in enumerate(self.threads) if thread.is_alive()}  # inside env.step
        force |= {group for group, _ in self.errors}  # e.g. a worker process died
        for group, worker in enumerate(self.workers):
            try:
                worker.collector.env.close(terminate=group in force)
            except Exception:  # noqa: BLE001 - a worker died during a step: gymnasium's close cannot finish
                _end_workers(worker.collector.env)


def _end_workers(env: Any) -> None:
    """Kill and reap an ``AsyncVectorEnv``'s worker processes and close its pipes (what its
    ``close`` does, for an env whose pending step can never be answered)."""
    for process in getattr(env, "processes", []):
        if process.is_alive():
            process.kill()
        process.join(timeout=10.0)
    for pipe in getattr(env, "parent_pipes", []):
        if pipe is not None:
            pipe.close()
    env.closed = True  # nothing left for its __del__ to close


class CentralActing(ActorActing):
    """Acting with ``policy: central``: an :class:`ActorActing` whose pool is a :class:`CentralPool`
    acting with the live module (the first agent attached; later attachments only move the
    version on, there is nothing to publish).

    Args:
        env: the env config of the groups (``num_envs`` is replaced by ``envs_per_actor``).
        settings: the datamodule's acting group (``policy: central``).
        chunk_length: env steps per chunk.
        overlap: unroll chunks (``chunk_length + 1`` rows, consecutive ones sharing a row).
    """

    def __init__(self, env: EnvConfig, settings: ActingSettings, chunk_length: int, overlap: bool = False) -> None:
        super().__init__(env, settings, chunk_length, overlap)
        self.agent: Any = None

    def attach_agent(self, agent: Any, version: int, random_rows: int = 0) -> None:
        """Start the groups with ``agent`` (the first call: each group first takes its share of
        ``random_rows`` with the random policy) or move the version on; with the inference in a
        process of its own, publish its weights (:func:`~lightning_wm.protocols.acting_weights`) every
        ``publish_every`` steps."""
        self.learner_version = int(version)
        own_process = self.settings.central_inference == "process"  # the policy in a process of its own
        if self.pool is None or agent is not self.agent:
            self.close()
            self.agent = agent
            if own_process and agent_device(agent).type != "cpu":
                raise ValueError(
                    f"acting.central_inference: process acts with a CPU copy, but the learner is on "
                    f"{agent_device(agent)}: keep central_inference: thread there (the policy stays on the GPU)"
                )
            config = ActorConfig(
                self.env,
                self.envs_per_actor,
                self.chunk_length,
                self.env.seed,
                self.rank,
                self.overlap,
                random_steps=math.ceil(max(0, random_rows) / self.num_streams),
                initial_version=self.learner_version,
            )
            if own_process:
                acting: Any = agent.acting_copy()
            else:
                acting = acting_view(agent).eval() if isinstance(agent, nn.Module) else agent
            args = (
                config,
                acting,
                self.num_actors,
                self.settings.deadline_ms / 1000.0,
                lambda: self.learner_version,
                self.settings.timeout_s,
                self.settings.queue_size,
            )
            if self.settings.central_groups == "processes":
                self.pool = CentralProcessPool(*args, inference=self.settings.central_inference)  # type: ignore[assignment]
            else:  # ActingSettings refuses the inference process beside group threads
                self.pool = CentralPool(*args)  # type: ignore[assignment]
        elif own_process:
            if not self.publish_due(self.learner_version):
                return
            self.pool.publish(acting_weights(agent), self.learner_version)  # type: ignore[attr-defined]
        self.published = self.learner_version

    def metrics(self) -> dict[str, float]:
        """The actors' gauges plus ``actors/groups_per_act``: env groups answered per policy call."""
        out = super().metrics()
        if self.pool is not None and self.pool.server.calls:
            out["actors/groups_per_act"] = self.pool.server.requests / self.pool.server.calls
        return out
