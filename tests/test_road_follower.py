"""RoadFollower, the CarRacing data agent that follows the road in the 64x64 frame."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from lightning_wm.agents.worldmodels.road_follower import RoadFollower, road_offsets, speed_bar
from lightning_wm.envs import EnvSpec

CARRACING = EnvSpec(
    gym.spaces.Box(0, 255, (64, 64, 3), np.uint8),
    gym.spaces.Box(np.array([-1.0, 0.0, 0.0], np.float32), np.ones(3, np.float32)),
    "CarRacing-v3",
)
GRASS, ROAD = (102, 204, 102), (105, 105, 105)


def frame(road_from: int, bar: int = 0) -> np.ndarray:
    """Grass with a 12-column road from column ``road_from`` and a speed bar of brightness ``bar``."""
    f = np.zeros((64, 64, 3), np.uint8)
    f[:56] = GRASS
    f[:56, road_from : road_from + 12] = ROAD
    f[56:, 8:10] = bar
    return f


def test_offsets_and_speed_read_from_the_frame():
    frames = np.stack([frame(26), frame(40, bar=200)])  # centred road; road right, fast
    far, near = road_offsets(frames)
    np.testing.assert_allclose(far, [0.0, 14.0])
    np.testing.assert_allclose(near, [0.0, 14.0])
    np.testing.assert_allclose(speed_bar(frames), [0.0, 200.0])
    no_road = np.zeros((1, 64, 64, 3), np.uint8)
    assert road_offsets(no_road)[0][0] == 0.0


def test_steers_to_the_road_and_holds_the_speed():
    agent = RoadFollower(CARRACING, steer_gain=0.1, speed=(60.0, 30.0), gas=0.25, brake=0.3, seed=0)
    obs = torch.from_numpy(np.stack([frame(26), frame(40, bar=200), frame(10, bar=40)]))
    action, state, extras = agent.act(obs, agent.initial_state(3))
    assert action.shape == (3, 3) and action.dtype == torch.float32 and state.shape == (3, 2) and extras == {}
    torch.testing.assert_close(action[0], torch.tensor([0.0, 0.25, 0.0]))  # straight road, slow: gas
    torch.testing.assert_close(action[1], torch.tensor([1.0, 0.0, 0.3]))  # road right (clipped), too fast
    # road 15.5 columns left: a bend (target 30, 1.3 x 30 < 40): no gas, brake
    torch.testing.assert_close(action[2], torch.tensor([-1.0, 0.0, 0.3]))


def test_noise_varies_the_steering_and_bad_shapes_are_refused():
    agent = RoadFollower(CARRACING, steer_noise=0.3, seed=0)
    obs = torch.from_numpy(np.stack([frame(26)] * 64))
    steer = agent.act(obs, agent.initial_state(64))[0][:, 0]
    assert 0.15 < float(steer.std()) < 0.45
    small = EnvSpec(gym.spaces.Box(0, 255, (96, 96, 3), np.uint8), CARRACING.action_space, "CarRacing-v3")
    with pytest.raises(ValueError, match="64, 64, 3"):
        RoadFollower(small)


def test_pedal_noise_pushes_the_gas_or_the_brake_and_is_off_by_default():
    obs = torch.from_numpy(np.stack([frame(26)] * 256))  # straight road, slow: gas 0.25, no brake
    quiet = RoadFollower(CARRACING, steer_noise=0.3, seed=0)
    state = quiet.initial_state(256)
    assert not state[:, 1].any()
    pedals = quiet.act(obs, state)[0][:, 1:]
    assert (pedals[:, 0] == 0.25).all() and (pedals[:, 1] == 0).all()
    noisy = RoadFollower(CARRACING, steer_noise=0.3, pedal_noise=0.5, seed=0)
    action, state, _ = noisy.act(obs, noisy.initial_state(256))
    gas, brake = action[:, 1], action[:, 2]
    push = 0.5 * state[:, 1].float()
    torch.testing.assert_close(gas, (0.25 + push.clamp(min=0)).clamp(max=1.0))
    torch.testing.assert_close(brake, (-push).clamp(min=0, max=1.0))
    assert 0.3 < float((brake > 0).float().mean()) < 0.7 and float(gas.max()) > 0.9
