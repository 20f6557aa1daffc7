"""IMPALA networks, action heads, settings groups and loss (lightning_wm.agents.impala)."""

import math
import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch

from lightning_wm.agents.impala import IMPALA, VTraceLossSettings, impala_loss, unroll_loss
from lightning_wm.agents.impala.agent import policy_lag_sums
from lightning_wm.agents.impala.losses import at_step, entropy_weight_at, normalized
from lightning_wm.data.collector import Collector
from lightning_wm.envs import EnvConfig, EnvSpec, env_spec, make_vector_env
from lightning_wm.nn.actor_critic import ActorCritic, ActorCriticSettings, CategoricalHead, GaussianHead
from lightning_wm.optim import OptimSettings
from lightning_wm.protocols import Agent
from lightning_wm.returns import UnrollSteps, lambda_return

from support.presets import IMPALA_TINY

CARTPOLE = EnvSpec(gym.spaces.Box(-np.inf, np.inf, (4,), np.float32), gym.spaces.Discrete(2), "CartPole-v1")
PENDULUM = EnvSpec(
    gym.spaces.Box(-8.0, 8.0, (3,), np.float32), gym.spaces.Box(-2.0, 2.0, (1,), np.float32), "Pendulum-v1"
)


class RowRecorder:
    """Stands in for a buffer: keeps the Collector's rows."""

    def __init__(self):
        self.rows = []

    def add(self, row):
        self.rows.append({k: np.array(v) for k, v in row.items()})

    def unrolls(self):
        """All rows as one unroll per env, batch-major tensors ``[N_envs, T+1, ...]``."""
        return {k: torch.from_numpy(np.stack([r[k] for r in self.rows], 1)) for k in self.rows[0]}


def _collect(spec_cfg, net, steps, num_envs=3, seed=0):
    env = make_vector_env(EnvConfig(**spec_cfg, num_envs=num_envs, seed=seed))
    recorder = RowRecorder()
    try:
        Collector(env, net, buffer=recorder, seeds=seed).collect(steps)
    finally:
        env.close()
    return recorder.unrolls()


# -- networks and acting -------------------------------------------------------------------------
@pytest.mark.parametrize("lstm_size", [0, 16])
def test_discrete_act_shapes_and_modes(lstm_size):
    torch.manual_seed(0)
    net = ActorCritic(CARTPOLE, ActorCriticSettings(hidden=32, lstm_size=lstm_size))
    assert isinstance(net, Agent)
    state = net.initial_state(5)
    assert (state is None) == (lstm_size == 0)
    obs = torch.randn(5, 4)
    action, new_state, extras = net.act(obs, state, explore=True)
    assert action.shape == (5,) and action.dtype == torch.int64
    assert set(extras) == ({"logits"} | ({"core_h", "core_c"} if lstm_size else set()))
    assert extras["logits"].shape == (5, 2)
    greedy, _, extras = net.act(obs, state, explore=False)
    assert torch.equal(greedy, extras["logits"].argmax(-1))  # argmax_sample in evaluation
    if lstm_size:
        assert new_state[0].shape == (5, 16) and not torch.equal(new_state[0], state[0])


def test_frame_and_dict_observations():
    torch.manual_seed(0)
    frames = gym.spaces.Box(0, 255, (36, 36, 3), np.uint8)
    for conv in ("deep", "shallow"):
        net = ActorCritic(EnvSpec(frames, gym.spaces.Discrete(4)), ActorCriticSettings(conv=conv, fc_size=32))
        action, _, extras = net.act(torch.randint(0, 255, (2, 36, 36, 3), dtype=torch.uint8), None, True)
        assert action.shape == (2,) and extras["logits"].shape == (2, 4)
    space = gym.spaces.Dict({"image": frames, "state": gym.spaces.Box(-1, 1, (5,), np.float32)})
    net = ActorCritic(EnvSpec(space, gym.spaces.Discrete(3)), ActorCriticSettings(conv="shallow", fc_size=32, hidden=8))
    assert net.encoder.out_dim == 32 + 8
    obs = {"image": torch.zeros(2, 36, 36, 3, dtype=torch.uint8), "state": torch.zeros(2, 5)}
    assert net.act(obs, None, True)[0].shape == (2,)
    with pytest.raises(ValueError, match="conv must be"):
        ActorCriticSettings(conv="resnet")
    with pytest.raises(ValueError, match="Discrete and Box"):
        ActorCritic(EnvSpec(frames, gym.spaces.MultiBinary(3)))


