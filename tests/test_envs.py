import gymnasium as gym
import numpy as np
import pytest
from PIL import Image

from lightning_wm.envs import EnvConfig, EnvError, env_spec, make_env, make_vector_env


@pytest.mark.parametrize(
    "config, shape, dtype, discrete",
    [
        (EnvConfig("CartPole-v1"), (4,), np.float32, True),
        (EnvConfig("CartPole-v1", pixels=True), (64, 64, 3), np.uint8, True),
        (EnvConfig("CartPole-v1", pixels=True, size=(32, 48), grayscale=True), (32, 48, 1), np.uint8, True),
        (EnvConfig("Pendulum-v1"), (3,), np.float32, False),
        (EnvConfig("CarRacing-v3"), (64, 64, 3), np.uint8, False),
        (EnvConfig("ALE/Pong-v5"), (64, 64, 3), np.uint8, True),
    ],
    ids=["cartpole", "cartpole-pixels", "cartpole-gray", "pendulum", "carracing", "pong"],
)
def test_each_env_builds_and_steps(config, shape, dtype, discrete):
    spec = env_spec(config)
    assert spec.obs_shape == shape and spec.discrete == discrete
    env = make_env(config)
    obs, _ = env.reset(seed=0)
    assert obs.shape == shape and obs.dtype == dtype
    for _ in range(3):
        obs, reward, terminated, truncated, _ = env.step(env.action_space.sample())
        assert obs.shape == shape and obs.dtype == dtype
        assert np.isfinite(reward)
    env.close()


def test_pixel_frames_show_the_pole_moving():
    env = make_env(EnvConfig("CartPole-v1", pixels=True))
    first, _ = env.reset(seed=0)
    for _ in range(8):
        obs, *_ = env.step(1)
    assert first.std() > 0, "frame is blank"
    assert np.abs(obs.astype(int) - first.astype(int)).sum() > 0
    env.close()


def test_vector_env_seeds_and_next_step_autoreset():
    env = make_vector_env(EnvConfig("CartPole-v1", num_envs=3))
    obs, _ = env.reset(seed=5)
    again = make_vector_env(EnvConfig("CartPole-v1", num_envs=3))
    obs2, _ = again.reset(seed=5)
    np.testing.assert_array_equal(obs, obs2)
    assert not np.allclose(obs[0], obs[1])
    ended: int | None = None  # the first env whose episode ended
    for _ in range(200):
        obs, reward, terminated, truncated, _ = env.step(np.zeros(3, np.int64))
        if ended is not None:
            # the step after an episode end is a reset: reward 0, not done
            assert reward[ended] == 0 and not terminated[ended]
            break
        if (terminated | truncated).any():
            ended = int(np.flatnonzero(terminated | truncated)[0])
    assert ended is not None


def test_action_repeat_and_time_limit():
    env = make_env(EnvConfig("CartPole-v1", action_repeat=2, max_episode_steps=5))
    env.reset(seed=0)
    _, reward, *_ = env.step(0)
    assert reward == 2.0
    steps, truncated, terminated = 1, False, False
    while not (truncated or terminated):
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        steps += 1
    assert steps <= 5


def test_unknown_env_id_is_named():
    with pytest.raises(EnvError, match="CartPol-v1"):
        make_env(EnvConfig("CartPol-v1"))


