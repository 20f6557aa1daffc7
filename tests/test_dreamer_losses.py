"""Dreamer's pure losses against hand-checked values, its settings groups (defaults, range checks,
partial mappings, a checkpoint round trip). Where ``lightning_wm/Dream-v0`` is registered: test_env_ids.py."""

import inspect
import math

import pytest
import torch

from lightning_wm.agents.dreamer import (
    BehaviorSettings,
    Dreamer,
    DreamerNet,
    DreamerOptim,
    WorldModelLoss,
)
from lightning_wm.agents.dreamer import losses as L
from lightning_wm.checkpoints import load_module
from lightning_wm.envs import EnvConfig, env_spec
from lightning_wm.nn import dists
from lightning_wm.settings import as_settings, plain
from lightning_wm.world_model import RolloutSchedule

LOG2 = math.log(2.0)


# -- world model ---------------------------------------------------------------------------------
def test_world_model_loss_hand_values_with_free_bits_and_terminal_weight():
    """Two rows; continue logits 0 (nll log 2, x3 on the terminal row); posterior = prior, so both
    KLs are 0 and clipped to the free 1 nat: 0.5 * 1 + 0.1 * 1 per row."""
    decoder = torch.tensor([[1.0, 3.0]])
    reward = torch.tensor([[0.5, 0.5]])
    logits = torch.zeros(1, 2, requires_grad=True)
    terminal = torch.tensor([[False, True]])
    post = prior = torch.log(torch.full((1, 2, 2, 3), 1 / 3))
    weights = WorldModelLoss(continue_terminal_weight=3.0)
    loss, parts = L.world_model_loss(decoder, reward, logits, terminal, post, prior, weights)
    expected = ((1.0 + 0.5 + LOG2 + 0.6) + (3.0 + 0.5 + 3 * LOG2 + 0.6)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(parts["continue"], torch.tensor([[LOG2, 3 * LOG2]]))
    torch.testing.assert_close(parts["kl"], torch.zeros(1, 2))
    torch.testing.assert_close(parts["kl_dyn"], torch.ones(1, 2))
    # weights scale their terms: decoder x2 adds mean(decoder) = 2
    loss2, _ = L.world_model_loss(
        decoder, reward, logits, terminal, post, prior, WorldModelLoss(continue_terminal_weight=3.0, decoder_weight=2.0)
    )
    assert loss2.item() == pytest.approx(expected + 2.0, rel=1e-6)
    # d loss / d logit = (sigmoid(0) - target) * weight / rows: continue target 1 -> -0.25, terminal 0 -> +0.75
    loss.backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[-0.25, 0.75]]))


def test_world_model_loss_gaussian_kl_above_free_bits():
    """N(1, 1) against N(0, 1) in 4 dims: KL 0.5 per dim = 2 nats > 1 free nat, for dyn and rep."""
    post = (torch.ones(1, 1, 4), torch.ones(1, 1, 4))
    prior = (torch.zeros(1, 1, 4), torch.ones(1, 1, 4))
    zero = torch.zeros(1, 1)
    loss, parts = L.world_model_loss(
        zero, zero, torch.full((1, 1), 50.0), torch.zeros(1, 1, dtype=torch.bool), post, prior, WorldModelLoss()
    )
    assert parts["kl"].item() == pytest.approx(2.0) and parts["kl_rep"].item() == pytest.approx(2.0)
    assert loss.item() == pytest.approx(0.5 * 2.0 + 0.1 * 2.0, abs=1e-6)  # continue nll of logit 50 ~ 0


