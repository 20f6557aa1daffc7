"""How rows are made: the acting part of an online datamodule (:mod:`lightning_wm.data.acting.base`).

* :class:`InProcessActing` — a Collector in the learner's process (``acting.num_actors: 0``);
* :class:`ActorActing` — an :class:`ActorPool` of spawned processes or Ray actors, each with a
  policy copy (``acting.policy: copies``);
* :class:`CentralActing` — env groups acting through one batched policy on the learner's device
  (``acting.policy: central``);
* :func:`make_acting` — the one the settings ask for.
"""

from __future__ import annotations

from lightning_wm.data.acting.actors import ActorActing
from lightning_wm.data.acting.base import RANDOM_POLICY_VERSION, Acting, Chunk
from lightning_wm.data.acting.central import CentralActing
from lightning_wm.data.acting.in_process import InProcessActing
from lightning_wm.data.acting.local import WeightStore
from lightning_wm.data.acting.metrics import ActorMetrics
from lightning_wm.data.acting.pool import ActorPool
from lightning_wm.data.acting.worker import ActorError
from lightning_wm.data.settings import ActingSettings
from lightning_wm.envs import EnvConfig, EnvSpec

__all__ = [
    "Acting",
    "ActorActing",
    "ActorError",
    "ActorMetrics",
    "ActorPool",
    "CentralActing",
    "Chunk",
    "InProcessActing",
    "RANDOM_POLICY_VERSION",
    "WeightStore",
    "make_acting",
]


def make_acting(env: EnvConfig, spec: EnvSpec, settings: ActingSettings, chunk_length: int, overlap: bool) -> Acting:
    """In process for ``settings.num_actors == 0``, else actors with policy copies or central
    acting (``settings.policy``); chunks of ``chunk_length`` steps."""
    if settings.num_actors == 0:
        return InProcessActing(env, spec, chunk_length, overlap, settings.splits)
    if settings.policy == "central":
        return CentralActing(env, settings, chunk_length, overlap)
    return ActorActing(env, settings, chunk_length, overlap)
