"""Collector: steps a vector env with any agent and writes rows (see DESIGN.md's row convention).

The vector env must use gymnasium's next-step autoreset (``lightning_wm.envs.make_vector_env``
does): after a row with ``is_last``, the next ``step`` call resets that env and returns its
first observation with reward 0, so every row belongs to exactly one episode.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor

from lightning_wm.data.episodes import EpisodeStore
from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.envs import EnvConfig, EnvSpec, make_vector_env
from lightning_wm.tree import stack, tree_map, where


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
        seed: seed of the first reset (env ``i`` gets ``seed + i``).
    """

    def __init__(
        self,
        env: gym.vector.VectorEnv,
        agent: Any,
        buffer: ReplayBuffer | None = None,
        store: EpisodeStore | None = None,
        seed: int | None = None,
        spec: EnvSpec | None = None,
    ) -> None:
        self.env, self.agent, self.buffer, self.store = env, agent, buffer, store
        self.num_envs = env.num_envs
        self.spec = spec or EnvSpec(env.single_observation_space, env.single_action_space)
        self.seed = seed
        self.stats = EpisodeStats()
        self._obs: np.ndarray | None = None
        self._state: Any = None
        self._keep: np.ndarray | None = None  # [num_envs] envs whose finished episodes count (None: all)

    # ----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start fresh episodes in every env (the next row of each is ``is_first``)."""
        obs, _ = self.env.reset(seed=self.seed)
        self.seed = None  # seed only the first reset; later episodes continue the env RNG
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

    def set_agent(self, agent: Any) -> None:
        """Act with ``agent`` from now on (its recurrent state starts afresh)."""
        self.agent = agent
        if self._obs is not None:
            self._state = agent.initial_state(self.num_envs)

    def _device(self) -> torch.device:
        device = getattr(self.agent, "device", None)
        return device if isinstance(device, torch.device) else torch.device("cpu")

    def _zero_action(self, action: np.ndarray) -> np.ndarray:
        action = action.copy()
        action[self._is_last] = 0
        return action

    def _env_action(self, action: np.ndarray) -> np.ndarray:
        if self.spec.discrete:
            return action.astype(np.int64)
        return np.clip(action, self.spec.action_low, self.spec.action_high).astype(np.float32)

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
            is_first = torch.from_numpy(self._is_first)
            if is_first.any():
                self._state = where(is_first, self.agent.initial_state(self.num_envs), self._state)
            obs = tree_map(lambda x: torch.as_tensor(x).to(device), self._obs)
            action, self._state, extras = self.agent.act(obs, self._state, explore)
            action = self._env_action(action.detach().cpu().numpy())
            row = {
                "obs": self._obs,
                "reward": self._reward,
                "is_first": self._is_first,
                "is_last": self._is_last,
                "is_terminal": self._is_terminal,
                "action": self._zero_action(action),
            }
            for key, value in extras.items():
                row[key] = value.detach().cpu().numpy()
            self._record(row, finished)
            obs, reward, terminated, truncated, _ = self.env.step(action)
            self._is_first = self._is_last.copy()
            self._obs = obs
            self._reward = np.where(self._is_first, 0.0, reward).astype(np.float32)
            self._is_last = np.asarray(terminated | truncated, bool) & ~self._is_first
            self._is_terminal = np.asarray(terminated, bool) & ~self._is_first
        return finished

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
                episode = {"return": float(self._episode_return[i]), "length": float(self._episode_length[i]),
                           "env": i}
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


def run_evaluation(config: EnvConfig, agent: Any, episodes: int, num_envs: int, seed: int, explore: bool = False,
                   spec: EnvSpec | None = None, progress: Callable[[int], None] | None = None) -> list[dict[str, float]]:
    """``episodes`` episodes of ``agent`` in fresh envs built from ``config`` (``min(num_envs,
    episodes)`` of them, seeded from ``seed``), closed afterwards; each env gives a fixed share
    (:meth:`Collector.run_episodes`). Returns ``{"return", "length", "env"}`` per episode."""
    cfg = EnvConfig(**{**vars(config), "num_envs": max(1, min(num_envs, episodes)), "seed": seed})
    env = make_vector_env(cfg)
    try:
        return Collector(env, agent, seed=seed, spec=spec).run_episodes(episodes, explore=explore, progress=progress)
    finally:
        env.close()