# -- actor ---------------------------------------------------------------------------------------
def test_actor_loss_reinforce_hand_values_and_gradients():
    """-(w (log pi * sg((R - v) / S) + eta H)): w 0.5, R 2, v 1, S 2, H 1, eta 0.1, log pi -0.7."""
    returns = torch.tensor([[2.0]], requires_grad=True)
    log_prob = torch.tensor([[-0.7]], requires_grad=True)
    args = (torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor(2.0), torch.tensor([[1.0]]), 0.1)
    loss = L.actor_loss(returns, *args, "reinforce", log_prob)
    assert loss.item() == pytest.approx(-(0.5 * (-0.7 * 0.5 + 0.1)))
    loss.backward()
    assert log_prob.grad.item() == pytest.approx(-0.5 * 0.5)
    assert returns.grad is None  # the advantage carries no gradient
    with pytest.raises(ValueError, match="log_prob"):
        L.actor_loss(returns, *args, "reinforce")


def test_actor_loss_dynamics_hand_values_and_gradients():
    """-(mean_t w_t (R_t / S + eta H_t)) over two steps; the gradient reaches the returns."""
    returns = torch.tensor([[2.0], [4.0]], requires_grad=True)
    weight = torch.tensor([[1.0], [0.5]])
    entropy = torch.tensor([[1.0], [2.0]])
    loss = L.actor_loss(returns, torch.zeros(2, 1), weight, torch.tensor(2.0), entropy, 0.1, "dynamics")
    assert loss.item() == pytest.approx(-((1.0 * (1.0 + 0.1)) + 0.5 * (2.0 + 0.2)) / 2)
    loss.backward()
    torch.testing.assert_close(returns.grad, torch.tensor([[-0.25], [-0.125]]))


def test_mixed_actor_loss_is_the_weighted_sum_and_its_end_points_are_the_pure_losses():
    """w 0.5, R 2, v 1, S 2, log pi -0.7, H 1, eta 0.1: L_reinforce = -(0.5 (-0.7 * 0.5 + 0.1)) =
    0.125, L_dynamics = -(0.5 (2 / 2 + 0.1)) = -0.55; rho 0.3: 0.3 * 0.125 + 0.7 * -0.55 = -0.3475,
    d/d log pi = 0.3 * -0.25 = -0.075, d/dR = 0.7 * -0.25 = -0.175 (the REINFORCE advantage has none)."""

    def loss_and_grads(rho):
        returns = torch.tensor([[2.0]], requires_grad=True)
        log_prob = torch.tensor([[-0.7]], requires_grad=True)
        value, weight, scale, entropy = (
            torch.tensor([[1.0]]),
            torch.tensor([[0.5]]),
            torch.tensor(2.0),
            torch.ones(1, 1),
        )
        loss = L.mixed_actor_loss(returns, value, weight, scale, 0.1, rho, log_prob, entropy, entropy)
        loss.backward()
        grads = [0.0 if g is None else g.item() for g in (log_prob.grad, returns.grad)]
        return loss.item(), grads

    (reinforce, g_reinforce), (dynamics, g_dynamics), (mixed, g_mixed) = map(loss_and_grads, (1.0, 0.0, 0.3))
    assert (reinforce, dynamics) == (pytest.approx(0.125), pytest.approx(-0.55))
    assert g_reinforce == pytest.approx([-0.25, 0.0]) and g_dynamics == pytest.approx([0.0, -0.25])
    assert mixed == pytest.approx(-0.3475)
    assert g_mixed == pytest.approx([0.3 * a + 0.7 * b for a, b in zip(g_reinforce, g_dynamics)])
    assert g_mixed == pytest.approx([-0.075, -0.175])
    # the end points need only their own inputs; a share without its inputs is refused
    one = torch.ones(1, 1)
    assert L.mixed_actor_loss(one, one, one, one, 0.0, 0.0, entropy_dynamics=one).item() == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="entropy_reinforce"):
        L.mixed_actor_loss(one, one, one, one, 0.0, 0.5, one, entropy_dynamics=one)
    with pytest.raises(ValueError, match="reinforce_weight must be in"):
        L.mixed_actor_loss(one, one, one, one, 0.0, 1.5, one, one, one)


