"""Acting in the learner's process (``acting.num_actors: 0``): :class:`InProcessActing`."""

from __future__ import annotations

from typing import Any

from lightning_wm.data.acting.base import NO_AGENT, Acting, Chunk
from lightning_wm.data.collector import Collector, EpisodeStats
from lightning_wm.data.split_collector import SplitCollector, check_splits, make_collector
from lightning_wm.envs import EnvConfig, EnvSpec
from lightning_wm.policies import RandomAgent
from lightning_wm.seeding import derive_seed, env_seeds

__all__ = ["InProcessActing"]


class InProcessActing(Acting):
    """A Collector steps the training envs (``env.num_envs``) with the live module inside the data
    fetch. Deterministic: a seeded run makes the same rows and weights every time. Every row also goes
    to the batch side's buffer as it is made; the batch side asks for an exact number of steps
    (:meth:`collect`, the replay ratio) or for chunks (unrolls).

    Seeds (:mod:`lightning_wm.seeding`, per DDP rank): the envs' first resets from role
    ``train``, the random prefill policy from ``prefill``.

    Args:
        env: the training env config.
        spec: its spaces.
        chunk_length: env steps per :meth:`next_chunk`.
        overlap: chunks of ``chunk_length + 1`` rows sharing a row with the one before.
        splits: the envs in this many equal parts stepped in turn, each part's env step overlapping
            the policy's call for the next (:class:`~lightning_wm.data.split_collector.SplitCollector`).
    """

    def __init__(
        self, env: EnvConfig, spec: EnvSpec, chunk_length: int = 64, overlap: bool = False, splits: int = 1
    ) -> None:
        super().__init__(chunk_length, overlap)
        check_splits(env, splits)
        self.env, self.spec, self.splits = env, spec, splits
        self.collector: Collector | SplitCollector | None = None  # kept (its envs closed) after close(), for its stats
        self.stats = EpisodeStats()  # kept across fits and restored from checkpoints
        self._open = False
        self.agent: Any = None
        self.version = 0
        self._prefill_seed = derive_seed(env.seed, "prefill", 0)

    @property
    def num_streams(self) -> int:
        return self.env.num_envs

    def setup(self, rank: int, rows: Any = None) -> None:
        if self._open:
            return
        self._prefill_seed = derive_seed(self.env.seed, "prefill", rank)
        self.collector = make_collector(
            self.env,
            RandomAgent(self.spec, seed=self._prefill_seed),
            rows,
            env_seeds(self.env.seed, self.env.num_envs, "train", rank),
            self.spec,
            self.splits,
        )
        self.collector.stats = self.stats
        self._open = True

    def attach_agent(self, agent: Any, version: int, random_rows: int = 0) -> None:
        """Keep the live ``agent`` (not a copy: it acts with the weights of the moment)."""
        self.agent, self.version = agent, int(version)

    def _ready(self, agent: Any) -> Collector:
        """The collector, acting with ``agent`` (its recurrent state starts afresh when it takes
        over, e.g. from the random prefill policy)."""
        if not self._open or self.collector is None:
            raise RuntimeError("setup() was not called")
        if agent is None:
            raise RuntimeError(NO_AGENT)
        if self.collector.agent is not agent:
            self.collector.set_agent(agent)
        return self.collector

    def collect_random(self, steps: int) -> None:
        """``steps`` vector steps with a random policy (seeded afresh from ``prefill``): the prefill."""
        self._ready(RandomAgent(self.spec, seed=self._prefill_seed)).collect(steps)

    def collect(self, steps: int) -> None:
        """``steps`` vector steps (``steps * num_envs`` rows) with the attached agent, exploring;
        the agent takes over even for 0 steps."""
        collector = self._ready(self.agent)
        if steps > 0:
            collector.collect(steps, explore=True)

    def next_chunk(self, timeout: float = 0.0) -> Chunk:
        """Act ``chunk_length`` steps now; the rows carry ``policy_version`` (the attached version)."""
        collector = self._ready(self.agent)
        collector.policy_version = self.version
        before = self.stats.env_steps
        rows = collector.collect_chunk(self.chunk_length, explore=True, overlap=self.overlap)
        return Chunk(0, self.version, rows, env_steps=self.stats.env_steps - before)

    @property
    def env_steps(self) -> int:
        return self.stats.env_steps

    def pop_episodes(self) -> list[dict[str, float]]:
        return self.stats.pop_finished()

    def close(self) -> None:
        if self._open and self.collector is not None:
            self.collector.close()
        self._open = False

    def state_dict(self) -> dict[str, Any]:
        return {"stats": self.stats.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "stats" in state:
            self.stats.load_state_dict(state["stats"])
