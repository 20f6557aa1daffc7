"""Dreams with an ensemble of Ms (VisionMemoryModel ``ensemble``): every member reads the same
steps, the next latent from the primary or a random member, reward and done combined; the
controller dreams with the ensemble and acts with M alone; older checkpoints still load."""

import numpy as np
import pytest
import torch

from lightning_wm.agents.worldmodels.controller import Controller
from lightning_wm.agents.worldmodels.memory import Memory
from lightning_wm.agents.worldmodels.vm_model import VisionMemoryModel

from support.presets import MEMORY_TINY
from support.worldmodels import DISCRETE, constant_latent_store, save_module, tiny_vision_memory

torch.set_num_threads(1)


def _member(spec=DISCRETE, seed=1, z_offset=0.0) -> Memory:
    """An M like ``_model``'s with other weights; with ``z_offset`` every mixture mean sits there
    (and sigma is tiny), so its draws are recognisable."""
    torch.manual_seed(seed)
    member = Memory(spec, **MEMORY_TINY)
    z = member.latent_dim
    with torch.no_grad():
        if z_offset:
            member.mdn_head.weight.zero_()
            member.mdn_head.bias.zero_()
            member.mdn_head.bias.view(z, 3, 2)[:, 1] = z_offset  # per_dim layout: (pi, mu, log_sigma) x K per dim
            member.mdn_head.bias.view(z, 3, 2)[:, 2] = -7.0
    return member


def test_ensemble_members_read_the_same_steps_and_the_primary_gives_the_features():
    base = tiny_vision_memory()
    twin = Memory(DISCRETE, **MEMORY_TINY)
    twin.load_state_dict(base.memory.state_dict())
    model = VisionMemoryModel(
        base.vision, base.memory, ensemble=[twin, _member()], ensemble_next="primary", ensemble_done="mean"
    )
    state = {**model.zero_state(3), "z": torch.randn(3, 4)}
    assert state["eh"].shape == state["ec"].shape == (3, 2, 8)
    action = torch.nn.functional.one_hot(torch.tensor([0, 1, 1]), 2).float()
    alone = base.step({k: state[k] for k in ("z", "h", "c")}, action, generator=torch.Generator().manual_seed(5))
    reward, nxt, done = model.step(state, action, generator=torch.Generator().manual_seed(5))
    # the twin's LSTM state follows M's exactly; primary: z' is M's own draw
    torch.testing.assert_close(nxt["eh"][:, 0], nxt["h"])
    torch.testing.assert_close(nxt["h"], alone[1]["h"])
    torch.testing.assert_close(nxt["z"], alone[1]["z"])
    torch.testing.assert_close(model.features(nxt), torch.cat([nxt["z"], nxt["h"]], -1))
    # reward and done: the mean over M, the twin and the other member
    other = VisionMemoryModel(base.vision, model.ensemble[1])
    o_reward, _, o_done = other.step({"z": state["z"], "h": state["eh"][:, 1], "c": state["ec"][:, 1]}, action)
    torch.testing.assert_close(done, (2 * alone[2] + o_done) / 3)
    torch.testing.assert_close(reward, (2 * alone[0] + o_reward) / 3)
    # filtering a recorded episode fills every member's memory; is_first resets them all
    episode = {
        "mu": np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32),
        "action": np.array([0, 1, 0, 1, 0]),
    }
    rows = model.posterior_states(episode)
    assert rows["eh"].shape == (5, 2, 8)
    torch.testing.assert_close(rows["eh"][:, 0], rows["h"])
    torch.testing.assert_close(rows["h"], base.posterior_states(episode)["h"])
    reset = model.observe_step(
        state, action, torch.zeros(3, 64, 64, 3, dtype=torch.uint8), is_first=torch.tensor([True, False, True])
    )
    assert reset["eh"][[0, 2]].abs().sum() == 0 and reset["eh"][1].abs().sum() > 0


