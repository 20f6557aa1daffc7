"""World Models controller: parameter count, batched policy math, CMA-ES learning and resume."""

import gymnasium as gym
import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from lightning_wm.agents.worldmodels.controller import Controller
from lightning_wm.agents.worldmodels.controller_net import (
    controller_forward,
    controller_num_params,
    widen_controller_params,
)
from lightning_wm.agents.worldmodels.memory import Memory
from lightning_wm.agents.worldmodels.vision import Vision
from lightning_wm.data.episodes import EpisodeStore
from lightning_wm.data.generations import GenerationDataModule
from lightning_wm.envs import EnvConfig, EnvSpec, env_spec

from support.presets import DREAMER_TINY
from support.unit_fit import quiet_trainer
from support.worldmodels import save_module

torch.set_num_threads(1)

CARRACING = EnvSpec(
    gym.spaces.Box(0, 255, (64, 64, 3), np.uint8),
    gym.spaces.Box(np.array([-1.0, 0.0, 0.0], np.float32), np.ones(3, np.float32)),
    "CarRacing-v3",
)


def test_paper_carracing_controller_has_867_parameters(tmp_path):
    assert controller_num_params(32 + 256, 3) == 867
    vision = save_module(Vision(CARRACING, latent_dim=32), tmp_path / "v.ckpt")
    memory = save_module(Memory(CARRACING, net={"latent_dim": 32, "hidden": 256}), tmp_path / "m.ckpt")
    controller = Controller(
        CARRACING, vision_ckpt=vision, memory_ckpt=memory, es={"popsize": 4, "episodes_per_member": 1}
    )
    assert controller.num_params == 867 and controller.params.numel() == 867
    assert controller.cmaes.N == 867
    # V and M are frozen; only the (gradient-free) CMA-ES weights are a trainable leaf
    assert [n for n, p in controller.named_parameters() if p.requires_grad] == ["params"]
    # act: features [z, h] -> tanh mapped onto the bounds; M's state advances
    obs = torch.randint(0, 256, (5, 64, 64, 3), dtype=torch.uint8)
    with torch.no_grad():
        controller.params.normal_()
    action, state, extras = controller.act(obs, controller.initial_state(5), explore=False)
    assert action.shape == (5, 3) and action.dtype == torch.float32 and extras == {}
    assert (action[:, 0].abs() <= 1).all() and (action[:, 1:] >= 0).all() and (action[:, 1:] <= 1).all()
    assert state["model"]["h"].shape == (5, 256) and state["model"]["z"].shape == (5, 32)
    assert not state["first"].any()
    _, state2, _ = controller.act(obs, state, explore=False)
    assert state2["model"]["h"].abs().sum() > 0  # M has read [z, a] of the first frame


def test_carracing_action_map_clips_the_brake_like_the_paper(tmp_path):
    """With ``action_map [linear, linear, clip]`` zero weights drive (gas 0.5, brake 0), as the
    paper's controller does; the linear mapping presses gas and brake half each."""
    vision = save_module(Vision(CARRACING, latent_dim=4), tmp_path / "v.ckpt")
    obs = torch.randint(0, 256, (2, 64, 64, 3), dtype=torch.uint8)
    linear = Controller(CARRACING, vision_ckpt=vision, es={"popsize": 4})
    paper = Controller(CARRACING, vision_ckpt=vision, es={"popsize": 4}, action_map=("linear", "linear", "clip"))
    torch.testing.assert_close(linear.act(obs, None)[0], torch.tensor([[0.0, 0.5, 0.5]] * 2))
    torch.testing.assert_close(paper.act(obs, None)[0], torch.tensor([[0.0, 0.5, 0.0]] * 2))
    bias = torch.tensor([-3.0, -3.0, 0.5])  # the last 3 of the (4 + 1) * 3 weights are the biases
    with torch.no_grad():
        paper.params[-3:] = bias
    expected = torch.stack([torch.tanh(bias[0]), (torch.tanh(bias[1]) + 1) / 2, torch.tanh(bias[2])])
    torch.testing.assert_close(paper.act(obs, None)[0], expected.expand(2, 3))
    with torch.no_grad():
        paper.params[-1] = -3.0
    assert (paper.act(obs, None)[0][:, 2] == 0).all()  # a negative brake output is no brake
    with pytest.raises(ValueError, match="action_map"):
        Controller(CARRACING, vision_ckpt=vision, action_map=("linear", "clip"))


