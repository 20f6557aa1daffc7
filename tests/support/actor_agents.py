"""Small acting modules for actor tests; importable by spawned actor processes and Ray workers as
``support.actor_agents`` (tests/ is on their sys.path or PYTHONPATH)."""

import copy
import threading
from typing import Any

import torch
from torch import nn


class MarkedPolicy(nn.Module):
    """Random discrete actions; every row's ``mark`` extra is the weight ``w`` it acted with, so
    a test can check which published weights made which rows."""

    def __init__(self, actions: int = 2) -> None:
        super().__init__()
        self.actions = actions
        self.w = nn.Parameter(torch.zeros(()))

    def initial_state(self, batch_size: int) -> Any:
        return None

    def act(self, obs: Any, state: Any, explore: bool):
        batch = obs.shape[0]
        return torch.randint(self.actions, (batch,)), state, {"mark": self.w.detach().expand(batch).clone()}

    def acting_copy(self) -> nn.Module:
        """What central acting's inference process acts with (a frozen copy)."""
        return copy.deepcopy(self).requires_grad_(False)


class FaultyPolicy(MarkedPolicy):
    """Raises (``fault="raise"``) or hangs practically forever (``fault="hang"``) on its ``at``-th call.

    A test that hung a thread of its own process (central inference) ends the hang after its
    checks with :attr:`hangs_released` (in an actor process nothing sets it: the process is killed)."""

    hangs_released = threading.Event()

    def __init__(self, fault: str, at: int = 5) -> None:
        super().__init__()
        self.fault, self.at, self.calls = fault, at, 0

    def act(self, obs: Any, state: Any, explore: bool):
        self.calls += 1
        if self.calls >= self.at:
            if self.fault == "raise":
                raise ValueError(f"policy exploded on call {self.calls}")
            FaultyPolicy.hangs_released.wait(3600)  # the behaviour under test: a hung policy call
        return super().act(obs, state, explore)


class StepCounter(nn.Module):
    """A recurrent agent whose state ``{"steps": [B]}`` counts the steps since the episode began
    (the Collector resets it from ``initial_state``); the ``steps`` extra is the state it acted
    from, the action ``steps % actions``. Deterministic, so rows can be compared across modes."""

    def __init__(self, actions: int = 2) -> None:
        super().__init__()
        self.actions = actions

    def initial_state(self, batch_size: int) -> Any:
        return {"steps": torch.zeros(batch_size, dtype=torch.int64)}

    def acting_copy(self) -> nn.Module:
        """What central acting's inference process acts with (it has no weights)."""
        return copy.deepcopy(self)

    def act(self, obs: Any, state: Any, explore: bool):
        steps = state["steps"]
        return steps % self.actions, {"steps": steps + 1}, {"steps": steps.clone(), "obs_sum": obs.float().sum(-1)}
