"""Central inference (``acting.policy: central``): ``acting.num_actors`` env groups step envs and one
batched policy call per round acts for all of them (:class:`~lightning_wm.data.acting.inference.Rounds`).

A group is an :class:`~lightning_wm.data.acting.worker.ActorWorker` over ``envs_per_actor`` envs whose
agent is an :class:`~lightning_wm.data.acting.inference.InferenceClient`. ``acting.central_groups``:

* ``threads`` — threads of the learner acting with the live module on its device (no copy, no
  publishing); the group whose request closes a round answers it. Starts at once; for a GPU learner.
* ``processes`` — spawned processes answered by one inference process whose CPU acting copy pulls the
  published weights (a :class:`~lightning_wm.data.acting.local.WeightStore`) before each call: nothing
  of acting shares the learner's interpreter (the fastest central mode on a CPU learner, 32+ envs a group).

Both share the rounds, the chunk permits (:class:`ChunkPermits`) and the failure checks
(:class:`~lightning_wm.data.acting.base.Pool`); everything dies with the learner.
"""

from __future__ import annotations

import queue as queue_lib
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.multiprocessing as tmp
from torch import Tensor, nn

from lightning_wm.data.acting.base import RANDOM_POLICY_VERSION, Chunk, Pool
from lightning_wm.data.acting.inference import (
    InferenceClient,
    InferenceStopped,
    Rounds,
    SharedSlots,
    acting_view,
    make_slots,
)
from lightning_wm.data.acting.local import WeightStore
from lightning_wm.data.acting.spawned import Link, SpawnedWorkers, heartbeat_of, hung, put_chunk, worker_process
from lightning_wm.data.acting.worker import (
    STARTUP_GRACE_S,
    ActingJob,
    ActorWorker,
    acting_copy_ready,
    seed_policy_draws,
)
from lightning_wm.data.collector import agent_device
from lightning_wm.envs import env_spec
from lightning_wm.signals import stop_requested

__all__ = ["CentralPool", "ChunkPermits", "GroupThreads", "SWITCH_INTERVAL_S"]

# The interpreter's thread switch interval while group threads act: a thread woken by an env, a
# request or an answer waits for the GIL until the learner's thread drops it, at most this long
# (Python's default, 5 ms, would be paid at nearly every env step while the learner computes).
SWITCH_INTERVAL_S = 0.0002


class ChunkPermits:
    """``permits`` chunks ahead of the learner (queued or in the making: they bound the policy lag)
    over ``num_groups`` groups, handed out in turn. Group ``g`` takes a permit from ``semaphores[g]``
    (made by ``semaphore(0)``) before it starts a chunk; when the learner takes its chunk the permit is
    used up and the next group in turn without one gets one: with a permit per group each runs one
    chunk ahead, with fewer they take turns."""

    def __init__(self, num_groups: int, permits: int, semaphore: Callable[[int], Any]) -> None:
        if num_groups < 1 or permits < 1:
            raise ValueError(f"need at least one group and one permit, got {num_groups} and {permits}")
        self.num_groups = num_groups
        self.semaphores = [semaphore(0) for _ in range(num_groups)]
        self._holding: set[int] = set()  # groups with a permit out (their chunk not taken yet)
        self._next = 0
        for _ in range(min(permits, num_groups)):
            self._grant()

    def _grant(self) -> None:
        for i in range(self.num_groups):
            group = (self._next + i) % self.num_groups
            if group not in self._holding:
                self._holding.add(group)
                self._next = (group + 1) % self.num_groups
                self.semaphores[group].release()
                return

    def taken(self, group: int) -> None:
        """The learner took ``group``'s chunk: its permit is used; the next group in turn gets one
        (the learner's thread only)."""
        self._holding.discard(group)
        self._grant()


def _group_loop(worker: ActorWorker, permit: Any, chunks: Any) -> None:
    """A group's body, thread or process: a chunk per permit into ``chunks`` until its client's
    ``stop`` is set (the client, ``worker.module``, also beats the group's heartbeat)."""
    client: InferenceClient = worker.module
    stop, beat, version = client.stop, client.beat, worker.job.version

    def on_act(answered: int) -> None:
        nonlocal version
        version = worker.collector.policy_version = answered

    client.on_act = on_act
    try:
        while not stop.is_set():
            beat()
            if not permit.acquire(False):  # a chunk starts with a permit (ChunkPermits)
                client.pause()  # rounds do not wait for a group waiting for the learner
                while not permit.acquire(True, 0.25):
                    beat()
                    if stop.is_set():
                        return
            chunk = worker.chunk(version)
            if chunk.version != RANDOM_POLICY_VERSION:  # rows carry the version of their moment: date by the oldest
                chunk.version = int(chunk.rows["policy_version"].min())
            put_chunk(chunk, chunks, stop, beat)
    except InferenceStopped:
        return


def _group_main(group: int, job: ActingJob, slots: SharedSlots, permits: list[Any], link: Link) -> None:
    """Body of env-group process ``group``."""
    with worker_process(group, link) as (holder, beat):
        torch.set_num_threads(1)
        holder[0] = worker = ActorWorker(group, job, InferenceClient(slots, group, link.stop, beat))
        _group_loop(worker, permits[group], link.chunks)


def _inference_main(
    index: int, job: ActingJob, store: WeightStore, slots: SharedSlots, deadline_s: float, link: Link
) -> None:
    """Body of the inference process: answer the groups' rounds with the newest published weights
    (its action draws seeded under the role ``"central policy"``)."""
    with worker_process(index, link) as (_, beat):
        seed_policy_draws(job, index, role="central policy")
        module = acting_copy_ready(store.new_module())
        version = store.pull_into(module)

        def newest() -> int:
            nonlocal version
            if store.version != version:
                version = store.pull_into(module, known_version=version)
            beat()  # a policy call that hangs stops the beat
            return version

        Rounds(module, slots, deadline_s, newest).serve(link.stop, beat)


