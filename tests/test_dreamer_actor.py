"""Dreamer's actor gradient and the values its returns bootstrap from: REINFORCE with the bounded
Normal scores the draw before the clip, the REINFORCE/dynamics mixture (``actor_grad: mix``) is
the weighted sum of the pure gradients, and ``bootstrap_critic: slow_critic``."""

import math

import pytest
import torch

from lightning_wm.agents.dreamer import Dreamer
from lightning_wm.agents.dreamer.policy import ActorDistribution
from lightning_wm.envs import EnvConfig, env_spec
from lightning_wm.nn import dists
from lightning_wm.returns import lambda_return

from support.batches import pendulum_batch
from support.presets import DREAMER_TINY

torch.set_num_threads(1)


def tiny(env_id: str, seed: int = 0, net=None, **behavior) -> Dreamer:
    torch.manual_seed(seed)
    spec = env_spec(EnvConfig(id=env_id))
    net = {**DREAMER_TINY["net"], **(net or {})}
    return Dreamer(spec, net=net, behavior={**DREAMER_TINY["behavior"], **behavior})


def cartpole_batch(B: int = 3, L: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    is_first = torch.zeros(B, L, dtype=torch.bool)
    is_first[:, 0] = True
    return {
        "obs": torch.randn(B, L, 4, generator=g),
        "action": torch.randint(0, 2, (B, L), generator=g),
        "reward": torch.ones(B, L),
        "is_first": is_first,
        "is_last": torch.zeros(B, L, dtype=torch.bool),
        "is_terminal": torch.zeros(B, L, dtype=torch.bool),
    }


def imagined(model: Dreamer, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    _, _, post = model.world_model_loss(batch)
    start = {k: post[k].detach().flatten(0, 1) for k in ("h", "z", "idx") if k in post}
    return model.imagine(start, 1.0 - batch["is_terminal"].flatten().float())


# -- REINFORCE with the bounded Normal -----------------------------------------------------------------
def test_the_score_of_the_bounded_normal_is_unbiased_for_the_clipped_action():
    """x ~ N(m, s), action clip(x, -1, 1): d/dm E[clip(x)] = Phi((1 - m) / s) - Phi((-1 - m) / s),
    times dm/draw = 1 - m^2 (m = tanh(raw)). The score function of the draw x estimates it (within
    0.01 on 200k draws); the clipped action's log-density under the unclipped Gaussian (the old
    estimate) gives 0.145 against 0.204 here."""
    torch.manual_seed(0)
    distribution = ActorDistribution(discrete=False)
    raw0 = torch.tensor([math.atanh(0.8), 0.0], requires_grad=True)
    raw = raw0.expand(200_000, 2)
    action, draw = distribution.sample(raw)
    assert torch.equal(action, draw.clamp(-1, 1)) or torch.allclose(action, draw.clamp(-1, 1), atol=1e-6)
    reward = action.detach()[:, 0]
    _, log_prob = distribution.entropy_and_log_prob(raw, draw, True)
    (grad,) = torch.autograd.grad((log_prob * (reward - reward.mean())).mean(), raw0)
    (m,), (s,) = (t.detach().flatten().tolist() for t in distribution.continuous(raw0[None]))
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    want = (phi((1 - m) / s) - phi((-1 - m) / s)) * (1 - m * m)
    assert grad[0].item() == pytest.approx(want, abs=0.01)


def test_imagined_reinforce_log_probs_are_the_draws_not_the_clipped_actions():
    model = tiny("Pendulum-v1", actor_grad="reinforce")
    traj = imagined(model, pendulum_batch(L=6))
    mean, std = model.actor_distribution.continuous(traj["raw"])
    draws, actions = traj["draws"], traj["actions"]
    clipped = draws.abs() > 1
    assert clipped.any() and torch.allclose(actions, draws.clamp(-1, 1), atol=1e-6)
    torch.testing.assert_close(traj["log_prob"], dists.normal_log_prob(draws, mean, std))
    at_actions = dists.normal_log_prob(actions, mean, std)
    assert not torch.allclose(traj["log_prob"][clipped.squeeze(-1)], at_actions[clipped.squeeze(-1)])
    traj["log_prob"].sum().backward()  # the score reaches the actor, not the draws' source
    assert model.actor[0].weight.grad.abs().sum() > 0 and all(p.grad is None for p in model.wm.parameters())


def test_tanh_normal_log_prob_is_the_squashed_density_of_the_draw():
    """log p(tanh(u)) = log N(u; m, s) - log(1 - tanh(u)^2), also where tanh(u) rounds to 1."""
    u, mean, std = torch.tensor([[0.3], [9.0]]), torch.zeros(2, 1), torch.ones(2, 1)
    want = dists.normal_log_prob(u, mean, std) - torch.log(1 - torch.tanh(u.double()) ** 2).squeeze(-1).float()
    torch.testing.assert_close(dists.tanh_normal_log_prob(u, mean, std), want, rtol=1e-5, atol=1e-4)
    distribution = ActorDistribution(discrete=False, kind="tanh_normal")
    _, log_prob = distribution.entropy_and_log_prob(torch.zeros(2, 2), u, True)
    assert torch.isfinite(log_prob).all()


# -- the REINFORCE / dynamics mixture ------------------------------------------------------------------
def actor_grads(model: Dreamer, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    torch.manual_seed(1)
    losses, _, _ = model.losses(batch, (model.ret_low, model.ret_high))
    losses["actor"].backward()
    return [p.grad.clone() for p in model.actor.parameters()]


def test_the_mixture_gradient_is_the_weighted_sum_of_the_pure_gradients():
    """Same weights, same draws: the actor's gradient with ``actor_grad: mix`` and ρ = 0.3 is 0.3
    times REINFORCE's plus 0.7 times the dynamics'; ρ = 1 and ρ = 0 are those two themselves."""
    batch = pendulum_batch(L=6)
    gaussian = {"latent": "gaussian"}  # no sparse one-hot path: both pure forms see the same values
    pure = {
        grad: actor_grads(tiny("Pendulum-v1", net=gaussian, actor_grad=grad), batch)
        for grad in ("reinforce", "dynamics")
    }
    mix = tiny("Pendulum-v1", net=gaussian, actor_grad="mix", reinforce_weight=0.3)
    assert mix.actor_grad == "mix"
    for got, r, d in zip(actor_grads(mix, batch), pure["reinforce"], pure["dynamics"]):
        torch.testing.assert_close(got, 0.3 * r + 0.7 * d, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(pure["reinforce"][0], pure["dynamics"][0])
    assert tiny("Pendulum-v1", actor_grad="mix", reinforce_weight=1.0).actor_grad == "reinforce"
    assert tiny("Pendulum-v1", actor_grad="mix", reinforce_weight=0.0).actor_grad == "dynamics"
    with pytest.raises(ValueError, match="behavior.actor_grad 'mix' needs continuous actions"):
        tiny("CartPole-v1", actor_grad="mix")


def test_a_mixed_step_reaches_only_the_actor_and_its_loss_is_logged():
    model = tiny("Pendulum-v1", actor_grad="mix", reinforce_weight=0.5)
    losses, logs = model.gradient_step(pendulum_batch(L=6), model.configure_optimizers())
    assert torch.isfinite(losses["actor"]) and torch.isfinite(logs["train/entropy"])
    traj = imagined(model, pendulum_batch(L=6))
    assert {"log_prob", "entropy_reinforce", "entropy_dynamics"} <= traj.keys()
    feats = traj["features"]  # with the dynamics' gradient (the actions are reparameterised)
    (through_returns,) = torch.autograd.grad(traj["returns"].sum(), feats, retain_graph=True, allow_unused=True)
    (through_score,) = torch.autograd.grad(traj["log_prob"].sum(), feats, retain_graph=True, allow_unused=True)
    assert through_returns is not None and through_score is None  # the score sees detached features


# -- the critic the returns bootstrap from -------------------------------------------------------------
@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"], ids=["reinforce", "dynamics"])
def test_returns_bootstrap_from_the_slow_critic_when_asked(env_id):
    """``bootstrap_critic: slow_critic``: the values (λ-return bootstrap, REINFORCE baseline) are the
    slow critic's, the critic's regulariser target too; the default keeps the critic's."""
    batch = pendulum_batch(L=6) if env_id == "Pendulum-v1" else cartpole_batch()
    for source in ("critic", "slow_critic"):
        model = tiny(env_id, bootstrap_critic=source)
        with torch.no_grad():  # a slow critic that differs from the critic
            for p in model.slow_critic.parameters():
                p.add_(0.3 * torch.randn_like(p))
        torch.manual_seed(1)
        traj = imagined(model, batch)
        states = {k: v.detach() for k, v in traj["states"].items()}
        with torch.no_grad():
            of = {
                name: model.wm.head_mean(model.wm.first_layer(getattr(model, name), states))
                for name in ("critic", "slow_critic")
            }
        torch.testing.assert_close(traj["value"].detach(), of[source], rtol=1e-4, atol=1e-5)
        assert not torch.allclose(of["critic"], of["slow_critic"])
        torch.testing.assert_close(traj["slow_values"], of["slow_critic"][:-1], rtol=1e-4, atol=1e-5)
        discount = model.behavior.discount * (1.0 - traj["dones"])
        want = lambda_return(traj["rewards"], traj["value"], discount, model.behavior.lambda_)
        torch.testing.assert_close(traj["returns"], want)
        losses, _, _ = model.losses(batch, (model.ret_low, model.ret_high))
        losses["actor"].backward()
        assert all(p.grad is None for p in model.slow_critic.parameters())
        assert all(p.grad is None for p in model.critic.parameters())
        assert model.actor[0].weight.grad.abs().sum() > 0


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_fp16_loss_scaling_is_refused_in_one_line(precision):
    """fp16's loss scaling would leave the actor's and critic's gradients scaled (they step their
    plain optimizers): refused by name; bf16 needs no scaling and builds its optimizers."""
    from types import SimpleNamespace

    model = tiny("CartPole-v1")
    model._trainer = SimpleNamespace(precision=precision, world_size=1)
    if precision == "16-mixed":
        with pytest.raises(ValueError, match="use bf16-mixed"):
            model.configure_optimizers()
    else:
        assert len(model.configure_optimizers()) == 3