def test_ensemble_random_next_draws_from_every_member_and_done_takes_the_max():
    base = tiny_vision_memory()
    far = _member(z_offset=100.0)
    model = VisionMemoryModel(base.vision, base.memory, ensemble=[far], ensemble_next="random", ensemble_done="max")
    n = 400
    state = {**model.zero_state(n), "z": torch.zeros(n, 4)}
    action = torch.nn.functional.one_hot(torch.zeros(n, dtype=torch.long), 2).float()
    _, nxt, done = model.step(state, action, generator=torch.Generator().manual_seed(0))
    from_far = (nxt["z"] > 50).all(-1)
    assert 0.4 < from_far.float().mean() < 0.6  # about half the dreams stepped with each member
    assert (nxt["z"][~from_far].abs() < 50).all()
    _, _, d_base = base.step({k: state[k] for k in ("z", "h", "c")}, action)
    _, _, d_far = VisionMemoryModel(base.vision, far).step({k: state[k] for k in ("z", "h", "c")}, action)
    torch.testing.assert_close(done, torch.maximum(d_base, d_far))
    # the same generator seed repeats the dream; primary never uses the far member's z
    _, again, _ = model.step(state, action, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(again["z"], nxt["z"])
    model.ensemble_next = "primary"
    assert (model.step(state, action)[1]["z"].abs() < 50).all()


def test_ensemble_refuses_a_mismatched_member_and_unknown_rules():
    base = tiny_vision_memory()
    with pytest.raises(ValueError, match="ensemble member 0 has latent_dim 4, hidden 16"):
        VisionMemoryModel(base.vision, base.memory, ensemble=[Memory(DISCRETE, net={"latent_dim": 4, "hidden": 16})])
    with pytest.raises(ValueError, match="ensemble_next must be"):
        VisionMemoryModel(base.vision, base.memory, ensemble=[_member()], ensemble_next="vote")
    with pytest.raises(ValueError, match="ensemble_done must be"):
        VisionMemoryModel(base.vision, base.memory, ensemble=[_member()], ensemble_done="min")
    with pytest.raises(ValueError, match="dream.ensemble needs memory_ckpt"):
        Controller(DISCRETE, dream={"ensemble": ["m2.ckpt"]})
    with pytest.raises(ValueError, match="ensemble_penalty must be >= 0 and needs an ensemble"):
        VisionMemoryModel(base.vision, base.memory, ensemble_penalty=0.5)
    with pytest.raises(ValueError, match="dream.ensemble_penalty needs dream.ensemble"):
        Controller(DISCRETE, dream={"ensemble_penalty": 0.5})


def test_ensemble_penalty_takes_the_members_disagreement_off_the_reward():
    """Two members: the std over them of their mean next latent is half the gap between the
    two means; the far member predicts exactly 100 in every dimension, so the gap is known."""
    base = tiny_vision_memory()
    far = _member(z_offset=100.0)
    plain = VisionMemoryModel(base.vision, base.memory, ensemble=[far])
    penalised = VisionMemoryModel(base.vision, base.memory, ensemble=[far], ensemble_penalty=0.01)
    state = {**plain.zero_state(3), "z": torch.randn(3, 4)}
    action = torch.nn.functional.one_hot(torch.tensor([0, 1, 1]), 2).float()
    reward, _, _ = plain.step(state, action, generator=torch.Generator().manual_seed(1))
    reward_pen, _, _ = penalised.step(state, action, generator=torch.Generator().manual_seed(1))
    out, _ = base.memory.step(state["z"], base.memory.action_input(action), (state["h"], state["c"]))
    m_base = base.memory.mean_next(base.memory.heads(out))  # [3, 4]
    gap = (m_base - 100.0).abs().mean(-1) / 2  # two members: population std = |a - b| / 2
    assert (gap > 40).all()
    torch.testing.assert_close(reward_pen, reward - 0.01 * gap)


def test_controller_dreams_with_an_ensemble_and_acts_with_m_alone(tmp_path):
    model = tiny_vision_memory()
    v, m = save_module(model.vision, tmp_path / "v.ckpt"), save_module(model.memory, tmp_path / "m.ckpt")
    m2 = save_module(_member(), tmp_path / "m2.ckpt")
    constant_latent_store(tmp_path / "latents")
    controller = Controller(
        DISCRETE,
        vision_ckpt=v,
        memory_ckpt=m,
        es={"popsize": 4, "episodes_per_member": 2},
        train_in="dream",
        dream={
            "dir": str(tmp_path / "latents"),
            "max_steps": 7,
            "done_threshold": 2.0,
            "reward": "survival",
            "ensemble": [m2],
        },
    )
    assert len(controller.dream_model.ensemble) == 1 and not len(controller.world_model.ensemble)
    assert not any(k.startswith("world_model.ensemble") or "dream_model" in k for k in controller.state_dict())
    assert controller.dream_starts_bank()["eh"].shape == (3, 1, 8)
    assert "eh" not in controller.initial_state(2)["model"]  # the real env runs M alone
    fitness = controller.evaluate_population(torch.randn(4, controller.num_params), 2, seed=0)
    torch.testing.assert_close(fitness, torch.full((4,), 7.0))
    # the ensemble's Ms are not saved: V and M alone load the dream-trained controller (evaluate,
    # record), and a controller built with the ensemble loads it with its members' own weights
    with torch.no_grad():
        controller.params.normal_()
    state = controller.state_dict()
    assert not any(k.startswith("memory_ensemble") for k in state)
    alone = Controller(DISCRETE, vision_ckpt=v, memory_ckpt=m, es={"popsize": 4})
    alone.load_state_dict(state)
    torch.testing.assert_close(alone.params, controller.params)
    member = {k: t.clone() for k, t in controller.memory_ensemble.state_dict().items()}
    controller.load_state_dict(state)
    for k, t in controller.memory_ensemble.state_dict().items():
        torch.testing.assert_close(t, member[k])
    # checkpoints saved before the members were left out still load, with or without the ensemble
    from lightning_wm.checkpoints import check_compatible

    older = {"state_dict": {**state, **{"memory_ensemble." + k: t for k, t in member.items()}}}
    for target in (alone, controller):
        check_compatible(older, target, "older.ckpt", "evaluation", "warn")
        target.load_state_dict(older["state_dict"])