def test_one_hidden_layer_parameter_count():
    assert controller_num_params(10, 2, hidden=4) == 11 * 4 + 5 * 2


@pytest.mark.parametrize("hidden", [0, 3])
def test_batched_policy_matches_a_per_member_loop(hidden):
    g = torch.Generator().manual_seed(0)
    f, o, b = 5, 2, 6
    p = controller_num_params(f, o, hidden)
    params, feats = torch.randn(b, p, generator=g), torch.randn(b, f, generator=g)
    out = controller_forward(params, feats, f, o, hidden)
    for i in range(b):
        theta, x = params[i], feats[i]
        if hidden == 0:
            expected = theta[: o * f].view(o, f) @ x + theta[o * f :]
        else:
            w1, b1 = theta[: hidden * f].view(hidden, f), theta[hidden * f : hidden * f + hidden]
            rest = theta[hidden * f + hidden :]
            w2, b2 = rest[: o * hidden].view(o, hidden), rest[o * hidden :]
            expected = w2 @ torch.tanh(w1 @ x + b1) + b2
        torch.testing.assert_close(out[i], expected)
    # a single parameter vector broadcasts over the batch
    torch.testing.assert_close(
        controller_forward(params[0], feats, f, o, hidden),
        controller_forward(params[:1].expand(b, -1), feats, f, o, hidden),
    )


def _fit(model, datamodule, steps, ckpt_path=None):
    trainer = quiet_trainer(
        max_steps=steps,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    return trainer


def _cartpole_controller(es=None, **kwargs):
    """A controller of vector CartPole (no V or M); ``es`` updates its small CMA-ES settings."""
    cfg = EnvConfig(id="CartPole-v1", seed=3)
    dm = GenerationDataModule(cfg, eval={"episodes": 2, "envs": 2})
    settings = {"popsize": 8, "episodes_per_member": 2, "sigma0": 0.5, "seed": 1, **(es or {})}
    return Controller(dm.spec, es=settings, **kwargs), dm


def test_one_generation_by_hand_evaluates_the_population_and_moves_the_search():
    """Without a Trainer (the fast lane's check): the controller builds, every member of a
    population plays the real env, and telling CMA-ES their fitness moves its mean."""
    model, dm = _cartpole_controller(es={"popsize": 4, "episodes_per_member": 1})
    solutions = np.asarray(model.cmaes.ask())
    returns = model.evaluate_population(torch.as_tensor(solutions, dtype=torch.float32), 1, seed=0, config=dm.env)
    assert returns.shape == (4,) and (returns >= 1).all() and (returns <= 500).all()
    mean = np.array(model.cmaes.mean, copy=True)
    model.cmaes.tell(list(solutions), list(-returns.double().numpy()))  # cma minimises
    assert model.cmaes.countiter == 1 and not np.array_equal(model.cmaes.mean, mean)


def test_a_saved_and_restored_cma_es_asks_the_same_next_generation(tmp_path):
    """The fast lane's resume check: after two generations told by hand, a checkpoint (through a
    file, as ``fit --ckpt_path last`` reads it) restores a CMA-ES into a fresh controller that
    asks exactly the population the original asks next, and tells it to the same mean."""
    model, _ = _cartpole_controller(es={"popsize": 4})
    for generation in range(2):
        solutions = np.asarray(model.cmaes.ask())
        model.cmaes.tell(list(solutions), list(np.arange(4.0) - generation))
    checkpoint = {}
    model.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, tmp_path / "cma.ckpt")
    restored, _ = _cartpole_controller(es={"popsize": 4})
    restored.on_load_checkpoint(torch.load(tmp_path / "cma.ckpt", weights_only=True))
    assert restored.cmaes is not model.cmaes and restored.cmaes.countiter == 2
    expected, got = np.asarray(model.cmaes.ask()), np.asarray(restored.cmaes.ask())
    assert expected.shape == (4, model.num_params)
    np.testing.assert_array_equal(got, expected)
    fitness = [0.5, -1.0, 2.0, 0.0]
    model.cmaes.tell(list(expected), fitness)
    restored.cmaes.tell(list(got), fitness)
    np.testing.assert_array_equal(restored.cmaes.mean, model.cmaes.mean)
    assert restored.cmaes.sigma == model.cmaes.sigma
    fresh, _ = _cartpole_controller(es={"popsize": 4})  # without the checkpoint: another population
    assert not np.array_equal(np.asarray(fresh.cmaes.ask()), expected)