def test_value_head_on_an_encoder_of_its_own():
    """``share_encoder: false``: the value loss reaches only the value encoder and head, the policy
    loss only the policy's encoder and head; acting skips the value encoder."""
    torch.manual_seed(0)
    net = ActorCritic(CARTPOLE, ActorCriticSettings(hidden=16, share_encoder=False))
    obs, is_first = torch.randn(3, 5, 4), torch.zeros(3, 5, dtype=torch.bool)
    params, value, _ = net.unroll(obs, is_first)
    assert params["logits"].shape == (3, 5, 2) and value.shape == (3, 5)
    value_side = {n for n, _ in net.named_parameters() if n.startswith(("value_encoder.", "value."))}
    grads = torch.autograd.grad(value.sum(), list(net.parameters()), allow_unused=True)
    touched = {n for (n, _), g in zip(net.named_parameters(), grads) if g is not None and g.abs().sum() > 0}
    assert touched == value_side and len(value_side) == 6  # two linear layers and the head, weights and biases
    grads = torch.autograd.grad(params["logits"].sum(), list(net.parameters()), allow_unused=True)
    touched = {n for (n, _), g in zip(net.named_parameters(), grads) if g is not None and g.abs().sum() > 0}
    assert touched and not touched & value_side
    shared = ActorCritic(CARTPOLE, ActorCriticSettings(hidden=16))
    assert shared.value_encoder is None
    shared.load_state_dict({k: v for k, v in net.state_dict().items() if not k.startswith("value_encoder.")})
    assert torch.equal(net.act(obs[0], None, False)[2]["logits"], shared.act(obs[0], None, False)[2]["logits"])
    with pytest.raises(ValueError, match="share_encoder: false needs a feed-forward"):
        ActorCriticSettings(share_encoder=False, lstm_size=8)
    with pytest.raises(ValueError, match="with an injected encoder"):
        ActorCritic(CARTPOLE, ActorCriticSettings(share_encoder=False), encoder=torch.nn.Linear(4, 8))


def test_continuous_act_within_bounds():
    torch.manual_seed(0)
    net = ActorCritic(PENDULUM, ActorCriticSettings(init_sigma=3.0))  # wide: many samples fall beyond the bounds
    action, _, extras = net.act(torch.randn(256, 3), None, explore=True)
    assert action.shape == (256, 1) and action.dtype == torch.float32
    assert action.abs().max() <= 2.0 and (action.abs() == 2.0).any()
    assert set(extras) == {"mu", "sigma"} and torch.allclose(extras["sigma"], torch.tensor(3.0))
    mean, _, extras = net.act(torch.randn(4, 3), None, explore=False)  # deterministic_sample: the mean
    assert torch.allclose(mean, net.head.to_env(extras["mu"]))


# -- action heads ----------------------------------------------------------------------------
def test_categorical_head_log_prob_entropy_and_sampling():
    head = CategoricalHead(3, 3)
    logits = torch.log(torch.tensor([[0.2, 0.3, 0.5]]))
    params = {"logits": logits.expand(20000, 3)}
    assert torch.allclose(head.log_prob(params, torch.tensor([2]).expand(20000))[0], torch.log(torch.tensor(0.5)))
    assert torch.allclose(head.entropy({"logits": logits}), -(logits.exp() * logits).sum(-1))
    torch.manual_seed(0)
    freq = torch.bincount(head.sample(params, explore=True), minlength=3).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.2, 0.3, 0.5]), atol=0.015)
    assert head.sample(params, explore=False).eq(2).all()


