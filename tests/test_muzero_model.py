"""MuZero networks: shapes, hidden-state scaling, value decoding, WorldModel and search adapters."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from lightning_wm.agents.muzero import MuZeroModel, MuZeroNet, scale_hidden
from lightning_wm.nn import dists
from lightning_wm.search import Root, SearchSettings, muzero_policy
from lightning_wm.world_model import WorldModel, rollout

torch.set_num_threads(1)

VECTOR = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)


def test_scale_hidden_per_sample():
    x = torch.tensor([[1.0, 3.0, 2.0], [-5.0, -5.0, -5.0]])
    assert torch.allclose(scale_hidden(x), torch.tensor([[0.0, 1.0, 0.5], [0.0, 0.0, 0.0]]))
    planes = torch.randn(3, 4, 2, 2) * 10
    s = scale_hidden(planes)
    assert s.shape == planes.shape
    assert torch.allclose(s.flatten(1).amin(1), torch.zeros(3)) and torch.allclose(s.flatten(1).amax(1), torch.ones(3))


def test_vector_model_shapes_and_ranges():
    model = MuZeroModel(VECTOR, 2, MuZeroNet(latent_dim=16, hidden=32, head_hidden=8, support_size=10))
    assert isinstance(model, WorldModel)
    obs = torch.randn(5, 4)
    out = model.initial_inference(obs)
    assert out["state"].shape == (5, 16)
    assert out["state"].min() >= 0 and out["state"].max() <= 1
    assert out["policy_logits"].shape == (5, 2) and out["value_logits"].shape == (5, 21)
    # heads start at zero: uniform policy, value 0 (the mean of symmetric bins)
    assert torch.allclose(out["policy_logits"], torch.zeros(5, 2))
    assert torch.allclose(out["value"], torch.zeros(5), atol=1e-6)
    rec = model.recurrent_inference(out["state"], torch.tensor([0, 1, 1, 0, 1]))
    assert rec["state"].shape == (5, 16) and rec["reward_logits"].shape == (5, 21) and rec["reward"].shape == (5,)


@pytest.mark.parametrize("frames", [False, True])
def test_state_norm_off_leaves_the_trunks_outputs_unscaled(frames):
    space = gym.spaces.Box(0, 255, (16, 16, 3), np.uint8) if frames else VECTOR
    torch.manual_seed(0)
    scaled = MuZeroModel(space, 2, MuZeroNet(latent_dim=16, hidden=32, head_hidden=8, support_size=10, channels=8))
    torch.manual_seed(0)
    raw = MuZeroModel(
        space, 2, MuZeroNet(latent_dim=16, hidden=32, head_hidden=8, support_size=10, channels=8, state_norm=False)
    )
    obs = torch.randint(0, 255, (5, 16, 16, 3), dtype=torch.uint8) if frames else torch.randn(5, 4) * 3
    s_raw, s_scaled = raw.representation(obs), scaled.representation(obs)
    torch.testing.assert_close(scale_hidden(s_raw), s_scaled)  # same networks, only the scaling differs
    assert s_raw.min() < 0 or s_raw.max() > 1
    action = torch.tensor([0, 1, 1, 0, 1])
    _, n_raw = raw.dynamics(s_raw, action)
    _, n_scaled = scaled.dynamics(s_raw, action)
    torch.testing.assert_close(scale_hidden(n_raw), n_scaled)
    assert n_raw.min() < 0 or n_raw.max() > 1


def test_value_decoding_matches_dists():
    model = MuZeroModel(
        VECTOR, 3, MuZeroNet(latent_dim=8, hidden=8, head_hidden=8, support_size=20, reward_support_size=5)
    )
    x = torch.tensor([0.0, 2.5, -40.0])
    logits = torch.log(dists.h_twohot_encode(x, dists.h_support(20)).clamp(min=1e-30))
    assert torch.allclose(model.value(logits), x, rtol=1e-4, atol=1e-4)
    assert model.reward_bins.numel() == 11
    # bins are not saved in checkpoints (derived from the options)
    assert "value_bins" not in model.state_dict()


def test_world_model_step_and_rollout():
    model = MuZeroModel(VECTOR, 2, MuZeroNet(latent_dim=8, hidden=16, head_hidden=8, support_size=5))
    state = model.initial_state(torch.randn(3, 4))
    onehot = torch.eye(2)[[0, 1, 1]]
    reward, nxt, done = model.step(state, onehot)
    reward2, nxt2, _ = model.step(state, torch.tensor([0, 1, 1]))
    assert torch.allclose(reward, reward2) and torch.allclose(nxt, nxt2)
    assert torch.equal(done, torch.zeros(3))
    assert model.features(nxt).shape == (3, model.feature_dim) == (3, 8)
    actor = torch.nn.Linear(8, 2)
    out = rollout(model, state.detach(), lambda f: torch.softmax(actor(f), -1), horizon=4)
    assert out["features"].shape == (5, 3, 8) and out["rewards"].shape == (4, 3)
    out["rewards"].sum().backward()
    assert actor.weight.grad is not None
    assert all(p.grad is None for p in model.parameters())


def test_game_over_head():
    model = MuZeroModel(
        VECTOR, 2, MuZeroNet(latent_dim=8, hidden=8, head_hidden=8, support_size=5), game_over_head=True
    )
    state = model.initial_state(torch.randn(4, 4))
    _, nxt, done = model.step(state, torch.tensor([0, 1, 0, 1]))
    assert done.shape == (4,) and ((done > 0) & (done < 1)).all()
    assert torch.allclose(done, torch.sigmoid(model.game_over_logit(nxt)))
    with pytest.raises(ValueError, match="no game-over head"):
        MuZeroModel(VECTOR, 2, MuZeroNet(latent_dim=8, hidden=8, head_hidden=8, support_size=5)).game_over_logit(nxt)


@pytest.mark.parametrize(
    "shape,stack,plane", [((64, 64, 3), 1, (4, 4)), ((84, 84, 1), 4, (6, 6)), ((96, 96, 3), 2, (6, 6))]
)
def test_conv_model_downsamples_by_16(shape, stack, plane):
    space = gym.spaces.Box(0, 255, shape, np.uint8)
    model = MuZeroModel(space, 6, MuZeroNet(channels=8, blocks=1, head_hidden=8, frame_stack=stack, support_size=5))
    assert model.state_shape == (8, *plane)
    obs = torch.randint(0, 256, (2, *model.obs_shape), dtype=torch.uint8)
    out = model.initial_inference(obs)
    assert out["state"].shape == (2, 8, *plane)
    assert out["state"].flatten(1).amax(1).allclose(torch.ones(2))
    reward, nxt, done = model.step(out["state"], torch.eye(6)[[1, 5]])
    assert reward.shape == (2,) and nxt.shape == out["state"].shape and done.shape == (2,)
    assert model.features(nxt).shape == (2, model.feature_dim)


def test_conv_model_uses_every_frame_of_the_stack():
    space = gym.spaces.Box(0, 255, (64, 64, 1), np.uint8)
    model = MuZeroModel(space, 4, MuZeroNet(channels=8, blocks=1, head_hidden=8, frame_stack=4, support_size=5))
    obs = torch.randint(0, 256, (1, 4, 64, 64, 1), dtype=torch.uint8)
    base = model.representation(obs)
    for k in range(4):
        changed = obs.clone()
        changed[:, k] = 255 - changed[:, k]
        assert not torch.allclose(model.representation(changed), base)


def test_bad_observations_and_options():
    model = MuZeroModel(VECTOR, 2, MuZeroNet(latent_dim=8, hidden=8, head_hidden=8, support_size=5))
    with pytest.raises(ValueError, match=r"expects observations \[B, 4\]"):
        model.representation(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="at least 2"):
        MuZeroModel(VECTOR, 1)
    with pytest.raises(ValueError, match="frame_stack"):
        MuZeroModel(VECTOR, 2, MuZeroNet(frame_stack=4))
    with pytest.raises(ValueError, match="float vectors"):
        MuZeroModel(gym.spaces.Box(0, 1, (2, 3), np.float32), 2)
    with pytest.raises(ValueError, match="unknown norm"):
        MuZeroModel(gym.spaces.Box(0, 255, (64, 64, 3), np.uint8), 2, MuZeroNet(norm="group"))


def test_recurrent_fn_drives_the_search():
    torch.manual_seed(0)
    model = MuZeroModel(VECTOR, 2, MuZeroNet(latent_dim=16, hidden=16, head_hidden=8, support_size=5)).eval()
    for p in model.parameters():  # non-zero heads, so that the search has something to read
        torch.nn.init.normal_(p, std=0.3)
    with torch.no_grad():
        root = model.initial_inference(torch.randn(6, 4))
        out = muzero_policy(
            model.recurrent_fn,
            Root(root["state"], root["policy_logits"], root["value"]),
            SearchSettings(num_simulations=12),
            discount=0.99,
            explore=False,
        )
    assert out.visit_counts.sum(-1).tolist() == [12.0] * 6
    assert out.root_value.shape == (6,) and torch.isfinite(out.root_value).all()


def test_joint_and_separate_decoding_agree():
    for reward_support in (None, 7):
        model = MuZeroModel(
            VECTOR,
            2,
            MuZeroNet(latent_dim=8, hidden=8, head_hidden=8, support_size=10, reward_support_size=reward_support),
        )
        rl = torch.randn(5, model.reward_bins.numel())
        vl = torch.randn(5, 21)
        reward, value = model.decode(rl, vl)
        assert torch.allclose(reward, model.reward(rl)) and torch.allclose(value, model.value(vl))
        state = model.initial_state(torch.randn(5, 4))
        nxt, r, logits, v = model.recurrent_fn(state, torch.zeros(5, dtype=torch.long))
        out = model.recurrent_inference(state, torch.zeros(5, dtype=torch.long))
        assert torch.allclose(r, out["reward"]) and torch.allclose(v, out["value"]) and torch.equal(nxt, out["state"])


@pytest.mark.parametrize("act", ["relu", "silu", "elu"])
def test_recurrent_fn_direct_path_matches_the_modules_bit_for_bit(act):
    torch.manual_seed(1)
    model = MuZeroModel(
        VECTOR, 3, MuZeroNet(latent_dim=16, hidden=16, head_hidden=8, support_size=5, activation=act)
    ).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    state = model.initial_state(torch.randn(7, 4))
    action = torch.tensor([0, 1, 2, 2, 1, 0, 1])
    with torch.inference_mode():
        fast = model.recurrent_fn(state, action)  # MLP.forward: layers called directly
        for mlp in (model.dyn_net, model.reward_head, model.pred_net, model.policy_head, model.value_head):
            mlp[0].register_forward_pre_hook(lambda module, args: None)  # a hook: layers called as modules
        slow = model.recurrent_inference(state, action)
    assert torch.equal(fast[0], slow["state"]) and torch.equal(fast[2], slow["policy_logits"])
    assert torch.equal(fast[1], slow["reward"]) and torch.equal(fast[3], slow["value"])


def test_mlp_direct_call_runs_forward_hooks():
    from lightning_wm.nn.blocks import MLP

    mlp = MLP(4, 3, hidden=8, layers=2, act="relu")
    x = torch.randn(5, 4)
    assert torch.equal(mlp(x), torch.nn.Sequential.forward(mlp, x))  # direct calls, the same result
    seen = []
    handle = mlp[0].register_forward_hook(lambda module, args, out: seen.append(out.shape) or out * 0)
    assert torch.equal(mlp(x), torch.nn.Sequential.forward(mlp, x))  # the hook changes the output on both paths
    assert len(seen) == 2
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: seen.append(1))
    try:
        mlp(x)
    finally:
        handle.remove()
    assert len(seen) > 3  # the MLP and its layers


def test_mlp_batch_norm_over_leading_axes_and_running_stats_in_eval():
    from lightning_wm.nn.blocks import MLP, BatchNormLast

    torch.manual_seed(0)
    mlp = MLP(4, 3, hidden=8, layers=2, act="relu", norm="batch")
    assert sum(isinstance(m, BatchNormLast) for m in mlp) == 2 and not any(
        isinstance(m, torch.nn.LayerNorm) for m in mlp
    )
    x = torch.randn(5, 6, 4)
    flat = mlp(x.reshape(30, 4))  # train mode: the batch's statistics over all 30 rows
    torch.testing.assert_close(mlp(x), flat.reshape(5, 6, 3))
    bn = mlp[1]
    h = mlp[0](x.reshape(30, 4))
    torch.testing.assert_close(bn(h), (h - h.mean(0)) / torch.sqrt(h.var(0, unbiased=False) + bn.eps))
    mlp.eval()  # running statistics: one row gives the same output alone or in a batch
    torch.testing.assert_close(mlp(x[0, :1]), mlp(x[0])[:1])
    with pytest.raises(ValueError, match="MLP norm must be"):
        MLP(4, 3, norm="group")


def test_layer_norm_mlp_without_biases_is_blind_to_the_input_scale_and_biases_fix_it():
    """LN(W c x) = LN(W x) for c > 0: the default (bias-free under LayerNorm) MLP maps an input and
    any positive multiple of it to one output; with ``bias=True`` it does not."""
    from lightning_wm.nn.blocks import MLP

    torch.manual_seed(0)
    x = torch.tensor([[0.9, 0.5, 0.025, 0.15]])
    blind = MLP(4, 3, hidden=16, layers=2, act="relu", norm="layer")
    assert all(m.bias is None for m in blind if isinstance(m, torch.nn.Linear) and m is not blind[-1])
    torch.testing.assert_close(blind(2 * x), blind(x), atol=1e-3, rtol=0)
    seeing = MLP(4, 3, hidden=16, layers=2, act="relu", norm="layer", bias=True)
    assert all(m.bias is not None for m in seeing if isinstance(m, torch.nn.Linear))
    assert (seeing(2 * x) - seeing(x)).abs().max() > 0.05
    assert all(m.bias is not None for m in MLP(4, 3, norm="none") if isinstance(m, torch.nn.Linear))


def test_vector_representation_tells_an_observation_from_a_multiple_of_it():
    """A CartPole cart at 0.9 m moving at 0.5 m/s and one at 1.8 m moving at 1 m/s (the pole twice
    as tilted) must not share a hidden state: MuZero's vector representation has biases under its
    LayerNorms (before, runs drove the cart out of bounds with a value that stayed flat)."""
    torch.manual_seed(0)
    model = MuZeroModel(VECTOR, 2, MuZeroNet(latent_dim=16, hidden=32, head_hidden=8, support_size=10))
    x = torch.tensor([[0.9, 0.5, 0.025, 0.15]])
    with torch.no_grad():
        states = [model.representation(c * x) for c in (1.0, 2.0, 4.0)]
    assert (states[1] - states[0]).abs().max() > 0.05 and (states[2] - states[1]).abs().max() > 0.05


def test_vector_model_with_batch_norm_trains_and_infers_in_eval():
    model = MuZeroModel(
        gym.spaces.Box(-1, 1, (4,), np.float32),
        2,
        MuZeroNet(latent_dim=8, hidden=16, layers=1, head_hidden=8, support_size=5, norm="batch"),
    )
    out = model.initial_inference(torch.randn(6, 4))
    assert out["value"].shape == (6,) and out["policy_logits"].shape == (6, 2)
    out["value"].sum().backward()
    model.eval()
    one = model.initial_inference(torch.randn(1, 4))  # eval: a batch of one works (running stats)
    assert torch.isfinite(one["value"]).all()