@pytest.mark.slow
def test_cma_es_learns_vector_cartpole_without_v_and_m():
    model, dm = _cartpole_controller()
    cfg = dm.env
    start = model.evaluate_population(model.params.detach()[None], 4, seed=99, config=cfg).item()
    trainer = _fit(model, dm, 15)  # > 150 after 15 generations for each of the seeds 0-4 (min 260)
    assert trainer.global_step == 15  # one step per generation
    after = model.evaluate_population(model.params.detach()[None], 4, seed=99, config=cfg).item()
    assert start < 20 and after > 150, (start, after)
    assert trainer.callback_metrics["fitness/best"] >= trainer.callback_metrics["fitness/mean"]
    assert trainer.callback_metrics["fitness/mean"] >= trainer.callback_metrics["fitness/worst"]
    episodes = dm.evaluate(model, 2)  # the real-env validation path (act through the Collector)
    assert len(episodes) == 2 and min(e["return"] for e in episodes) > 100


@pytest.mark.slow
def test_resume_continues_the_same_cma_es_state(tmp_path):
    straight, dm = _cartpole_controller(es={"popsize": 4, "episodes_per_member": 1})
    _fit(straight, dm, 4)

    first, dm1 = _cartpole_controller(es={"popsize": 4, "episodes_per_member": 1})
    trainer = _fit(first, dm1, 2)
    ckpt = tmp_path / "gen2.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)  # the CMA-ES is a plain uint8 tensor
    assert saved["cma_es"].dtype == torch.uint8

    resumed, dm2 = _cartpole_controller(es={"popsize": 4, "episodes_per_member": 1})
    trainer2 = _fit(resumed, dm2, 4, ckpt_path=str(ckpt))
    assert trainer2.global_step == 4
    assert resumed.cmaes.countiter == straight.cmaes.countiter == 4
    np.testing.assert_array_equal(resumed.cmaes.mean, straight.cmaes.mean)
    assert resumed.cmaes.sigma == straight.cmaes.sigma
    torch.testing.assert_close(resumed.params, straight.params)


def test_bad_configurations_are_named():
    spec = env_spec(EnvConfig(id="CartPole-v1"))
    with pytest.raises(ValueError, match="memory_ckpt needs vision_ckpt"):
        Controller(spec, memory_ckpt="m.ckpt")
    with pytest.raises(ValueError, match="train_in='dream' needs"):
        Controller(spec, train_in="dream")
    with pytest.raises(ValueError, match="not both"):
        Controller(spec, vision_ckpt="v.ckpt", dreamer_ckpt="d.ckpt")
    with pytest.raises(ValueError, match="use must be"):
        Controller(spec, use="median")
    with pytest.raises(ValueError, match="es.l2_decay"):
        Controller(spec, es={"l2_decay": -1.0})
    with pytest.raises(ValueError, match="es.popsize"):
        Controller(spec, es={"popsize": 1})
    with pytest.raises(ValueError, match="dream.done_mode"):
        Controller(spec, dream={"done_mode": "never"})
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['popsize'\]"):
        Controller(spec, dream={"popsize": 4})
    with pytest.raises(ValueError, match="need a trained V"):
        Controller(CARRACING)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Controller(CARRACING, vision_ckpt="missing.ckpt")


