"""``MinAtarVectorEnv``: MinAtar ids stepped in one loop give what gymnasium's sync vector env over
``make_env``'s envs gives, bit for bit, episode ends, time limits and reseeding included."""

import dataclasses

import gymnasium as gym
import numpy as np
import pytest

from lightning_wm.envs import EnvConfig, EnvError, gymnasium_vector_env, make_env, make_vector_env, minatar_in_one_loop
from lightning_wm.minatar_vector import MinAtarVectorEnv
from lightning_wm.seeding import reset_seeds

pytest.importorskip("minatar.gym", reason='MinAtar is the optional extra: pip install -e ".[minatar]"')


def assert_same_results(ours: tuple, theirs: tuple, step: int) -> None:
    for name, a, b in zip(("obs", "reward", "terminated", "truncated"), ours[:4], theirs[:4]):
        assert a.dtype == b.dtype and a.shape == b.shape, (step, name, a.dtype, b.dtype, a.shape, b.shape)
        np.testing.assert_array_equal(a, b, err_msg=f"{name} differs at step {step}")


@pytest.mark.parametrize(
    ("env_id", "limit"),
    [("MinAtar/Breakout-v1", None), ("MinAtar/SpaceInvaders-v1", 40), ("MinAtar/Seaquest-v0", 25)],
)
def test_steps_as_the_sync_vector_env_does_bit_for_bit(env_id, limit):
    config = EnvConfig(id=env_id, num_envs=3, seed=0, max_episode_steps=limit)
    ours, theirs = make_vector_env(config), gymnasium_vector_env(config)  # the reference: gymnasium's own
    assert isinstance(ours, MinAtarVectorEnv) and isinstance(theirs, gym.vector.SyncVectorEnv)
    assert ours.single_observation_space == theirs.single_observation_space
    assert ours.single_action_space == theirs.single_action_space
    assert ours.observation_space == theirs.observation_space
    seeds = [2**40 + 7, 11, 5]  # a 64-bit seed, folded for MinAtar's RandomState on both sides
    first, first_ref = ours.reset(seed=seeds), theirs.reset(seed=seeds)
    np.testing.assert_array_equal(first[0], first_ref[0])
    actions = np.random.default_rng(0).integers(0, ours.single_action_space.n, size=(600, 3))
    ends = 0
    for step, action in enumerate(actions):
        if step == 300:  # a second reset mid-episode: an int seed, then on with the streams
            np.testing.assert_array_equal(ours.reset(seed=3)[0], theirs.reset(seed=3)[0])
        result = ours.step(action)
        assert_same_results(result, theirs.step(action), step)
        assert result[4] == {}
        ends += int(np.sum(result[2] | result[3]))
    assert ends > 3  # episodes ended (and the envs were reset next step) along the way
    np.testing.assert_array_equal(ours.reset()[0], theirs.reset()[0])  # seed None: on with each stream
    assert_same_results(ours.step(actions[0]), theirs.step(actions[0]), len(actions))
    ours.close(), theirs.close()


def test_frames_are_fresh_arrays_of_0_and_255():
    env = make_vector_env(EnvConfig(id="MinAtar/Breakout-v1", num_envs=2, seed=0))
    obs, _ = env.reset(seed=0)
    after, *_ = env.step(np.zeros(2, dtype=np.int64))
    assert obs.dtype == np.uint8 and set(np.unique(after)) <= {0, 255} and 255 in after
    assert not np.shares_memory(obs, after)  # a collector may keep every step's frames
    env.close()


def test_only_plain_sync_minatar_configs_step_in_one_loop():
    plain = EnvConfig(id="MinAtar/Breakout-v1", num_envs=2)
    assert minatar_in_one_loop(plain)
    for other in (
        dataclasses.replace(plain, frame_stack=2),
        dataclasses.replace(plain, action_repeat=2),
        dataclasses.replace(plain, vectorization="async"),
        dataclasses.replace(plain, backend="envpool"),
        EnvConfig(id="CartPole-v1", num_envs=2),
    ):
        assert not minatar_in_one_loop(other)
    stacked = make_vector_env(dataclasses.replace(plain, frame_stack=2))
    assert isinstance(stacked, gym.vector.SyncVectorEnv) and stacked.single_observation_space.shape == (10, 10, 8)
    stacked.close()
    with pytest.raises(EnvError, match="FrameStackObservation"):
        MinAtarVectorEnv([make_env(dataclasses.replace(plain, frame_stack=2))])
    with pytest.raises(EnvError, match="ActionRepeat"):
        MinAtarVectorEnv([make_env(dataclasses.replace(plain, action_repeat=2))])
    with pytest.raises(EnvError, match="steps MinAtar games"):
        MinAtarVectorEnv([gym.make("CartPole-v1")])
    with pytest.raises(EnvError, match="at least one env"):
        make_vector_env(dataclasses.replace(plain, num_envs=0))


def test_reset_seeds_read_as_gymnasium_reads_them():
    assert reset_seeds(None, 2) == [None, None]
    assert reset_seeds(5, 3) == [5, 6, 7]
    assert reset_seeds([9, 4], 2) == [9, 4]
    with pytest.raises(ValueError, match="got 1 seeds for 2 envs"):
        reset_seeds([1], 2)
