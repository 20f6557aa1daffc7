"""One source's work, shared by every mode that acts outside the data fetch: :class:`ActingJob` (what
every source of a fit is built from; picklable, it travels to actor and group processes and Ray
actors) and :class:`ActorWorker` (a Collector over its own vector env, random steps first).

A source (an actor, or a central env group) owns a vector env of ``envs_per_actor`` envs (first-reset
seeds ``seeding.env_seeds(env.seed, n, "train", rank, actor)``, distinct across sources and DDP
ranks) and an agent: a CPU policy copy, or central inference's client. It sends chunks of rows
``[T, N_envs, ...]`` (the row convention, agent extras and a ``policy_version`` column) with the
episodes it finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_wm import runtime
from lightning_wm.data.acting.base import RANDOM_POLICY_VERSION, Chunk
from lightning_wm.data.settings import ActingSettings
from lightning_wm.data.split_collector import make_collector
from lightning_wm.envs import EnvConfig, EnvSpec, env_spec
from lightning_wm.policies import RandomAgent
from lightning_wm.seeding import derive_seed, env_seeds

__all__ = ["ActingJob", "ActorWorker", "STARTUP_GRACE_S", "acting_copy_ready"]

STARTUP_GRACE_S = 60.0  # seconds a source may take to start (spawn, imports, envs) on top of timeout_s


def acting_copy_ready(module: nn.Module) -> nn.Module:
    """A process's policy copy made ready to act: denormals flushed, one torch thread, eval mode, no gradients."""
    runtime.flush_denormals()
    torch.set_num_threads(1)
    return module.requires_grad_(False).eval()


@dataclass(frozen=True)
class ActingJob:
    """What every source of one fit's acting is built from: the env config and the datamodule's
    ``acting`` settings, both unchanged, and what the datamodule decides (picklable).

    Attributes:
        env: the training env config (``num_envs`` is replaced by ``envs_per_actor`` per source).
        settings: the datamodule's acting group.
        chunk_length: env steps per chunk.
        overlap: chunks of ``chunk_length + 1`` rows, consecutive ones sharing a row (unrolls).
        rank: the DDP rank (seeds).
        random_steps: vector steps each source takes with the random policy first (prefill);
            their rows carry ``policy_version`` ``-1``.
        version: the version of the weights the sources start with.
    """

    env: EnvConfig
    settings: ActingSettings
    chunk_length: int
    overlap: bool = False
    rank: int = 0
    random_steps: int = 0
    version: int = 0

    @property
    def envs_per_actor(self) -> int:
        """Envs of one source: ``acting.envs_per_actor``, default ``env.num_envs``."""
        return self.settings.envs_per_actor or self.env.num_envs

    def actor_env(self) -> EnvConfig:
        """One source's env: ``env`` with ``envs_per_actor`` envs."""
        return EnvConfig(**{**vars(self.env), "num_envs": self.envs_per_actor})


class ActorWorker:
    """A source's Collector: its own vector env, the agent it acts with, random steps first.

    ``module`` is any :class:`~lightning_wm.protocols.Agent`: an actor process's frozen CPU copy
    (:func:`acting_copy_ready` prepares it), or a central env group's inference client; its envs
    in ``acting.splits`` parts (policy copies only: the settings refuse splits for central groups).
    """

    def __init__(self, actor: int, job: ActingJob, module: Any) -> None:
        self.actor, self.job, self.module = actor, job, module
        env_cfg = job.actor_env()
        self.spec: EnvSpec = env_spec(env_cfg)
        seeds = env_seeds(job.env.seed, job.envs_per_actor, "train", job.rank, actor)
        self.collector = make_collector(env_cfg, module, None, seeds, self.spec, job.settings.splits)
        self.random_left = job.random_steps
        if self.random_left > 0:
            seed = derive_seed(job.env.seed, "prefill", job.rank, actor)
            self.collector.set_agent(RandomAgent(self.spec, seed=seed))

    def chunk(self, version: int) -> Chunk:
        """Act for one chunk with the weights of ``version`` (already in ``module``)."""
        collector, job = self.collector, self.job
        if self.random_left <= 0 and collector.agent is not self.module:
            collector.set_agent(self.module)
        random = self.random_left > 0
        collector.policy_version = RANDOM_POLICY_VERSION if random else version
        steps = min(job.chunk_length, self.random_left) if random and not job.overlap else job.chunk_length
        before = collector.stats.env_steps
        start = time.perf_counter()
        rows = collector.collect_chunk(steps, explore=True, overlap=job.overlap)
        made = collector.stats.env_steps - before
        self.random_left -= made // job.envs_per_actor
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
