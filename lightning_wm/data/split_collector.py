"""Double-buffered acting (``acting.splits``): the envs in equal parts, their steps overlapping the
policy's calls.

A :class:`~lightning_wm.data.collector.Collector` waits for its envs' step before it acts again. A
:class:`SplitCollector` holds ``K`` Collectors over ``N / K`` envs each and takes them in turn: it
acts for part ``k`` and sends its actions, then takes part ``k + 1``'s results (their step ran
while the policy acted for part ``k``) and acts for it, and so on (Sample Factory's double-buffered
sampling, in one process). It pays where the env step runs outside the interpreter: gymnasium's
``AsyncVectorEnv`` (worker processes) or EnvPool (its own threads). The last parts' steps stay in
flight when a chunk is returned, so the envs also step while the learner trains on it.

The rows are the ones a single Collector over all ``N`` envs makes from the same actions (env
``i`` of part ``k`` is stream ``k * N / K + i``); only the order in which the policy sees the envs
differs, so a sampling policy draws differently than with ``K = 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import torch

from lightning_wm.data.collector import Collector, EpisodeStats
from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.envs import EnvConfig, EnvSpec, make_vector_env
from lightning_wm.tree import concat, stack

__all__ = ["SplitCollector", "check_splits", "make_collector"]


class SplitCollector:
    """``len(envs)`` Collectors stepped in turn, seen as one Collector over all their envs (the
    interface :class:`~lightning_wm.data.acting.InProcessActing` uses: ``collect``,
    ``collect_chunk``, ``set_agent``, ``agent``, ``policy_version``, ``stats``, ``close``).

    Args:
        envs: one vector env per part, all with the same number of envs.
        agent: what every part acts with.
        buffer: every step's row of all parts goes here (``[N, ...]`` leaves) if given.
        seeds: the first reset's seeds, one per env of all parts in order.
        spec: the env's spaces.
    """

    def __init__(
        self,
        envs: Sequence[gym.vector.VectorEnv],
        agent: Any,
        buffer: ReplayBuffer | None = None,
        seeds: Sequence[int] | None = None,
        spec: EnvSpec | None = None,
    ) -> None:
        sizes = {env.num_envs for env in envs}
        if len(sizes) != 1:
            raise ValueError(f"the parts of a SplitCollector need equal env counts, got {[e.num_envs for e in envs]}")
        size = sizes.pop()
        self.num_envs = size * len(envs)
        if seeds is not None and len(seeds) != self.num_envs:
            raise ValueError(f"got {len(seeds)} seeds for {self.num_envs} envs; give one per env")
        self.parts = [
            Collector(env, agent, seeds=None if seeds is None else list(seeds[k * size : (k + 1) * size]), spec=spec)
            for k, env in enumerate(envs)
        ]
        self.buffer = buffer
        self.stats = EpisodeStats()

    @property
    def stats(self) -> EpisodeStats:
        return self._stats

    @stats.setter
    def stats(self, stats: EpisodeStats) -> None:
        """One :class:`EpisodeStats` counts the steps and episodes of every part."""
        self._stats = stats
        for part in self.parts:
            part.stats = stats

    @property
    def agent(self) -> Any:
        return self.parts[0].agent

    def set_agent(self, agent: Any) -> None:
        for part in self.parts:
            part.set_agent(agent)

    @property
    def policy_version(self) -> int | None:
        return self.parts[0].policy_version

    @policy_version.setter
    def policy_version(self, version: int | None) -> None:
        for part in self.parts:
            part.policy_version = version

    def _round(self, explore: bool, finished: list[dict[str, float]]) -> list[dict[str, Any]]:
        """One step of every part in turn; each part's row ``[n, ...]`` (also in ``buffer``, joined)."""
        rows = []
        for k, part in enumerate(self.parts):
            if part._obs is None:
                part.reset()
            row = part._act(explore, part._device())  # takes this part's step results, sends the next step
            done: list[dict[str, float]] = []
            part._record(row, done)
            finished.extend({**episode, "env": episode["env"] + k * part.num_envs} for episode in done)
            rows.append(row)
        if self.buffer is not None:
            self.buffer.add(concat(rows))
        return rows

    @torch.no_grad()
    def collect(self, num_steps: int, explore: bool = True) -> list[dict[str, float]]:
        """``num_steps`` vector steps of all parts (what :meth:`Collector.collect` returns)."""
        finished: list[dict[str, float]] = []
        for _ in range(num_steps):
            self._round(explore, finished)
        return finished

    @torch.no_grad()
    def collect_chunk(self, num_steps: int, explore: bool = True, overlap: bool = False) -> dict[str, Any]:
        """``num_steps`` vector steps as one chunk ``[T, N, ...]`` (:meth:`Collector.collect_chunk`)."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        rows: list[list[dict[str, Any]]] = [
            [part._last_row] if overlap and part._last_row is not None else [] for part in self.parts
        ]
        finished: list[dict[str, float]] = []
        while len(rows[0]) < num_steps + (1 if overlap else 0):
            for part_rows, row in zip(rows, self._round(explore, finished)):
                part_rows.append(row)
        return concat([stack(part_rows) for part_rows in rows], dim=1)

    def close(self) -> None:
        for part in self.parts:
            part.close()


def check_splits(env: EnvConfig, splits: int) -> None:
    """Raise ``ValueError`` (one line: what is wrong, what to do) where ``acting.splits`` cannot pay or apply."""
    if splits < 1:
        raise ValueError(f"acting.splits must be >= 1, got {splits}")
    if splits == 1:
        return
    if env.num_envs % splits:
        raise ValueError(f"acting.splits={splits} must divide env.num_envs={env.num_envs} (the parts are equal)")
    if env.backend != "envpool" and env.vectorization != "async":
        raise ValueError(
            f"acting.splits={splits} overlaps env steps with the policy only where they run outside the interpreter: "
            "set env.vectorization: async or env.backend: envpool, or leave splits at 1"
        )


def make_collector(
    env: EnvConfig,
    agent: Any,
    buffer: ReplayBuffer | None,
    seeds: Sequence[int],
    spec: EnvSpec,
    splits: int = 1,
) -> Collector | SplitCollector:
    """A Collector over ``env.num_envs`` envs built from ``env``, or (``splits > 1``) a
    :class:`SplitCollector` over ``splits`` parts of them; ``seeds``: one per env."""
    check_splits(env, splits)
    if splits == 1:
        return Collector(make_vector_env(env), agent, buffer, seeds=list(seeds), spec=spec)
    part = EnvConfig(**{**vars(env), "num_envs": env.num_envs // splits})
    envs: list[gym.vector.VectorEnv] = []
    try:
        for _ in range(splits):
            envs.append(make_vector_env(part))
    except BaseException:
        for built in envs:
            built.close()
        raise
    return SplitCollector(envs, agent, buffer, seeds, spec)