def test_update_return_range_moves_the_emas_from_the_state_passed_in():
    """Returns 0..100: percentiles 5 and 95. From (0, 0) with decay 0.99: (0.05, 0.95), S = max(1,
    0.9) = 1; from (10, 50): (9.95, 50.45), S = 40.5. ``reduce`` maps the percentiles first (x2:
    10 and 190 -> (0.1, 1.9), S = 1.8); the state passed in is not written; no return_norm: S = 1."""
    returns = torch.arange(101.0).reshape(101, 1)
    zero = (torch.tensor(0.0), torch.tensor(0.0))
    settings = BehaviorSettings()
    (low, high), scale = L.update_return_range(zero, returns, settings)
    assert (low.item(), high.item(), scale.item()) == (pytest.approx(0.05), pytest.approx(0.95), 1.0)
    (low, high), scale = L.update_return_range((torch.tensor(10.0), torch.tensor(50.0)), returns, settings)
    assert (low.item(), high.item(), scale.item()) == pytest.approx((9.95, 50.45, 40.5))
    (low, high), scale = L.update_return_range(zero, returns, settings, reduce=lambda q: 2 * q)
    assert (low.item(), high.item(), scale.item()) == pytest.approx((0.1, 1.9, 1.8))
    assert zero[0].item() == 0.0 and zero[1].item() == 0.0
    state, scale = L.update_return_range(zero, returns, BehaviorSettings(return_norm=False))
    assert state == zero and scale.item() == 1.0


def test_behaviour_losses_hand_values():
    """H 1, N 2, squared errors without symlog. Percentiles 0 and 1 of returns [2, 0] with decay 0:
    (low, high) = (0, 2), S = 2. Actor (REINFORCE): advantages (R - v) / S = [0.5, -0.5], times
    log pi [-0.5, -1] = [-0.25, 0.5], + 0.1 H = [-0.15, 0.6], weighted [1, 0.5]: mean 0.075, loss
    -0.075. Critic: (1.5 - 2)^2 + (1.5 - 1)^2 = 0.5 and (0.5 - 0)^2 + (0.5 - 1)^2 = 0.5, weighted:
    mean(0.5, 0.25) = 0.375."""
    imagined = {
        "returns": torch.tensor([[2.0, 0.0]]),
        "value": torch.tensor([[1.0, 1.0], [0.0, 0.0]]),
        "weight": torch.tensor([[1.0, 0.5], [1.0, 1.0]]),
        "critic_out": torch.tensor([[[1.5], [0.5]], [[0.0], [0.0]]]),
        "slow_values": torch.tensor([[1.0, 1.0]]),
        "log_prob": torch.tensor([[-0.5, -1.0]]),
        "entropy_reinforce": torch.ones(1, 2),
        "rewards": torch.ones(1, 2),
        "dones": torch.zeros(1, 2),
    }
    settings = BehaviorSettings(entropy_weight=0.1, return_norm_decay=0.0, return_norm_low=0.0, return_norm_high=1.0)
    zero = (torch.tensor(0.0), torch.tensor(0.0))
    actor, critic, (low, high), logs = L.behaviour_losses(imagined, zero, settings, 1.0, None, symlog=False)
    assert actor.item() == pytest.approx(-0.075) and critic.item() == pytest.approx(0.375)
    assert (low.item(), high.item()) == (0.0, 2.0) and logs["train/return_scale"].item() == 2.0
    assert logs["train/adv_abs"].item() == pytest.approx(0.5) and logs["train/return_high"].item() == 2.0


def test_return_percentiles_and_scale():
    q = L.return_percentiles(torch.arange(101.0).reshape(101, 1), 0.05, 0.95)
    torch.testing.assert_close(q, torch.tensor([5.0, 95.0]))
    assert L.return_scale(torch.tensor(0.2), torch.tensor(0.7)).item() == 1.0  # small spreads are not scaled up
    assert L.return_scale(torch.tensor(5.0), torch.tensor(95.0)).item() == 90.0


