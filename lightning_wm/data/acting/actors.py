"""Acting in actors (``acting.num_actors > 0``): the datamodule's handle on an
:class:`~lightning_wm.data.acting.pool.ActorPool`.

The pool starts at the first agent attached (``AgentPublisher`` attaches when fit starts), with
``module.acting_copy()`` and the random prefill steps each actor takes first; later versions go
out every ``publish_every`` optimizer steps. Chunks the batch side uses count as env steps and
feed :class:`~lightning_wm.data.acting.metrics.ActorMetrics` (policy lag, frames per second,
queue depth, the learner's wait).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from lightning_wm.data.acting.base import Acting, Chunk
from lightning_wm.data.acting.metrics import ActorMetrics
from lightning_wm.data.acting.pool import ActorPool
from lightning_wm.data.settings import ActingSettings
from lightning_wm.envs import EnvConfig
from lightning_wm.protocols import acting_weights

__all__ = ["ActorActing"]


class ActorActing(Acting):
    """``settings.num_actors`` actors of ``envs_per_actor`` envs each (default ``env.num_envs``).

    Args:
        env: the env config of the actors (``num_envs`` is replaced by ``envs_per_actor``).
        settings: the datamodule's acting group.
        chunk_length: env steps per chunk.
        overlap: unroll chunks (``chunk_length + 1`` rows, consecutive ones sharing a row).
    """

    def __init__(self, env: EnvConfig, settings: ActingSettings, chunk_length: int, overlap: bool = False) -> None:
        super().__init__(chunk_length, overlap)
        if settings.num_actors < 1:
            raise ValueError(f"ActorActing needs acting.num_actors >= 1, got {settings.num_actors}")
        self.env, self.settings = env, settings
        self.num_actors = settings.num_actors
        self.envs_per_actor = settings.envs_per_actor or env.num_envs
        self.pool: ActorPool | None = None
        self.published: int | None = None  # newest version sent to the actors
        self.learner_version = 0  # newest version attached (the learner's optimizer steps)
        self.rank = 0
        self.gauges = ActorMetrics()
        self._env_steps = 0

    @property
    def num_streams(self) -> int:
        return self.num_actors * self.envs_per_actor

    @property
    def concurrent_sources(self) -> int:
        return self.num_actors

    def setup(self, rank: int, rows: Any = None) -> None:
        """Remember the rank (the pool starts when an agent is attached); the batch side adds the
        chunks' rows itself, so ``rows`` is not used."""
        self.rank = rank

    def attach_agent(self, agent: Any, version: int, random_rows: int = 0) -> None:
        """Start the actors with ``agent.acting_copy()`` (the first call; each actor first takes
        its share of ``random_rows`` with the random policy), or send a new version if
        ``publish_every`` steps have passed since the last one sent."""
        self.learner_version = int(version)
        if self.pool is None:
            self.pool = ActorPool(
                self.env,
                agent.acting_copy(),
                self.num_actors,
                self.envs_per_actor,
                self.chunk_length,
                seed=self.env.seed,
                rank=self.rank,
                backend=self.settings.backend,
                ray_address=self.settings.ray_address,
                timeout_s=self.settings.timeout_s,
                overlap=self.overlap,
                random_steps=math.ceil(max(0, random_rows) / self.num_streams),
                initial_version=version,
                queue_size=self.settings.queue_size,
                splits=self.settings.splits,
            )
        elif self.publish_due(version):
            self.pool.publish(acting_weights(agent), version)
        else:
            return
        self.published = version

    def publish_due(self, version: int) -> bool:
        """``version`` goes out: none was sent yet, the learner went back (a resume), or
        ``acting.publish_every`` steps have passed since the last one sent."""
        published = self.published
        return published is None or version < published or version - published >= self.settings.publish_every

    def require_pool(self) -> ActorPool:
        if self.pool is None:
            raise RuntimeError(
                "acting.num_actors > 0 but no agent was attached, so no actor was started: the AgentPublisher "
                "callback (lightning_wm.callbacks.AgentPublisher, in default_callbacks() and the CLI's Trainer) "
                "attaches the module when fit starts; add it to your Trainer's callbacks"
            )
        return self.pool

    def next_chunk(self, timeout: float = 0.0) -> Chunk | None:
        return self.require_pool().get(timeout=timeout)

    def streams(self, chunk: Chunk) -> np.ndarray:
        """Actor ``a``'s env ``j`` is stream ``a * envs_per_actor + j``."""
        return np.arange(chunk.actor * self.envs_per_actor, (chunk.actor + 1) * self.envs_per_actor)

    def check(self) -> None:
        self.require_pool().check()

    def received(self, chunk: Chunk) -> None:
        self._env_steps += chunk.env_steps
        self.gauges.chunk(chunk, self.learner_version)

    def batch_done(self, waited_s: float, held: int = 0) -> None:
        self.gauges.queue_depth = self.require_pool().qsize() + held
        self.gauges.waited(waited_s)

    @property
    def env_steps(self) -> int:
        return self._env_steps

    def pop_episodes(self) -> list[dict[str, float]]:
        return self.gauges.pop_episodes()

    def metrics(self) -> dict[str, float]:
        return self.gauges.gauges()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def state_dict(self) -> dict[str, Any]:
        """The rows the actors sent (chunks still queued at a checkpoint are lost: a resumed run
        starts its actors afresh, in new episodes)."""
        return {"actor_rows": self._env_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "actor_rows" in state:
            self._env_steps = int(state["actor_rows"])
