"""The EnvPool backend (``env.backend: envpool``) against the gymnasium backend: spaces, observation
layout, dynamics, rewards, episode ends and next-step autoreset; rows from a Collector; a CLI fit.
The option mapping and its errors are tested without EnvPool; the rest is skipped without it."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from lightning_wm.cli import main
from lightning_wm.data.collector import Collector
from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.envpool_backend import envpool_options
from lightning_wm.envs import AtariPreprocessingConfig, EnvConfig, EnvError, env_spec, make_vector_env
from lightning_wm.policies import RandomAgent

from support.presets import IMPALA_TINY, UNROLL_DATA_TINY, data_overrides, model_overrides

ROOT = Path(__file__).resolve().parents[1]
needs_envpool = pytest.mark.skipif(
    importlib.util.find_spec("envpool") is None,
    reason='EnvPool is not installed (pip install -e ".[envpool]")',
)

PONG = EnvConfig("ALE/Pong-v5", atari_preprocessing=AtariPreprocessingConfig(), frame_stack=4)


def backends(config: EnvConfig) -> tuple[EnvConfig, EnvConfig]:
    return dataclasses.replace(config, backend="gymnasium"), dataclasses.replace(config, backend="envpool")


# -- the option mapping (no EnvPool needed) --------------------------------------------------------------


def test_atari_options_map_to_envpools():
    config = dataclasses.replace(
        PONG,
        atari_preprocessing=AtariPreprocessingConfig(noop_max=7, frame_skip=3, screen_size=64, grayscale_obs=False),
        frame_stack=2,
        max_episode_steps=1000,
        kwargs={"repeat_action_probability": 0.1},
    )
    task, options = envpool_options(config)
    assert task == "Pong-v5"
    assert options == {
        "frame_skip": 3,
        "noop_max": 7,
        "img_height": 64,
        "img_width": 64,
        "gray_scale": False,
        "episodic_life": False,
        "stack_num": 2,
        "repeat_action_probability": 0.1,
        "full_action_space": False,
        "max_episode_steps": 1000,
        "use_fire_reset": False,
        "reward_clip": False,
    }
    # the defaults: ALE v5's sticky actions and its 108,000-frame cap in agent steps
    _, options = envpool_options(PONG)
    assert options["repeat_action_probability"] == 0.25 and options["max_episode_steps"] == 27_000
    assert options["stack_num"] == 4 and options["noop_max"] == 30 and options["frame_skip"] == 4
    assert envpool_options(EnvConfig("CartPole-v1", max_episode_steps=50)) == ("CartPole-v1", {"max_episode_steps": 50})


@pytest.mark.parametrize(
    "config, words",
    [
        (EnvConfig("CartPole-v1", pixels=True), "cannot express pixels"),
        (EnvConfig("CartPole-v1", action_repeat=2), "cannot express action_repeat"),
        (dataclasses.replace(PONG, crop=(30, 28, 153, 103)), "cannot express crop; drop it or use backend: gymnasium"),
        (EnvConfig("CartPole-v1", kwargs={"sutton_barto_reward": True}), "drop kwargs"),
        (EnvConfig("CartPole-v1", vectorization="async"), "vectorization: async does not apply"),
        (EnvConfig("CarRacing-v3"), "use backend: gymnasium"),
        (EnvConfig("ALE/Pong-v5"), "set atari_preprocessing"),
        (dataclasses.replace(PONG, atari_preprocessing=AtariPreprocessingConfig(noop_max=0)), "noop_max >= 1"),
        (dataclasses.replace(PONG, kwargs={"frameskip": 1}), "got frameskip"),
    ],
    ids=["pixels", "action-repeat", "crop", "kwargs", "async", "unsupported-id", "raw-ale", "no-noops", "ale-kwargs"],
)
def test_what_envpool_cannot_express_is_one_clear_line(config, words):
    with pytest.raises(EnvError, match=words) as info:
        envpool_options(dataclasses.replace(config, backend="envpool"))
    assert "\n" not in str(info.value)


def test_missing_envpool_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "envpool", None)  # import envpool raises ImportError
    with pytest.raises(EnvError, match=r'pip install -e "\.\[envpool\]"'):
        make_vector_env(EnvConfig("CartPole-v1", backend="envpool"))


# -- against the gymnasium backend ---------------------------------------------------------------------


@needs_envpool
@pytest.mark.parametrize(
    "config", [EnvConfig("CartPole-v1"), EnvConfig("Pendulum-v1"), PONG], ids=["cartpole", "pendulum", "pong"]
)
def test_both_backends_have_the_same_spaces(config):
    gym_spec, pool_spec = (env_spec(c) for c in backends(config))
    assert pool_spec.observation_space == gym_spec.observation_space
    assert pool_spec.action_space == gym_spec.action_space
    env = make_vector_env(dataclasses.replace(config, num_envs=2, backend="envpool"))
    try:
        obs, _ = env.reset(seed=[1, 2])
        assert obs.shape == (2, *gym_spec.obs_shape) and obs.dtype == gym_spec.observation_space.dtype
        obs, reward, terminated, truncated, _ = env.step(env.action_space.sample())
        assert obs.shape == (2, *gym_spec.obs_shape) and reward.shape == terminated.shape == truncated.shape == (2,)
    finally:
        env.close()


@needs_envpool
def test_cartpole_dynamics_rewards_and_episode_ends_match_gymnasium():
    """Started from EnvPool's states, gymnasium's CartPole gives the same observations, rewards,
    terminations and truncations (at 40 steps) for the same actions, and both autoreset the next
    step with reward 0."""
    n = 4
    gym_env, pool_env = (
        make_vector_env(c) for c in backends(EnvConfig("CartPole-v1", num_envs=n, max_episode_steps=40))
    )
    try:
        obs, _ = pool_env.reset(seed=list(range(n)))
        gym_env.reset(seed=list(range(n)))
        synced_from, ended = np.ones(n, bool), np.zeros(n, bool)  # obs to start gymnasium from; ended last step
        rng = np.random.default_rng(0)
        ends = {"terminated": 0, "truncated": 0}
        for _ in range(300):
            for i in np.flatnonzero(synced_from):  # gymnasium's own resets draw other starts: take EnvPool's
                gym_env.envs[i].unwrapped.state = obs[i].astype(np.float64)
            actions = rng.integers(0, 2, n)
            obs, reward, terminated, truncated, _ = pool_env.step(actions)
            gym_obs, gym_reward, gym_terminated, gym_truncated, _ = gym_env.step(actions)
            np.testing.assert_array_equal(terminated, gym_terminated)
            np.testing.assert_array_equal(truncated, gym_truncated)
            np.testing.assert_array_equal(reward, gym_reward)
            np.testing.assert_allclose(obs[~ended], gym_obs[~ended], rtol=1e-5, atol=1e-5)
            assert np.all(reward[ended] == 0) and not np.any(terminated[ended] | truncated[ended])  # autoreset
            ends["terminated"] += int(terminated.sum())
            ends["truncated"] += int(truncated.sum())
            synced_from, ended = ended, terminated | truncated
        assert ends["terminated"] > 0 and ends["truncated"] > 0, ends
    finally:
        gym_env.close()
        pool_env.close()


@needs_envpool
def test_pong_frames_rewards_and_episode_ends_match_gymnasium():
    """Without sticky actions and with one no-op at reset both backends play the same game: the same
    rewards and episode ends for the same actions, the same 84x84x4 frames (except on the last row
    of an episode, where the game ends within a frame skip and the max-pooled frames differ), and the
    reset frame with reward 0 on the step after the end."""
    config = dataclasses.replace(
        PONG, atari_preprocessing=AtariPreprocessingConfig(noop_max=1), kwargs={"repeat_action_probability": 0.0}
    )
    gym_env, pool_env = (make_vector_env(c) for c in backends(config))
    try:
        gym_obs, _ = gym_env.reset(seed=[3])
        obs, _ = pool_env.reset(seed=[3])
        np.testing.assert_array_equal(obs, gym_obs)
        rng = np.random.default_rng(0)
        rewards, ended_at = [], None
        for t in range(1000):
            actions = rng.integers(0, 6, 1)
            obs, reward, terminated, truncated, _ = pool_env.step(actions)
            gym_obs, gym_reward, gym_terminated, gym_truncated, _ = gym_env.step(actions)
            assert (reward[0], terminated[0], truncated[0]) == (gym_reward[0], gym_terminated[0], gym_truncated[0]), t
            assert obs.shape == (1, 84, 84, 4) and obs.dtype == np.uint8
            if not terminated[0]:
                np.testing.assert_array_equal(obs, gym_obs, err_msg=f"step {t}")
            if ended_at is not None and t == ended_at + 1:
                assert reward[0] == 0 and all(np.array_equal(obs[0, ..., 0], obs[0, ..., k]) for k in range(4))
            if terminated[0] and ended_at is None:
                ended_at = t
            rewards.append(reward[0])
        assert ended_at is not None, "no game ended within 1000 steps"
        assert set(np.unique(rewards)) <= {-1.0, 0.0, 1.0} and -1.0 in rewards
    finally:
        gym_env.close()
        pool_env.close()


def _check_rows(chunk: dict) -> None:
    """The row convention: an episode's first row has reward 0, a last row is followed by a first row,
    a terminal row is a last row, and no action is taken on a last row."""
    is_first, is_last = chunk["is_first"], chunk["is_last"]
    assert np.all(chunk["reward"][is_first] == 0)
    assert np.array_equal(is_last[:-1], is_first[1:])
    assert not np.any(chunk["is_terminal"] & ~is_last)
    assert np.all(chunk["action"][is_last] == 0)


@needs_envpool
def test_collector_rows_on_envpool_cartpole():
    config = EnvConfig("CartPole-v1", num_envs=3, max_episode_steps=25, backend="envpool")
    env = make_vector_env(config)
    buffer = ReplayBuffer(1000, 3, seed=0)
    try:
        collector = Collector(env, RandomAgent(env_spec(config), seed=0), buffer=buffer, seeds=[5, 6, 7])
        chunk = collector.collect_chunk(120)
    finally:
        env.close()
    assert chunk["obs"].shape == (120, 3, 4) and chunk["obs"].dtype == np.float32
    assert chunk["is_first"][0].all() and chunk["is_last"].any()
    _check_rows(chunk)
    assert len(buffer) == 360 and collector.stats.episodes > 0
    assert all(e["return"] == e["length"] for e in collector.stats.recent)  # CartPole: reward 1 per action taken


@needs_envpool
@pytest.mark.slow  # about 3 s of Atari
def test_collector_rows_on_envpool_pong():
    config = dataclasses.replace(PONG, num_envs=2, max_episode_steps=100, backend="envpool")
    env = make_vector_env(config)
    try:
        collector = Collector(env, RandomAgent(env_spec(config), seed=0), seeds=[1, 2])
        chunk = collector.collect_chunk(250)
    finally:
        env.close()
    assert chunk["obs"].shape == (250, 2, 84, 84, 4) and chunk["obs"].dtype == np.uint8
    assert set(np.unique(chunk["reward"])) <= {-1.0, 0.0, 1.0}
    assert chunk["is_last"].sum() >= 4 and not chunk["is_terminal"].any()  # truncated at 100 steps
    _check_rows(chunk)


@needs_envpool
def test_same_seeds_same_episodes_other_seeds_others():
    def first_obs(seeds):
        env = make_vector_env(EnvConfig("CartPole-v1", num_envs=2, backend="envpool"))
        try:
            return env.reset(seed=seeds)[0]
        finally:
            env.close()

    np.testing.assert_array_equal(first_obs([1, 2]), first_obs([1, 2]))
    assert not np.array_equal(first_obs([1, 2]), first_obs([3, 4]))


@needs_envpool
@pytest.mark.slow
@pytest.mark.parametrize("splits", [1, 2])
def test_impala_fit_on_envpool_from_the_command_line(splits):
    cli = main(
        args=[
            "fit",
            "--config",
            str(ROOT / "configs/impala/cartpole.yaml"),
            "--trainer.max_steps",
            "3",
            "--trainer.val_check_interval",
            "3",
            "--trainer.enable_progress_bar",
            "false",
            *data_overrides(UNROLL_DATA_TINY),
            *model_overrides(IMPALA_TINY),
            "--data.init_args.acting.num_actors",
            "0",
            "--data.init_args.env.backend",
            "envpool",
            "--data.init_args.acting.splits",
            str(splits),
        ]
    )
    assert cli.trainer.global_step == 3
    assert len(getattr(cli.datamodule.acting.collector, "parts", [None])) == splits
    assert cli.datamodule.env.backend == "envpool"
    assert np.isfinite(float(cli.trainer.callback_metrics["val/return"]))


@needs_envpool
@pytest.mark.slow  # about 3 s of Atari
def test_frames_handed_on_as_views_stay_what_each_step_returned():
    """EnvPool's frames reach the rows as channels-last views, not copies: a later step must not
    overwrite the frames of rows still held (a chunk keeps them until it is stacked)."""
    config = dataclasses.replace(PONG, num_envs=2, backend="envpool")
    env = make_vector_env(config)
    received, step_wait = [], env.step_wait

    def wait_and_copy(**kwargs):
        out = step_wait(**kwargs)
        received.append(np.array(out[0], copy=True))
        return out

    env.step_wait = wait_and_copy
    try:
        chunk = Collector(env, RandomAgent(env_spec(config), seed=0), seeds=[1, 2]).collect_chunk(200)
    finally:
        env.close()
    for t in range(199):
        np.testing.assert_array_equal(chunk["obs"][t + 1], received[t])