# -- critic --------------------------------------------------------------------------------------
def test_critic_loss_two_hot_hand_values_and_the_mixed_target_equals_two_cross_entropies():
    """Uniform logits over bins [-1, 0, 1]: -log_softmax = log 3 for every bin, so each two-hot
    target (weight 1) costs log 3: return 0.5 and slow value 0 with regulariser weight 1 -> 2 log 3."""
    bins = torch.tensor([-1.0, 0.0, 1.0])
    logits = torch.zeros(1, 1, 3)
    loss = L.critic_loss(logits, torch.tensor([[0.5]]), torch.tensor([[0.0]]), torch.ones(1, 1), 1.0, bins)
    assert loss.item() == pytest.approx(2 * math.log(3.0))
    torch.manual_seed(0)
    bins = dists.symexp_bins(31)
    logits, returns, slow, weight = torch.randn(4, 5, 31), torch.randn(4, 5) * 3, torch.randn(4, 5), torch.rand(4, 5)
    mixed = L.critic_loss(logits, returns, slow, weight, 0.7, bins)
    separate = (
        weight * (dists.twohot_loss(logits, returns, bins) + 0.7 * dists.twohot_loss(logits, slow, bins))
    ).mean()
    assert mixed.item() == pytest.approx(separate.item(), rel=1e-5)


def test_critic_loss_squared_errors_without_bins():
    logits, weight = torch.tensor([[[0.5]]]), torch.ones(1, 1)
    plain_loss = L.critic_loss(logits, torch.tensor([[1.5]]), torch.tensor([[0.5]]), weight, 2.0, None, symlog=False)
    assert plain_loss.item() == pytest.approx((0.5 - 1.5) ** 2 + 2.0 * 0.0)
    symlog_loss = L.critic_loss(logits, torch.tensor([[math.e - 1]]), torch.tensor([[0.0]]), weight, 1.0, None)
    assert symlog_loss.item() == pytest.approx((0.5 - 1.0) ** 2 + 0.5**2)  # symlog(e - 1) = 1, symlog(0) = 0


def test_replay_critic_loss_counts_only_masked_steps():
    logits = torch.tensor([[[0.5]], [[0.0]]])  # [T=2, B=1, 1]
    targets = torch.tensor([[1.5], [100.0]])
    mask = torch.tensor([[True], [False]])
    loss = L.replay_critic_loss(logits, targets, mask, None, symlog=False)
    assert loss.item() == pytest.approx(1.0 / 2)


def test_head_nll_two_hot_is_the_two_hot_cross_entropy():
    bins = dists.symexp_bins(15)
    logits, target = torch.randn(3, 15), torch.tensor([0.3, -2.0, 40.0])
    torch.testing.assert_close(L.head_nll(logits, target, bins), dists.twohot_loss(logits, target, bins))


