"""Policy copies in Ray actors (``acting.backend: ray``; ``pip install -e ".[ray]"``) on the machines of
a Ray cluster; weights through the object store, chunks returned as object refs collected with
``ray.wait``. ``acting.ray_address``: ``None`` starts a local Ray instance (:func:`start_ray`);
``auto`` or ``host:port`` joins a running cluster."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_wm.data.acting.base import ActorError, Chunk, Pool
from lightning_wm.data.acting.spawned import hung
from lightning_wm.data.acting.worker import (
    STARTUP_GRACE_S,
    ActingJob,
    ActorWorker,
    acting_copy_ready,
    seed_policy_draws,
)
from lightning_wm.signals import reclaim_signals

__all__ = ["RayPool", "start_ray"]


class _RayWorker:
    """The Ray actor: a :class:`ActorWorker` that loads the weights it is handed, chunk by chunk."""

    def __init__(self, actor: int, job: ActingJob, module: nn.Module) -> None:
        seed_policy_draws(job, actor)
        self.worker = ActorWorker(actor, job, acting_copy_ready(module))

    def pid(self) -> int:
        return os.getpid()

    def chunk(self, weights: dict[str, torch.Tensor] | None, version: int) -> Chunk:
        if weights is not None:
            self.worker.module.load_state_dict(weights)
        return self.worker.chunk(version)


def start_ray(address: str | None, num_actors: int) -> tuple[Any, bool]:
    """The ``ray`` module, with Ray started if it was not (``True`` second: this pool started it and
    shuts it down): a local instance with room for every actor, or the cluster at ``address``."""
    try:
        import ray
    except ImportError:
        raise ValueError('acting.backend: ray needs Ray; install the extra: pip install -e ".[ray]"') from None
    if ray.is_initialized():
        return ray, False
    if address is None:
        ray.init(num_cpus=max(num_actors, os.cpu_count() or 1), include_dashboard=False, configure_logging=False)
    else:
        ray.init(address=address, include_dashboard=False, configure_logging=False)
    reclaim_signals()  # ray.init made SIGTERM sys.exit(15): a stop must save last.ckpt first
    return ray, True


class RayPool(Pool):
    """Ray actors with two chunk calls in flight each (one runs while the learner reads the other);
    an actor's results are taken in call order with ``ray.wait`` over each actor's oldest call."""

    def __init__(self, job: ActingJob, module: nn.Module) -> None:
        super().__init__(job.settings.timeout_s)
        num_actors = job.settings.num_actors
        self.ray, self.owns_ray = start_ray(job.settings.ray_address, num_actors)
        remote = self.ray.remote(num_cpus=1)(_RayWorker)
        self.actors = [remote.remote(i, job, module) for i in range(num_actors)]
        self.weights: Any = None
        self.version = job.version
        self.sent = [job.version] * num_actors  # newest version handed to each actor
        self.calls: list[deque[tuple[Any, float]]] = [deque() for _ in range(num_actors)]  # (ref, submitted at)
        self.last_seen = [time.monotonic() + STARTUP_GRACE_S] * num_actors
        for i in range(num_actors):
            for _ in range(2):
                self._submit(i)

    def _submit(self, actor: int) -> None:
        weights = self.weights if self.sent[actor] != self.version else None
        self.sent[actor] = self.version
        self.calls[actor].append((self.actors[actor].chunk.remote(weights, self.version), time.monotonic()))

    def pids(self) -> list[int | None]:
        return list(self.ray.get([a.pid.remote() for a in self.actors], timeout=120))

    def publish(self, weights: Mapping[str, Tensor] | nn.Module | None, version: int) -> None:
        if weights is None:
            return
        state = weights.state_dict() if isinstance(weights, nn.Module) else weights
        self.weights = self.ray.put({k: v.detach().cpu().clone() for k, v in state.items()})
        self.version = int(version)

    def take(self, timeout: float) -> Chunk | None:
        oldest = {calls[0][0]: actor for actor, calls in enumerate(self.calls) if calls}  # ref -> actor
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

    def failure(self) -> str | None:
        now = time.monotonic()
        ready = set(self._ready())
        for actor, calls in enumerate(self.calls):
            if any(ref in ready for ref, _ in calls):
                self.last_seen[actor] = now
            elif calls:
                last = max(calls[0][1], self.last_seen[actor])
                if (silent := hung(f"ray actor {actor}", last, self.timeout_s, sign="chunk")) is not None:
                    return silent
        return None

    def stop(self) -> None:
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:  # noqa: BLE001 - already dead
                pass
        for calls in self.calls:
            calls.clear()
        if self.owns_ray:
            self.ray.shutdown()