def test_gaussian_head_censored_likelihood_sums_to_one():
    """The mass on the two bounds plus the density integrated over the inside is 1."""
    head = GaussianHead(2, gym.spaces.Box(-2.0, 2.0, (1,), np.float32))
    params = {"mu": torch.tensor([[0.7]]), "sigma": torch.tensor([[0.6]])}
    grid = torch.linspace(-2.0, 2.0, 40001)[1:-1].unsqueeze(-1)
    dens = head.log_prob({k: v.expand(len(grid), 1) for k, v in params.items()}, grid).exp()
    inside = torch.trapezoid(dens, grid.squeeze(-1)) / 2.0  # env units -> normalised units (width 4 -> 2)
    edges = head.log_prob({k: v.expand(2, 1) for k, v in params.items()}, torch.tensor([[-2.0], [2.0]])).exp()
    normal = torch.distributions.Normal(0.7, 0.6)
    assert torch.allclose(
        edges, torch.stack([normal.cdf(torch.tensor(-1.0)), 1 - normal.cdf(torch.tensor(1.0))]), rtol=1e-5
    )
    assert torch.allclose(inside * 2.0 / 2.0 + edges.sum(), torch.tensor(1.0), atol=1e-4)


def test_gaussian_head_mapping_and_unbounded_space():
    head = GaussianHead(2, gym.spaces.Box(np.array([-2.0, 0.0], np.float32), np.array([2.0, 1.0], np.float32)))
    u = torch.tensor([[-1.0, 1.0], [0.5, -0.5], [3.0, -3.0]])
    env = head.to_env(u)
    assert torch.allclose(env, torch.tensor([[-2.0, 1.0], [1.0, 0.25], [2.0, 0.0]]))
    assert torch.allclose(head.from_env(env), u.clamp(-1, 1))
    free = GaussianHead(2, gym.spaces.Box(-np.inf, np.inf, (2,), np.float32))
    x = torch.tensor([[5.0, -7.0]])
    params = {"mu": torch.zeros(1, 2), "sigma": torch.ones(1, 2)}
    assert torch.equal(free.to_env(x), x)
    assert torch.allclose(free.log_prob(params, x), torch.distributions.Normal(0.0, 1.0).log_prob(x).sum(-1))
    with pytest.raises(ValueError, match="every dimension or in none"):
        GaussianHead(2, gym.spaces.Box(np.array([-1.0, -np.inf], np.float32), np.array([1.0, np.inf], np.float32)))
    with pytest.raises(ValueError, match="sigma_type"):
        GaussianHead(2, gym.spaces.Box(-1.0, 1.0, (1,), np.float32), sigma_type="state")
    conditioned = GaussianHead(4, gym.spaces.Box(-1.0, 1.0, (2,), np.float32), "conditioned", "tanh", 0.5)
    assert conditioned(torch.randn(3, 4) * 1e4)["mu"].abs().max() <= 1.0
    assert torch.allclose(conditioned(torch.zeros(3, 4))["sigma"], torch.tensor(0.5))


# -- acting and learning see the same policy ----------------------------------------------------
@pytest.mark.parametrize("env_id,lstm_size", [("CartPole-v1", 0), ("CartPole-v1", 8), ("Pendulum-v1", 8)])
def test_learner_recomputes_the_behaviour_policy(env_id, lstm_size):
    """Rows made by the Collector with the net itself: the learner's unroll from row 0's stored
    core state reproduces every row's behaviour policy (across episode ends, where the core
    restarts), so on-policy ratios are exactly 1."""
    torch.manual_seed(0)
    cfg = {"id": env_id, "max_episode_steps": 12}
    net = ActorCritic(env_spec(EnvConfig(**cfg)), ActorCriticSettings(**IMPALA_TINY["net"], lstm_size=lstm_size))
    batch = _collect(cfg, net, steps=30)
    assert batch["is_first"][:, 1:].any()  # episodes end inside the unroll
    obs = batch["obs"].transpose(0, 1)
    state = (batch["core_h"][:, 0], batch["core_c"][:, 0]) if lstm_size else None
    params, _, _ = net.unroll(obs, batch["is_first"].transpose(0, 1), state)
    acting = ~batch["is_last"].transpose(0, 1)
    for key in net.head.behaviour_keys:
        assert torch.allclose(params[key][acting], batch[key].transpose(0, 1)[acting], atol=1e-5)
    loss = unroll_loss(net, batch)
    assert torch.allclose(loss.stats["rho_mean"], torch.tensor(1.0), atol=1e-4)
    assert loss.stats["rho_clipped_fraction"] == 0
    loss.total_loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in net.parameters() if p.grad is not None)