# -- settings ------------------------------------------------------------------------------------
def test_defaults_are_dreamerv3s():
    loss, behavior, optim = WorldModelLoss(), BehaviorSettings(), DreamerOptim()
    assert (loss.kl_dyn_weight, loss.kl_rep_weight, loss.free_nats) == (0.5, 0.1, 1.0)
    assert (behavior.horizon, behavior.discount, behavior.lambda_, behavior.entropy_weight) == (15, 0.997, 0.95, 3e-4)
    assert (behavior.slow_critic_tau, behavior.slow_critic_weight, behavior.return_norm_decay) == (0.02, 1.0, 0.99)
    assert (optim.model.lr, optim.model.eps, optim.model.clip.type, optim.model.clip.value) == (
        1e-4,
        1e-8,
        "clip_norm",
        1000.0,
    )
    for network in (optim.actor, optim.critic):
        assert (network.lr, network.eps, network.clip.value, network.lr_anneal_steps) == (3e-5, 1e-5, 100.0, None)
    assert DreamerNet().unimix == 0.01 and DreamerNet().bins == 255
    assert len(inspect.signature(Dreamer.__init__).parameters) - 1 <= 20


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: BehaviorSettings(discount=1.5), "behavior.discount must be in [0.0, 1.0], got 1.5"),
        (lambda: BehaviorSettings(lambda_=-0.1), "behavior.lambda_ must be in [0.0, 1.0], got -0.1"),
        (lambda: BehaviorSettings(horizon=0), "behavior.horizon must be >= 1, got 0"),
        (lambda: BehaviorSettings(actor_grad="backprop"), "behavior.actor_grad must be"),
        (lambda: BehaviorSettings(reinforce_weight=1.5), "behavior.reinforce_weight must be in [0.0, 1.0], got 1.5"),
        (
            lambda: BehaviorSettings(bootstrap_critic="target"),
            "behavior.bootstrap_critic must be one of ['critic', 'slow_critic'], got 'target'",
        ),
        (lambda: BehaviorSettings(return_norm_low=0.9, return_norm_high=0.1), "return_norm_low and return_norm_high"),
        (lambda: BehaviorSettings(slow_critic_every=0), "behavior.slow_critic_every must be >= 1, got 0"),
        (lambda: WorldModelLoss(free_nats=-1.0), "loss.free_nats must be >= 0, got -1.0"),
        (lambda: DreamerNet(activation="swish"), "net.activation must be one of"),
        (lambda: DreamerNet(latent="vq"), "net.latent must be one of ['categorical', 'gaussian'], got 'vq'"),
        (lambda: DreamerNet(deter=0), "net.deter must be >= 1, got 0"),
    ],
)
def test_settings_refuse_bad_values_in_one_line_naming_the_option(build, message):
    with pytest.raises(ValueError) as info:
        build()
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_partial_mapping_keeps_the_groups_other_defaults():
    optim = as_settings(DreamerOptim, {"model": {"lr": 3e-3}, "actor": {"clip": {"value": 5.0}}})
    assert optim.model.lr == 3e-3 and optim.model.eps == 1e-8 and optim.model.clip.value == 1000.0
    assert optim.actor.lr == 3e-5 and optim.actor.clip.type == "clip_norm" and optim.actor.clip.value == 5.0
    assert optim.critic == DreamerOptim().critic
    behavior = as_settings(BehaviorSettings, plain(BehaviorSettings(horizon_schedule=RolloutSchedule(0, 10, 2, 6))))
    assert behavior.horizon_schedule == RolloutSchedule(0, 10, 2, 6)
    assert [behavior.current_horizon(n) for n in (0, 5, 10, 99)] == [2, 4, 6, 6]
    with pytest.raises(ValueError, match="unknown setting"):
        as_settings(DreamerNet, {"act": "silu"})


def test_settings_round_trip_through_a_checkpoint(tmp_path):
    """Groups are saved as plain dicts and rebuilt into the dataclasses by load_module."""
    spec = env_spec(EnvConfig(id="CartPole-v1"))
    net = DreamerNet(deter=16, stoch=4, classes=4, hidden=16, bins=31, activation="elu")
    behavior = BehaviorSettings(horizon=3, horizon_schedule=RolloutSchedule(0, 100, 1, 3), discount=0.9)
    optim = as_settings(DreamerOptim, {"actor": {"lr": 1e-3, "lr_anneal_steps": 50}})
    model = Dreamer(spec, net=net, behavior=behavior, optim=optim, eval_policy="sample")
    assert model.hparams["net"] == plain(net) and isinstance(model.hparams["optim"]["model"], dict)
    path = tmp_path / "dreamer.ckpt"
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}, path)
    loaded = load_module(Dreamer, path, env_spec=spec)
    assert (loaded.net, loaded.behavior, loaded.optim, loaded.loss) == (net, behavior, optim, WorldModelLoss())
    assert loaded.eval_policy == "sample" and loaded.optim_settings()[1].lr_anneal_steps == 50
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
