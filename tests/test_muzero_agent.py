"""The MuZero LightningModule: acting, frame stacks, the unroll losses, priorities, reanalyse
(only the selected rows, stale rows skipped), the target network, and fits from the command line."""

from __future__ import annotations

import shutil
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tb_scalars import logged_scalars

from lightning_wm.agents.muzero import MuZero, MuZeroPolicy
from lightning_wm.agents.muzero.agent import push_frame, reanalyze_td_steps, window_stacks
from lightning_wm.data.modules import ReplayDataModule
from lightning_wm.data.samplers import WindowSampler
from lightning_wm.envs import EnvConfig, EnvSpec, env_spec
from lightning_wm.nn import dists
from lightning_wm.nn.blocks import scale_gradient, soft_update

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(latent_dim=16, hidden=16, layers=1, head_hidden=8, support_size=10, num_simulations=4, lr=1e-3)


def cartpole_spec() -> EnvSpec:
    return env_spec(EnvConfig("CartPole-v1"))


def filled_datamodule(
    model: MuZero,
    rows: int = 120,
    num_envs: int = 2,
    capacity: int = 1000,
    sampler: WindowSampler | None = None,
    prioritized: bool = False,
) -> ReplayDataModule:
    """A datamodule whose buffer holds ``rows`` rows per env acted by ``model`` (no prefill)."""
    dm = ReplayDataModule(
        EnvConfig("CartPole-v1", num_envs=num_envs, seed=3),
        batch_size=8,
        sampler=sampler or WindowSampler(model.hparams.num_unroll_steps, model.hparams.td_steps),
        prefill=0,
        replay={"capacity": capacity, "prioritized": prioritized},
    )
    dm.setup("fit")
    dm.collector.set_agent(model)
    dm.collector.collect(rows)
    return dm


def quiet(model: MuZero) -> MuZero:
    model.log = lambda *args, **kwargs: None  # training_step outside a Trainer
    return model


# -- small pieces ------------------------------------------------------------------------------------
def test_scale_gradient_and_soft_update():
    x = torch.tensor([1.0, -2.0], requires_grad=True)
    y = scale_gradient(x, 0.5)
    assert torch.equal(y, x)
    (y * torch.tensor([2.0, 4.0])).sum().backward()
    assert torch.equal(x.grad, torch.tensor([1.0, 2.0]))
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    before = a.weight.detach().clone()
    soft_update(a, b, 0.25)
    torch.testing.assert_close(a.weight, 0.75 * before + 0.25 * b.weight)
    soft_update(a, b, 1.0)
    assert torch.equal(a.weight, b.weight)


def test_reanalyze_td_steps_linear_in_age():
    age = torch.tensor([0, 50, 100, 1000])
    assert reanalyze_td_steps(age, 5, None).tolist() == [5, 5, 5, 5]
    # ALF's LinearTdStepFunc(max_bootstrap_age=100, min_td_steps=1): ceil(1 + 4 * relu(1 - age / 100))
    assert reanalyze_td_steps(age, 5, (100, 1)).tolist() == [5, 3, 1, 1]


def test_window_stacks_match_the_acting_frame_stack():
    # one stream: an episode of 3 rows, then one of 5; acting stacks restart from zeros at is_first
    frames = torch.arange(1, 9, dtype=torch.uint8).view(8, 1, 1, 1).expand(8, 2, 2, 1)
    is_first = torch.tensor([1, 0, 0, 1, 0, 0, 0, 0], dtype=torch.bool)
    acting, stacks = [], torch.zeros(1, 3, 2, 2, 1, dtype=torch.uint8)
    for t in range(8):
        if is_first[t]:
            stacks = torch.zeros_like(stacks)
        stacks = push_frame(stacks, frames[t : t + 1])
        acting.append(stacks[0])
    # a window with history 2 from position t = 4 (rows 2..7): row 2 belongs to the previous episode
    mask = torch.tensor([[False, True, True, True, True, True]])
    out = window_stacks(frames[2:8].unsqueeze(0), mask, 3)
    assert out.shape == (1, 4, 3, 2, 2, 1)
    for j in range(4):
        assert torch.equal(out[0, j], acting[4 + j])


