"""Central acting with env groups in their own processes (``acting.central_groups: processes``).

Each of the ``acting.num_actors`` groups is a spawned process that steps its vector env of
``envs_per_actor`` envs and builds its rows and chunks itself (an
:class:`~lightning_wm.data.acting.worker.ActorWorker`, the actors' Collector loop, seeds and random
prefill); its agent is a :class:`~lightning_wm.data.acting.shared_inference.SharedMemoryClient`,
so for every step only the observations go to the learner and the actions and extras come back,
through shared memory. One :class:`~lightning_wm.data.acting.shared_inference.InferenceLoop`
thread in the learner acts for all groups with the live module on its device
(``acting.central_inference: thread``), or a process of its own with a CPU acting copy refreshed
from the learner's published weights (``process``,
:class:`~lightning_wm.data.acting.inference_process.InferenceProcess`). Chunks come through
a queue as the actors' do; a group starts a chunk only with a permit
(:class:`~lightning_wm.data.acting.permits.ChunkPermits`, a semaphore per group): ``acting.queue_size``
chunks, default one per group, are made ahead of the learner, the groups taking turns.

Robustness is the actor processes' (:mod:`lightning_wm.data.acting.spawned`): a group's exception,
death or silence, the inference loop's exception, or one policy call running for
``acting.timeout_s`` becomes one :class:`~lightning_wm.data.acting.worker.ActorError`; groups die with
the learner, ``kill -9`` included; the shared tensors are file descriptors, never files in
``/dev/shm``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.multiprocessing as tmp
from torch import Tensor

from lightning_wm.data.acting.base import Chunk, wait_for_chunk
from lightning_wm.data.acting.inference import InferenceStopped, shorten_switch_interval
from lightning_wm.data.acting.inference_process import InferenceProcess
from lightning_wm.data.acting.permits import ChunkPermits
from lightning_wm.data.acting.shared_inference import InferenceLoop, SharedMemoryClient, SharedSlots, make_slots
from lightning_wm.data.acting.spawned import SpawnedWorkers, heartbeat_of, put_chunk, worker_process
from lightning_wm.data.acting.worker import ActorConfig, ActorError, ActorWorker
from lightning_wm.envs import env_spec

__all__ = ["CentralProcessPool"]


def _group_main(
    group: int,
    config: ActorConfig,
    slots: SharedSlots,
    permits: list[Any],
    chunks: Any,
    errors: Any,
    stop: Any,
    heartbeat: Any,
    parent_pid: int,
) -> None:
    """Body of env-group process ``group``: chunks into ``chunks`` until ``stop`` is set."""
    with worker_process(group, chunks, errors, parent_pid) as holder:
        torch.set_num_threads(1)
        beat = heartbeat_of(heartbeat, group)
        client = SharedMemoryClient(slots, group, stop, beat)
        worker = holder[0] = ActorWorker(group, config, client)
        version = config.initial_version

        def on_act(answered: int) -> None:
            nonlocal version
            version = worker.collector.policy_version = answered

        client.on_act = on_act
        try:
            while not stop.is_set():
                beat()
                client.pause()  # rounds do not wait for a group waiting for the learner
                while not permits[group].acquire(timeout=0.25):
                    beat()
                    if stop.is_set():
                        return
                chunk = worker.chunk(version)
                chunk.date_by_oldest_row()
                put_chunk(chunk, chunks, stop, beat)
        except InferenceStopped:
            return


class CentralProcessPool:
    """``num_groups`` env-group processes acting through one :class:`InferenceLoop` with ``agent``.

    Args:
        config: what every group is built from (:class:`ActorConfig`; a group is an actor here).
        agent: the acting module (its ``device``; one call per round, from the loop's thread); with
            ``inference="process"`` a CPU acting copy (``module.acting_copy()``).
        num_groups: env groups (``acting.num_actors``).
        deadline_s: how long a round waits for the other active groups after its first request.
        version: the learner's weights version now.
        timeout_s: a group silent this long, or one policy call this long, is reported as hung.
        chunks_ahead: chunks made ahead of the learner, all groups together (default one per group).
        inference: ``thread`` (a thread of the learner acting with ``agent`` itself) or ``process``
            (:class:`InferenceProcess`; new weights reach it by :meth:`publish`).
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
        inference: str = "thread",
    ) -> None:
        if inference not in ("thread", "process"):
            raise ValueError(f"acting.central_inference must be 'thread' or 'process', got {inference!r}")
        self.num_groups, self.timeout_s = num_groups, float(timeout_s)
        env_cfg = config.actor_env()
        slots = make_slots(
            agent, env_spec(env_cfg).observation_space, num_groups, config.envs_per_actor, config.explore
        )
        self.permits = ChunkPermits(num_groups, chunks_ahead or num_groups, tmp.get_context("spawn").Semaphore)
        self.server: InferenceLoop | InferenceProcess
        if inference == "process":
            self._restore_switch_interval = lambda: None  # the learner's interpreter serves no request
            self.server = InferenceProcess(agent, int(version()), slots, deadline_s)
        else:
            self._restore_switch_interval = shorten_switch_interval()  # called by close()
            self.server = InferenceLoop(agent, slots, deadline_s, version)
        self._closed = False
        self._last_check = 0.0
        try:
            self.workers = SpawnedWorkers(
                _group_main,
                (config, slots, self.permits.semaphores),
                num_groups,
                num_groups,
                "env group {} (central acting)",
            )
        except BaseException:
            self.server.close()
            self._restore_switch_interval()
            raise

    def get(self, timeout: float = 0.0) -> Chunk | None:
        """The next chunk, waiting up to ``timeout`` seconds; ``None`` if none came.

        Raises:
            ActorError: a group or the inference loop raised or hung (the pool is closed first).
            RunStopped: a stop was requested while waiting.
        """
        chunk = wait_for_chunk(self.workers.get, self.check, timeout)
        if chunk is not None:
            self.permits.taken(chunk.actor)  # the next group in turn may start a chunk
        return chunk

    def check(self, every_s: float = 0.25) -> None:
        """Raise :class:`ActorError` (after closing the pool) if a group or the loop raised or hung."""
        if self._closed:
            raise RuntimeError("the central acting pool is closed")
        failure = None
        due = time.monotonic() - self._last_check >= every_s
        if isinstance(self.server, InferenceLoop) or due:  # the thread's checks cost nothing
            failure = self.server.failure(self.timeout_s)
        if failure is None and due:
            self._last_check = time.monotonic()
            failure = self.workers.failure(self.timeout_s)
        if failure is not None:
            self.close()
            raise ActorError(failure)

    def publish(self, weights: Mapping[str, Tensor] | torch.nn.Module, version: int) -> None:
        """New weights for the inference process (``inference="process"``; the thread acts with the live module)."""
        if not isinstance(self.server, InferenceProcess):
            raise RuntimeError(
                "only the inference process takes published weights; the thread acts with the live module"
            )
        self.server.publish(weights, version)

    def qsize(self) -> int:
        return self.workers.qsize()

    def pids(self) -> list[int | None]:
        """Process ids of the env groups, then the inference process's (``inference="process"``)."""
        return self.workers.pids() + (self.server.pids() if isinstance(self.server, InferenceProcess) else [])

    def close(self) -> None:
        """Stop the groups (their envs close in their processes), then the loop; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.workers.close()
        self.server.close()
        self._restore_switch_interval()
