"""The ``ray`` actor backend: Ray actors (``pip install -e ".[ray]"``) on the machines of a Ray
cluster; weights through the object store, chunks returned as object refs collected with ``ray.wait``."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_wm.data.acting.base import Chunk
from lightning_wm.data.acting.worker import STARTUP_GRACE_S, ActorConfig, ActorError, ActorWorker, acting_copy_ready
from lightning_wm.signals import reclaim_signals

__all__ = ["RayBackend"]


class _RayWorker:
    """The Ray actor: a :class:`ActorWorker` that loads the weights it is handed, chunk by chunk."""

    def __init__(self, actor: int, config: ActorConfig, module: nn.Module) -> None:
        self.worker = ActorWorker(actor, config, acting_copy_ready(module))

    def pid(self) -> int:
        return os.getpid()

    def chunk(self, weights: dict[str, torch.Tensor] | None, version: int) -> Chunk:
        if weights is not None:
            self.worker.module.load_state_dict(weights)
        return self.worker.chunk(version)


class RayBackend:
    """Ray actors with two chunk calls in flight each (one runs while the learner reads the other);
    an actor's results are taken in call order with ``ray.wait`` over each actor's oldest call."""

    def __init__(self, config: ActorConfig, module: nn.Module, num_actors: int, address: str | None) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError('acting.backend: ray needs Ray; install the extra: pip install -e ".[ray]"') from None
        self.ray = ray
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            if address is None:  # a local instance, with room for every actor
                ray.init(
                    num_cpus=max(num_actors, os.cpu_count() or 1), include_dashboard=False, configure_logging=False
                )
            else:
                ray.init(address=address, include_dashboard=False, configure_logging=False)
            reclaim_signals()  # ray.init made SIGTERM sys.exit(15): a stop must save last.ckpt first
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

    def publish(self, weights: Mapping[str, Tensor] | nn.Module, version: int) -> None:
        state = weights.state_dict() if isinstance(weights, nn.Module) else weights
        self.weights = self.ray.put({k: v.detach().cpu().clone() for k, v in state.items()})
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
                        f"ray actor {actor} hung: no chunk for {silent:.1f} s (acting.timeout_s={timeout_s:g}); "
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