# -- acting ------------------------------------------------------------------------------------------
def test_act_returns_search_extras_and_is_greedy_without_exploration():
    torch.manual_seed(0)
    model = MuZero(cartpole_spec(), **SMALL)
    obs = torch.randn(5, 4)
    action, state, extras = model.act(obs, None, explore=False)
    assert action.shape == (5,) and action.dtype == torch.int64 and state is None
    assert extras["root_value"].shape == (5,) and extras["visit_probs"].shape == (5, 2)
    torch.testing.assert_close(extras["visit_probs"].sum(-1), torch.ones(5))
    assert torch.equal(model.act(obs, None, explore=False)[0], action)  # no noise, argmax: repeatable
    assert model.search_stats.count == 0  # evaluation is not counted in the search statistics
    model.act(obs, None, explore=True)
    assert model.search_stats.count == 5 and model.search_stats.means()["search/depth"] >= 1


def test_acting_copy_acts_like_the_module_and_carries_the_temperature():
    torch.manual_seed(0)
    model = MuZero(cartpole_spec(), temperature_boundaries=[10], temperature_values=[1.0, 0.25], **SMALL)
    policy = model.acting_copy()
    assert isinstance(policy, MuZeroPolicy) and not any(p.requires_grad for p in policy.parameters())
    assert float(policy.temperature) == 1.0 and "temperature" in policy.state_dict()
    obs = torch.randn(6, 4)
    a, _, extras = model.act(obs, None, explore=False)
    b, _, extras_b = policy.act(obs, None, explore=False)
    assert torch.equal(a, b)
    torch.testing.assert_close(extras["visit_probs"], extras_b["visit_probs"])
    torch.testing.assert_close(extras["root_value"], extras_b["root_value"])


@pytest.mark.skipif(
    not any(shutil.which(c) for c in ("c++", "g++", "clang++")), reason="torch.compile on CPU needs a C++ compiler"
)
def test_compile_search_acts_like_the_eager_search():
    """``compile_search`` reaches the search of the module and of its acting copy (the one the
    actor processes run) and changes nothing but the speed."""
    torch.manual_seed(0)
    eager = MuZero(cartpole_spec(), **SMALL)
    compiled = MuZero(cartpole_spec(), compile_search=True, **SMALL)
    compiled.load_state_dict(eager.state_dict())
    assert compiled.settings.compile and not eager.settings.compile
    obs = torch.randn(5, 4)
    a, _, extras = eager.act(obs, None, explore=False)
    for agent in (compiled, compiled.acting_copy()):
        b, _, extras_b = agent.act(obs, None, explore=False)
        assert torch.equal(a, b)
        torch.testing.assert_close(extras["visit_probs"], extras_b["visit_probs"])
        torch.testing.assert_close(extras["root_value"], extras_b["root_value"])


def test_frame_stack_acting_state():
    space = gym.spaces.Box(0, 255, (64, 64, 1), np.uint8)
    spec = EnvSpec(space, gym.spaces.Discrete(3), "frames")
    model = MuZero(spec, frame_stack=4, channels=8, blocks=1, head_hidden=8, support_size=5, num_simulations=2)
    state = model.initial_state(2)
    assert state.shape == (2, 4, 64, 64, 1) and state.dtype == torch.uint8 and not state.any()
    frame = torch.full((2, 64, 64, 1), 7, dtype=torch.uint8)
    action, state, extras = model.act(frame, state, explore=True)
    assert action.shape == (2,) and torch.equal(state[:, -1], frame) and not state[:, :-1].any()