class _Stop(threading.Event):
    """Set by :meth:`GroupThreads.close` or by a stop request (a scheduler's signal)."""

    def is_set(self) -> bool:
        return super().is_set() or stop_requested() is not None


class GroupThreads:
    """Env groups as threads of the learner driving ``rounds`` themselves, with what
    :class:`~lightning_wm.data.acting.spawned.SpawnedWorkers` offers processes; the interpreter's
    switch interval short while they run; envs built in the calling thread before any group runs."""

    def __init__(self, job: ActingJob, slots: SharedSlots, rounds: Rounds, permits: list[Any]) -> None:
        count = len(permits)
        self.slots, self.chunks = slots, queue_lib.Queue[Chunk]()
        self.stop = _Stop()
        self.errors: list[tuple[int, BaseException]] = []
        self.heartbeat = [time.monotonic() + STARTUP_GRACE_S] * count
        self.workers: list[ActorWorker] = []
        self.threads: list[threading.Thread] = []
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL_S))
        try:
            for g in range(count):
                client = InferenceClient(slots, g, self.stop, heartbeat_of(self.heartbeat, g), rounds)
                self.workers.append(ActorWorker(g, job, client))
        except BaseException:
            self.close()
            raise
        for g, worker in enumerate(self.workers):
            thread = threading.Thread(target=self._run, args=(g, worker, permits[g], rounds.device), daemon=True)
            thread.name = f"lightning_wm-group-{g}"
            self.threads.append(thread)
            thread.start()

    def _run(self, group: int, worker: ActorWorker, permit: Any, device: torch.device) -> None:
        try:
            if device.type == "cuda":  # a thread starts on the first GPU: the one of this rank instead
                torch.cuda.set_device(device)
            _group_loop(worker, permit, self.chunks)
        except BaseException as error:  # noqa: BLE001 - reported to the learner by failure()
            # kept, not formatted here: Python 3.11's traceback parses source, and ast is not thread-safe
            if not self.stop.is_set():
                self.errors.append((group, error))
            self.slots.active[group] = False  # the others are served without waiting for it

    def failure(self, timeout_s: float) -> str | None:
        if self.errors:
            group, error = self.errors[0]
            tb = "".join(traceback.format_exception(error)).rstrip()
            return f"env group {group} (central acting) raised:\n{tb}"
        silent = (hung(f"env group {g} (central acting)", beat, timeout_s) for g, beat in enumerate(self.heartbeat))
        return next((s for s in silent if s is not None), None)

    def pids(self) -> list[int | None]:
        return [p.pid for w in self.workers for p in getattr(w.collector.env, "processes", [])]

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=10.0)
        sys.setswitchinterval(self._switch_interval)
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


class CentralPool(Pool):
    """``job``'s env groups (threads or processes, ``acting.central_groups``) acting through one batched
    policy: ``agent`` (the module being trained) itself, or its acting copy in the inference process.
    Its :attr:`sources`: the groups, then the inference process (processes only)."""

    def __init__(self, job: ActingJob, agent: Any) -> None:
        settings, count = job.settings, job.settings.num_actors
        super().__init__(settings.timeout_s)
        deadline_s, processes = settings.deadline_ms / 1000.0, settings.central_groups == "processes"
        if processes and agent_device(agent).type != "cpu":
            raise ValueError(
                f"acting.central_groups: processes acts with a CPU copy in a process of its own, but the learner is "
                f"on {agent_device(agent)}: use central_groups: threads there (the policy stays on the learner's device)"
            )
        self.copies_weights, self.version = processes, job.version  # the inference process acts with copies
        acting: Any = agent.acting_copy().cpu() if processes else agent
        if not processes and isinstance(agent, nn.Module):
            acting = acting_view(agent).eval()
        semaphore = tmp.get_context("spawn").Semaphore if processes else threading.Semaphore
        self.slots = make_slots(
            acting, env_spec(job.actor_env()).observation_space, count, job.envs_per_actor, semaphore
        )
        self.permits = ChunkPermits(count, settings.queue_size or count, semaphore)
        self.groups: SpawnedWorkers | GroupThreads
        if not processes:
            self.groups = GroupThreads(
                job, self.slots, Rounds(acting, self.slots, deadline_s, lambda: self.version), self.permits.semaphores
            )
            self.sources = [self.groups]
            return
        self.store = WeightStore(acting, job.version)
        args = (job, self.store, self.slots, deadline_s)
        inference = SpawnedWorkers(_inference_main, args, 1, 1, "central inference process")
        try:
            args = (job, self.slots, self.permits.semaphores)
            self.groups = SpawnedWorkers(_group_main, args, count, count, "env group {} (central acting)")
        except BaseException:
            inference.close()
            raise
        self.sources = [self.groups, inference]

    @property
    def groups_per_act(self) -> float | None:
        """Env groups answered per policy call so far (``None`` before the first call)."""
        calls, requests = (int(x) for x in self.slots.served)
        return requests / calls if calls else None

    def taken(self, chunk: Chunk) -> None:
        self.permits.taken(chunk.actor)  # the next group in turn may start a chunk

    def publish(self, weights: Mapping[str, Tensor] | nn.Module | None, version: int) -> None:
        """The learner's version now; with groups in processes, the weights the next policy call takes."""
        self.version = int(version)
        if weights is not None and self.copies_weights:
            self.store.publish(weights, version)
