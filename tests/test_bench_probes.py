"""bench/probelib.py, dreamer_probe.py and muzero_probe.py: the real discounted returns a value
is set against, the AUC, and each probe's figures on a tiny module's windows."""

import math

import pytest
import torch

from lightning_wm.agents.dreamer import Dreamer
from lightning_wm.envs import EnvConfig, env_spec

from support.bench_scripts import load_bench_script
from support.muzero_helpers import quiet, small
from support.presets import DREAMER_TINY

probelib = load_bench_script("probelib.py")
probe = load_bench_script("dreamer_probe.py")
muzero_probe = load_bench_script("muzero_probe.py")


def test_discounted_returns_chain_within_an_episode_and_stop_at_its_last_row():
    value = torch.tensor([[10.0, 20.0, 30.0, 40.0, 50.0]])
    reward = torch.tensor([[0.0, 1.0, 0.0, 2.0, 4.0]])
    none = torch.zeros(1, 5, dtype=torch.bool)
    g = probelib.discounted_returns(value, reward, none, none, 0.5)
    # G4 = V4 = 50; G3 = 4 + 25 = 29; G2 = 2 + 14.5 = 16.5; G1 = 0 + 8.25; G0 = 1 + 4.125
    assert g.tolist() == [[5.125, 8.25, 16.5, 29.0, 50.0]]
    terminal = torch.tensor([[False, False, True, False, False]])
    last = terminal.clone()
    g = probelib.discounted_returns(value, reward, terminal, last, 0.5)
    # row 2 ends its episode: G2 = 0, G1 = r2 + γ·0 = 0, G0 = 1; rows 3.. a new episode
    assert g.tolist() == [[1.0, 0.0, 0.0, 29.0, 50.0]]
    truncated = torch.tensor([[False, True, False, False, False]])
    g = probelib.discounted_returns(value, reward, none, truncated, 0.5)
    assert g[0, 1] == 20.0 and g[0, 0] == 1.0 + 0.5 * 20.0, "a truncated episode bootstraps with the critic"


def test_the_figures_on_a_tiny_dreamers_windows():
    torch.manual_seed(0)
    model = Dreamer(env_spec(EnvConfig(id="CartPole-v1")), **DREAMER_TINY).eval()
    is_first = torch.zeros(4, 12, dtype=torch.bool)
    is_first[:, 0] = is_first[1, 6] = True
    is_last = torch.roll(is_first, -1, 1)
    batch = {
        "obs": torch.randn(4, 12, 4),
        "action": torch.randint(0, 2, (4, 12)),
        "reward": torch.where(is_first, 0.0, 1.0),
        "is_first": is_first,
        "is_last": is_last,
        "is_terminal": is_last.clone(),
    }
    figures = probe.probe(model, batch)
    assert figures["rows"] == 48
    assert figures["rewarded rows"] == pytest.approx(float((batch["reward"] != 0).float().mean()))
    assert figures["posterior: real on rewarded rows"] == 1.0
    assert 0.0 <= figures["prior: rewards seen (>= half)"] <= 1.0
    assert 0.0 < figures["actor entropy, of uniform"] <= 1.0 + 1e-6
    shares = [float(x) for x in figures["replay's actions, share per action"].split(" / ")]
    assert len(shares) == 2 and sum(shares) == pytest.approx(1.0, abs=0.01)
    assert all(isinstance(v, str) or v == v for v in figures.values()), "no NaN"


def test_auc_is_the_share_of_positive_negative_pairs_in_order():
    score = torch.tensor([0.9, 0.1, 0.5, 0.5, 0.2])
    positive = torch.tensor([True, False, True, False, False])
    # pairs (pos, neg): 0.9 beats 0.1, 0.5, 0.2; 0.5 beats 0.1, 0.2 and ties 0.5: (3 + 2 + 0.5) / 6
    assert probelib.auc(score, positive) == pytest.approx(5.5 / 6)
    assert math.isnan(probelib.auc(score, torch.zeros(5, dtype=torch.bool))), "no positive row: undefined"


def test_the_value_sees_a_reward_coming_within_the_horizon_of_its_episode():
    reward = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    last = torch.zeros(1, 8, dtype=torch.bool)
    last[0, 4] = True  # rows 5.. another episode: row 4 sees no reward at row 6
    # horizon 2, rows 0..5: a reward at rows t+1..t+2 of t's episode for t = 0, 1, 5 (row 4 ends)
    coming = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
    figures = muzero_probe._value_sees_rewards(coming, reward, last, 2)
    assert figures["rows with a reward within 2"] == pytest.approx(3 / 6)
    assert figures["value: AUC, a reward within 2 above none"] == 1.0
    assert muzero_probe._value_sees_rewards(-coming, reward, last, 2)["value: AUC, a reward within 2 above none"] == 0.0