# -- the unroll losses ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bootstrap,step_weights", [("target_network", "pseudocode"), ("stored", "pseudocode"), ("target_network", "equal")]
)
def test_unroll_losses_match_a_per_sample_computation(bootstrap, step_weights):
    """The batched loss against a slow per-sample, per-step computation from the same targets."""
    torch.manual_seed(1)
    K, n = 3, 2
    model = quiet(
        MuZero(
            cartpole_spec(),
            num_unroll_steps=K,
            td_steps=n,
            train_game_over_function=True,
            bootstrap_value=bootstrap,
            unroll_step_weights=step_weights,
            train_repr_prediction=True,
            reward_loss_weight=0.7,
            repr_loss_weight=0.3,
            recurrent_gradient_scaling_factor=1.0,
            **SMALL,
        )
    )
    with torch.no_grad():  # heads away from their zero init; a target network unlike the model
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    dm = filled_datamodule(model, rows=60)
    batch = dm.sample_batch()
    batch["weight"] = torch.rand(8) + 0.5
    out = model.training_step(batch, 0)
    # the same targets the step used: bootstrapping from the target network's values
    from lightning_wm.agents.muzero.targets import bootstrap_rows, muzero_targets

    fwd = dict(batch)
    value = batch["root_value"].clone()
    boot = bootstrap_rows(batch["mask"], torch.full((8,), n), K + 1) & ~batch["is_terminal"]
    if bootstrap == "stored":  # only where no search value is stored: the last row of a truncated episode
        boot &= batch["is_last"]
    value[boot] = model.target_model.initial_inference(batch["obs"][boot])["value"]
    if bootstrap == "target_network":  # the choice matters: the target values are not the stored ones
        assert boot.sum() > 8 and not torch.allclose(value[boot], batch["root_value"][boot])
    t = muzero_targets({**fwd, "root_value": value}, num_unroll_steps=K, td_steps=n, discount=model.hparams.discount)
    m = model.model
    total = torch.zeros(())
    for b in range(8):
        state = m.representation(batch["obs"][b : b + 1, 0])
        sample = 0.0
        for k in range(K + 1):
            scale = 1.0 if k == 0 and step_weights == "pseudocode" else 1.0 / K  # "equal": every step 1 / K
            if k > 0:
                r_logits, state = m.dynamics(state, t.actions[b : b + 1, k - 1])
                if t.reward_mask[b, k]:
                    target = dists.h_twohot_encode(t.reward[b, k : k + 1], m.reward_bins)
                    sample += scale * 0.7 * -(target * torch.log_softmax(r_logits, -1)).sum()
                if batch["mask"][b, k]:
                    rep = m.representation(batch["obs"][b : b + 1, k]).detach()
                    sample += scale * 0.3 * (1 - F.cosine_similarity(state.flatten(), rep.flatten(), dim=0))
            p_logits, v_logits = m.prediction(state)
            if t.value_mask[b, k]:
                target = dists.h_twohot_encode(t.value[b, k : k + 1], m.value_bins)
                sample += scale * 0.25 * -(target * torch.log_softmax(v_logits, -1)).sum()
            if t.policy_mask[b, k]:
                sample += scale * -(t.policy[b, k] * torch.log_softmax(p_logits[0], -1)).sum()
            if t.game_over_mask[b, k]:
                sample += scale * F.binary_cross_entropy_with_logits(
                    m.game_over_logit(state)[0], t.game_over[b, k].float()
                )
        total = total + batch["weight"][b] * sample
    torch.testing.assert_close(out["loss"], total / 8, rtol=1e-5, atol=1e-6)
    # priorities: |v(s_0) - z_0| of the network's value at the position
    v0 = m.initial_inference(batch["obs"][:, 0])["value"].detach()
    torch.testing.assert_close(out["priority"], (v0 - t.value[:, 0]).abs() + 1e-6)
    out["loss"].backward()
    assert all(p.grad is not None for p in m.parameters())
    assert not any(p.requires_grad for p in model.target_model.parameters())


