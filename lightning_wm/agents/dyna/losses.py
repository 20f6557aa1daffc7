"""The dream loss of a Hybrid Dyna learner as a pure function of tensors.

A dream is an on-the-fly rollout through the world model with the policy's differentiable actions
(:meth:`~lightning_wm.world_model.DreamWorldModel.rollout`, DI-engine's ``DreamWorldModel``): its
λ-returns are maximised by backpropagating through the model's dynamics into the policy (value
gradients, as Dreamer's ``actor_grad: dynamics``); the model's parameters get no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_wm.returns import lambda_return

__all__ = ["dream_loss"]


def dream_loss(
    reward: Tensor, value: Tensor, done: Tensor, bonus: Tensor, discount: float, lambda_: float
) -> tuple[Tensor, Tensor]:
    """The policy's loss on one dream, time-major.

    Args:
        reward: the model's rewards ``[N, B]`` on arriving at imagined state ``t + 1`` (in the
            policy's reward units).
        value: the policy's values ``V(s_t)`` ``[N+1, B]`` of the start and every imagined state
            (gradients flow through the states, not into the value's parameters).
        done: the model's termination probabilities ``[N, B]`` at state ``t + 1``.
        bonus: the actor's bonus in each state ``[N+1, B]`` (e.g. an entropy bonus), added to the
            reward of the step taken there (the last one is not taken).
        discount: γ in [0, 1]; step ``t`` is discounted by ``γ (1 - done_t)``.
        lambda_: λ of the returns, in [0, 1].
    Returns:
        ``(loss, returns)``: ``loss = -mean_t,b(alive_t * G_t)``, the λ-returns ``G [N, B]`` of
        :func:`~lightning_wm.returns.lambda_return` on ``reward + bonus[:-1]``, weighted by the
        probability ``alive_t = prod_{k<t} (1 - done_k)`` (no gradient) that the dream still runs
        at ``t``; and ``G`` itself.
    """
    if reward.shape[0] == 0:
        raise ValueError("a dream needs at least one imagined step (rollout length 0)")
    gamma = discount * (1.0 - done)
    returns = lambda_return(reward + bonus[:-1], value, gamma, lambda_)
    survive = (1.0 - done).detach()
    alive = torch.cat([torch.ones_like(survive[:1]), torch.cumprod(survive[:-1], 0)])
    return -(alive * returns).mean(), returns