def test_unroll_loss_names_missing_columns():
    net = ActorCritic(CARTPOLE)
    batch = {"obs": torch.zeros(2, 3, 4), "reward": torch.zeros(2, 3)}
    with pytest.raises(KeyError, match="logits"):
        unroll_loss(net, batch)


# -- the loss ------------------------------------------------------------------------------
def _steps(reward, discount, mask=None):
    reward = torch.as_tensor(reward, dtype=torch.float32)
    mask = torch.ones_like(reward, dtype=torch.bool) if mask is None else torch.as_tensor(mask)
    return UnrollSteps(reward, torch.as_tensor(discount, dtype=torch.float32), mask)


def test_impala_loss_hand_values():
    """T=2, B=1 on-policy (rho = 1), lambda 1, gamma 0.5: V = [1, 2], bootstrap 4, r = [1, 1].
    vs_1 = 1 + 0.5*4 = 3, vs_0 = 1 + 0.5*3 = 2.5; advantages r + gamma vs_next - V: [1.5, 1];
    log pi = [log .5, log .25]; policy = -(log.5 * 1.5 + log.25 * 1) / 2;
    value = ((1 - 2.5)^2 + (2 - 3)^2) / 2 = 1.625; entropy mean of [0.7, 0.3] = 0.5."""
    logp = torch.log(torch.tensor([[0.5], [0.25]]))
    value = torch.tensor([[1.0], [2.0], [4.0]])
    cfg = VTraceLossSettings(value_weight=0.5, entropy_weight=0.1, discount=0.5, lambda_=1.0)
    out = impala_loss(logp, logp, torch.tensor([[0.7], [0.3]]), value, _steps([[1.0], [1.0]], [[0.5], [0.5]]), cfg)
    policy = -(math.log(0.5) * 1.5 + math.log(0.25) * 1.0) / 2
    assert math.isclose(out.policy_loss.item(), policy, rel_tol=1e-6)
    assert math.isclose(out.value_loss.item(), 1.625, rel_tol=1e-6)
    assert math.isclose(out.entropy_loss.item(), 0.5, rel_tol=1e-6)
    assert math.isclose(out.total_loss.item(), policy + 0.5 * 1.625 - 0.1 * 0.5, rel_tol=1e-6)
    assert torch.allclose(out.priority, torch.tensor([(1.5 + 1.0) / 2]))
    assert out.stats["rho_mean"] == 1.0 and out.stats["rho_clipped_fraction"] == 0.0


