"""Dreamer: RSSM resets, the sparse one-hot path, imagination gradients, one backward of the summed
losses equal to per-loss backwards, losses falling on a fixed batch, acting, the loss weights and
learning-rate schedules (CLI fits and resume: test_dreamer_cli.py)."""

from pathlib import Path

import pytest
import torch

from lightning_wm.agents.dreamer import Dreamer, onehot_linear
from lightning_wm.agents.dreamer import losses as L
from lightning_wm.envs import EnvConfig, env_spec
from lightning_wm.nn import dists

from support.batches import pendulum_batch
from support.presets import DREAMER_TINY

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
HORIZON = DREAMER_TINY["behavior"]["horizon"]


def tiny(spec, net=None, loss=None, behavior=None, optim=None, **kwargs) -> Dreamer:
    """A tiny Dreamer (``DREAMER_TINY``); group fields given as dicts override its sizes."""
    return Dreamer(
        spec,
        net={**DREAMER_TINY["net"], **(net or {})},
        loss=loss,
        behavior={**DREAMER_TINY["behavior"], **(behavior or {})},
        optim=optim,
        **kwargs,
    )


def cartpole_batch(B: int = 4, L: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    is_first = torch.zeros(B, L, dtype=torch.bool)
    is_first[:, 0] = True
    is_first[0, 5] = is_first[2, 7] = True
    is_terminal = torch.zeros(B, L, dtype=torch.bool)
    is_terminal[0, 4] = True
    return {
        "obs": torch.randn(B, L, 4, generator=g),
        "action": torch.randint(0, 2, (B, L), generator=g),
        "reward": torch.where(is_first, 0.0, 1.0),
        "is_first": is_first,
        "is_last": is_terminal.clone(),
        "is_terminal": is_terminal,
    }


@pytest.fixture(scope="module")
def cartpole_spec():
    return env_spec(EnvConfig(id="CartPole-v1"))


def test_rssm_resets_where_is_first(cartpole_spec):
    torch.manual_seed(0)
    model = tiny(cartpole_spec)
    batch = cartpole_batch()
    wm = model.wm
    with torch.no_grad():
        embed = wm.encode(batch["obs"])
        out = wm.observe(embed, model.actions.encode(batch["action"]), batch["is_first"])
        # after a reset, h depends on nothing (zero state, zero action): same for every reset entry
        h0 = out["h"][0, 0]
        for b, t in [(0, 5), (2, 7), (1, 0), (3, 0)]:
            assert torch.allclose(out["h"][b, t], h0, atol=1e-6)
        assert not torch.allclose(out["h"][0, 4], h0)
        # ... and the posterior there depends only on the observation: restart the sequence at t=5
        rest = wm.observe(embed[:, 5:], model.actions.encode(batch["action"][:, 5:]), batch["is_first"][:, 5:])
        assert torch.allclose(out["post"][0, 5], rest["post"][0, 0], atol=1e-5)
        assert not torch.allclose(out["post"][1, 5], rest["post"][1, 0], atol=1e-3)  # no reset for b=1
        # the agent's initial state gives the same filter step as a reset in training
        state = model.initial_state(4)
        assert set(state) == {"h", "z", "action"} and all(v.shape[0] == 4 and not v.any() for v in state.values())
        post = wm.obs_step(state, state["action"], embed[:, 0])
        assert torch.allclose(post["h"], out["h"][:, 0], atol=1e-6)


def test_onehot_linear_and_sparse_heads_match_dense(cartpole_spec):
    torch.manual_seed(0)
    index = torch.randint(0, 4, (6, 3))
    z = torch.nn.functional.one_hot(index, 4).float().flatten(-2)
    flat = index + torch.arange(3) * 4
    weight = torch.randn(5, 12, requires_grad=True)
    dense = z @ weight.t()
    sparse = onehot_linear(flat, z, weight)
    assert torch.allclose(dense, sparse, atol=1e-6)
    g = torch.randn(6, 5)
    (grad_dense,) = torch.autograd.grad(dense, weight, g)
    (grad_sparse,) = torch.autograd.grad(sparse, weight, g)
    assert torch.allclose(grad_dense, grad_sparse, atol=1e-6)
    # the CPU backward scatters in row chunks (256 rows here: 3 chunks, the last one short)
    index = torch.randint(0, 4, (600, 3))
    z_many = torch.nn.functional.one_hot(index, 4).float().flatten(-2)
    wide = torch.randn(4096, 12, requires_grad=True)
    g = torch.randn(600, 4096)
    (grad_dense,) = torch.autograd.grad(z_many @ wide.t(), wide, g)
    (grad_sparse,) = torch.autograd.grad(onehot_linear(index + torch.arange(3) * 4, z_many, wide), wide, g)
    assert torch.allclose(grad_dense, grad_sparse, atol=1e-4)

    model = tiny(cartpole_spec, net={"stoch": 3})
    state = {"h": torch.randn(6, 16), "z": z, "idx": flat}
    feat = model.wm.features(state)
    for mlp in (model.wm.reward_head, model.wm.cont_head, model.critic, model.actor):
        assert torch.allclose(model.wm.first_layer(mlp, state), mlp(feat), atol=1e-5)
    assert torch.equal(model.wm.onehot_index(z), flat)


def test_imagination_gradients_reach_only_their_networks(cartpole_spec):
    torch.manual_seed(0)
    model = tiny(cartpole_spec)
    batch = cartpole_batch()
    _, _, post = model.world_model_loss(batch)
    start = {k: post[k].detach().flatten(0, 1) for k in ("h", "z", "idx")}
    traj = model.imagine(start, 1.0 - batch["is_terminal"].flatten().float())
    H, N = HORIZON, 4 * 12
    assert traj["features"].shape == (H + 1, N, 16 + 16)
    assert traj["actions"].shape == (H, N, 2) and traj["returns"].shape == (H, N)
    assert traj["weight"].shape == (H + 1, N)
    assert torch.all(traj["weight"][:, 4] == 0)  # imagination from a terminal state counts for nothing
    actor_loss, critic_loss, _, logs = behaviour_losses(model, traj)
    actor_loss.backward(retain_graph=True)
    assert all(p.grad is None for p in model.wm.parameters())
    assert all(p.grad is None for p in model.critic.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.actor.parameters())
    model.zero_grad()
    critic_loss.backward()
    assert all(p.grad is None for p in model.wm.parameters()) and all(p.grad is None for p in model.actor.parameters())
    assert model.critic[-1].weight.grad.abs().sum() > 0
    assert float(logs["train/return_scale"]) >= 1.0


def behaviour_losses(model: Dreamer, traj: dict[str, torch.Tensor]):
    """:func:`~lightning_wm.agents.dreamer.losses.behaviour_losses` with the module's settings and return range."""
    bins = model.wm.bins if model.wm.twohot else None
    return L.behaviour_losses(
        traj, (model.ret_low, model.ret_high), model.behavior, model.reinforce_weight, bins, model.wm.symlog_obs
    )


def _train(model: Dreamer, batch: dict[str, torch.Tensor], steps: int) -> list[dict[str, float]]:
    """What ``training_step`` does, without Lightning: one backward of the summed losses."""
    optimizers = model.configure_optimizers()
    history = []
    for _ in range(steps):
        _, logs = model.gradient_step(batch, optimizers)
        history.append({k: float(v) for k, v in logs.items()})
    return history


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"], ids=["reinforce", "dynamics-backprop"])
def test_one_backward_of_the_summed_losses_gives_each_network_its_own_gradient(env_id):
    """The three losses touch disjoint parameter sets, so ``training_step``'s single backward of
    their sum (what DDP needs) equals three separate backwards, network by network (the critic's
    including its loss on the replayed sequences)."""
    torch.manual_seed(0)
    model = tiny(env_spec(EnvConfig(id=env_id)), behavior={"replay_critic_weight": 0.3})
    batch = cartpole_batch() if env_id == "CartPole-v1" else pendulum_batch()
    losses, _, _ = model.losses(batch, (model.ret_low, model.ret_high))
    groups = {
        "model": list(model.wm.parameters()),
        "actor": list(model.actor.parameters()),
        "critic": list(model.critic.parameters()),
    }
    assert all(not p.requires_grad for p in model.slow_critic.parameters())
    every = [p for params in groups.values() for p in params]
    assert len(every) == sum(p.requires_grad for p in model.parameters())  # nothing else is trained
    per_loss = {}
    for name, loss in losses.items():
        grads = torch.autograd.grad(loss, every, retain_graph=True, allow_unused=True)
        per_loss[name] = dict(zip(every, grads))
        for owner, params in groups.items():
            if owner == name:  # every parameter of its own network is in its graph, some get a gradient
                assert all(per_loss[name][p] is not None for p in params), (name, owner)
                assert any(per_loss[name][p].abs().sum() > 0 for p in params), name
            else:  # no path at all into another network's parameters
                assert all(per_loss[name][p] is None for p in params), f"{name} loss reaches the {owner}"
    sum(losses.values()).backward()
    for owner, params in groups.items():
        for p in params:
            torch.testing.assert_close(p.grad, per_loss[owner][p])


def test_replay_critic_loss_teaches_the_critic_real_terminations(cartpole_spec):
    """Trained on its replay loss alone (gamma 0.8), the critic learns the real returns: 1 on the
    row before the terminal row (0, 4), 1 + 0.8 on the one before, about 1 / (1 - 0.8) = 5
    along sequence 1, which never terminates."""
    torch.manual_seed(0)
    model = tiny(cartpole_spec, behavior={"replay_critic_weight": 1.0, "discount": 0.8})
    batch = cartpole_batch()
    with torch.no_grad():
        _, _, post = model.world_model_loss(batch)
    states = {k: post[k] for k in ("h", "z", "idx")}
    optimizer = torch.optim.Adam(model.critic.parameters(), lr=3e-3)
    for _ in range(300):
        loss = model.replay_critic_loss(batch, post)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        value = model.wm.head_mean(model.wm.first_layer(model.critic, states))  # [B, L]
    assert batch["is_terminal"][0, 4]
    assert value[0, 3].item() == pytest.approx(1.0, abs=0.2)
    assert value[0, 2].item() == pytest.approx(1.8, abs=0.3)
    assert 4.0 < value[1].min() and value[1].max() < 6.0


def test_losses_fall_on_a_fixed_batch(cartpole_spec):
    torch.manual_seed(0)
    model = tiny(cartpole_spec, optim={"model": {"lr": 3e-3}, "critic": {"lr": 3e-3}, "actor": {"lr": 1e-3}})
    history = _train(model, cartpole_batch(), 40)
    first, last = history[0], history[-1]
    assert last["train/loss_model"] < 0.7 * first["train/loss_model"]
    assert last["train/loss_recon"] < 0.7 * first["train/loss_recon"]
    assert last["train/loss_reward"] < 0.5 * first["train/loss_reward"]
    assert last["train/loss_critic"] < first["train/loss_critic"]
    # rewards of 1 are learnt: imagined rewards, returns and values rise from 0
    assert last["train/imag_reward"] > 0.3 and last["train/imag_return"] > 0.8
    assert last["train/imag_value"] > 0.1


@pytest.mark.parametrize(
    "options",
    [
        dict(net={"latent": "gaussian"}),
        dict(net={"twohot": False, "symlog_obs": False}, behavior={"return_norm": False}),
    ],
    ids=["gaussian", "mse-heads"],
)
def test_variants_train(cartpole_spec, options):
    torch.manual_seed(0)
    model = tiny(cartpole_spec, optim={"model": {"lr": 3e-3}}, **options)
    history = _train(model, cartpole_batch(), 15)
    assert history[-1]["train/loss_model"] < history[0]["train/loss_model"]
    assert all(torch.isfinite(torch.tensor(list(h.values()))).all() for h in history)


def test_act_discrete_explore_and_mode(cartpole_spec):
    torch.manual_seed(0)
    model = tiny(cartpole_spec)
    state = model.initial_state(3)
    obs = torch.randn(3, 4)
    action, new_state, extras = model.act(obs, state, explore=True)
    assert action.dtype == torch.int64 and action.shape == (3,) and extras == {}
    assert set(new_state) == {"h", "z", "action"}
    assert torch.equal(new_state["action"].argmax(-1), action)
    # explore=False is the actor's mode: deterministic given the state
    torch.manual_seed(1)
    a1, s1, _ = model.act(obs, state, explore=False)
    logits = model.actor(model.wm.features(s1))
    assert torch.equal(a1, logits.argmax(-1))


@pytest.mark.slow  # torch.compile
@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_acting_copy_ships_only_what_acting_needs_and_acts_the_same(env_id):
    import pickle

    torch.manual_seed(0)
    spec = env_spec(EnvConfig(id=env_id))
    model = tiny(spec, compile=False)
    policy = model.acting_copy()
    keys = list(policy.state_dict())
    assert keys == list(model.acting_copy().state_dict())
    assert any(k.startswith("wm.codec.encoders") for k in keys) and any(k.startswith("actor.") for k in keys)
    assert not any(part in k for k in keys for part in ("decoders", "reward_head", "cont_head", "prior_net", "critic"))
    assert not policy.training and all(not p.requires_grad for p in policy.parameters())
    assert any(p.requires_grad for p in model.parameters()), "the learner's own module is untouched"
    policy = pickle.loads(pickle.dumps(policy))  # spawn-safe
    obs = torch.randn(3, spec.observation_space.shape[0])
    state_m, state_p = model.initial_state(3), policy.initial_state(3)
    for step in range(3):  # the same actions and states, exploring with the same random draws
        torch.manual_seed(step)
        a_m, state_m, _ = model.act(obs, state_m, explore=True)
        torch.manual_seed(step)
        a_p, state_p, _ = policy.act(obs, state_p, explore=True)
        assert torch.equal(a_m, a_p)
        for key in state_m:
            assert torch.equal(state_m[key], state_p[key]), key
    # the weights a store publishes are the learner's own values
    for key, value in policy.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key
    # a compiled learner ships a plain (uncompiled, picklable) policy
    compiled = tiny(spec, compile=True).acting_copy()
    assert "_recurrent" not in vars(compiled.wm) and compiled.actor._compiled_call_impl is None
    pickle.loads(pickle.dumps(compiled))


def test_continuous_pendulum_dynamics_backprop():
    torch.manual_seed(0)
    spec = env_spec(EnvConfig(id="Pendulum-v1"))
    model = tiny(spec)
    assert model.actor_grad == "dynamics"
    state = model.initial_state(5)
    action, state, _ = model.act(torch.randn(5, 3), state, explore=True)
    assert action.shape == (5, 1) and action.dtype == torch.float32
    assert action.abs().max() <= 2.0  # Pendulum torque bounds
    B, L = 3, 8
    batch = {
        "obs": torch.randn(B, L, 3),
        "action": torch.rand(B, L, 1) * 4 - 2,
        "reward": -torch.rand(B, L),
        "is_first": torch.zeros(B, L, dtype=torch.bool),
        "is_last": torch.zeros(B, L, dtype=torch.bool),
        "is_terminal": torch.zeros(B, L, dtype=torch.bool),
    }
    assert model.actions.encode(batch["action"]).abs().max() <= 1.0
    _, _, post = model.world_model_loss(batch)
    traj = model.imagine({k: post[k].detach().flatten(0, 1) for k in ("h", "z")}, torch.ones(B * L))
    actor_loss, critic_loss, _, _ = behaviour_losses(model, traj)
    actor_loss.backward()
    # gradients flow through the (frozen) dynamics into the actor, never into the model
    assert model.actor[0].weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.wm.parameters())
    assert all(p.grad is None for p in model.critic.parameters())