class _SaveAtEnd(pl.Callback):
    def __init__(self, path):
        self.path = path

    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)  # collective; rank 0 writes


@pytest.mark.slow
def test_ddp_splits_the_population_and_matches_one_process(tmp_path, monkeypatch):
    """2 ranks (gloo, spawn): each evaluates half the population; the gathered fitness makes the
    same CMA-ES update as one process evaluating everyone (common episode seeds per member)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # Lightning's spawn launcher leaves an empty mkdtemp folder
    single, dm = _cartpole_controller(es={"popsize": 5, "episodes_per_member": 2})
    _fit(single, dm, 2)

    model, dm2 = _cartpole_controller(es={"popsize": 5, "episodes_per_member": 2})
    path = tmp_path / "ddp.ckpt"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[_SaveAtEnd(str(path))],
    )
    trainer.fit(model, datamodule=dm2)
    restored, _ = _cartpole_controller(es={"popsize": 5, "episodes_per_member": 2})
    restored.on_load_checkpoint(torch.load(path, weights_only=True))
    assert restored.cmaes.countiter == single.cmaes.countiter == 2
    np.testing.assert_allclose(restored.cmaes.mean, single.cmaes.mean, rtol=1e-12, atol=1e-12)


@pytest.mark.slow  # worker processes
def test_population_envs_in_worker_processes_matches_in_process_envs():
    """Stepping a subset of envs in 2 subprocesses gives what in-process envs give."""
    from lightning_wm.population_envs import PopulationEnvs

    config = EnvConfig(id="CartPole-v1", pixels=True, size=(16, 16), crop=(160, 0, 160, 600))
    local, remote = PopulationEnvs(config, 5), PopulationEnvs(config, 5, workers=2)
    try:
        seeds = [11, 12, 13, 14, 15]
        np.testing.assert_array_equal(local.reset(seeds), remote.reset(seeds))
        rng = np.random.default_rng(0)
        for index in (np.arange(5), np.array([4, 1, 2]), np.array([3]), np.array([0, 2, 4, 1])):
            actions = rng.integers(0, 2, len(index))
            for a, b in zip(local.step(index, actions), remote.step(index, actions)):
                np.testing.assert_array_equal(a, b)
    finally:
        local.close()
        remote.close()
    assert remote._procs == []


@pytest.mark.slow  # worker processes
def test_population_envs_worker_errors_are_reported():
    from lightning_wm.population_envs import PopulationEnvs

    pool = PopulationEnvs(EnvConfig(id="CartPole-v1"), 2, workers=2)
    try:
        pool.reset([0, 1])
        with pytest.raises(RuntimeError, match="env worker"):
            pool.step(np.arange(2), np.array([[0.5, 0.5], [0.1, 0.2]]))  # not a Discrete action
    finally:
        pool.close()


@pytest.mark.slow  # worker processes
def test_population_envs_workers_end_on_terminate_despite_an_inherited_sigterm_handler():
    """Lightning installs a SIGTERM handler that only sets a flag; forked workers must not keep it
    (else multiprocessing's terminate() at interpreter exit waits for them forever)."""
    import signal

    from lightning_wm.population_envs import PopulationEnvs

    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        pool = PopulationEnvs(EnvConfig(id="CartPole-v1"), 2, workers=2)
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        pool.reset([0, 1])
        for proc in pool._procs:
            proc.terminate()
            proc.join(timeout=10)
            assert not proc.is_alive()
    finally:
        pool.close()


# -- HumbleRL's options: l2_decay, best and mean weights ---------------------------------


def test_l2_penalty_is_humblerls_weight_decay():
    from lightning_wm.agents.worldmodels.controller import l2_penalty

    solutions = torch.tensor([[1.0, 2.0], [0.0, 0.0], [-3.0, 1.0]])
    # l2_decay * mean(theta^2) per member (HumbleRL / estool: compute_weight_decay)
    torch.testing.assert_close(l2_penalty(solutions, 0.01), torch.tensor([0.025, 0.0, 0.05], dtype=torch.float64))


@pytest.mark.slow
def test_fitness_is_penalised_and_the_best_member_is_kept(monkeypatch):
    """With equal returns the L2 penalty alone ranks the members: the smallest-norm member of
    all generations is the best one; the mean is CMA-ES's favourite."""
    model, dm = _cartpole_controller(es={"popsize": 6, "episodes_per_member": 1, "l2_decay": 1.0, "sigma0": 1.0})
    told = []
    monkeypatch.setattr(model, "evaluate_population", lambda mine, *a, **k: torch.full((mine.shape[0],), 10.0))
    tell = model.cmaes.tell
    monkeypatch.setattr(model.cmaes, "tell", lambda x, f: (told.append((np.asarray(x), np.asarray(f))), tell(x, f)))
    _fit(model, dm, 3)
    members = np.concatenate([x for x, _ in told])
    fitness = -np.concatenate([f for _, f in told])
    np.testing.assert_allclose(fitness, 10.0 - (members**2).mean(1))
    best = int(fitness.argmax())
    np.testing.assert_allclose(model.best_params.numpy(), members[best], rtol=1e-6)
    assert float(model.best_fitness) == pytest.approx(fitness[best])
    np.testing.assert_allclose(model.params.detach().numpy(), model.cmaes.result.xfavorite, rtol=1e-6)
    # `use` picks which of the two acts
    assert torch.equal(model.acting_params, model.params.detach())
    model.use = "best"
    assert torch.equal(model.acting_params, model.best_params)


@pytest.mark.slow
def test_both_solutions_are_in_the_checkpoint_and_evaluate_picks_one(tmp_path):
    model, dm = _cartpole_controller(es={"popsize": 4, "episodes_per_member": 1})
    trainer = _fit(model, dm, 3)
    path = tmp_path / "c.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert {"params", "best_params", "best_fitness"} <= set(saved["state_dict"])
    assert "use" not in saved["hyper_parameters"]  # not a model setting: evaluate may choose
    obs = torch.tensor([[0.01, 0.5, -0.02, -0.6], [0.0, -0.5, 0.03, 0.7]])
    for use in ("mean", "best"):
        fresh, _ = _cartpole_controller(es={"popsize": 4, "episodes_per_member": 1}, use=use)
        fresh.on_load_checkpoint(saved)
        fresh.load_state_dict(saved["state_dict"])
        expected = saved["state_dict"]["params" if use == "mean" else "best_params"]
        torch.testing.assert_close(fresh.acting_params, expected)
        action, _, _ = fresh.act(obs, None)
        torch.testing.assert_close(action, fresh._act(expected, obs))


# -- the controller over Dreamer's RSSM ---------------------------------------------------


@pytest.mark.slow
def test_controller_on_dreamers_world_model_in_the_dream_and_the_real_env(tmp_path):
    from lightning_wm.agents.dreamer import Dreamer

    model_dm = GenerationDataModule(EnvConfig(id="CartPole-v1", seed=3), eval={"episodes": 1, "envs": 1})
    torch.manual_seed(0)
    dreamer = Dreamer(model_dm.spec, **DREAMER_TINY)
    ckpt = save_module(dreamer, tmp_path / "dreamer.ckpt")
    store = EpisodeStore(tmp_path / "episodes")
    rng = np.random.default_rng(0)
    for _ in range(2):
        store.add(
            {
                "obs": rng.normal(size=(5, 4)).astype(np.float32),
                "action": rng.integers(0, 2, 5),
                "reward": np.ones(5, np.float32),
                "is_first": np.eye(1, 5, dtype=bool)[0],
                "is_last": np.eye(1, 5, 4, dtype=bool)[0],
                "is_terminal": np.eye(1, 5, 4, dtype=bool)[0],
            }
        )
    controller = Controller(
        model_dm.spec,
        dreamer_ckpt=ckpt,
        es={"popsize": 3, "episodes_per_member": 1},
        train_in="dream",
        dream={"dir": str(tmp_path / "episodes"), "starts": "all", "max_steps": 6, "reward": "survival"},
        max_episode_steps=20,
    )
    assert controller.in_dim == 16 + 16 and controller.num_params == (32 + 1) * 2
    assert controller.dream_starts_bank()["h"].shape == (8, 16)  # 2 episodes x 4 rows that are not last
    torch.testing.assert_close(
        controller.world_model.state_dict()["gru.linear.weight"], dreamer.wm.state_dict()["gru.linear.weight"]
    )
    _fit(controller, model_dm, 1)
    assert controller.cmaes.countiter == 1
    # acting in the real env filters real observations through the RSSM's posterior
    real = controller.evaluate_population(
        torch.randn(2, controller.num_params), 1, seed=0, where="real", config=model_dm.env
    )
    assert real.shape == (2,) and (real >= 1).all() and (real <= 20).all()
    episodes = model_dm.evaluate(controller, 1)
    assert len(episodes) == 1


def test_explore_noise_replaces_actions_only_when_exploring():
    model, _ = _cartpole_controller(es={"popsize": 4, "episodes_per_member": 1}, explore_noise=0.5)
    with torch.no_grad():
        model.params.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0, 1.0]))  # always action 1
    obs = torch.zeros(2000, 4)
    greedy, _, _ = model.act(obs, None, explore=False)
    assert (greedy == 1).all()
    noisy, _, _ = model.act(obs, None, explore=True)
    assert 0.2 < (noisy == 0).float().mean() < 0.3  # half replaced, half of those by the other action
    with pytest.raises(ValueError, match="explore_noise"):
        _cartpole_controller(explore_noise=1.5)