def test_the_muzero_probes_figures_on_a_tiny_models_windows():
    torch.manual_seed(0)
    model = quiet(small())
    is_last = torch.zeros(4, 12, dtype=torch.bool)
    is_last[1, 5] = True
    reward = torch.zeros(4, 12)
    reward[:, 3] = reward[2, 8] = 1.0
    batch = {
        "obs": torch.randn(4, 12, 4),
        "action": torch.randint(0, 2, (4, 12)),
        "reward": reward,
        "is_last": is_last,
        "is_terminal": is_last.clone(),
        "visit_probs": torch.softmax(torch.randn(4, 12, 2), -1),
    }
    figures = muzero_probe.probe(model, batch, horizon=3)
    assert figures["rows"] == 48 and figures["rewarded rows"] == pytest.approx(5 / 48)
    K = model.unroll.num_unroll_steps
    for k in sorted({1, (K + 1) // 2, K}):
        assert figures[f"dynamics, {k} step(s) in: real on rewarded rows"] == 1.0
        assert 0.0 <= figures[f"dynamics, {k} step(s) in: AUC, rewarded rows above the others"] <= 1.0
    assert 0.0 < figures["prior entropy, of uniform"] <= 1.0 + 1e-6
    assert 0.0 < figures["stored search policy entropy, of uniform"] <= 1.0 + 1e-6
    assert all(isinstance(v, str) or v == v for v in figures.values()), "no NaN"


def test_the_unrolled_reward_k_steps_in_is_set_against_the_reward_entering_row_s_plus_k():
    """A stand-in dynamics that predicts the action's number as the reward; with ``action[t] =
    reward[t + 1]`` each step's prediction is exactly the reward it is set against."""
    from types import SimpleNamespace

    reward = torch.tensor([[0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])
    action = torch.cat([reward[:, 1:], torch.zeros(1, 1)], 1).long()
    dynamics = SimpleNamespace(recurrent_inference=lambda s, a: {"state": s, "reward": a.float()})
    state = torch.zeros(1, 10, 2)
    none = torch.zeros(1, 10, dtype=torch.bool)
    figures = muzero_probe._unrolled_rewards(dynamics, state, action, reward, none, 3)
    for k in (1, 2, 3):
        assert figures[f"dynamics, {k} step(s) in: rewards seen (>= half)"] == 1.0
        assert figures[f"dynamics, {k} step(s) in: AUC, rewarded rows above the others"] == 1.0
    shifted = muzero_probe._unrolled_rewards(dynamics, state, torch.roll(action, 1, 1), reward, none, 3)
    assert shifted["dynamics, 1 step(s) in: AUC, rewarded rows above the others"] < 1.0


def test_asterix_rewards_come_mostly_from_the_players_step_onto_visible_gold():
    pytest.importorskip("minatar")
    sources = load_bench_script("asterix_reward_sources.py")
    counts = sources.reward_sources(episodes=60, seed=0)
    assert counts["steps"] > 60 * 10
    assert counts["by the player's step"] > counts["by gold moving"] > 0


def test_the_offline_fit_changes_only_the_named_settings_and_trains_and_reports():
    from support.muzero_helpers import filled_datamodule

    fit_script = load_bench_script("muzero_offline_fit.py")
    torch.manual_seed(0)
    model = quiet(small())
    fit_script.apply_settings(model, ["loss.reward_weight=4", "optim.weight_decay=0"])
    assert model.loss.reward_weight == 4.0 and model.optim.weight_decay == 0.0
    with pytest.raises(SystemExit, match="GROUP.FIELD=VALUE"):
        fit_script.apply_settings(model, ["net.latent_dim=3"])
    dm = filled_datamodule(model, rows=40)
    before = [p.detach().clone() for p in model.model.parameters()]
    reported: list[int] = []
    seconds = fit_script.fit(model, dm.sample_batch, steps=4, every=2, report=reported.append)
    assert reported == [0, 2, 4] and seconds > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.model.parameters())), "no step was taken"


def test_the_offline_fit_follows_the_modules_lr_schedule_and_clipping():
    """A warm-up returns ``{"optimizer", "lr_scheduler"}`` from configure_optimizers: the fit steps
    the schedule, and the module's clipping bounds the gradients it steps with."""
    from lightning_wm.optim import GradClipSettings, OptimSettings

    from support.muzero_helpers import filled_datamodule

    fit_script = load_bench_script("muzero_offline_fit.py")
    torch.manual_seed(0)
    optim = OptimSettings(lr=1e-3, lr_warmup_steps=10, clip=GradClipSettings(type="clip_norm", value=1e-3))
    model = quiet(small(optim=optim))
    dm = filled_datamodule(model, rows=40)
    norms: list[float] = []
    clip = model.configure_gradient_clipping

    def clipped(optimizer):
        clip(optimizer)
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.model.parameters()]))))

    model.configure_gradient_clipping = clipped
    configured: list = []
    configure = model.configure_optimizers
    model.configure_optimizers = lambda: configured.append(configure()) or configured[-1]
    fit_script.fit(model, dm.sample_batch, steps=4, every=4, report=lambda step: None)
    assert len(norms) == 4 and max(norms) <= 1e-3 * (1 + 1e-3)
    optimizer = configured[0]["optimizer"]
    assert optim.lr_factor_at(4) < 1.0, "still warming up after 4 steps"
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * optim.lr_factor_at(4))
