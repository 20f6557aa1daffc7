"""Acting with sources that run while the learner trains (``acting.num_actors > 0``): :class:`PoolActing`,
the datamodule's handle on a :class:`~lightning_wm.data.acting.base.Pool`, and the ``actors/*`` gauges
(:class:`ActorMetrics`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
from torch import nn

from lightning_wm.data.acting.base import NO_AGENT, RANDOM_POLICY_VERSION, Acting, Chunk, Pool
from lightning_wm.data.acting.central import CentralPool
from lightning_wm.data.acting.local import LocalPool
from lightning_wm.data.acting.ray_backend import RayPool
from lightning_wm.data.acting.worker import ActingJob
from lightning_wm.data.settings import ActingSettings
from lightning_wm.data.split_collector import check_splits
from lightning_wm.envs import EnvConfig
from lightning_wm.protocols import acting_weights

__all__ = ["ActorMetrics", "PoolActing", "actor_pool"]


class ActorMetrics:
    """Gauges of the actors as the learner sees them, over a sliding window of ``window_s`` seconds.

    * ``actors/frames_per_s``: env steps received per second;
    * ``actors/policy_lag``: learner version minus the version that made the rows (mean over the
      window's chunks; rows of the random prefill policy are not counted);
    * ``actors/queue_depth``: chunks waiting for the learner (latest);
    * ``actors/wait_fraction``: share of the learner's wall time spent waiting for rows;
    * ``actors/batch_wait_ms``: mean wait per batch.
    """

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self.clock = window_s, clock
        self._start = clock()
        # (time, value) per event in the window, with each window's running sum: reading the gauges
        # (twice per learner step) costs O(1), not a pass over the window's thousands of chunks
        self._windows: dict[str, deque[tuple[float, float]]] = {"frames": deque(), "lags": deque(), "waits": deque()}
        self._sums = dict.fromkeys(self._windows, 0.0)
        self.episodes: list[dict[str, float]] = []
        self.queue_depth = 0

    def _add(self, window: str, now: float, value: float) -> None:
        self._windows[window].append((now, value))
        self._sums[window] += value

    def _trim(self, now: float) -> None:
        for name, window in self._windows.items():
            while window and window[0][0] < now - self.window_s:
                self._sums[name] -= window.popleft()[1]
            if not window:
                self._sums[name] = 0.0  # no rounding left over from the values that left

    def chunk(self, chunk: Chunk, learner_version: int) -> None:
        """A chunk reached the learner (its rows are in, its episodes count)."""
        now = self.clock()
        self._add("frames", now, chunk.env_steps)
        if chunk.version != RANDOM_POLICY_VERSION:
            self._add("lags", now, learner_version - chunk.version)
        self.episodes.extend(chunk.episodes)

    def waited(self, seconds: float) -> None:
        """The learner waited ``seconds`` for rows before one batch."""
        self._add("waits", self.clock(), seconds)

    def pop_episodes(self) -> list[dict[str, float]]:
        out, self.episodes = self.episodes, []
        return out

    def gauges(self) -> dict[str, float]:
        now = self.clock()
        self._trim(now)
        span = max(1e-6, min(self.window_s, now - self._start))
        out = {
            "actors/frames_per_s": self._sums["frames"] / span,
            "actors/queue_depth": float(self.queue_depth),
        }
        if lags := len(self._windows["lags"]):
            out["actors/policy_lag"] = self._sums["lags"] / lags
        if waits := len(self._windows["waits"]):
            waited = self._sums["waits"]
            out["actors/wait_fraction"] = min(1.0, waited / span)
            out["actors/batch_wait_ms"] = 1000.0 * waited / waits
        return out


def actor_pool(job: ActingJob, module: nn.Module) -> Pool:
    """Policy copies of ``module`` (a CPU acting copy) in ``acting.num_actors`` actors of the
    settings' backend (``local`` processes or ``ray`` actors)."""
    check_splits(job.actor_env(), job.settings.splits)  # here: one clear line, before any actor starts
    module = module.cpu().eval().requires_grad_(False)
    return RayPool(job, module) if job.settings.backend == "ray" else LocalPool(job, module)


class PoolActing(Acting):
    """``settings.num_actors`` sources, each built from :attr:`job` (:class:`ActingJob`: its envs,
    chunks and seeds)."""

    def __init__(self, env: EnvConfig, settings: ActingSettings, chunk_length: int, overlap: bool = False) -> None:
        super().__init__(chunk_length, overlap)
        self.job = ActingJob(env, settings, self.chunk_length, self.overlap)  # rank, prefill, version: at start
        self.pool: Pool | None = None
        self.agent: Any = None  # the agent the pool was started with
        self.published: int | None = None  # newest version sent to the sources
        self.learner_version = 0  # newest version attached (the learner's optimizer steps)
        self.gauges = ActorMetrics()
        self._env_steps = 0

    @property
    def num_streams(self) -> int:
        return self.job.settings.num_actors * self.job.envs_per_actor

    @property
    def concurrent_sources(self) -> int:
        return self.job.settings.num_actors

    def setup(self, rank: int, rows: Any = None) -> None:
        """Remember the rank (the pool starts when an agent is attached; ``rows`` is not used)."""
        self.job = replace(self.job, rank=rank)

    def attach_agent(self, agent: Any, version: int, random_rows: int = 0) -> None:
        """Start the sources (the first call, or a new agent for sources that act with the live
        module; each source first takes its share of ``random_rows`` with the random policy), or
        publish: the version to sources acting with the live module, the weights
        (:func:`~lightning_wm.protocols.acting_weights`) to copies every ``publish_every`` steps."""
        self.learner_version = version = int(version)
        pool = self.pool
        if pool is None or (not pool.copies_weights and agent is not self.agent):
            self.close()
            self.agent = agent
            random_steps = math.ceil(max(0, random_rows) / self.num_streams)
            job = replace(self.job, random_steps=random_steps, version=version)
            self.pool = (
                CentralPool(job, agent) if job.settings.policy == "central" else actor_pool(job, agent.acting_copy())
            )
        elif not pool.copies_weights:
            pool.publish(None, version)
        elif self.publish_due(version):
            pool.publish(acting_weights(agent), version)
        else:
            return
        self.published = version

    def publish_due(self, version: int) -> bool:
        """``version`` goes out: none was sent yet, the learner went back (a resume), or
        ``acting.publish_every`` steps have passed since the last one sent."""
        published = self.published
        return published is None or version < published or version - published >= self.job.settings.publish_every

    def require_pool(self) -> Pool:
        if self.pool is None:
            raise RuntimeError(f"acting.num_actors > 0 but no actor was started: {NO_AGENT}")
        return self.pool

    def next_chunk(self, timeout: float = 0.0) -> Chunk | None:
        return self.require_pool().get(timeout=timeout)

    def streams(self, chunk: Chunk) -> np.ndarray:
        """Source ``a``'s env ``j`` is stream ``a * envs_per_actor + j``."""
        return np.arange(chunk.actor * self.job.envs_per_actor, (chunk.actor + 1) * self.job.envs_per_actor)

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
        """The sources' gauges; central acting's also ``actors/groups_per_act`` (groups per policy call)."""
        out = self.gauges.gauges()
        if isinstance(self.pool, CentralPool) and (per_act := self.pool.groups_per_act) is not None:
            out["actors/groups_per_act"] = per_act
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def state_dict(self) -> dict[str, Any]:
        """The rows the sources sent (queued chunks are lost: a resumed run starts afresh)."""
        return {"actor_rows": self._env_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "actor_rows" in state:
            self._env_steps = int(state["actor_rows"])