def test_impala_loss_gradients_masks_and_weights():
    torch.manual_seed(1)
    T, B = 5, 3
    tlogp = torch.log_softmax(torch.randn(T, B, 2), -1)[..., 0].requires_grad_()
    value = torch.randn(T + 1, B, requires_grad=True)
    blogp = torch.randn(T, B).clamp(max=-0.1)
    mask = torch.ones(T, B, dtype=torch.bool)
    mask[2, 1] = False
    blogp[2, 1] = float("nan")  # a zeroed extra (sigma 0) on a masked step
    steps = _steps(torch.randn(T, B), torch.full((T, B), 0.9), mask)
    cfg = VTraceLossSettings(lambda_=1.0)
    out = impala_loss(tlogp, blogp, torch.ones(T, B), value, steps, cfg)
    out.total_loss.backward()
    assert torch.isfinite(out.total_loss) and torch.isfinite(tlogp.grad).all() and torch.isfinite(value.grad).all()
    assert tlogp.grad[2, 1] == 0 and value.grad[2, 1] == 0  # the masked step adds nothing ...
    assert value.grad[3, 1] != 0  # ... but the step before it bootstraps from V(x_3)
    # the policy gradient is -A / count: the loss raises log pi where the advantage is positive
    adv_sign = torch.sign(-tlogp.grad[mask])
    from lightning_wm.returns import vtrace

    safe = torch.where(mask, blogp, torch.zeros(()))
    _, adv = vtrace(safe, tlogp.detach(), steps.reward, value[:-1], value[-1], steps.discount, lambda_=1.0, mask=mask)
    assert torch.equal(adv_sign, torch.sign(adv[mask]))
    # IS weights scale each unroll's terms
    w = torch.tensor([1.0, 0.0, 2.0])
    weighted = impala_loss(tlogp, blogp, torch.ones(T, B), value, steps, cfg, weight=w)
    terms = [
        impala_loss(
            tlogp[:, b : b + 1],
            blogp[:, b : b + 1],
            torch.ones(T, 1),
            value[:, b : b + 1],
            UnrollSteps(*(x[:, b : b + 1] for x in steps)),
            cfg,
        ).value_loss
        * mask[:, b].sum()
        for b in range(B)
    ]
    assert torch.allclose(weighted.value_loss, (terms[0] + 2 * terms[2]) / mask.sum())


def test_impala_loss_on_policy_value_target_is_lambda_return():
    torch.manual_seed(2)
    T, B = 6, 2
    logp = torch.randn(T, B)
    value = torch.randn(T + 1, B, requires_grad=True)
    reward, discount = torch.randn(T, B), torch.full((T, B), 0.95)
    cfg = VTraceLossSettings(lambda_=0.8)
    out = impala_loss(logp, logp, torch.zeros(T, B), value, _steps(reward, discount), cfg)
    target = lambda_return(reward, value.detach(), discount, 0.8)
    assert torch.allclose(out.value_loss, (value[:-1] - target).square().mean())


def test_policy_learns_the_better_arm_from_off_policy_data():
    """Two-armed bandit, one-step unrolls acted by a uniform behaviour policy: the V-trace
    gradient moves the target policy to the arm paying 1 (a sign check of the whole loss)."""
    torch.manual_seed(3)
    net = ActorCritic(CARTPOLE, ActorCriticSettings(**IMPALA_TINY["net"]))
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    B = 64
    for _ in range(25):
        action = torch.randint(0, 2, (B,))
        batch = {
            "obs": torch.zeros(B, 2, 4),
            "reward": torch.stack([torch.zeros(B), action.float()], 1),
            "is_first": torch.tensor([True, False]).expand(B, 2),
            "is_last": torch.tensor([False, True]).expand(B, 2),
            "is_terminal": torch.tensor([False, True]).expand(B, 2),
            "action": torch.stack([action, torch.zeros(B, dtype=torch.long)], 1),
            "logits": torch.zeros(B, 2, 2),  # uniform behaviour
        }
        loss = unroll_loss(net, batch, VTraceLossSettings(entropy_weight=0.0))
        opt.zero_grad()
        loss.total_loss.backward()
        opt.step()
    probs = torch.softmax(net.unroll(torch.zeros(1, 1, 4), torch.ones(1, 1, dtype=torch.bool))[0]["logits"], -1)
    assert probs[0, 0, 1] > 0.9


