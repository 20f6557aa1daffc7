"""DreamEnv over any WorldModel (V+M and Dreamer's RSSM): gymnasium's env checker on the one-env
view, next-step autoreset, truncation, reproducibility, rendering, decoded observations; dream
starts from recorded episodes (first rows or all rows); the models' filtering (observe_step,
posterior_states); a controller trained inside the dream. Ensembles of Ms: test_dream_ensemble.py."""

import warnings

import gymnasium as gym
import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from gymnasium.utils.env_checker import check_env

from lightning_wm.agents.dreamer import Dreamer
from lightning_wm.agents.worldmodels.controller import Controller
from lightning_wm.agents.worldmodels.memory import Memory
from lightning_wm.agents.worldmodels.vision import Vision
from lightning_wm.agents.worldmodels.vm_model import VisionMemoryModel
from lightning_wm.data.collector import Collector
from lightning_wm.data.episodes import EpisodeStore
from lightning_wm.dream_env import DreamEnv, DreamSingleEnv, start_states
from lightning_wm.envs import EnvConfig, EnvSpec, env_spec
from lightning_wm.policies import RandomAgent
from lightning_wm.world_model import rollout

from support.presets import DREAMER_TINY, MEMORY_TINY, VISION_TINY
from support.unit_fit import quiet_trainer
from support.worldmodels import DISCRETE, constant_latent_store, save_module, tiny_vision_memory

torch.set_num_threads(1)

CONTINUOUS = EnvSpec(
    gym.spaces.Box(0, 255, (64, 64, 3), np.uint8),
    gym.spaces.Box(np.array([-1.0, 0.0], np.float32), np.ones(2, np.float32)),
    "SyntheticContinuous",
)


