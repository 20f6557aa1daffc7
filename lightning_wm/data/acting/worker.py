"""One actor's work, shared by both backends: its config (picklable, it travels to the actors)
and its Collector (:class:`ActorWorker`): its own vector env, a copy of the agent, random steps first.

An actor owns a vector env of ``envs_per_actor`` envs (first-reset seeds
``seeding.env_seeds(seed, n, "train", rank, actor)``, distinct across actors and DDP ranks) and
a CPU copy of the agent (``ActingAgent.acting_copy()``, one torch thread). It sends chunks of
rows ``[T, N_envs, ...]`` (the row convention, agent extras and a ``policy_version`` column)
with the episodes it finished, and pulls the newest weights between chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_wm import runtime
from lightning_wm.data.acting.base import RANDOM_POLICY_VERSION, Chunk
from lightning_wm.data.split_collector import make_collector
from lightning_wm.envs import EnvConfig, EnvSpec, env_spec
from lightning_wm.policies import RandomAgent
from lightning_wm.seeding import derive_seed, env_seeds

__all__ = ["ActorConfig", "ActorError", "ActorWorker", "STARTUP_GRACE_S", "acting_copy_ready"]

STARTUP_GRACE_S = 60.0  # seconds an actor may take to start (spawn, imports, envs) on top of timeout_s


def acting_copy_ready(module: nn.Module) -> nn.Module:
    """An actor process's copy made ready to act: denormals flushed, one torch thread, eval mode, no gradients."""
    runtime.flush_denormals()
    torch.set_num_threads(1)
    return module.requires_grad_(False).eval()


class ActorError(RuntimeError):
    """An actor raised, died or hung. The message names the actor and carries its traceback."""


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
    splits: int = 1  # the actor's envs in this many parts stepped in turn (acting.splits; SplitCollector)

    def actor_env(self) -> EnvConfig:
        """One actor's env: ``env`` with ``envs_per_actor`` envs."""
        return EnvConfig(**{**vars(self.env), "num_envs": self.envs_per_actor})


class ActorWorker:
    """An actor's Collector: its own vector env, the agent it acts with, random steps first.

    ``module`` is any :class:`~lightning_wm.protocols.Agent`: an actor process's frozen CPU copy
    (:func:`acting_copy_ready` prepares it), or a central env group's inference client.
    """

    def __init__(self, actor: int, config: ActorConfig, module: Any) -> None:
        self.actor, self.config, self.module = actor, config, module
        env_cfg = config.actor_env()
        self.spec: EnvSpec = env_spec(env_cfg)
        seeds = env_seeds(config.seed, config.envs_per_actor, "train", config.rank, actor)
        self.collector = make_collector(env_cfg, module, None, seeds, self.spec, config.splits)
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
        self.collector.close()