def test_reward_scale_scales_the_value_targets_and_the_advantages():
    """``reward_scale`` c is the loss of the same unrolls with their rewards multiplied by c."""
    torch.manual_seed(0)
    net = ActorCritic(CARTPOLE, ActorCriticSettings(hidden=8))
    B, T = 3, 5
    batch = {
        "obs": torch.randn(B, T + 1, 4),
        "reward": torch.rand(B, T + 1) * 10,
        "is_first": torch.zeros(B, T + 1, dtype=torch.bool),
        "is_last": torch.zeros(B, T + 1, dtype=torch.bool),
        "is_terminal": torch.zeros(B, T + 1, dtype=torch.bool),
        "action": torch.randint(0, 2, (B, T + 1)),
        "logits": torch.randn(B, T + 1, 2),
    }
    scaled = dict(batch, reward=batch["reward"] * 0.1)
    a = unroll_loss(net, batch, VTraceLossSettings(reward_scale=0.1))
    b = unroll_loss(net, scaled, VTraceLossSettings())
    for name in ("total_loss", "policy_loss", "value_loss", "entropy_loss"):
        assert torch.allclose(getattr(a, name), getattr(b, name)), name
    c = unroll_loss(net, batch, VTraceLossSettings())
    assert not torch.allclose(a.value_loss, c.value_loss)


def test_normalized_advantages_hand_values_and_masked_steps_left_alone():
    """Real steps [1, 3]: mean 2, std 1 -> [-1, 1]; the masked step keeps its 100."""
    advantage = torch.tensor([[1.0], [3.0], [100.0]])
    mask = torch.tensor([[True], [True], [False]])
    assert torch.allclose(normalized(advantage, mask), torch.tensor([[-1.0], [1.0], [100.0]]))


def test_impala_loss_with_normalized_advantages_hand_values():
    """The hand-values case: advantages [1.5, 1] (mean 1.25, std 0.25) become [1, -1]:
    policy = -(log .5 * 1 + log .25 * -1) / 2; the value and entropy terms are unchanged."""
    logp = torch.log(torch.tensor([[0.5], [0.25]]))
    value = torch.tensor([[1.0], [2.0], [4.0]])
    cfg = VTraceLossSettings(discount=0.5, lambda_=1.0, normalize_advantage=True)
    out = impala_loss(logp, logp, torch.tensor([[0.7], [0.3]]), value, _steps([[1.0], [1.0]], [[0.5], [0.5]]), cfg)
    assert math.isclose(out.policy_loss.item(), -(math.log(0.5) - math.log(0.25)) / 2, rel_tol=1e-6)
    assert math.isclose(out.value_loss.item(), 1.625, rel_tol=1e-6)


def test_relative_entropy_weight_is_in_units_of_the_advantages_batch_std():
    """The hand-values case above: advantages [1.5, 1], std 0.25; entropies [0.7, 0.3] (mean 0.5).
    With entropy_relative the bonus is 0.2 * 0.25 * 0.5; the policy and value terms are unchanged."""
    logp = torch.log(torch.tensor([[0.5], [0.25]]))
    value = torch.tensor([[1.0], [2.0], [4.0]])
    steps = _steps([[1.0], [1.0]], [[0.5], [0.5]])
    entropy = torch.tensor([[0.7], [0.3]])
    common = {"discount": 0.5, "lambda_": 1.0, "entropy_weight": 0.2}
    plain = impala_loss(logp, logp, entropy, value, steps, VTraceLossSettings(**common))
    relative = impala_loss(logp, logp, entropy, value, steps, VTraceLossSettings(**common, entropy_relative=True))
    assert torch.equal(plain.policy_loss, relative.policy_loss) and torch.equal(plain.value_loss, relative.value_loss)
    rest = plain.policy_loss + 0.5 * plain.value_loss
    assert math.isclose((plain.total_loss - rest).item(), -0.2 * 0.5, abs_tol=1e-6)
    assert math.isclose((relative.total_loss - rest).item(), -0.2 * 0.25 * 0.5, abs_tol=1e-6)
    assert math.isclose(plain.stats["entropy_weight"].item(), 0.2, rel_tol=1e-6)
    assert math.isclose(relative.stats["entropy_weight"].item(), 0.2 * 0.25, rel_tol=1e-6)


