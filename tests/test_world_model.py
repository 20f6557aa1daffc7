"""The shared WorldModel helpers: rollout with a frozen model, rollout-length scheduler, cadence."""

import pytest
import torch
from torch import nn

from lightning_wm.world_model import Cadence, DreamWorldModel, RolloutSchedule, WorldModel, rollout


class LinearModel(nn.Module, WorldModel):
    def __init__(self):
        super().__init__()
        self.dyn = nn.Linear(3, 2)
        self.rew = nn.Linear(2, 1)

    def initial_state(self, obs):
        return obs

    def step(self, state, action):
        nxt = self.dyn(torch.cat([state, action], -1))
        return self.rew(nxt).squeeze(-1), nxt, torch.zeros(nxt.shape[0])

    def features(self, state):
        return state


def test_rollout_shapes_and_gradients():
    model, actor = LinearModel(), nn.Linear(2, 1)
    out = rollout(model, torch.randn(4, 2), lambda f: torch.tanh(actor(f)), horizon=5)
    assert out["states"].shape == (6, 4, 2) and out["features"].shape == (6, 4, 2)
    assert out["actions"].shape == (6, 4, 1) and out["rewards"].shape == (5, 4) and out["dones"].shape == (5, 4)
    assert out["aug_rewards"].shape == (6, 4) and not out["aug_rewards"].any(), "no bonus: zeros"
    out["rewards"].sum().backward()
    assert actor.weight.grad is not None and actor.weight.grad.abs().sum() > 0, "actor gets dynamics gradients"
    assert all(p.grad is None for p in model.parameters()), "model parameters must not get gradients"
    assert all(p.requires_grad for p in model.parameters()), "requires_grad restored after the rollout"


def test_rollout_stacks_dict_states():
    class DictModel(LinearModel):
        def initial_state(self, obs):
            return {"x": obs}

        def step(self, state, action):
            r, nxt, d = super().step(state["x"], action)
            return r, {"x": nxt}, d

        def features(self, state):
            return state["x"]

    out = rollout(DictModel(), {"x": torch.zeros(3, 2)}, lambda f: torch.zeros(3, 1), horizon=2)
    assert out["states"]["x"].shape == (3, 3, 2)


def test_rollout_schedule_is_linear_between_its_ends():
    schedule = RolloutSchedule(start_step=100, end_step=200, min_length=1, max_length=11)
    assert [schedule(s) for s in (0, 100, 150, 199, 200, 10_000)] == [1, 1, 6, 10, 11, 11]
    assert RolloutSchedule(0, 0, 1, 5)(0) == 5


def test_rollout_length_scheduler_has_the_seed_defaults():
    schedule = RolloutSchedule()
    assert (schedule.start_step, schedule.end_step) == (20_000, 150_000)
    assert (schedule.min_length, schedule.max_length) == (1, 25)
    assert [schedule(s) for s in (0, 20_000, 85_000, 150_000)] == [1, 1, 13, 25]
    with pytest.raises(ValueError, match="min_length"):
        RolloutSchedule(min_length=5, max_length=2)


def test_horizon_zero_gives_the_start_alone():
    model = LinearModel()
    out = rollout(model, torch.randn(4, 2), lambda f: (torch.zeros(4, 1), torch.ones(4)), horizon=0)
    assert out["states"].shape == (1, 4, 2) and out["actions"].shape == (1, 4, 1)
    assert out["rewards"].shape == (0, 4) and out["dones"].shape == (0, 4)
    assert out["aug_rewards"].shape == (1, 4)


def test_actor_bonus_becomes_aug_rewards_in_every_state():
    """actor_fn returning (action, bonus): aug_rewards [N+1, B] holds the bonus of every state,
    the last one included; rewards stay the model's own (hand-checked against step())."""
    model, actor = LinearModel(), nn.Linear(2, 1)

    def actor_fn(f):
        return torch.tanh(actor(f)), -f.sum(-1)  # a bonus that depends on the state

    start = torch.randn(3, 2)
    out = rollout(model, start, actor_fn, horizon=4)
    assert out["aug_rewards"].shape == (5, 3)
    torch.testing.assert_close(out["aug_rewards"], -out["features"].sum(-1))
    reward, nxt, _ = model.step(start, out["actions"][0])
    torch.testing.assert_close(out["rewards"][0], reward)
    out["aug_rewards"][-1].sum().backward()  # the last state's bonus reaches the actor through the dynamics
    assert actor.weight.grad is not None and all(p.grad is None for p in model.parameters())


def test_dream_world_model_takes_the_horizon_from_its_scheduler():
    schedule = RolloutSchedule(start_step=0, end_step=100, min_length=0, max_length=10)
    dream = DreamWorldModel(LinearModel(), rollout_length_scheduler=schedule)
    actor = lambda f: torch.zeros(f.shape[0], 1)  # noqa: E731
    assert dream.rollout(torch.zeros(2, 2), actor, envstep=0)["rewards"].shape == (0, 2)
    assert dream.rollout(torch.zeros(2, 2), actor, envstep=50)["rewards"].shape == (5, 2)
    assert dream.rollout(torch.zeros(2, 2), actor, envstep=50, horizon=3)["rewards"].shape == (3, 2)
    with pytest.raises(TypeError, match="WorldModel"):
        DreamWorldModel(nn.Linear(2, 2))


def test_cadence_trains_every_train_freq_and_evaluates_only_after_a_first_training():
    cadence = Cadence()
    assert (cadence.train_freq, cadence.eval_freq) == (250, 250)
    assert not cadence.should_train(249) and cadence.should_train(250)
    assert not cadence.should_eval(10_000), "never evaluated before a first training"
    cadence.trained(300)
    assert not cadence.should_train(549) and cadence.should_train(550)
    assert cadence.should_eval(300)
    cadence.evaluated(300)
    assert not cadence.should_eval(549) and cadence.should_eval(550)
    restored = Cadence()
    restored.load_state_dict(cadence.state_dict())
    assert restored.should_eval(550) and not restored.should_train(549)