@pytest.mark.slow
def test_init_params_ckpt_starts_the_search_from_another_controllers_mean(tmp_path):
    trained, dm = _cartpole_controller(es={"popsize": 4, "episodes_per_member": 1})
    trainer = _fit(trained, dm, 3)
    path = tmp_path / "round1.ckpt"
    trainer.save_checkpoint(path)
    mean = trained.params.detach().clone()
    assert mean.abs().sum() > 0

    warm, _ = _cartpole_controller(
        es={"popsize": 4, "episodes_per_member": 1, "sigma0": 0.05}, init_params_ckpt=str(path)
    )
    torch.testing.assert_close(warm.params.detach(), mean)
    np.testing.assert_allclose(warm.cmaes.mean, mean.double().numpy(), rtol=0, atol=1e-7)
    assert warm.cmaes.sigma == 0.05 and warm.cmaes.countiter == 0  # a new search around that mean
    assert "init_params_ckpt" not in warm.hparams  # only a start: not a setting a checkpoint keeps
    # the first generation is drawn around the saved mean, not around zero
    members = torch.as_tensor(np.array(warm.cmaes.ask()))
    assert (members - mean).abs().max() < 0.3 < mean.abs().max()

    cold, _ = _cartpole_controller(es={"popsize": 4, "episodes_per_member": 1})
    assert cold.params.abs().sum() == 0

    spec = env_spec(EnvConfig(id="CartPole-v1"))
    with pytest.raises(ValueError, match="holds 10 controller weights, this controller has 30"):
        Controller(env_spec=spec, hidden=4, es={"popsize": 4}, init_params_ckpt=str(path))
    other = tmp_path / "not_a_controller.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1)}}, other)
    with pytest.raises(ValueError, match="not a Controller checkpoint"):
        Controller(env_spec=spec, es={"popsize": 4}, init_params_ckpt=str(other))