def test_consistency_through_projection_heads():
    """With ``projection`` the latent consistency loss compares predictor(projector(unrolled state))
    with projector(representation of the observation reached), the latter without gradient, as in
    EfficientZero; projector and predictor learn."""
    from lightning_wm.agents.muzero.agent import LossSettings, unroll_losses
    from lightning_wm.agents.muzero.targets import muzero_targets

    torch.manual_seed(2)
    K = 3
    model = quiet(
        MuZero(
            cartpole_spec(), num_unroll_steps=K, td_steps=2, train_repr_prediction=True, projection=[12, 10, 6], **SMALL
        )
    )
    m = model.model
    assert m.project(torch.rand(5, 16)).shape == (5, 10) and m.predict_projection(torch.rand(5, 16)).shape == (5, 10)
    batch = filled_datamodule(model, rows=60).sample_batch()
    t = muzero_targets(dict(batch), num_unroll_steps=K, td_steps=torch.full((8,), 2), discount=0.997)
    valid = batch["mask"].bool()
    settings = LossSettings(
        recurrent_gradient_scaling_factor=1.0,
        train_reward_function=False,
        train_policy=False,
        train_repr_prediction=True,
    )
    losses, _ = unroll_losses(m, batch["obs"], t, valid, settings)
    # by hand, for the whole batch at once (batch norm sees the same rows)
    state, unrolled = m.representation(batch["obs"][:, 0]), []
    for k in range(K):
        _, state = m.dynamics(state, t.actions[:, k])
        unrolled.append(state)
    online = m.predictor(m.projector(torch.stack(unrolled, 1).flatten(0, 1))).view(8, K, -1)
    target = m.projector(m.representation(batch["obs"][:, 1 : K + 1].flatten(0, 1))).view(8, K, -1).detach()
    by_hand = ((1 - F.cosine_similarity(online, target, dim=-1)) * valid[:, 1 : K + 1] / K).sum(1)
    torch.testing.assert_close(losses["repr"], by_hand, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(
        losses["repr"],
        unroll_losses(MuZero(cartpole_spec(), num_unroll_steps=K, **SMALL).model, batch["obs"], t, valid, settings)[0][
            "repr"
        ],
    )
    losses["repr"].sum().backward()
    heads = list(m.projector.parameters()) + list(m.predictor.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in heads)
    # no gradient through the target branch: the representation's gradient is the online branch's alone
    grads = [p.grad.clone() for p in m.repr_net.parameters()]
    m.zero_grad()
    by_hand.sum().backward()
    for g, p in zip(grads, m.repr_net.parameters()):
        torch.testing.assert_close(g, p.grad)
    with pytest.raises(ValueError, match="projection is"):
        MuZero(cartpole_spec(), projection=[8, 8], **SMALL)


def test_unknown_unroll_step_weights_are_refused():
    with pytest.raises(ValueError, match="unroll_step_weights must be 'pseudocode' or 'equal'"):
        MuZero(cartpole_spec(), unroll_step_weights="mean", **SMALL)


def test_losses_fall_on_a_fixed_batch():
    torch.manual_seed(2)
    model = quiet(MuZero(cartpole_spec(), num_unroll_steps=3, td_steps=3, **{**SMALL, "lr": 3e-3}))
    dm = filled_datamodule(model, rows=60)
    batch = dm.sample_batch()
    opt = torch.optim.Adam(model.model.parameters(), 3e-3)
    losses = []
    for _ in range(40):
        loss = model.training_step(batch, 0)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0]


def test_a_sampler_whose_windows_are_too_short_is_refused():
    model = quiet(MuZero(cartpole_spec(), num_unroll_steps=3, td_steps=5, **SMALL))
    dm = filled_datamodule(model, rows=30, sampler=WindowSampler(3, 2))
    with pytest.raises(ValueError, match=r"WindowSampler\(num_unroll_steps=3, td_steps=5, history=0\)"):
        model.training_step(dm.sample_batch(), 0)