def test_entropy_weight_schedule_moves_linearly_then_holds():
    cfg = VTraceLossSettings(entropy_weight=0.1, entropy_weight_end=0.01, entropy_anneal_steps=100)
    assert [round(entropy_weight_at(cfg, s), 6) for s in (0, 50, 100, 200)] == [0.1, 0.055, 0.01, 0.01]
    assert at_step(cfg, 50).entropy_weight == pytest.approx(0.055) and at_step(cfg, 50).entropy_weight_end is None
    plain = VTraceLossSettings(entropy_weight=0.1)
    assert at_step(plain, 10**6) is plain and entropy_weight_at(plain, 7) == 0.1
    with pytest.raises(ValueError, match="entropy_anneal_steps >= 1"):
        VTraceLossSettings(entropy_weight_end=0.01)
    late = VTraceLossSettings(
        entropy_weight=0.1, entropy_weight_end=0.01, entropy_anneal_steps=100, entropy_anneal_start=300
    )
    assert [round(entropy_weight_at(late, s), 6) for s in (0, 300, 350, 400, 10**6)] == [0.1, 0.1, 0.055, 0.01, 0.01]
    with pytest.raises(ValueError, match="entropy_anneal_start must be >= 0"):
        VTraceLossSettings(entropy_anneal_start=-1)


def cartpole_unrolls(B: int = 2, T: int = 4) -> dict[str, torch.Tensor]:
    """A random batch of ``B`` CartPole unrolls ``[B, T+1, ...]`` with behaviour logits (seeded)."""
    torch.manual_seed(0)
    return {
        "obs": torch.randn(B, T + 1, 4),
        "reward": torch.rand(B, T + 1),
        "is_first": torch.zeros(B, T + 1, dtype=torch.bool),
        "is_last": torch.zeros(B, T + 1, dtype=torch.bool),
        "is_terminal": torch.zeros(B, T + 1, dtype=torch.bool),
        "action": torch.randint(0, 2, (B, T + 1)),
        "logits": torch.randn(B, T + 1, 2),
    }


def test_the_learner_uses_the_entropy_weight_of_its_step():
    """total(step 0) - total(step 100) = -(0.1 - 0.01) * entropy: only the entropy weight moved."""
    batch = cartpole_unrolls()
    model = IMPALA(
        CARTPOLE,
        net={"hidden": 8},
        loss={"entropy_weight": 0.1, "entropy_weight_end": 0.01, "entropy_anneal_steps": 100},
    )
    early, _, _ = model._losses(batch, None, 0)
    late, _, _ = model._losses(batch, None, 100)
    assert torch.allclose(early.total_loss - late.total_loss, -0.09 * early.entropy_loss)
    assert early.stats["entropy_weight"].item() == pytest.approx(0.1)
    assert late.stats["entropy_weight"].item() == pytest.approx(0.01)


def test_policy_lag_sums_hand_values():
    """Trained at step 10: rows of versions 9 and 7 lag 1 and 3; the bootstrap column and the
    random prefill's -1 are left out."""
    version = torch.tensor([[9, 9, 9, 0], [7, 7, -1, 5]])
    assert policy_lag_sums(version, 10).tolist() == [1 + 1 + 1 + 3 + 3, 5]
    assert policy_lag_sums(torch.full((2, 3), -1), 10).tolist() == [0, 0]


def test_logged_policy_lag_is_the_mean_over_the_steps_since_the_last_written_one(monkeypatch):
    """A chunk that feeds two batches is trained at steps 10 and 11 (lags 2 and 3); the logger
    writes step 11 alone, and ``train/policy_lag`` reads 2.5, not the one step's 3."""
    B, T = 2, 4
    batch = {**cartpole_unrolls(B, T), "policy_version": torch.full((B, T + 1), 8)}
    model = IMPALA(CARTPOLE, net={"hidden": 8})
    step = [10]
    logged = []
    monkeypatch.setattr(IMPALA, "global_step", property(lambda self: step[0]))
    monkeypatch.setattr(model, "logs_step", lambda s: s == 12)
    monkeypatch.setattr(model, "log_dict", lambda logs, **kw: logged.append(logs))
    monkeypatch.setattr(model, "log", lambda *a, **kw: None)
    model.training_step(batch, 0)
    assert logged == []
    step[0] = 11
    model.training_step(batch, 1)
    assert logged[0]["train/policy_lag"].item() == pytest.approx(2.5)
    step[0] = 12
    model.training_step({**batch, "policy_version": torch.full((B, T + 1), -1)}, 2)
    assert model._lag_sums.tolist() == [0, 0], "the sums start again after a written step"