def test_widen_controller_params_appends_zero_weights_for_the_new_features():
    # W [2 outputs, 2 features] = [[1, 2], [3, 4]], b = [5, 6] -> W [2, 3] with a zero third column
    params = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    np.testing.assert_array_equal(widen_controller_params(params, 2, 3, 2), [1, 2, 0, 3, 4, 0, 5, 6])
    with pytest.raises(ValueError, match="cannot widen"):
        widen_controller_params(params, 2, 1, 2)
    with pytest.raises(ValueError, match="cannot widen"):
        widen_controller_params(params[:5], 2, 3, 2)


def test_a_v_only_controller_starts_a_z_h_controller_that_acts_the_same(tmp_path):
    vision = save_module(Vision(CARRACING, latent_dim=8), tmp_path / "v.ckpt")
    memory = save_module(Memory(CARRACING, net={"latent_dim": 8, "hidden": 16}), tmp_path / "m.ckpt")
    es = {"popsize": 4, "episodes_per_member": 1}
    v_only = Controller(CARRACING, vision_ckpt=vision, es=es)
    with torch.no_grad():
        v_only.params.copy_(torch.randn(v_only.num_params, generator=torch.Generator().manual_seed(0)))
    path = save_module(v_only, tmp_path / "c_v.ckpt")
    z_h = Controller(CARRACING, vision_ckpt=vision, memory_ckpt=memory, es=es, init_params_ckpt=path)
    assert (v_only.num_params, z_h.num_params) == ((8 + 1) * 3, (8 + 16 + 1) * 3)
    z, h = torch.randn(5, 8), torch.randn(5, 16)
    torch.testing.assert_close(
        controller_forward(z_h.params.detach(), torch.cat([z, h], -1), 24, 3),
        controller_forward(v_only.params.detach(), z, 8, 3),
    )
    with pytest.raises(ValueError, match="holds 27 controller weights"):  # a hidden layer is not widened
        Controller(CARRACING, vision_ckpt=vision, memory_ckpt=memory, hidden=4, es=es, init_params_ckpt=path)