def _vm_starts(model: VisionMemoryModel, n: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    zeros = model.zero_state(n)
    return {**zeros, "z": torch.randn(n, model.latent_dim, generator=g)}


def _dream(spec=DISCRETE, num_envs=3, temperature=None, **kwargs) -> DreamEnv:
    model = tiny_vision_memory(spec, temperature=temperature)
    return DreamEnv(model, spec.action_space, _vm_starts(model), num_envs=num_envs, **kwargs)


def _checked(env: gym.Env) -> list[str]:
    """gymnasium's env checker; returns the warnings that are not advisory notes (z is unbounded,
    an env not made by gym.make has no spec)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env, skip_render_check=False)
    allowed = ("infinity", "not having a spec")
    return [str(w.message) for w in caught if not any(a in str(w.message) for a in allowed)]


@pytest.mark.parametrize("spec", [DISCRETE, CONTINUOUS])
def test_single_env_view_passes_gymnasium_env_checker(spec):
    env = DreamSingleEnv(_dream(spec, num_envs=1, max_episode_steps=20))
    assert not _checked(env)
    obs, _ = env.reset(seed=1)
    assert obs.shape == (4 + 8,) and obs.dtype == np.float32 and env.observation_space.contains(obs)
    assert env.render().shape == (64, 64, 3)


def test_vector_api_spaces_and_render():
    env = _dream(num_envs=3)
    assert env.observation_space.shape == (3, 12) and env.single_action_space == DISCRETE.action_space
    obs, info = env.reset(seed=0)
    assert obs.shape == (3, 12) and obs.dtype == np.float32
    obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
    assert reward.shape == terminated.shape == truncated.shape == (3,) and terminated.dtype == bool
    frames = env.render()
    assert frames.shape == (3, 64, 64, 3) and frames.dtype == np.uint8
    assert env.metadata["autoreset_mode"] == gym.vector.AutoresetMode.NEXT_STEP


def test_decoded_observations_are_frames_in_the_real_format():
    env = _dream(num_envs=2, observation="decoded")
    assert env.single_observation_space == gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (2, 64, 64, 3) and obs.dtype == np.uint8
    np.testing.assert_array_equal(obs, env.render())
    obs, *_ = env.step(np.array([0, 1]))
    assert env.observation_space.contains(obs)


def test_next_step_autoreset_after_termination():
    env = _dream(num_envs=2, done_threshold=-1.0)  # every step terminates
    env.reset(seed=0)
    _, r1, term1, trunc1, _ = env.step(np.array([0, 1]))
    assert term1.all() and not trunc1.any()
    obs2, r2, term2, trunc2, _ = env.step(np.array([1, 1]))  # the reset step: reward 0, not done
    assert (r2 == 0).all() and not term2.any() and not trunc2.any()
    _, _, term3, _, _ = env.step(np.array([1, 0]))
    assert term3.all()


def test_autoreset_puts_a_start_state_in_place():
    """The reset step's state is a bank entry (h and c zero here), not the model's next state."""
    env = _dream(num_envs=2, done_threshold=-1.0)
    env.reset(seed=0)
    env.step(np.array([0, 1]))
    assert env.state["h"].abs().sum() > 0  # M stepped
    env.step(np.array([0, 1]))  # next-step autoreset
    assert env.state["h"].abs().sum() == 0 and env.state["c"].abs().sum() == 0
    bank = env.starts["z"]
    assert all(any(torch.equal(z, b) for b in bank) for z in env.state["z"])


def test_truncation_after_max_episode_steps_and_survival_reward():
    env = _dream(num_envs=2, done_threshold=2.0, max_episode_steps=3, reward="survival")
    env.reset(seed=0)
    flags = []
    for _ in range(5):
        _, reward, terminated, truncated, _ = env.step(np.zeros(2, np.int64))
        flags.append((reward[0], bool(terminated[0]), bool(truncated[0])))
    assert flags == [(1, False, False), (1, False, False), (1, False, True), (0, False, False), (1, False, False)]


def test_done_mode_sample_draws_termination_from_the_probability():
    """Sampled: about a fraction p of dreams end (p from the done head); thresholded at 0.5:
    all or none of them for one start state."""
    model = tiny_vision_memory()
    starts = {**model.zero_state(1), "z": torch.zeros(1, 4)}
    with torch.no_grad():
        model.memory.done_head.bias.fill_(0.0)
        model.memory.done_head.weight.zero_()  # p = 0.5 everywhere
    ends = {}
    for mode in ("sample", "threshold"):
        env = DreamEnv(model, DISCRETE.action_space, starts, num_envs=2000, done_mode=mode, done_threshold=0.4)
        env.reset(seed=0)
        ends[mode] = env.step(np.zeros(2000, np.int64))[2].mean()
    assert 0.45 < ends["sample"] < 0.55 and ends["threshold"] == 1.0
    with pytest.raises(ValueError, match="done_mode"):
        _dream(done_mode="maybe")


def test_seeded_dreams_are_reproducible_and_temperature_matters():
    def trajectory(seed, temperature=1.0):
        env = _dream(num_envs=2, temperature=temperature)
        out = [env.reset(seed=seed)[0]]
        for t in range(4):
            out.append(env.step(np.array([t % 2, 1]))[0])
        return np.stack(out)

    np.testing.assert_array_equal(trajectory(7), trajectory(7))
    assert not np.array_equal(trajectory(7), trajectory(8))

    def one_start(seed, temperature):  # every dream starts from the same latent
        model = tiny_vision_memory(temperature=temperature)
        starts = {**model.zero_state(1), "z": torch.ones(1, 4)}
        env = DreamEnv(model, DISCRETE.action_space, starts, num_envs=2)
        out = [env.reset(seed=seed)[0]]
        for t in range(4):
            out.append(env.step(np.array([t % 2, 1]))[0])
        return np.stack(out)

    # temperature 0: the dynamics are deterministic given the start, whatever the seed;
    # temperature 1: the sampled z differ from seed to seed
    np.testing.assert_array_equal(one_start(7, 0.0), one_start(8, 0.0))
    assert not np.allclose(one_start(7, 1.0), one_start(8, 1.0))


def test_collector_records_dream_rows():
    env = _dream(num_envs=2, done_threshold=2.0, max_episode_steps=4)
    spec = EnvSpec(env.single_observation_space, env.single_action_space)
    collector = Collector(env, RandomAgent(spec, seed=0), seeds=0, spec=spec)
    finished = collector.collect(10)
    assert [e["length"] for e in finished] == [4.0, 4.0, 4.0, 4.0]


def test_bad_starts_are_refused():
    model = tiny_vision_memory()
    with pytest.raises(ValueError, match="starts must be"):
        DreamEnv(model, DISCRETE.action_space, {"z": torch.zeros(0, 4), "h": torch.zeros(0, 8), "c": torch.zeros(0, 8)})
    with pytest.raises(ValueError, match="'first' or 'all'"):
        start_states(model, [], where="middle")
    with pytest.raises(ValueError, match="no recorded episode"):
        start_states(model, [])


# -- V+M as a WorldModel ---------------------------------------------------------------


def _latent_episode(length: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    is_first = np.zeros(length, bool)
    is_first[0] = True
    is_last = np.zeros(length, bool)
    is_last[-1] = True
    return {
        "mu": rng.normal(size=(length, 4)).astype(np.float32),
        "logvar": np.full((length, 4), -3.0, np.float32),
        "action": rng.integers(0, 2, length),
        "reward": np.ones(length, np.float32),
        "is_first": is_first,
        "is_last": is_last,
        "is_terminal": is_last.copy(),
    }


def test_vision_memory_model_is_a_world_model():
    model = tiny_vision_memory()
    obs = torch.randint(0, 256, (3, 64, 64, 3), dtype=torch.uint8)
    start = model.initial_state(obs)
    assert model.features(start).shape == (3, 12)
    actor = torch.nn.Linear(12, 2)
    out = rollout(model, start, lambda f: torch.softmax(actor(f), -1), horizon=4)
    assert out["features"].shape == (5, 3, 12) and out["rewards"].shape == (4, 3)
    assert ((out["dones"] >= 0) & (out["dones"] <= 1)).all()
    assert all(not p.requires_grad for p in model.parameters())
    assert model.decode(start).shape == (3, 64, 64, 3)


def test_dream_ends_from_the_drawn_latent_with_done_input_latent():
    torch.manual_seed(0)
    model = VisionMemoryModel(
        Vision(DISCRETE, **VISION_TINY),
        Memory(DISCRETE, net={**MEMORY_TINY["net"], "done_input": "latent"}),
    )
    start = _vm_starts(model, 3)
    g = torch.Generator().manual_seed(5)
    reward, nxt, done = model.step(start, torch.tensor([0, 1, 0]), generator=g)
    torch.testing.assert_close(done, torch.sigmoid(model.memory.done_head(nxt["z"]).squeeze(-1)))


def test_vision_memory_filtering_matches_m_over_the_episode():
    """posterior_states: z_t = V's mean of row t, h_t = M's LSTM output after reading rows < t
    (what Memory.unroll gives); observe_step reproduces it row by row and restarts at is_first."""
    model = tiny_vision_memory()
    episode = _latent_episode(6, seed=1)
    states = model.posterior_states(episode)
    mu = torch.as_tensor(episode["mu"])
    torch.testing.assert_close(states["z"], mu)
    out, _ = model.memory.unroll(mu[None], model.memory.action_input(torch.as_tensor(episode["action"]))[None])
    torch.testing.assert_close(states["h"][1:], out[0, :-1])
    assert states["h"][0].abs().sum() == 0 and states["c"][0].abs().sum() == 0
    # observe_step on frames: the first frame restarts from the zero state, as initial_state does
    frames = torch.randint(0, 256, (2, 64, 64, 3), dtype=torch.uint8)
    first = model.observe_step(model.zero_state(2), model.actions.zeros(2), frames, torch.ones(2, dtype=torch.bool))
    for key, value in model.initial_state(frames).items():
        torch.testing.assert_close(first[key], value)
    nxt = model.observe_step(first, model.actions.encode(torch.tensor([0, 1])), frames, torch.tensor([False, True]))
    assert nxt["h"][0].abs().sum() > 0 and nxt["h"][1].abs().sum() == 0


def test_start_states_first_rows_or_all_rows():
    model = tiny_vision_memory()
    episodes = [_latent_episode(5, seed=s) for s in range(3)]
    first = start_states(model, episodes, where="first")
    torch.testing.assert_close(first["z"], torch.as_tensor(np.stack([e["mu"][0] for e in episodes])))
    assert first["h"].abs().sum() == 0
    every = start_states(model, episodes, where="all")  # every row but the last of each episode
    assert every["z"].shape == (3 * 4, 4) and every["h"].shape == (12, 8)
    torch.testing.assert_close(every["h"][:4], model.posterior_states(episodes[0])["h"][:4])
    few = start_states(model, episodes, where="all", max_starts=5, seed=3)
    assert few["z"].shape == (5, 4)
    assert all(any(torch.equal(z, e) for e in every["z"]) for z in few["z"])


@pytest.mark.slow
def test_controller_trains_inside_the_dream(tmp_path):
    model = tiny_vision_memory()
    v, m = save_module(model.vision, tmp_path / "v.ckpt"), save_module(model.memory, tmp_path / "m.ckpt")
    constant_latent_store(tmp_path / "latents")
    controller = Controller(
        DISCRETE,
        vision_ckpt=v,
        memory_ckpt=m,
        es={"popsize": 4, "episodes_per_member": 2},
        train_in="dream",
        dream={"dir": str(tmp_path / "latents"), "max_steps": 7, "done_threshold": 2.0, "reward": "survival"},
    )
    assert sorted(controller.dream_starts_bank()["z"][:, 0].tolist()) == [0.0, 1.0, 2.0]
    solutions = torch.randn(4, controller.num_params)
    fitness = controller.evaluate_population(solutions, 2, seed=0)
    torch.testing.assert_close(fitness, torch.full((4,), 7.0))  # never done: survive to truncation
    from lightning_wm.data.generations import GenerationDataModule

    class _Synthetic(GenerationDataModule):
        def __init__(self):
            pl.LightningDataModule.__init__(self)
            self.env, self.spec = None, DISCRETE

    trainer = quiet_trainer(
        max_steps=2,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(controller, datamodule=_Synthetic())
    assert controller.cmaes.countiter == 2 and trainer.callback_metrics["fitness/mean"] == 7.0


def test_load_dream_env_from_checkpoints_matches_the_models(tmp_path):
    from lightning_wm.agents.worldmodels.vm_model import load_dream_env

    model = tiny_vision_memory()
    v, m = save_module(model.vision, tmp_path / "v.ckpt"), save_module(model.memory, tmp_path / "m.ckpt")
    store = EpisodeStore(tmp_path / "latents")
    for i in range(2):
        store.add(
            {
                "mu": np.full((3, 4), i, np.float32),
                "logvar": np.full((3, 4), -20.0, np.float32),
                "action": np.zeros(3, np.int64),
            }
        )
    env = load_dream_env(
        v, m, str(tmp_path / "latents"), DISCRETE.action_space, num_envs=2, max_episode_steps=5, temperature=0.5
    )
    assert env.model.temperature == 0.5
    assert sorted(env.starts["z"][:, 0].tolist()) == [0.0, 1.0]
    for a, b in zip(env.model.memory.state_dict().values(), model.memory.state_dict().values()):
        torch.testing.assert_close(a, b)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (2, 4 + 8)
    with pytest.raises(FileNotFoundError, match="record"):
        load_dream_env(v, m, str(tmp_path / "missing"), DISCRETE.action_space)


# -- Dreamer's RSSM as a WorldModel ------------------------------------------------------


def _vector_episode(length: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    is_first = np.zeros(length, bool)
    is_first[0] = True
    is_last = np.zeros(length, bool)
    is_last[-1] = True
    return {
        "obs": rng.normal(size=(length, 4)).astype(np.float32),
        "action": rng.integers(0, 2, length),
        "reward": np.ones(length, np.float32),
        "is_first": is_first,
        "is_last": is_last,
        "is_terminal": is_last.copy(),
    }


@pytest.fixture(scope="module")
def rssm():
    torch.manual_seed(0)
    return Dreamer(env_spec(EnvConfig(id="CartPole-v1")), **DREAMER_TINY).wm.eval().requires_grad_(False)


def test_rssm_posterior_states_follow_the_recurrence(rssm):
    episode = _vector_episode(5, seed=0)
    states = rssm.posterior_states(episode)
    assert set(states) == {"h", "z", "idx"} and states["h"].shape == (5, 16) and states["z"].shape == (5, 16)
    actions = rssm.actions.encode(torch.as_tensor(episode["action"]))
    for t in range(1, 5):  # h_t = GRU(z_{t-1}, a_{t-1}, h_{t-1}): the posterior path's recurrence
        prev = {"h": states["h"][t - 1 : t], "z": states["z"][t - 1 : t]}
        torch.testing.assert_close(states["h"][t : t + 1], rssm._recurrent(prev, rssm.img_in_a(actions[t - 1 : t])))
    # a one-hot latent per group, and idx pointing at its ones
    torch.testing.assert_close(states["idx"], rssm.onehot_index(states["z"]))
    # observe_step at is_first is initial_state (same sample): zero state, zero action first
    obs = torch.as_tensor(episode["obs"][:2])
    torch.manual_seed(1)
    first = rssm.observe_step(rssm.zero_state(2), rssm.actions.zeros(2), obs, torch.ones(2, dtype=torch.bool))
    torch.manual_seed(1)
    init = rssm.initial_state(obs)
    torch.testing.assert_close(first["h"], init["h"])
    torch.testing.assert_close(first["z"], init["z"])


@pytest.mark.parametrize("observation", ["features", "decoded"])
def test_dream_over_the_rssm_passes_gymnasium_env_checker(rssm, observation):
    bank = start_states(rssm, [_vector_episode(6, seed=s) for s in range(2)], where="all")
    assert bank["h"].shape == (10, 16)
    env = DreamSingleEnv(
        DreamEnv(rssm, gym.spaces.Discrete(2), bank, num_envs=1, max_episode_steps=15, observation=observation)
    )
    assert not _checked(env)
    obs, _ = env.reset(seed=3)
    assert obs.shape == ((16 + 16,) if observation == "features" else (4,))
    assert obs.dtype == np.float32 and env.render() is None  # vector observations: nothing to render

    # seeded dreams reproduce (the prior's samples come from the env's generator)
    def run(seed):
        out = [env.reset(seed=seed)[0]]
        for t in range(6):
            out.append(env.step(t % 2)[0])
        return np.stack(out)

    np.testing.assert_array_equal(run(5), run(5))
    assert not np.array_equal(run(5), run(6))


def test_dream_over_a_pixel_rssm_renders_decoded_frames():
    torch.manual_seed(0)
    spec = env_spec(EnvConfig(id="CartPole-v1", pixels=True, size=(64, 64)))
    wm = Dreamer(spec, **DREAMER_TINY).wm.eval().requires_grad_(False)
    episode = {
        "obs": np.random.default_rng(0).integers(0, 256, (3, 64, 64, 3), dtype=np.uint8),
        "action": np.array([0, 1, 0]),
        "is_first": np.array([True, False, False]),
    }
    env = DreamEnv(wm, spec.action_space, start_states(wm, [episode], where="all"), num_envs=2, observation="decoded")
    obs, _ = env.reset(seed=0)
    assert obs.shape == (2, 64, 64, 3) and obs.dtype == np.uint8
    env.step(np.array([1, 0]))
    frames = env.render()
    assert frames.shape == (2, 64, 64, 3) and frames.dtype == np.uint8
    assert not _checked(DreamSingleEnv(DreamEnv(wm, spec.action_space, env.starts, num_envs=1, max_episode_steps=5)))


# -- a Dreamer's dream as a gymnasium id (any agent trains inside it) ---------------------


@pytest.fixture(scope="module")
def dream_files(tmp_path_factory):
    """A tiny Dreamer checkpoint of CartPole-v1 and a store of two recorded episodes."""
    root = tmp_path_factory.mktemp("dream")
    torch.manual_seed(0)
    dreamer = Dreamer(env_spec(EnvConfig(id="CartPole-v1")), **DREAMER_TINY)
    ckpt = root / "dreamer.ckpt"
    torch.save(
        {
            "state_dict": dreamer.state_dict(),
            "hyper_parameters": dict(dreamer.hparams),
            "pytorch-lightning_version": pl.__version__,
        },
        ckpt,
    )
    store = EpisodeStore(root / "episodes")
    for seed in range(2):
        store.add(_vector_episode(6, seed))
    return {"dreamer_ckpt": str(ckpt), "episodes": str(root / "episodes"), "max_episode_steps": 9}


def test_dream_env_id_builds_one_dream_or_a_batch_of_them(dream_files):
    from lightning_wm.envs import DREAM_ENV_ID, EnvError, make_env, make_vector_env

    single = make_env(EnvConfig(id=DREAM_ENV_ID, kwargs=dream_files))
    assert not _checked(single.unwrapped)
    assert single.observation_space.shape == (4,) and single.action_space == gym.spaces.Discrete(2)
    vector = make_vector_env(EnvConfig(id=DREAM_ENV_ID, num_envs=3, kwargs=dream_files))
    assert isinstance(vector, DreamEnv) and vector.num_envs == 3 and vector.max_episode_steps == 9
    obs, _ = vector.reset(seed=4)
    assert obs.shape == (3, 4) and obs.dtype == np.float32
    # the same dreams as a DreamEnv built by hand from the same model and starts
    wm = Dreamer.load_from_checkpoint(dream_files["dreamer_ckpt"], env_spec=env_spec(EnvConfig(id="CartPole-v1"))).wm
    torch.manual_seed(0)  # the seed the factory filters the start rows with
    bank = start_states(wm.eval(), EpisodeStore(dream_files["episodes"]).episodes())
    by_hand = DreamEnv(wm, gym.spaces.Discrete(2), bank, num_envs=3, max_episode_steps=9, observation="decoded")
    np.testing.assert_allclose(obs, by_hand.reset(seed=4)[0], rtol=1e-5, atol=1e-6)
    for t in range(10):  # truncated after 9 steps at the latest, then a fresh dream
        step = vector.step(np.array([t % 2, 1, 0]))
        np.testing.assert_allclose(step[0], by_hand.step(np.array([t % 2, 1, 0]))[0], rtol=1e-5, atol=1e-6)
    assert step[0].shape == (3, 4)
    limited = make_vector_env(EnvConfig(id=DREAM_ENV_ID, num_envs=2, max_episode_steps=4, kwargs=dream_files))
    assert limited.max_episode_steps == 4
    with pytest.raises(EnvError, match="pixels.*real_env"):
        make_vector_env(EnvConfig(id=DREAM_ENV_ID, pixels=True, kwargs=dream_files))
    with pytest.raises(EnvError, match="dreamer_ckpt"):
        make_env(EnvConfig(id=DREAM_ENV_ID, kwargs={"episodes": dream_files["episodes"]}))
    with pytest.raises(FileNotFoundError, match="record"):
        make_vector_env(EnvConfig(id=DREAM_ENV_ID, kwargs={**dream_files, "episodes": dream_files["episodes"] + "x"}))


def test_impala_in_a_dream_evaluates_in_the_real_env(dream_files, monkeypatch):
    """Training unrolls come from the dream, validation episodes from eval_env (the real env)."""
    from lightning_wm.data.modules import UnrollDataModule
    from lightning_wm.envs import DREAM_ENV_ID

    dream = EnvConfig(id=DREAM_ENV_ID, num_envs=2, kwargs=dream_files)
    data = UnrollDataModule(
        dream, unroll_length=4, batch_size=2, eval={"episodes": 2, "envs": 2, "env": EnvConfig(id="CartPole-v1")}
    )
    built = []
    monkeypatch.setattr(
        "lightning_wm.data.collector.make_vector_env",
        lambda config: built.append(config.id) or make_vector_env_real(config),
    )
    episodes = data.evaluate(RandomAgent(data.spec, seed=0))
    assert built == ["CartPole-v1"] and len(episodes) == 2
    assert all(e["length"] == e["return"] for e in episodes)  # CartPole pays 1 per real step
    with pytest.raises(ValueError, match="does not fit"):
        UnrollDataModule(dream, eval={"env": EnvConfig(id="Acrobot-v1")})


def make_vector_env_real(config):
    from lightning_wm.envs import make_vector_env

    return make_vector_env(config)


@pytest.mark.slow
def test_impala_in_dream_config_fits_in_the_dream_and_evaluates_in_the_real_env(dream_files, capsys):
    import json
    from pathlib import Path

    from lightning_wm.cli import main

    config = str(Path(__file__).resolve().parents[1] / "configs/impala/cartpole_in_dream.yaml")
    kwargs = {**dream_files, "real_env": "CartPole-v1", "starts": "all"}
    args = [
        "--config",
        config,
        "--trainer.max_steps",
        "3",
        "--trainer.val_check_interval",
        "3",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.run_name",
        "in-dream",
        "--trainer.log_every_n_steps",
        "1",
        "--data.init_args.env.num_envs",
        "2",
        "--data.init_args.unroll_length",
        "4",
        "--data.init_args.batch_size",
        "2",
        "--data.init_args.eval.episodes",
        "2",
        "--data.init_args.eval.envs",
        "2",
        "--data.init_args.env.kwargs",
        json.dumps(kwargs),
    ]
    cli = main(args=["fit", *args])
    assert cli.trainer.global_step == 3
    logged = cli.trainer.logged_metrics
    assert float(logged["env/steps"]) >= 3 * 2 * 4 and "val/return" in logged
    main(args=["evaluate", *args, "--ckpt_path", "last", "--episodes", "2"])
    assert "return" in capsys.readouterr().out