def test_eval_policy_sample_evaluates_with_the_actors_samples(cartpole_spec):
    """``eval_policy: sample`` (DreamerV3's eval mode): ``explore=False`` acts exactly as
    exploring does, in the learner and in its acting copy; ``mode`` keeps the argmax."""
    torch.manual_seed(0)
    model = tiny(cartpole_spec, eval_policy="sample")
    obs = torch.randn(64, 4)
    for agent in (model, model.acting_copy()):
        state = agent.initial_state(64)
        torch.manual_seed(5)
        sampled, _, _ = agent.act(obs, state, explore=True)
        torch.manual_seed(5)
        evaluated, _, _ = agent.act(obs, state, explore=False)
        assert torch.equal(sampled, evaluated)
    model.eval_policy = "mode"
    action, new_state, _ = model.act(obs, model.initial_state(64), explore=False)
    assert torch.equal(action, model.actor(model.wm.features(new_state)).argmax(-1)), "mode: the argmax"
    with pytest.raises(ValueError, match="eval_policy"):
        tiny(cartpole_spec, eval_policy="greedy")


def test_continue_terminal_weight_scales_the_continue_loss_on_terminal_rows_only(cartpole_spec):
    """With weight w the continue loss is the plain per-row loss with its terminal rows times w:
    the logged mean moves by (w - 1) * sum(terminal rows' loss) / rows."""
    batch = cartpole_batch()
    terminal = batch["is_terminal"].bool()
    losses = {}
    for weight in (1.0, 20.0):
        torch.manual_seed(0)
        model = tiny(cartpole_spec, loss={"continue_terminal_weight": weight})
        torch.manual_seed(1)
        _, logs, out = model.world_model_loss(batch)
        losses[weight] = logs["train/loss_cont"]
        feat = torch.cat([out["h"], out["z"]], -1)
        per_row = dists.bernoulli_nll(model.wm.cont_head(feat).squeeze(-1).float(), 1.0 - terminal.float())
    expected = losses[1.0] + 19.0 * per_row[terminal].sum() / per_row.numel()
    assert losses[20.0].item() == pytest.approx(expected.item(), rel=1e-5)
    with pytest.raises(ValueError, match="loss.continue_terminal_weight must be > 0, got 0.0"):
        tiny(cartpole_spec, loss={"continue_terminal_weight": 0.0})