def test_a_sampler_whose_windows_are_longer_than_needed_warns_once():
    """The model's td_steps lowered without the sampler's: training works on the first rows and
    the user hears, once, that the rest are sampled for nothing and which sampler fits."""
    import warnings

    model = quiet(MuZero(cartpole_spec(), num_unroll_steps=3, td_steps=2, **SMALL))
    dm = filled_datamodule(model, rows=30, sampler=WindowSampler(3, 5))
    with pytest.warns(
        UserWarning, match=r"longer than .* use WindowSampler\(num_unroll_steps=3, td_steps=2, history=0\)"
    ):
        model.training_step(dm.sample_batch(), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.training_step(dm.sample_batch(), 1)  # once is enough
    shifted = quiet(MuZero(cartpole_spec(), num_unroll_steps=3, td_steps=2, **SMALL))  # frame_stack 1
    with pytest.warns(UserWarning, match=r"history is longer than frame_stack - 1 = 0"):
        shifted.training_step(
            filled_datamodule(shifted, rows=30, sampler=WindowSampler(3, 2, history=2)).sample_batch(), 0
        )
    exact = quiet(MuZero(cartpole_spec(), num_unroll_steps=3, td_steps=2, **SMALL))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exact.training_step(filled_datamodule(exact, rows=30).sample_batch(), 0)


# -- reanalyse -------------------------------------------------------------------------------------------
def test_reanalyse_writes_only_the_selected_rows_and_stale_rows_are_skipped():
    torch.manual_seed(3)
    K = 2
    model = quiet(
        MuZero(
            cartpole_spec(),
            num_unroll_steps=K,
            td_steps=3,
            reanalyze_ratio=0.25,
            reanalyze_td_steps=3,
            reanalyze_batch_size=5,
            **SMALL,
        )
    )
    # a ring of 40 rows per env, full: new rows overwrite the oldest
    dm = filled_datamodule(model, rows=60, capacity=80, sampler=WindowSampler(K, 3))
    buffer = dm.buffer
    batch = dm.sample_batch()
    before = {k: buffer.column(k).copy() for k in ("root_value", "visit_probs")}
    out = model.training_step(batch, 0)
    write = out["write"]
    # the written rows are the searched rows of the first round(0.25 * 8) = 2 samples: unroll rows
    # 0..K that belong to the episode and are not its last row
    rows = batch["row_index"][:2, : K + 1]
    searched = (batch["mask"] & ~batch["is_last"])[:2, : K + 1]
    assert sorted(write["index"].tolist()) == sorted(rows[searched].tolist())
    assert torch.equal(write["generation"], batch["row_generation"][:2, : K + 1][searched])
    torch.testing.assert_close(write["columns"]["visit_probs"].sum(-1), torch.ones(len(write["index"])))
    # overwrite the oldest rows of both streams before the feedback arrives (Lightning's prefetch)
    written_before = buffer.rows_written(np.arange(2))  # [2]
    dm.collector.collect(10)
    result = dm.apply_feedback(batch, {"write": write})
    cap = buffer.cap_per_stream
    index = write["index"].numpy()
    current = buffer.generation(index // cap, index % cap) == write["generation"].numpy()
    assert result == {"applied": int(current.sum()), "stale": int((~current).sum())}
    after = {k: buffer.column(k) for k in ("root_value", "visit_probs")}
    stream, slot = index // cap, index % cap
    written = np.zeros(after["root_value"].shape, bool)
    written[stream[current], slot[current]] = True
    fresh = buffer.generation(np.arange(2)[:, None], np.arange(cap)[None]) >= written_before[:, None]  # the new rows
    assert fresh.sum() == 20
    untouched = ~written & ~fresh
    assert np.array_equal(after["root_value"][untouched], before["root_value"][untouched])
    assert np.array_equal(after["visit_probs"][untouched], before["visit_probs"][untouched])
    np.testing.assert_allclose(
        after["root_value"][stream[current], slot[current]], write["columns"]["root_value"].numpy()[current]
    )
    assert current.sum() > 0


def test_reanalyse_targets_come_from_the_target_network_search():
    torch.manual_seed(4)
    K = 2
    model = quiet(
        MuZero(
            cartpole_spec(),
            num_unroll_steps=K,
            td_steps=2,
            reanalyze_ratio=1.0,
            reanalyze_td_steps=2,
            full_reanalyze=True,
            **SMALL,
        )
    )
    dm = filled_datamodule(model, rows=40, sampler=WindowSampler(K, 2))
    batch = dm.sample_batch()
    # a target network that differs from the model: reanalysed values must be its search values
    with torch.no_grad():
        for p in model.target_model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    out = model.training_step(batch, 0)
    from lightning_wm.agents.muzero.agent import search

    searched = batch["mask"] & ~batch["is_last"]
    fresh = search(model.target_model, model.settings, batch["obs"][searched], explore=False)
    order = torch.argsort(out["write"]["index"])
    want = torch.argsort(batch["row_index"][searched])
    torch.testing.assert_close(out["write"]["columns"]["root_value"][order], fresh.root_value[want].float())
    torch.testing.assert_close(out["write"]["columns"]["visit_probs"][order], fresh.visit_probs[want].float())


def test_target_network_follows_every_period_by_tau():
    model = MuZero(cartpole_spec(), target_update_tau=0.5, target_update_period=3, **SMALL)
    with torch.no_grad():
        for p in model.model.parameters():
            p.add_(1.0)
    target = [p.detach().clone() for p in model.target_model.parameters()]
    online = [p.detach().clone() for p in model.model.parameters()]

    assert not model.update_target(2)
    assert all(torch.equal(a, b) for a, b in zip(model.target_model.parameters(), target))
    assert model.update_target(3)
    for a, t0, o in zip(model.target_model.parameters(), target, online):
        torch.testing.assert_close(a, 0.5 * t0 + 0.5 * o)


# -- the command line --------------------------------------------------------------------------------
def _cartpole_args(steps: int, run: str = "run", extra: tuple[str, ...] = ()) -> list[str]:
    """configs/muzero/cartpole.yaml shrunk to a few seconds."""
    return [
        "fit",
        "--config",
        str(ROOT / "configs/muzero/cartpole.yaml"),
        "--seed_everything",
        "7",
        "--trainer.max_steps",
        str(steps),
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.val_check_interval",
        str(steps),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.run_name",
        run,
        "--model.init_args.num_simulations",
        "4",
        "--model.init_args.latent_dim",
        "16",
        "--model.init_args.hidden",
        "16",
        "--data.init_args.batch_size",
        "8",
        "--data.init_args.prefill",
        "40",
        "--data.init_args.env.num_envs",
        "2",
        "--data.init_args.eval.episodes",
        "1",
        "--data.init_args.eval.envs",
        "1",
        *extra,
    ]


def test_cli_fit_cartpole_logs_every_part():
    from lightning_wm.cli import main

    cli = main(
        args=_cartpole_args(
            6, extra=("--model.init_args.reanalyze_ratio", "0.5", "--model.init_args.reanalyze_td_steps", "3")
        )
    )
    assert cli.trainer.global_step == 6
    run = Path("lightning_logs/run")
    for tag in (
        "loss/total",
        "loss/value",
        "loss/reward",
        "loss/policy",
        "replay/priority_mean",
        "replay/priority_max",
        "replay/weight_mean",
        "replay/age",
        "reanalyse/fraction",
        "reanalyse/rows",
        "search/root_value",
        "search/visit_entropy",
        "search/depth",
        "search/temperature",
        "val/return",
        "env/steps",
    ):
        assert logged_scalars(run, tag), tag
    assert logged_scalars(run, "reanalyse/fraction")[-1] == 0.5
    # priorities came back: the buffer's positions no longer all share the initial priority
    leaves = cli.datamodule.buffer._tree.leaves
    assert len(np.unique(leaves[leaves > 0])) > 1


def test_same_seed_same_weights():
    """num_actors 0: acting, sampling, search noise and training all follow the seed, so two fits
    of one config end bit-identical."""
    from lightning_wm.cli import main

    weights = []
    for run in ("a", "b"):
        cli = main(
            args=_cartpole_args(
                5, run=run, extra=("--model.init_args.reanalyze_ratio", "0.25", "--trainer.limit_val_batches", "0")
            )
        )
        weights.append({k: v.clone() for k, v in cli.model.state_dict().items()})
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key
    start = MuZero(cartpole_spec(), **{**SMALL, "num_simulations": 4}).state_dict()
    assert any(not torch.equal(weights[0][k], start[k]) for k in start if k.startswith("model."))


def test_averaged_weights_are_evaluated_and_saved_and_a_resumed_run_continues_from_the_online_ones(
    monkeypatch, recwarn
):
    """configs/muzero/cartpole.yaml lists EMAWeights: the module after fit and last.ckpt's
    state_dict are the average (what `evaluate` loads, without a warning), the online weights are
    kept beside it, and a longer run resumed from the finished run's last.ckpt starts from those
    (Lightning's own callback saved the average twice there), with the callback listed or not."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    import resume_probe

    from lightning_wm.callbacks import EMAWeights
    from lightning_wm.cli import main

    cli = main(args=_cartpole_args(6, run="ema"))
    assert [c.update_every_n_steps for c in cli.trainer.callbacks if isinstance(c, EMAWeights)] == [1]
    ckpt = torch.load("lightning_logs/ema/checkpoints/last.ckpt", weights_only=True)
    average, online = ckpt["state_dict"], ckpt["current_model_state"]
    assert average.keys() == online.keys()
    for name, value in cli.model.state_dict().items():
        assert torch.equal(value, average[name]), name
    moved = [k for k in average if k.startswith("model.") and not torch.equal(average[k], online[k])]
    assert moved, "the average equals the online weights: nothing was averaged"
    assert ckpt["averaging_state"]["n_averaged"].item() == 6

    main(
        args=[
            "evaluate",
            "--config",
            str(ROOT / "configs/muzero/cartpole.yaml"),
            "--trainer.run_name",
            "ema",
            "--ckpt_path",
            "last",
            "--episodes",
            "1",
            "--model.init_args.num_simulations",
            "4",
            "--model.init_args.latent_dim",
            "16",
            "--model.init_args.hidden",
            "16",
        ]
    )
    assert not [w for w in recwarn if "WeightAveraging" in str(w.message)]

    # a run that lists no averaging, resumed from that checkpoint, also continues from the online weights
    main(
        args=_cartpole_args(
            7,
            run="plain",
            extra=(
                "--ckpt_path",
                "lightning_logs/ema/checkpoints/last.ckpt",
                "--trainer.callbacks",
                '[{"class_path": "resume_probe.RecordStart"}]',
            ),
        )
    )
    assert resume_probe.SEEN["global_step"] == 6
    for name, value in online.items():
        assert torch.equal(resume_probe.SEEN["model"][name], value), name

    callbacks = (
        '[{"class_path": "lightning_wm.callbacks.EMAWeights", "init_args": {"decay": 0.99}}, '
        '{"class_path": "resume_probe.RecordStart"}]'
    )
    cli = main(args=_cartpole_args(8, run="ema", extra=("--ckpt_path", "last", "--trainer.callbacks", callbacks)))
    assert resume_probe.SEEN["global_step"] == 6 and cli.trainer.global_step == 8
    for name, value in online.items():
        assert torch.equal(resume_probe.SEEN["model"][name], value), name


def test_ema_weights_options_are_checked_and_follow_lightnings_schedule():
    from lightning_wm.callbacks import EMAWeights

    every = EMAWeights(decay=0.99)
    assert [every.should_update(step_idx=i) for i in range(3)] == [True] * 3
    assert not every.should_update(epoch_idx=0)
    later = EMAWeights(decay=0.5, update_every_n_steps=2, update_starting_at_step=3)
    assert [later.should_update(step_idx=i) for i in range(7)] == [False] * 4 + [True, False, True]
    with pytest.raises(ValueError, match="decay must be in"):
        EMAWeights(decay=1.0)
    with pytest.raises(ValueError, match="update_every_n_steps"):
        EMAWeights(update_every_n_steps=0)


def test_cli_fit_pong_config_shrunk():
    """configs/muzero/pong.yaml (frame stacks from the sampler's history, conv net, BatchNorm,
    latent consistency, reanalyse, SGD with warm-up) shrunk to a CPU smoke test."""
    from lightning_wm.cli import main

    cli = main(
        args=[
            "fit",
            "--config",
            str(ROOT / "configs/muzero/pong.yaml"),
            "--seed_everything",
            "1",
            "--trainer.accelerator",
            "cpu",
            "--trainer.max_steps",
            "2",
            "--trainer.log_every_n_steps",
            "1",
            "--trainer.limit_val_batches",
            "0",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.run_name",
            "pong",
            "--model.init_args.channels",
            "8",
            "--model.init_args.num_simulations",
            "2",
            "--model.init_args.support_size",
            "10",
            "--model.init_args.reanalyze_batch_size",
            "16",
            "--data.init_args.env.num_envs",
            "2",
            "--data.init_args.env.size",
            "[32, 32]",
            "--data.init_args.replay.capacity",
            "400",
            "--data.init_args.batch_size",
            "4",
            "--data.init_args.prefill",
            "40",
            "--data.init_args.replay_ratio",
            "1.0",
        ]
    )
    assert cli.trainer.global_step == 2
    assert cli.model.model.obs_shape == (4, 32, 32, 1)
    run = Path("lightning_logs/pong")
    for tag in ("loss/value", "loss/policy", "loss/reward", "loss/repr", "reanalyse/rows"):
        assert logged_scalars(run, tag), tag


def test_cli_fit_with_actor_processes():
    """num_actors 1: the actor searches with the acting copy (CPU, published weights) and its
    rows carry the search's root_value and visit_probs; training goes on from them."""
    from lightning_wm.cli import main

    cli = main(
        args=_cartpole_args(
            6,
            run="actors",
            extra=("--data.init_args.acting.num_actors", "1", "--data.init_args.acting.chunk_length", "8"),
        )
    )
    assert cli.trainer.global_step == 6
    buffer = cli.datamodule.buffer
    probs, version = buffer.column("visit_probs"), buffer.column("policy_version")
    stored = buffer.generation(np.arange(buffer.num_streams)[:, None], np.arange(buffer.cap_per_stream)[None]) >= 0
    searched = stored & (probs.sum(-1) > 0)  # rows acted by a search (not the random prefill, not last rows)
    assert searched.sum() > 0
    np.testing.assert_allclose(probs[searched].sum(-1), 1.0, rtol=1e-5)
    assert np.isfinite(buffer.column("root_value")[searched]).all()
    assert (version[searched] >= 0).all()
    assert "actors/policy_lag" in cli.trainer.logged_metrics
