"""Collector: steps a vector env with any agent and writes rows (the row convention of docs/architecture.md).

The vector env must use gymnasium's next-step autoreset (``lightning_wm.envs.make_vector_env``
does): after a row with ``is_last``, the next ``step`` call resets that env and returns its
first observation with reward 0, so every row belongs to exactly one episode.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from lightning_wm.actions import ActionCodec
from lightning_wm.data.episodes import EpisodeStore
from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.envs import EnvConfig, EnvSpec, make_vector_env
from lightning_wm.signals import check_stop
from lightning_wm.tree import stack, tree_map, where


def agent_device(agent: Any) -> torch.device:
    """Where ``agent`` takes its observations: its ``device`` attribute, else the CPU."""
    device = getattr(agent, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")


class EpisodeStats:
    """Env steps taken and the episodes finished since the last :meth:`pop_finished`."""

    def __init__(self, window: int = 100) -> None:
        self.env_steps = 0
        self.episodes = 0
        self.recent: deque[dict[str, float]] = deque(maxlen=window)
        self._unread: list[dict[str, float]] = []

    def add_episode(self, episode_return: float, length: int) -> None:
        record = {"return": float(episode_return), "length": float(length)}
        self.episodes += 1
        self.recent.append(record)
        self._unread.append(record)

    def pop_finished(self) -> list[dict[str, float]]:
        out, self._unread = self._unread, []
        return out

    def mean_return(self) -> float:
        return float(np.mean([r["return"] for r in self.recent])) if self.recent else float("nan")

    def state_dict(self) -> dict[str, int]:
        return {"env_steps": self.env_steps, "episodes": self.episodes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.env_steps, self.episodes = int(state["env_steps"]), int(state["episodes"])


class Collector:
    """Steps ``env`` (a gymnasium VectorEnv) with ``agent`` and records rows.

    Args:
        env: vector env with next-step autoreset.
        agent: anything with ``initial_state(batch_size)`` and ``act(obs, state, explore)``.
        buffer: rows are added here (one entry per env) if given.
        store: finished episodes are written here if given.
        seeds: seeds of the first reset, one per env (``lightning_wm.seeding.env_seeds``), or
            one int (env ``i`` gets ``seeds + i``, gymnasium's convention); later episodes
            continue each env's RNG.
        spec: the env's spaces (read from ``env`` if not given).

    Attributes:
        policy_version: when not ``None``, every row gets a ``policy_version`` int64 column
            with this value (actors set it to the weight version they act with).
    """

    def __init__(
        self,
        env: gym.vector.VectorEnv,
        agent: Any,
        buffer: ReplayBuffer | None = None,
        store: EpisodeStore | None = None,
        seeds: int | list[int] | None = None,
        spec: EnvSpec | None = None,
    ) -> None:
        self.env, self.agent, self.buffer, self.store = env, agent, buffer, store
        self.num_envs = env.num_envs
        self.spec = spec or EnvSpec(env.single_observation_space, env.single_action_space)
        if isinstance(seeds, (list, tuple)):
            if len(seeds) != self.num_envs:
                raise ValueError(f"got {len(seeds)} seeds for a vector env of {self.num_envs} envs; give one per env")
            seeds = [int(s) for s in seeds]
        self.actions = ActionCodec(self.spec)
        self.seeds = seeds
        self.policy_version: int | None = None
        self.stats = EpisodeStats()
        self._obs: np.ndarray | None = None
        self._state: Any = None
        self._keep: np.ndarray | None = None  # [num_envs] envs whose finished episodes count (None: all)
        self._last_row: dict[str, Any] | None = None  # the newest row (the overlap of the next unroll)
        self._in_flight: np.ndarray | None = None  # the actions of an env step sent and not yet received

    # ----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start fresh episodes in every env (the next row of each is ``is_first``)."""
        self._receive()
        obs, _ = self.env.reset(seed=self.seeds)
        self.seeds = None  # seed only the first reset; later episodes continue the env RNG
        n = self.num_envs
        self._obs = obs
        self._reward = np.zeros(n, np.float32)
        self._is_first = np.ones(n, bool)
        self._is_last = np.zeros(n, bool)
        self._is_terminal = np.zeros(n, bool)
        self._state = self.agent.initial_state(n)
        self._episode_return = np.zeros(n, np.float64)
        self._episode_length = np.zeros(n, np.int64)
        self._episodes: list[list[dict[str, np.ndarray]]] = [[] for _ in range(n)]
        self._last_row = None

    def set_agent(self, agent: Any) -> None:
        """Act with ``agent`` from now on (its recurrent state starts afresh)."""
        self.agent = agent
        if self._obs is not None:
            self._state = agent.initial_state(self.num_envs)

    def _device(self) -> torch.device:
        return agent_device(self.agent)

    def _zero_on_last(self, value: np.ndarray) -> np.ndarray:
        """A copy of ``value [N, ...]`` with the entries of envs on a last row zeroed: no action is
        taken there, so neither the action nor what the agent computed for it is data."""
        value = np.array(value, copy=True)
        value[self._is_last] = 0
        return value

    def _step(self, explore: bool, device: torch.device) -> dict[str, Any]:
        """Act in every env once; returns the row of the observation acted on ([N, ...] leaves)."""
        row = self._act(explore, device)
        self._receive()
        return row

    def _act(self, explore: bool, device: torch.device) -> dict[str, Any]:
        """Act on the current observations and send the actions to the envs; returns the row acted
        on. The env step runs on while the caller goes on where the env can (``step_async``: gymnasium's
        ``AsyncVectorEnv``, EnvPool); :meth:`_receive` takes its results (the next ``_act`` does)."""
        self._receive()
        is_first = torch.from_numpy(self._is_first)
        if is_first.any():
            self._state = where(is_first, self.agent.initial_state(self.num_envs), self._state)
        obs = tree_map(lambda x: torch.as_tensor(x).to(device), self._obs)
        action, self._state, extras = self.agent.act(obs, self._state, explore)
        action = self.actions.clip(action.detach().cpu().numpy())
        row: dict[str, Any] = {
            "obs": self._obs,
            "reward": self._reward,
            "is_first": self._is_first,
            "is_last": self._is_last,
            "is_terminal": self._is_terminal,
            "action": self._zero_on_last(action),
        }
        for key, value in extras.items():
            row[key] = self._zero_on_last(value.detach().cpu().numpy())
        if self.policy_version is not None:
            row["policy_version"] = np.full(self.num_envs, self.policy_version, np.int64)
        step_async = getattr(self.env, "step_async", None)
        if step_async is not None:
            step_async(action)
        self._in_flight = action
        self._last_row = row
        return row

    def _receive(self) -> None:
        """Take the results of the env step :meth:`_act` sent (nothing if none is in flight)."""
        if self._in_flight is None:
            return
        action, self._in_flight = self._in_flight, None
        step_wait = getattr(self.env, "step_wait", None)
        if step_wait is not None:
            obs, reward, terminated, truncated, _ = step_wait()
        else:
            obs, reward, terminated, truncated, _ = self.env.step(action)
        self._is_first = self._is_last.copy()
        self._obs = obs
        self._reward = np.where(self._is_first, 0.0, reward).astype(np.float32)
        self._is_last = np.asarray(terminated | truncated, bool) & ~self._is_first
        self._is_terminal = np.asarray(terminated, bool) & ~self._is_first

    def close(self) -> None:
        """Close the envs (a step in flight is abandoned)."""
        self._in_flight = None
        self.env.close()

    @torch.no_grad()
    def collect(self, num_steps: int, explore: bool = True) -> list[dict[str, float]]:
        """Take ``num_steps`` vector steps (``num_steps * num_envs`` rows).

        Returns the episodes finished during the call as ``{"return", "length"}`` dicts.
        """
        if self._obs is None:
            self.reset()
        finished: list[dict[str, float]] = []
        device = self._device()
        for _ in range(num_steps):
            self._record(self._step(explore, device), finished)
        return finished

    @torch.no_grad()
    def collect_chunk(self, num_steps: int, explore: bool = True, overlap: bool = False) -> dict[str, Any]:
        """Take ``num_steps`` vector steps and return their rows stacked time-major: every leaf
        ``[T, N, ...]`` (numpy; dict observations stay dicts), ``T = num_steps``.

        With ``overlap`` consecutive chunks share one row: chunk ``k`` holds rows ``kT .. kT+T``
        of each env (``T + 1`` rows; the first is the previous chunk's last), the unrolls an
        IMPALA learner bootstraps from. The first chunk then takes ``T + 1`` steps.
        Rows also go to ``buffer``/``store`` if given; finished episodes are in ``stats``.
        """
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if self._obs is None:
            self.reset()
        finished: list[dict[str, float]] = []
        device = self._device()
        rows = [self._last_row] if overlap and self._last_row is not None else []
        while len(rows) < num_steps + (1 if overlap else 0):
            row = self._step(explore, device)
            self._record(row, finished)
            rows.append(row)
        return stack(rows)

    def _record(self, row: dict[str, np.ndarray], finished: list[dict[str, float]]) -> None:
        if self.buffer is not None:
            self.buffer.add(row)
        self.stats.env_steps += self.num_envs
        self._episode_return = np.where(row["is_first"], 0.0, self._episode_return + row["reward"])
        self._episode_length = np.where(row["is_first"], 0, self._episode_length + 1)
        for i in range(self.num_envs):
            if self._keep is not None and not self._keep[i]:
                continue  # this env has given run_episodes its share
            if self.store is not None:
                if row["is_first"][i]:
                    self._episodes[i] = []
                self._episodes[i].append(tree_map(lambda v: np.array(v[i]), row))
            if row["is_last"][i]:
                # length counts actions taken: the rows of the episode minus its first.
                episode = {"return": float(self._episode_return[i]), "length": float(self._episode_length[i]), "env": i}
                self.stats.add_episode(episode["return"], int(episode["length"]))
                finished.append(episode)
                if self.store is not None:
                    self.store.add(stack(self._episodes[i]))
                    self._episodes[i] = []

    def run_episodes(
        self, episodes: int, explore: bool = False, progress: Callable[[int], None] | None = None
    ) -> list[dict[str, float]]:
        """Step until ``episodes`` episodes have finished (counting from now), each env giving a
        fixed share: env ``i`` gives ``episodes // n`` (+1 for ``i < episodes % n``).

        Fixed shares keep the sample unbiased: taking whichever episodes finish first would
        over-represent short ones (a policy's failures) when ``episodes > num_envs``. Episodes
        an env finishes beyond its share are neither returned, counted nor stored.
        """
        if episodes < 1:
            raise ValueError(f"episodes must be >= 1, got {episodes}")
        n = self.num_envs
        share = np.array([episodes // n + (i < episodes % n) for i in range(n)])
        done: list[dict[str, float]] = []
        self._keep = share > 0
        try:
            while len(done) < episodes:
                check_stop()  # a scheduler's stop request ends evaluation episodes at once
                new = self.collect(1, explore=explore)
                for episode in new:
                    share[int(episode["env"])] -= 1
                self._keep = share > 0
                done.extend(new)
                if progress is not None and new:
                    progress(len(new))
        finally:
            self._keep = None
        return done


def run_evaluation(
    config: EnvConfig,
    agent: Any,
    episodes: int,
    num_envs: int,
    seed: int,
    explore: bool = False,
    spec: EnvSpec | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[dict[str, float]]:
    """``episodes`` episodes of ``agent`` in fresh envs built from ``config`` (``min(num_envs,
    episodes)`` of them, seeded from ``seed``), closed afterwards; each env gives a fixed share
    (:meth:`Collector.run_episodes`). Returns ``{"return", "length", "env"}`` per episode."""
    cfg = EnvConfig(**{**vars(config), "num_envs": max(1, min(num_envs, episodes)), "seed": seed})
    env = make_vector_env(cfg)
    try:
        return Collector(env, agent, seeds=seed, spec=spec).run_episodes(episodes, explore=explore, progress=progress)
    finally:
        env.close()