def test_fitness_figure_draws_each_curve_by_generation():
    from lightning_wm.agents.worldmodels.figures import FITNESS_CURVES, fitness_figure

    history = np.array([[10.0, 5.0, 1.0, 9.5], [12.0, 7.0, 2.0, 11.5], [11.0, 8.0, 4.0, 11.5]])
    (ax,) = fitness_figure(history).get_axes()
    assert ax.get_xlabel() == "CMA-ES generation" and "return" in ax.get_ylabel()
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == set(FITNESS_CURVES)
    for i, name in enumerate(FITNESS_CURVES):
        assert lines[name].get_xdata().tolist() == [1, 2, 3]
        assert lines[name].get_ydata().tolist() == history[:, i].tolist()
    with pytest.raises(ValueError, match=r"\[G >= 1, 4\]"):
        fitness_figure(np.zeros((0, 4)))


@pytest.mark.slow
def test_fitness_by_generation_is_logged_and_kept_in_the_checkpoint(tmp_path):
    """Every validation logs the figure ``fitness/by_generation`` to TensorBoard, and the curve's
    history (best, mean, worst, best ever per generation) is in the checkpoint: a resumed search
    draws the whole curve."""
    from pytorch_lightning.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model, dm = _cartpole_controller(es={"popsize": 4, "episodes_per_member": 1})
    logger = TensorBoardLogger(str(tmp_path), name="c")
    trainer = quiet_trainer(
        accelerator="cpu",
        max_steps=2,
        val_check_interval=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=logger,
    )
    trainer.fit(model, datamodule=dm)
    assert len(model.fitness_history) == 2
    for best, mean, worst, best_ever in model.fitness_history:
        assert best >= mean >= worst >= 1 and best_ever <= 500
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    events.Reload()
    images = events.Images("fitness/by_generation")
    assert [i.step for i in images] == [1, 2] and images[-1].width > 0
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    restored, _ = _cartpole_controller(es={"popsize": 4, "episodes_per_member": 1})
    restored.on_load_checkpoint(torch.load(tmp_path / "c.ckpt", weights_only=True))
    assert restored.fitness_history == model.fitness_history