def test_each_optimizers_lr_anneal_steps_anneals_its_own_rate(cartpole_spec, monkeypatch):
    """With optim.actor/critic.lr_anneal_steps, at gradient step n their rates are
    lr * (1 - n / lr_anneal_steps), floored at 0, so from step lr_anneal_steps on the policy no
    longer moves; the world model (no anneal) keeps its lr and goes on learning."""
    steps = {"n": 0}
    monkeypatch.setattr(Dreamer, "global_step", property(lambda self: steps["n"]))
    torch.manual_seed(0)
    optim = {
        "model": {"lr": 1e-3},
        "actor": {"lr": 4e-4, "lr_anneal_steps": 4},
        "critic": {"lr": 2e-4, "lr_anneal_steps": 4},
    }
    model = tiny(cartpole_spec, optim=optim)
    optimizers = model.configure_optimizers()
    batch = cartpole_batch()
    for n in range(6):
        steps["n"] = n
        actor_before = [p.detach().clone() for p in model.actor.parameters()]
        wm_before = [p.detach().clone() for p in model.wm.parameters()]
        _, logs = model.gradient_step(batch, optimizers)
        factor = max(0.0, 1.0 - n / 4)
        assert optimizers[1].param_groups[0]["lr"] == pytest.approx(4e-4 * factor)
        assert optimizers[2].param_groups[0]["lr"] == pytest.approx(2e-4 * factor)
        assert optimizers[0].param_groups[0]["lr"] == 1e-3
        assert float(logs["train/lr_actor"]) == pytest.approx(4e-4 * factor)
        actor_moved = any(not torch.equal(a, b) for a, b in zip(actor_before, model.actor.parameters()))
        assert actor_moved == (factor > 0)
        assert any(not torch.equal(a, b) for a, b in zip(wm_before, model.wm.parameters()))
    with pytest.raises(ValueError, match="lr_anneal_steps"):
        tiny(cartpole_spec, optim={"actor": {"lr_anneal_steps": 0}})


