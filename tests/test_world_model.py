"""The shared WorldModel helpers: rollout with a frozen model, rollout-length schedule."""

import torch
from torch import nn

from lightning_wm.world_model import RolloutSchedule, WorldModel, rollout


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
    assert out["actions"].shape == (5, 4, 1) and out["rewards"].shape == (5, 4) and out["dones"].shape == (5, 4)
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
    schedule = RolloutSchedule(min_length=1, max_length=11, start_step=100, end_step=200)
    assert [schedule(s) for s in (0, 100, 150, 199, 200, 10_000)] == [1, 1, 6, 10, 11, 11]
    assert RolloutSchedule(1, 5, 0, 0)(0) == 5