class RandomAgent:
    """Random actions, optionally temporally correlated.

    ``correlation`` ρ in ``[0, 1)``. By default continuous actions follow an AR(1) process
    ``u_t = ρ u_{t-1} + sqrt(1-ρ²) ε`` clamped to ``[-1, 1]`` and mapped linearly onto the
    action bounds (independent uniform draws when ρ = 0); discrete actions repeat the
    previous action with probability ρ.

    ``action_mean`` / ``action_std`` (continuous actions only, one value per action
    dimension) choose a biased scheme instead: ``a_t = clip(mean + std * x_t, low, high)``
    with ``x_t = ρ x_{t-1} + sqrt(1-ρ²) ε`` an unclamped AR(1) process with stationary
    distribution N(0, 1). Each dimension then sits at ``mean`` on average and crosses a bound
    only as rarely as its z-score says: for CarRacing ``mean [0, 0.15, -0.3]``, ``std [0.3,
    0.1, 0.2]`` steers smoothly, keeps a light gas on ~93% of the steps and brakes on ~7% of
    them (brake > 0 needs ``x > 1.5``), so the car drives along the track instead of braking
    half the time as under the uniform mapping.
    """

    def __init__(
        self,
        spec: EnvSpec,
        correlation: float = 0.0,
        seed: int | None = None,
        action_mean: list[float] | None = None,
        action_std: list[float] | None = None,
    ) -> None:
        if not 0.0 <= correlation < 1.0:
            raise ValueError(f"correlation must be in [0, 1), got {correlation}")
        self.spec, self.correlation = spec, correlation
        self.generator = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
        self.mean = self.std = None
        if action_mean is not None or action_std is not None:
            if spec.discrete:
                raise ValueError("action_mean/action_std apply to continuous actions; this env's actions are discrete")
            dim = spec.action_dim
            mean = torch.as_tensor(action_mean if action_mean is not None else [0.0] * dim, dtype=torch.float32)
            std = torch.as_tensor(action_std if action_std is not None else [1.0] * dim, dtype=torch.float32)
            if mean.shape != (dim,) or std.shape != (dim,):
                raise ValueError(
                    f"action_mean and action_std need one value per action dimension ({dim}); "
                    f"got {list(mean.shape)} and {list(std.shape)}"
                )
            if (std < 0).any():
                raise ValueError(f"action_std must be >= 0, got {std.tolist()}")
            self.mean, self.std = mean, std

    def initial_state(self, batch_size: int) -> Tensor:
        if self.spec.discrete:
            return torch.randint(self.spec.action_dim, (batch_size,), generator=self.generator)
        if self.mean is not None:
            return torch.randn(batch_size, self.spec.action_dim, generator=self.generator)
        return torch.rand(batch_size, self.spec.action_dim, generator=self.generator) * 2 - 1

    def act(self, obs: Tensor, state: Tensor, explore: bool = True) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        batch, rho = state.shape[0], self.correlation
        if self.spec.discrete:
            fresh = torch.randint(self.spec.action_dim, (batch,), generator=self.generator)
            keep = torch.rand(batch, generator=self.generator) < rho
            action = torch.where(keep, state, fresh)
            return action, action, {}
        low, high = torch.from_numpy(self.spec.action_low), torch.from_numpy(self.spec.action_high)
        if self.mean is not None:
            noise = torch.randn(batch, self.spec.action_dim, generator=self.generator)
            x = rho * state + (1 - rho**2) ** 0.5 * noise
            return torch.maximum(torch.minimum(self.mean + self.std * x, high), low), x, {}
        noise = torch.randn(batch, self.spec.action_dim, generator=self.generator)
        u = (rho * state + (1 - rho**2) ** 0.5 * noise).clamp(-1, 1) if rho > 0 else torch.rand(
            batch, self.spec.action_dim, generator=self.generator
        ) * 2 - 1
        action = low + (u + 1) / 2 * (high - low)
        return action, u, {}
