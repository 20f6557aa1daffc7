"""A hand-stepped env and an agent whose rows can be predicted by hand, for tests of collection
and batching (the rows they make are spelled out by ``expected_rows`` in tests/test_collector.py)."""

import gymnasium as gym
import numpy as np
import torch


class CountdownEnv(gym.Env):
    """obs = [episode id, step]; reward = 10 * step + action; terminates after ``length``
    steps, or truncates there when ``truncate``."""

    observation_space = gym.spaces.Box(-1e6, 1e6, (2,), np.float32)
    action_space = gym.spaces.Discrete(3)

    def __init__(self, length: int, truncate: bool = False):
        self.length, self.truncate, self.episode, self.t = length, truncate, -1, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode += 1
        self.t = 0
        return np.array([self.episode, 0], np.float32), {}

    def step(self, action):
        self.t += 1
        done = self.t >= self.length
        obs = np.array([self.episode, self.t], np.float32)
        return obs, float(10 * self.t + action), done and not self.truncate, done and self.truncate, {}


class CountingAgent:
    """Acts ``step % 3``; its state counts calls since the last reset (to check resets)."""

    def initial_state(self, batch_size):
        return torch.zeros(batch_size, dtype=torch.long)

    def act(self, obs, state, explore):
        action = obs[:, 1].long() % 3
        return action, state + 1, {"calls": state.float()}


def countdown_envs(lengths, truncate=False):
    """A vector env of ``CountdownEnv`` of the given lengths, autoresetting on the next step."""
    return gym.vector.SyncVectorEnv(
        [lambda n=n: CountdownEnv(n, truncate) for n in lengths],
        autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP,
    )
