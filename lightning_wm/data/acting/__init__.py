"""How rows are made: the acting part of an online datamodule (:class:`~lightning_wm.data.acting.base.Acting`).

* :class:`InProcessActing` — a Collector in the learner's process (``acting.num_actors: 0``);
* :class:`PoolActing` — a :class:`Pool` of sources acting while the learner trains: actor
  processes or Ray actors with policy copies (``acting.policy: copies``), or env groups (threads or
  processes) acting through central inference (``acting.policy: central``);
* :func:`make_acting` — the one the settings ask for.
"""

from __future__ import annotations

from lightning_wm.data.acting.base import RANDOM_POLICY_VERSION, Acting, ActorError, Chunk, Pool
from lightning_wm.data.acting.in_process import InProcessActing
from lightning_wm.data.acting.local import WeightStore
from lightning_wm.data.acting.pools import ActorMetrics, PoolActing, actor_pool
from lightning_wm.data.acting.worker import ActingJob
from lightning_wm.data.settings import ActingSettings
from lightning_wm.envs import EnvConfig, EnvSpec

__all__ = [
    "Acting",
    "ActingJob",
    "ActorError",
    "ActorMetrics",
    "Chunk",
    "InProcessActing",
    "Pool",
    "PoolActing",
    "RANDOM_POLICY_VERSION",
    "WeightStore",
    "actor_pool",
    "make_acting",
]


def make_acting(env: EnvConfig, spec: EnvSpec, settings: ActingSettings, chunk_length: int, overlap: bool) -> Acting:
    """In process for ``settings.num_actors == 0``, else a pool of actors (policy copies) or of
    central acting's env groups (``settings.policy``); chunks of ``chunk_length`` steps."""
    if settings.num_actors == 0:
        return InProcessActing(env, spec, chunk_length, overlap, settings.splits)
    return PoolActing(env, settings, chunk_length, overlap)