# -- settings groups -----------------------------------------------------------------------
def test_settings_groups_check_their_ranges_and_keep_the_defaults():
    """Each group refuses an out-of-range value in one line naming the option; IMPALA's defaults
    are DI-engine's (Adam at 0.0005, no clipping, value 0.5, entropy 0.0001, gamma 0.99, lambda
    0.95, clips 1), and a partial mapping (YAML, a checkpoint) keeps the other defaults."""
    for kwargs, name in (
        ({"discount": 1.5}, "loss.discount"),
        ({"lambda_": -0.1}, "loss.lambda_"),
        ({"entropy_weight": -1.0}, "loss.entropy_weight"),
        ({"rho_clip": 0.0}, "loss.rho_clip"),
        ({"reward_scale": 0.0}, "loss.reward_scale"),
    ):
        with pytest.raises(ValueError, match=name):
            VTraceLossSettings(**kwargs)
    for kwargs, match in (
        ({"hidden": 0}, "hidden >= 1"),
        ({"activation": "swish"}, "unknown activation"),
        ({"sigma_type": "state"}, "sigma_type"),
        ({"bound_type": "clip"}, "bound_type"),
        ({"init_sigma": 0.0}, "init_sigma"),
    ):
        with pytest.raises(ValueError, match=match):
            ActorCriticSettings(**kwargs)
    model = IMPALA(CARTPOLE)
    assert model.optim == OptimSettings(lr=0.0005) and model.optim.clip.type is None
    assert model.loss == VTraceLossSettings(0.5, 0.0001, 0.99, 0.95, 1.0, 1.0, 1.0, 1.0, False, None, 0)
    assert model.net_settings == ActorCriticSettings(hidden=64, layers=2)
    partial = IMPALA(CARTPOLE, net={"hidden": 8}, loss={"discount": 0.9}, optim={"eps": 0.01, "clip": {"value": 4.0}})
    assert partial.optim.lr == 0.0005 and partial.optim.eps == 0.01 and partial.optim.clip.value == 4.0
    assert partial.loss.discount == 0.9 and partial.loss.value_weight == 0.5 and partial.net_settings.layers == 2
    assert partial.hparams["optim"]["lr"] == 0.0005 and partial.hparams["loss"]["discount"] == 0.9
    with pytest.raises(ValueError, match="unknown setting"):
        IMPALA(CARTPOLE, loss={"discount_factor": 0.9})
    with pytest.raises(ValueError, match="'adam' or 'rmsprop'"):
        IMPALA(CARTPOLE, optim=OptimSettings(name="sgd"))


def test_rmsprop_eps_of_a_summed_loss_is_warned_about_and_of_a_mean_loss_is_not():
    """The paper's eps 0.01 belongs to a loss summed over T x B steps; the mean loss takes 0.01 / (T x B)."""
    with pytest.warns(UserWarning, match=r"optim.eps 0.01 with rmsprop: .*0.01 / \(batch_size x unroll_length\)"):
        IMPALA(CARTPOLE, optim={"name": "rmsprop", "eps": 0.01})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        IMPALA(CARTPOLE, optim={"name": "rmsprop", "eps": 1.5625e-5, "clip": {"type": "clip_norm", "value": 0.0625}})
        IMPALA(CARTPOLE, optim={"eps": 0.01})  # Adam's eps is not the paper's constant