def test_unsupported_action_space_is_named():
    class MultiDiscreteEnv(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
        action_space = gym.spaces.MultiDiscrete([2, 3])

    gym.register("MultiDiscreteTest-v0", entry_point=lambda: MultiDiscreteEnv())
    with pytest.raises(EnvError, match="MultiDiscrete"):
        make_env(EnvConfig("MultiDiscreteTest-v0"))


def test_crop_selects_the_box_before_the_resize():
    # CartPole renders 400x600; the box [150, 0, 180, 600] holds the pole and the cart.
    box = (150, 0, 180, 600)
    env = make_env(EnvConfig("CartPole-v1", pixels=True, crop=box))
    obs, _ = env.reset(seed=0)
    assert obs.shape == (64, 64, 3) and obs.dtype == np.uint8
    assert env.observation_space.shape == (64, 64, 3)
    full = env.unwrapped.render()
    top, left, height, width = box
    expected = np.asarray(
        Image.fromarray(full[top : top + height, left : left + width]).resize((64, 64), Image.BILINEAR)
    )
    np.testing.assert_array_equal(obs, expected)
    # the cart (black) fills more of the cropped frame than of the uncropped one
    uncropped, _ = make_env(EnvConfig("CartPole-v1", pixels=True)).reset(seed=0)
    assert (obs < 60).all(-1).mean() > 2 * (uncropped < 60).all(-1).mean()
    env.close()


def test_crop_of_an_image_observation_and_grayscale():
    env = make_env(EnvConfig("CarRacing-v3", size=(32, 32), grayscale=True, crop=(0, 0, 84, 96)))
    obs, _ = env.reset(seed=0)
    assert obs.shape == (32, 32, 1) and obs.dtype == np.uint8
    env.close()


def test_crop_of_a_synthetic_frame_is_humblerls_crop_range():
    """HumbleRL's ``crop_range "[30:183, 28:131, :]"`` is ``crop: [30, 28, 153, 103]``: on a
    synthetic 210x160 frame whose pixels encode their own row and column, the kept frame
    (at its own size: no resize) holds exactly rows 30..182 and columns 28..130."""
    rows, cols = np.meshgrid(np.arange(210), np.arange(160), indexing="ij")
    frame = np.stack([rows, cols, (rows + cols) % 256], -1).astype(np.uint8)

    class FrameEnv(gym.Env):
        observation_space = gym.spaces.Box(0, 255, (210, 160, 3), np.uint8)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            return frame, {}

        def step(self, action):
            return frame, 0.0, False, False, {}

    from lightning_wm.envs import PixelObservation

    env = PixelObservation(FrameEnv(), (153, 103), grayscale=False, render=False, crop=(30, 28, 153, 103))
    obs, _ = env.reset()
    assert obs.shape == (153, 103, 3) and env.observation_space.shape == (153, 103, 3)
    np.testing.assert_array_equal(obs, frame[30:183, 28:131])
    assert obs[0, 0, :2].tolist() == [30, 28] and obs[-1, -1, :2].tolist() == [182, 130]
    small = PixelObservation(FrameEnv(), (64, 64), grayscale=False, render=False, crop=(30, 28, 153, 103))
    expected = np.asarray(Image.fromarray(frame[30:183, 28:131]).resize((64, 64), Image.BILINEAR))
    np.testing.assert_array_equal(small.reset()[0], expected)  # cropped, then resized
    with pytest.raises(EnvError, match="outside the 210x160"):
        PixelObservation(FrameEnv(), (64, 64), grayscale=False, render=False, crop=(30, 28, 181, 103))


@pytest.mark.parametrize(
    "config, match",
    [
        (EnvConfig("CartPole-v1", pixels=True, crop=(300, 0, 200, 600)), "outside the 400x600"),
        (EnvConfig("CartPole-v1", pixels=True, crop=(0, 10, 100, 600)), "outside the 400x600"),
        (EnvConfig("CarRacing-v3", crop=(0, 0, 97, 96)), "outside the 96x96"),
        (EnvConfig("CartPole-v1", pixels=True, crop=(0, 0, 0, 600)), "height, width > 0"),
        (EnvConfig("CartPole-v1", pixels=True, crop=(-1, 0, 10, 600)), "top, left >= 0"),
        (EnvConfig("CartPole-v1", pixels=True, crop=(0, 0, 10)), "four integers"),
        (EnvConfig("CartPole-v1", crop=(0, 0, 10, 10)), "set pixels: true"),
    ],
    ids=["rows-past-bottom", "columns-past-right", "image-obs", "empty", "negative", "three-values", "no-pixels"],
)
def test_bad_crop_is_named(config, match):
    with pytest.raises(EnvError, match=match):
        env = make_env(config)
        env.reset(seed=0)


def test_default_has_no_crop():
    assert EnvConfig().crop is None
    plain, _ = make_env(EnvConfig("CartPole-v1", pixels=True)).reset(seed=3)
    whole, _ = make_env(EnvConfig("CartPole-v1", pixels=True, crop=(0, 0, 400, 600))).reset(seed=3)
    np.testing.assert_array_equal(plain, whole)


@pytest.mark.parametrize("limit, repeat", [(10, 2), (300, 1)])
def test_max_episode_steps_replaces_the_registered_limit(limit, repeat):
    """Pendulum-v1 is registered with 200 steps; the configured limit wins, counted in agent steps."""
    env = make_env(EnvConfig(id="Pendulum-v1", max_episode_steps=limit, action_repeat=repeat))
    env.reset(seed=0)
    steps, truncated = 0, False
    while not truncated:
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        steps += 1
        assert not terminated
    assert steps == limit
    env.close()


def test_async_vector_env_steps_like_the_sync_one():
    sync = make_vector_env(EnvConfig(id="CartPole-v1", num_envs=2, seed=5))
    async_ = make_vector_env(EnvConfig(id="CartPole-v1", num_envs=2, seed=5, vectorization="async"))
    try:
        assert isinstance(async_, gym.vector.AsyncVectorEnv)
        np.testing.assert_array_equal(sync.reset(seed=5)[0], async_.reset(seed=5)[0])
        for _ in range(30):
            a = np.array([1, 0])
            out_s, out_a = sync.step(a), async_.step(a)
            for x, y in zip(out_s[:4], out_a[:4]):
                np.testing.assert_array_equal(x, y)
    finally:
        sync.close()
        async_.close()


def test_keep_state_gives_a_dict_of_frame_and_vector():
    cfg = EnvConfig(id="CartPole-v1", pixels=True, keep_state=True, num_envs=2, size=(32, 32))
    spec = env_spec(cfg)
    assert spec.is_dict and not spec.is_pixels and set(spec.obs_spaces) == {"image", "state"}
    with pytest.raises(ValueError, match="one shape per key"):
        _ = spec.obs_shape
    env = make_vector_env(cfg)
    obs, _ = env.reset(seed=0)
    assert obs["image"].shape == (2, 32, 32, 3) and obs["image"].dtype == np.uint8
    assert obs["state"].shape == (2, 4) and obs["state"].dtype == np.float32
    obs, *_ = env.step(np.array([0, 1]))
    assert np.abs(obs["state"]).max() < 1  # CartPole's state, next to its frame
    env.close()


@pytest.mark.parametrize(
    "config", [EnvConfig(id="CartPole-v1", keep_state=True), EnvConfig(id="CarRacing-v3", keep_state=True)]
)
def test_keep_state_without_a_rendered_vector_env_is_refused(config):
    with pytest.raises(EnvError, match="keep_state"):
        make_env(config)


def test_collector_stores_dict_observations(tmp_path):
    from lightning_wm.data.collector import Collector
    from lightning_wm.data.episodes import EpisodeStore
    from lightning_wm.policies import RandomAgent

    cfg = EnvConfig(id="CartPole-v1", pixels=True, keep_state=True, num_envs=2, size=(16, 16))
    spec = env_spec(cfg)
    env = make_vector_env(cfg)
    store = EpisodeStore(tmp_path / "eps")
    episodes = Collector(env, RandomAgent(spec, seed=0), store=store, seeds=0, spec=spec).run_episodes(2)
    env.close()
    assert len(store) == 2
    for stats, episode in zip(
        sorted(episodes, key=lambda e: e["length"]), sorted(store.episodes(), key=lambda e: len(e["reward"]))
    ):
        assert episode["obs"]["image"].shape == (stats["length"] + 1, 16, 16, 3)
        assert episode["obs"]["state"].shape == (stats["length"] + 1, 4)


# -- Atari preprocessing and frame stacks ------------------------------------------------------
def _atari(frame_stack=1, **options):
    from lightning_wm.envs import AtariPreprocessingConfig

    return EnvConfig("ALE/Pong-v5", atari_preprocessing=AtariPreprocessingConfig(**options), frame_stack=frame_stack)


def test_atari_preprocessing_and_frame_stack_give_channels_last_frames():
    pytest.importorskip("cv2", reason="AtariPreprocessing needs opencv (pip install -e '.[atari]')")
    spec = env_spec(_atari(frame_stack=4))
    assert spec.obs_shape == (84, 84, 4) and spec.discrete
    stacked, single = make_env(_atari(frame_stack=4, noop_max=0)), make_env(_atari(noop_max=0))
    obs, _ = stacked.reset(seed=3)
    first, _ = single.reset(seed=3)
    assert obs.shape == (84, 84, 4) and obs.dtype == np.uint8 and single.observation_space.shape == (84, 84, 1)
    assert all(np.array_equal(obs[..., k], first[..., 0]) for k in range(4)), "the first frame fills the stack"
    frames = [first[..., 0]]
    for action in [2, 3, 2, 3, 0, 2]:
        obs, *_ = stacked.step(action)
        frames.append(single.step(action)[0][..., 0])
        want = np.stack((frames[:1] * 4 + frames)[-4:], -1)  # oldest first, the newest in channel 3
        np.testing.assert_array_equal(obs, want)
    assert len(np.unique(obs.reshape(-1, 4), axis=0)) > 1
    stacked.close(), single.close()


def test_atari_options_reach_gymnasium_and_max_episode_steps_counts_agent_steps():
    pytest.importorskip("cv2", reason="AtariPreprocessing needs opencv (pip install -e '.[atari]')")
    from lightning_wm.envs import atari_options

    rgb = make_env(
        EnvConfig(
            "ALE/Pong-v5",
            atari_preprocessing={"screen_size": 42, "grayscale_obs": False},
            frame_stack=2,
            max_episode_steps=5,
        )
    )
    assert rgb.observation_space.shape == (42, 42, 6)
    assert atari_options(EnvConfig(atari_preprocessing={"frame_skip": 2})).frame_skip == 2
    rgb.reset(seed=0)
    steps = 0
    while True:
        steps += 1
        *_, terminated, truncated, _ = rgb.step(0)
        if terminated or truncated:
            break
    assert steps == 5 and truncated
    rgb.close()


@pytest.mark.parametrize(
    "config, match",
    [
        (EnvConfig("CartPole-v1", frame_stack=4), "frame_stack stacks image observations"),
        (EnvConfig("CartPole-v1", frame_stack=0), "frame_stack must be >= 1"),
        (EnvConfig("ALE/Pong-v5", atari_preprocessing={"noop": 3}), "its options are noop_max"),
        (EnvConfig("ALE/Pong-v5", atari_preprocessing={}, pixels=True), "drop pixels"),
    ],
)
def test_bad_frame_options_are_named(config, match):
    with pytest.raises(EnvError, match=match):
        make_env(config)


def test_frame_stack_of_rendered_frames():
    env = make_env(EnvConfig("CartPole-v1", pixels=True, size=(48, 48), grayscale=True, frame_stack=3))
    obs, _ = env.reset(seed=0)
    assert obs.shape == (48, 48, 3) and np.array_equal(obs[..., 0], obs[..., 2])
    previous = obs
    for _ in range(3):
        obs, *_ = env.step(1)
        np.testing.assert_array_equal(obs[..., :2], previous[..., 1:])  # the stack moves by one frame
        previous = obs
    assert not np.array_equal(obs[..., 0], obs[..., 2]), "the cart moved between the oldest and newest frame"
    env.close()


def test_an_image_observation_keeps_its_channels():
    """An env whose own observation is an image with 4 channels (e.g. stacked gray frames) is
    resized channel by channel, not squeezed into RGB."""
    import gymnasium as gym

    class Stacked(gym.Env):
        observation_space = gym.spaces.Box(0, 255, (32, 24, 4), np.uint8)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            return np.full((32, 24, 4), [10, 20, 30, 40], np.uint8), {}

        def step(self, action):
            return self.reset()[0], 0.0, False, False, {}

    gym.register("StackedTest-v0", entry_point=Stacked)
    try:
        env = make_env(EnvConfig("StackedTest-v0", size=(16, 12)))
        obs, _ = env.reset(seed=0)
        assert env.observation_space.shape == obs.shape == (16, 12, 4)
        assert obs[0, 0].tolist() == [10, 20, 30, 40]
    finally:
        del gym.registry["StackedTest-v0"]
