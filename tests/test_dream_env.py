"""DreamEnv: gymnasium's env checker on the one-env view, next-step autoreset, truncation,
reproducibility, rendering; V+M as a WorldModel; a controller trained inside the dream."""

import warnings

import gymnasium as gym
import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from gymnasium.utils.env_checker import check_env

from lightning_wm.agents.controller import Controller
from lightning_wm.agents.memory import Memory
from lightning_wm.agents.vision import Vision
from lightning_wm.agents.vm_model import VisionMemoryModel, initial_latents_from_store
from lightning_wm.data.collector import Collector
from lightning_wm.data.episodes import EpisodeStore
from lightning_wm.dream_env import DreamEnv, DreamSingleEnv
from lightning_wm.envs import EnvSpec
from lightning_wm.policies import RandomAgent
from lightning_wm.world_model import rollout

torch.set_num_threads(1)

DISCRETE = EnvSpec(gym.spaces.Box(0, 255, (64, 64, 3), np.uint8), gym.spaces.Discrete(2), "Synthetic")
CONTINUOUS = EnvSpec(
    gym.spaces.Box(0, 255, (64, 64, 3), np.uint8),
    gym.spaces.Box(np.array([-1.0, 0.0], np.float32), np.ones(2, np.float32)),
    "SyntheticContinuous",
)


def _model(spec=DISCRETE, z=4, hidden=8) -> VisionMemoryModel:
    torch.manual_seed(0)
    return VisionMemoryModel(Vision(spec, z_size=z, depth=4), Memory(spec, z_size=z, hidden_size=hidden, num_mixtures=2))


def _dream(spec=DISCRETE, num_envs=3, **kwargs) -> DreamEnv:
    model = _model(spec)
    g = torch.Generator().manual_seed(0)
    mu, logvar = torch.randn(5, 4, generator=g), torch.full((5, 4), -1.0)
    return DreamEnv(model, spec.action_space, mu, logvar, num_envs=num_envs, **kwargs)


@pytest.mark.parametrize("spec", [DISCRETE, CONTINUOUS])
def test_single_env_view_passes_gymnasium_env_checker(spec):
    env = DreamSingleEnv(_dream(spec, num_envs=1, max_episode_steps=20))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env, skip_render_check=False)
    # only advisory notes may remain: z is unbounded, and an env not made by gym.make has no spec
    allowed = ("infinity", "not having a spec")
    problems = [str(w.message) for w in caught if not any(a in str(w.message) for a in allowed)]
    assert not problems, problems
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


def test_next_step_autoreset_after_termination():
    env = _dream(num_envs=2, done_threshold=-1.0)  # every step terminates
    env.reset(seed=0)
    _, r1, term1, trunc1, _ = env.step(np.array([0, 1]))
    assert term1.all() and not trunc1.any()
    obs2, r2, term2, trunc2, _ = env.step(np.array([1, 1]))  # the reset step: reward 0, not done
    assert (r2 == 0).all() and not term2.any() and not trunc2.any()
    _, _, term3, _, _ = env.step(np.array([1, 0]))
    assert term3.all()


def test_truncation_after_max_episode_steps_and_survival_reward():
    env = _dream(num_envs=2, done_threshold=2.0, max_episode_steps=3, reward="survival")
    env.reset(seed=0)
    flags = []
    for _ in range(5):
        _, reward, terminated, truncated, _ = env.step(np.zeros(2, np.int64))
        flags.append((reward[0], bool(terminated[0]), bool(truncated[0])))
    assert flags == [(1, False, False), (1, False, False), (1, False, True), (0, False, False), (1, False, False)]


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
        model = _model()
        env = DreamEnv(model, DISCRETE.action_space, torch.ones(1, 4), None, num_envs=2, temperature=temperature)
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
    collector = Collector(env, RandomAgent(spec, seed=0), seed=0, spec=spec)
    finished = collector.collect(10)
    assert [e["length"] for e in finished] == [4.0, 4.0, 4.0, 4.0]


def test_vision_memory_model_is_a_world_model():
    model = _model()
    obs = torch.randint(0, 256, (3, 64, 64, 3), dtype=torch.uint8)
    start = model.initial_state(obs)
    assert model.features(start).shape == (3, 12)
    actor = torch.nn.Linear(12, 2)
    out = rollout(model, start, lambda f: torch.softmax(actor(f), -1), horizon=4)
    assert out["features"].shape == (5, 3, 12) and out["rewards"].shape == (4, 3)
    assert ((out["dones"] >= 0) & (out["dones"] <= 1)).all()
    assert all(not p.requires_grad for p in model.parameters())
    assert model.decode(start).shape == (3, 64, 64, 3)


def _save(module, path):
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                "pytorch-lightning_version": pl.__version__}, path)
    return str(path)


def test_controller_trains_inside_the_dream(tmp_path):
    model = _model()
    v, m = _save(model.vision, tmp_path / "v.ckpt"), _save(model.memory, tmp_path / "m.ckpt")
    store = EpisodeStore(tmp_path / "latents")
    for i in range(3):
        store.add({"mu": np.full((4, 4), i, np.float32), "logvar": np.zeros((4, 4), np.float32)})
    mu, logvar = initial_latents_from_store(store)
    assert mu.shape == (3, 4) and mu[:, 0].tolist() == [0.0, 1.0, 2.0]
    controller = Controller(DISCRETE, vision_ckpt=v, memory_ckpt=m, popsize=4, episodes_per_member=2,
                            train_in="dream", dream_dir=str(tmp_path / "latents"), dream_max_steps=7,
                            dream_done_threshold=2.0, dream_reward="survival")
    solutions = torch.randn(4, controller.num_params)
    fitness = controller.evaluate_population(solutions, 2, seed=0)
    torch.testing.assert_close(fitness, torch.full((4,), 7.0))  # never done: survive to truncation
    from lightning_wm.data.generations import GenerationDataModule

    class _Synthetic(GenerationDataModule):
        def __init__(self):
            pl.LightningDataModule.__init__(self)
            self.env, self.spec = None, DISCRETE

    trainer = pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(controller, datamodule=_Synthetic())
    assert controller.es.countiter == 2 and trainer.callback_metrics["fitness/mean"] == 7.0


def test_load_dream_env_from_checkpoints_matches_the_models(tmp_path):
    from lightning_wm.agents.vm_model import load_dream_env

    model = _model()
    v, m = _save(model.vision, tmp_path / "v.ckpt"), _save(model.memory, tmp_path / "m.ckpt")
    store = EpisodeStore(tmp_path / "latents")
    for i in range(2):
        store.add({"mu": np.full((3, 4), i, np.float32), "logvar": np.full((3, 4), -20.0, np.float32)})
    env = load_dream_env(v, m, str(tmp_path / "latents"), DISCRETE.action_space, num_envs=2, max_episode_steps=5,
                         temperature=0.5)
    assert env.temperature == 0.5 and env.model.temperature == 0.5
    assert sorted(env.start_mu[:, 0].tolist()) == [0.0, 1.0]
    for a, b in zip(env.model.memory.state_dict().values(), model.memory.state_dict().values()):
        torch.testing.assert_close(a, b)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (2, 4 + 8)
    with pytest.raises(FileNotFoundError, match="record"):
        load_dream_env(v, m, str(tmp_path / "missing"), DISCRETE.action_space)
