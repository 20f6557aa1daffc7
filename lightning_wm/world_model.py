"""The interface every steppable learned model offers, and what is built on top of it.

A *state* is a model's own latent (RSSM ``h``/``z``, MDN-RNN ``h`` + VAE ``z``, MuZero hidden
state): any pytree (tensor, tuple, dict) of tensors whose first dimension is the batch.

* :class:`WorldModel` — ``initial_state(obs)``, ``step(state, action)``, ``features(state)``;
  where a model can: ``zero_state``, ``observe_step`` (filter real steps), ``decode`` (render a
  state), ``posterior_states`` (filter a recorded episode: where dreams start).
* :func:`rollout` — imagination: actor gradients flow through the model's computation but
  never into the model's parameters.
* :class:`RolloutSchedule` — horizon linear in env steps.
* ``DreamEnv`` (in :mod:`lightning_wm.dream_env`) — a gymnasium vector env driven by a model.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from lightning_wm import tree

State = Any


class WorldModel(ABC):
    """Mixin for an ``nn.Module`` whose dynamics can be stepped on batches."""

    @abstractmethod
    def initial_state(self, obs: Tensor) -> State:
        """Latent state from real observations ``[B, ...]``."""

    @abstractmethod
    def step(self, state: State, action: Tensor,
             generator: torch.Generator | None = None) -> tuple[Tensor, State, Tensor]:
        """One imagined transition.

        Args:
            state: latent of batch ``B``.
            action: ``[B, A]`` (one-hot for discrete actions) float.
            generator: source of the transition's randomness (reproducible dreams); the
                global RNG when None.
        Returns:
            ``(reward [B], next_state, done [B])``: the reward received on arriving at
            ``next_state`` and the probability (in ``[0, 1]``) that the episode terminated there.
        """

    @abstractmethod
    def features(self, state: State) -> Tensor:
        """``[B, F]`` vector an actor or critic reads from a state."""

    # -- optional: what a model offers where it can ------------------------------------------
    def zero_state(self, batch_size: int, device: torch.device | None = None) -> State:
        """The state before anything was observed (zeros), shaped like every other state."""
        raise NotImplementedError(f"{type(self).__name__} has no zero state")

    def observe_step(self, state: State, action: Tensor, obs: Any, is_first: Tensor | None = None) -> State:
        """Filter one real step: the state after taking ``action [B, A]`` (float; one-hot for
        discrete actions) in ``state`` and then observing ``obs [B, ...]``. Where ``is_first``
        (bool ``[B]``) the episode restarts and the result is ``initial_state(obs)`` there."""
        raise NotImplementedError(f"{type(self).__name__} cannot filter real observations")

    def decode(self, state: State) -> Any:
        """The observation a state stands for, in the env's format (``uint8 [B, H, W, C]``
        frames, float vectors, or a dict of both); for rendering dreams and imagined rows."""
        raise NotImplementedError(f"{type(self).__name__} cannot decode its states")

    def posterior_states(self, episode: dict[str, Any]) -> State:
        """The filtered state at every row of one real episode (row convention, leaves
        ``[T, ...]``) -> states ``[T, ...]``: row 0 is ``initial_state(obs[0])``, row ``t`` has
        read rows ``0..t`` and the actions before ``t``. Dreams start from these."""
        raise NotImplementedError(f"{type(self).__name__} cannot filter recorded episodes")


@contextlib.contextmanager
def frozen(module: nn.Module) -> Iterator[None]:
    """Within the block, ``module``'s parameters do not require grad (restored afterwards).

    Gradients still flow *through* the module's computation to whatever else requires grad
    (the actor), but the graph built inside holds no edges into these parameters.
    """
    flags = [(p, p.requires_grad) for p in module.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def rollout(
    model: WorldModel,
    start: State,
    actor_fn: Callable[[Tensor], Tensor],
    horizon: int,
) -> dict[str, Any]:
    """Imagine ``horizon`` steps from ``start`` with actions ``actor_fn(features)``.

    Returns a dict with
        ``states``: the start and every imagined state, stacked: pytree of ``[H+1, B, ...]``;
        ``features``: ``[H+1, B, F]``;
        ``actions``: ``[H, B, A]`` (``actions[t]`` taken in ``states[t]``);
        ``rewards``: ``[H, B]`` (received on arriving at ``states[t+1]``);
        ``dones``: ``[H, B]`` termination probability at ``states[t+1]``.
    The model's parameters get no gradient from anything computed here; the actor's do.
    """
    if not isinstance(model, nn.Module):
        raise TypeError("rollout needs a WorldModel that is an nn.Module")
    states, feats, actions, rewards, dones = [start], [model.features(start)], [], [], []
    state = start
    with frozen(model):
        for _ in range(horizon):
            action = actor_fn(feats[-1])
            reward, state, done = model.step(state, action)
            states.append(state)
            feats.append(model.features(state))
            actions.append(action)
            rewards.append(reward)
            dones.append(done)
    return {
        "states": tree.stack(states),
        "features": torch.stack(feats),
        "actions": torch.stack(actions),
        "rewards": torch.stack(rewards),
        "dones": torch.stack(dones),
    }


@dataclass
class RolloutSchedule:
    """Rollout length linear in env steps: ``min_length`` until ``start_step``, ``max_length``
    from ``end_step`` on, and the linear interpolation (rounded down) in between."""

    min_length: int = 1
    max_length: int = 15
    start_step: int = 0
    end_step: int = 0

    def __call__(self, env_step: int) -> int:
        if env_step >= self.end_step:
            return self.max_length
        if env_step <= self.start_step:
            return self.min_length
        frac = (env_step - self.start_step) / (self.end_step - self.start_step)
        return int(self.min_length + frac * (self.max_length - self.min_length))
