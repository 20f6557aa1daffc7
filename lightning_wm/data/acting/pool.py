"""Acting outside the learner: a pool of actors that each run a :class:`~lightning_wm.data.collector.Collector`.

Two backends with one interface (:class:`ActorPool`): ``local`` (spawned processes,
:mod:`lightning_wm.data.acting.local`) and ``ray`` (Ray actors,
:mod:`lightning_wm.data.acting.ray_backend`). The learner turns an actor's exception (with its
traceback), an actor that died, or one whose heartbeat stopped for ``timeout_s`` into one
:class:`~lightning_wm.data.acting.worker.ActorError` naming the actor, after stopping the others.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from torch import Tensor, nn

from lightning_wm.data.acting.base import Chunk, wait_for_chunk
from lightning_wm.data.acting.local import LocalBackend
from lightning_wm.data.acting.ray_backend import RayBackend
from lightning_wm.data.acting.worker import ActorConfig, ActorError
from lightning_wm.data.split_collector import check_splits
from lightning_wm.envs import EnvConfig

__all__ = ["ActorPool"]


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
        splits: int = 1,
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
            env, envs_per_actor, chunk_length, seed, rank, overlap, random_steps, explore, initial_version, splits
        )
        check_splits(config.actor_env(), splits)  # here: one clear line, before any actor starts
        acting_module = acting_module.cpu().eval().requires_grad_(False)
        if backend == "local":
            self._impl: Any = LocalBackend(config, acting_module, num_actors, queue_size or 2 * num_actors)
        elif backend == "ray":
            self._impl = RayBackend(config, acting_module, num_actors, ray_address)
        else:
            raise ValueError(f"acting.backend must be 'local' or 'ray', got {backend!r}")
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

    def publish(self, weights: Mapping[str, Tensor] | nn.Module, version: int) -> None:
        """Make ``weights`` (an acting copy's ``state_dict``, :func:`~lightning_wm.protocols.acting_weights`,
        or the copy itself) the newest, as ``version``."""
        self._impl.publish(weights, version)

    def qsize(self) -> int:
        """Chunks waiting for the learner."""
        return self._impl.qsize()

    def get(self, timeout: float = 0.0) -> Chunk | None:
        """The next chunk, waiting up to ``timeout`` seconds; ``None`` if none came.

        Raises:
            ActorError: an actor raised (its traceback in the message), died or hung; the
                pool is closed first.
            RunStopped: a stop was requested (a scheduler's signal) while waiting.
        """
        return wait_for_chunk(self._take, self.check, timeout)

    def _take(self, timeout: float) -> Chunk | None:
        try:
            return self._impl.get(timeout)
        except ActorError:
            self.close()
            raise

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
