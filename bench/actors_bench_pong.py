"""Registers ``PongStack-v0`` for bench/actors.py: ALE/Pong-v5 through gymnasium's
``AtariPreprocessing`` (84x84 gray, frame skip 4, no-op starts) and ``FrameStackObservation`` (4),
observed as ``uint8 [84, 84, 4]`` (channels last, lightning_wm's image layout).

``gym.make("actors_bench_pong:PongStack-v0")`` imports this module first, also in actor processes.
"""

import ale_py
import gymnasium as gym
import numpy as np
from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

gym.register_envs(ale_py)


class ChannelsLast(gym.ObservationWrapper):
    """``[k, H, W]`` stacked frames -> ``[H, W, k]``."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        k, h, w = env.observation_space.shape
        self.observation_space = gym.spaces.Box(0, 255, (h, w, k), np.uint8)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.moveaxis(observation, 0, -1))


def make_pong_stack(**kwargs) -> gym.Env:
    env = gym.make("ALE/Pong-v5", frameskip=1, **kwargs)
    return ChannelsLast(FrameStackObservation(AtariPreprocessing(env, frame_skip=4, screen_size=84), 4))


if "PongStack-v0" not in gym.registry:
    gym.register("PongStack-v0", entry_point=make_pong_stack, max_episode_steps=27_000)