def test_p_end_at_terminal_is_the_mean_over_the_terminal_rows_since_the_last_written_log(cartpole_spec):
    """The continue head's end probability at real terminations: summed per step without a host
    sync, written as the mean over every terminal row since the last written log; left out of a
    log that saw none."""
    model = tiny(cartpole_spec)
    with_end, without = cartpole_batch(seed=0), cartpole_batch(seed=1)
    without["is_terminal"][:] = False
    torch.manual_seed(1)
    _, logs, out = model.world_model_loss(with_end)
    feat = torch.cat([out["h"], out["z"]], -1)
    p_end = torch.sigmoid(-model.wm.cont_head(feat).squeeze(-1).float())
    terminal = with_end["is_terminal"].bool()
    torch.testing.assert_close(logs["_terminal_p_end"], torch.stack([p_end[terminal].sum(), torch.tensor(1.0)]))
    torch.testing.assert_close(logs["train/p_end_elsewhere"], p_end[~terminal].mean())

    written = [False, False, True, True]  # the logger writes the third and the fourth step
    steps = [{"_terminal_p_end": torch.tensor(v)} for v in ([0.5, 1.0], [1.1, 2.0], [0.0, 0.0], [0.0, 0.0])]
    for logs, write in zip(steps, written):
        model.log_p_end_at_terminal(logs, write)
    assert [list(logs) for logs in steps] == [[], [], ["train/p_end_at_terminal"], []]
    assert steps[2]["train/p_end_at_terminal"].item() == pytest.approx(1.6 / 3.0)
