"""One source's work: :class:`ActingJob` (what every source of a fit is built from; picklable, it
travels to processes and Ray actors) and :class:`ActorWorker` (a Collector over the source's own
vector env, random steps first) that actors and central env groups share.
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

__all__ = ["ActingJob", "ActorWorker", "STARTUP_GRACE_S", "acting_copy_ready", "seed_policy_draws"]

STARTUP_GRACE_S = 60.0  # seconds a source may take to start (spawn, imports, envs) on top of timeout_s


def acting_copy_ready(module: nn.Module) -> nn.Module:
    """A process's policy copy made ready to act: denormals flushed, one torch thread, eval mode, no gradients."""
    runtime.flush_denormals()
    torch.set_num_threads(1)
    return module.requires_grad_(False).eval()


def seed_policy_draws(job: ActingJob, source: int, role: str = "policy") -> None:
    """Seed this process's torch generator, which the policy copy samples its actions from, with
    ``derive_seed(env.seed, role, rank, source)``: each actor process draws its own stream, derived
    from the run's seed like its envs' (without it every process started from a random seed). Call
    it in a source's own process only: env groups as threads share the learner's generator."""
    torch.manual_seed(derive_seed(job.env.seed, role, job.rank, source))


@dataclass(frozen=True)
class ActingJob:
    """What every source of one fit is built from: the env config and the datamodule's ``acting``
    settings, both unchanged, plus the chunk shape (``chunk_length`` steps; ``overlap``: ``+ 1`` row
    shared with the next, unrolls), the DDP ``rank``, the vector steps each source takes with the
    random policy first (``random_steps``; rows of version ``-1``) and the weights' first ``version``."""

    env: EnvConfig
    settings: ActingSettings
    chunk_length: int
    overlap: bool = False
    rank: int = 0
    random_steps: int = 0
    version: int = 0

    def __post_init__(self) -> None:
        if self.settings.num_actors < 1 or self.chunk_length < 1:
            raise ValueError(
                f"sources need acting.num_actors >= 1 and chunks of >= 1 step, got {self.settings.num_actors}, "
                f"{self.chunk_length}"
            )

    @property
    def envs_per_actor(self) -> int:
        """Envs of one source: ``acting.envs_per_actor``, default ``env.num_envs``."""
        return self.settings.envs_per_actor or self.env.num_envs

    def actor_env(self) -> EnvConfig:
        """One source's env: ``env`` with ``envs_per_actor`` envs."""
        return EnvConfig(**{**vars(self.env), "num_envs": self.envs_per_actor})


class ActorWorker:
    """Source ``actor``'s Collector over its own ``envs_per_actor`` envs (first-reset seeds
    ``env_seeds(env.seed, n, "train", rank, actor)``; ``acting.splits`` parts) acting with ``module``:
    a policy copy (:func:`acting_copy_ready`) or a central group's inference client."""

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
