"""MuZero's loss: the pure muzero_loss against a per-sample computation, the training step's loss
and priorities against a slow per-sample, per-step one, latent consistency through the projection
heads, and losses falling on a fixed batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_wm.agents.muzero import MuZero, MuZeroLossSettings, MuZeroNet, UnrollSettings
from lightning_wm.agents.muzero.losses import Supports, UnrollOutput, loss_terms, muzero_loss, unroll_model
from lightning_wm.agents.muzero.targets import UnrollTargets
from lightning_wm.nn import dists

from support.muzero_helpers import cartpole_spec, filled_datamodule, quiet, small
from support.presets import MUZERO_TINY

torch.set_num_threads(1)


@pytest.mark.parametrize("rule", ["pseudocode", "equal"])
def test_muzero_loss_against_a_per_sample_loop(rule):
    """The pure loss on random predictions and targets against the paper's sum written per sample
    and per step: categorical value and reward losses over two-hot targets, policy cross-entropy,
    game over, latent consistency, step weights, importance weights."""
    g = torch.Generator().manual_seed(0)
    B, K, A, D = 5, 3, 3, 6
    bins = dists.h_support(5)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    def mask(*shape):
        return torch.rand(*shape, generator=g) > 0.3

    out = UnrollOutput(
        policy_logits=[randn(B, A) for _ in range(K + 1)],
        value_logits=[randn(B, len(bins)) for _ in range(K + 1)],
        reward_logits=[randn(B, len(bins)) for _ in range(K)],
        game_over_logits=randn(B, K + 1),
        consistency=(randn(B, K, D), randn(B, K, D)),
        value0=randn(B),
    )
    t = UnrollTargets(
        actions=torch.zeros(B, K, dtype=torch.long),
        value=3 * randn(B, K + 1),
        value_mask=mask(B, K + 1),
        reward=2 * randn(B, K + 1),
        reward_mask=mask(B, K + 1),
        policy=torch.softmax(randn(B, K + 1, A), -1),
        policy_mask=mask(B, K + 1),
        game_over=mask(B, K + 1),
        game_over_mask=mask(B, K + 1),
    )
    valid = mask(B, K + 4)
    settings = MuZeroLossSettings(
        value_weight=0.25,
        reward_weight=0.7,
        policy_weight=1.3,
        game_over_weight=0.4,
        repr_weight=0.3,
        train_game_over_function=True,
        train_repr_prediction=True,
        unroll_step_weights=rule,
    )
    weight = torch.rand(B, generator=g) + 0.5
    loss, parts = muzero_loss(out, t, valid, settings, Supports(bins, bins, 0.001), weight)

    def ce(target_probs, logits):
        return -(target_probs * torch.log_softmax(logits, -1)).sum()

    total = 0.0
    for b in range(B):
        by_part = dict.fromkeys(parts, 0.0)
        for k in range(K + 1):
            w = 1.0 if k == 0 and rule == "pseudocode" else 1.0 / K
            if t.value_mask[b, k]:
                by_part["value"] += (
                    w * 0.25 * ce(dists.h_twohot_encode(t.value[b, k : k + 1], bins)[0], out.value_logits[k][b])
                )
            if k > 0 and t.reward_mask[b, k]:
                target = dists.h_twohot_encode(t.reward[b, k : k + 1], bins)[0]
                by_part["reward"] += w * 0.7 * ce(target, out.reward_logits[k - 1][b])
            if t.policy_mask[b, k]:
                by_part["policy"] += w * 1.3 * ce(t.policy[b, k], out.policy_logits[k][b])
            if t.game_over_mask[b, k]:
                logit, over = out.game_over_logits[b, k], t.game_over[b, k].float()
                by_part["game_over"] += w * 0.4 * F.binary_cross_entropy_with_logits(logit, over)
            if k > 0 and valid[b, k]:
                predicted, target = out.consistency[0][b, k - 1], out.consistency[1][b, k - 1]
                by_part["repr"] += w * 0.3 * (1 - F.cosine_similarity(predicted, target, dim=0))
        for name, value in by_part.items():
            torch.testing.assert_close(parts[name][b], torch.as_tensor(value, dtype=torch.float32))
        total += weight[b] * sum(by_part.values())
    torch.testing.assert_close(loss, total / B)
    unweighted, _ = muzero_loss(out, t, valid, settings, Supports(bins, bins, 0.001))
    torch.testing.assert_close(unweighted, sum(parts.values()).mean())
    without = MuZeroLossSettings(train_reward_function=False, train_policy=False)
    assert set(loss_terms(out, t, valid, without, Supports(bins, bins, 0.001))) == {"value"}


@pytest.mark.parametrize(
    "bootstrap,step_weights", [("target_network", "pseudocode"), ("stored", "pseudocode"), ("target_network", "equal")]
)
def test_unroll_losses_match_a_per_sample_computation(bootstrap, step_weights):
    """The batched loss against a slow per-sample, per-step computation from the same targets."""
    torch.manual_seed(1)
    K, n = 3, 2
    loss = MuZeroLossSettings(
        train_game_over_function=True,
        unroll_step_weights=step_weights,
        train_repr_prediction=True,
        reward_weight=0.7,
        repr_weight=0.3,
        recurrent_gradient_scaling_factor=1.0,
    )
    model = quiet(small(unroll=UnrollSettings(K, n, bootstrap_value=bootstrap), loss=loss))
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
    t = muzero_targets({**fwd, "root_value": value}, num_unroll_steps=K, td_steps=n, discount=model.discount)
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
    from lightning_wm.agents.muzero.targets import muzero_targets

    torch.manual_seed(2)
    K = 3
    net = MuZeroNet(**MUZERO_TINY["net"], projection=[12, 10, 6])
    model = quiet(small(net=net, unroll=UnrollSettings(K, 2), loss=MuZeroLossSettings(train_repr_prediction=True)))
    m = model.model
    assert m.project(torch.rand(5, 16)).shape == (5, 10) and m.predict_projection(torch.rand(5, 16)).shape == (5, 10)
    batch = filled_datamodule(model, rows=60).sample_batch()
    t = muzero_targets(dict(batch), num_unroll_steps=K, td_steps=torch.full((8,), 2), discount=0.997)
    valid = batch["mask"].bool()
    settings = MuZeroLossSettings(
        recurrent_gradient_scaling_factor=1.0,
        train_reward_function=False,
        train_policy=False,
        train_repr_prediction=True,
    )

    def unroll_losses(model):
        return loss_terms(
            unroll_model(model, batch["obs"], t.actions, settings), t, valid, settings, Supports.of(model)
        )

    losses = unroll_losses(m)
    # by hand, for the whole batch at once (batch norm sees the same rows)
    state, unrolled = m.representation(batch["obs"][:, 0]), []
    for k in range(K):
        _, state = m.dynamics(state, t.actions[:, k])
        unrolled.append(state)
    online = m.predictor(m.projector(torch.stack(unrolled, 1).flatten(0, 1))).view(8, K, -1)
    target = m.projector(m.representation(batch["obs"][:, 1 : K + 1].flatten(0, 1))).view(8, K, -1).detach()
    by_hand = ((1 - F.cosine_similarity(online, target, dim=-1)) * valid[:, 1 : K + 1] / K).sum(1)
    torch.testing.assert_close(losses["repr"], by_hand, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(losses["repr"], unroll_losses(small(unroll=UnrollSettings(K)).model)["repr"])
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
        MuZero(cartpole_spec(), net={"projection": [8, 8]})


def test_losses_fall_on_a_fixed_batch():
    torch.manual_seed(2)
    model = quiet(small(unroll=UnrollSettings(3, 3)))
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


def test_the_training_step_leaves_its_batch_as_it_was():
    """Targets -> loss -> report reads the batch and writes nothing into it, also for a batch of
    random-prefill rows only (no visit_probs / root_value columns yet)."""
    torch.manual_seed(5)
    model = quiet(small(unroll=UnrollSettings(3, 2)))
    batch = filled_datamodule(model, rows=40).sample_batch()
    batch["weight"] = torch.rand(8) + 0.5
    for columns in (batch, {k: v for k, v in batch.items() if k not in ("visit_probs", "root_value")}):
        before = {k: v.clone() if torch.is_tensor(v) else v for k, v in columns.items()}
        out = model.training_step(columns, 0)
        assert torch.isfinite(out["loss"]) and out["priority"].shape == (8,)
        assert columns.keys() == before.keys()
        for key, value in before.items():
            assert not torch.is_tensor(value) or torch.equal(columns[key], value), key
