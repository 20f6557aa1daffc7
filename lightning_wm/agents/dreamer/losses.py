"""Dreamer's losses as pure tensor functions, in the paper's terms (DreamerV3, Hafner et al. 2023).

World model (:func:`world_model_loss`), over replayed rows ``[B, L]``::

    L(φ) = mean( β_dec L_dec + β_rew L_rew + β_con L_con + β_dyn L_dyn + β_rep L_rep )
    L_dyn = max(free, KL[sg(q(z|h,x)) || p(z|h)])     L_rep = max(free, KL[q(z|h,x) || sg(p(z|h))])

Actor (:func:`actor_loss`), over imagined steps ``[H, N]`` weighted by the probability ``w_t``
that the imagined episode still runs, with returns scaled by ``S = max(1, P95 - P05)``
(:func:`return_scale`)::

    REINFORCE:  L(θ) = -mean( w_t (log π(a_t|s_t) sg((R_t - v(s_t)) / S) + η H[π(·|s_t)]) )
    dynamics:   L(θ) = -mean( w_t (R_t / S + η H[π(·|s_t)]) )

Critic (:func:`critic_loss`): the two-hot cross-entropy of the critic against the λ-returns
``R_t`` plus a regulariser towards the slow (EMA) critic's values, weighted the same way;
:func:`replay_critic_loss` the same regression on the replayed rows' own λ-returns.

Scalar heads (reward, critic) are categoricals over symexp-spaced ``bins`` (two-hot targets) or,
without bins, a squared error in symlog space (:func:`head_nll`).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from lightning_wm.agents.dreamer.settings import WorldModelLoss
from lightning_wm.nn import dists

__all__ = [
    "actor_loss",
    "critic_loss",
    "head_nll",
    "replay_critic_loss",
    "return_percentiles",
    "return_scale",
    "world_model_loss",
]


def head_nll(out: Tensor, target: Tensor, bins: Tensor | None, symlog: bool = True) -> Tensor:
    """Negative log-likelihood ``[...]`` of a scalar ``target [...]`` (no gradient into it) under a
    head's output ``out [..., K or 1]``: the two-hot cross-entropy over ``bins [K]``, or without
    bins the squared error of ``out`` against ``symlog(target)`` (``target`` when not ``symlog``)."""
    out = out.float()
    if bins is not None:
        return dists.twohot_loss(out, target, bins)
    target = target.detach()
    return (out.squeeze(-1) - (dists.symlog(target) if symlog else target)).square()


def world_model_loss(
    decoder_nll: Tensor,
    reward_nll: Tensor,
    continue_logits: Tensor,
    is_terminal: Tensor,
    post: Tensor | dists.Gaussian,
    prior: Tensor | dists.Gaussian,
    weights: WorldModelLoss,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DreamerV3's world-model loss (scalar) and its per-row parts.

    Args:
        decoder_nll: ``[B, L]`` reconstruction loss of each row's observation.
        reward_nll: ``[B, L]`` reward head's loss (:func:`head_nll`).
        continue_logits: ``[B, L]`` continue head's logits (``P(continue) = sigmoid``).
        is_terminal: ``[B, L]`` bool: the episode terminated at the row (continue target 0).
        post, prior: the posterior and prior of every row, as :func:`~lightning_wm.nn.dists.kl_balance`
            takes them (log-probabilities ``[B, L, stoch, classes]`` or ``(mean, std) [B, L, stoch]``).
        weights: the loss weights and free bits.
    Returns:
        ``(loss, parts)``: parts ``decoder``, ``reward``, ``continue`` (weighted by
        ``continue_terminal_weight`` on terminal rows), ``kl_dyn``, ``kl_rep`` (clipped) and
        ``kl`` (unclipped), each ``[B, L]``.
    """
    terminal = is_terminal.bool()
    cont = dists.bernoulli_nll(continue_logits, 1.0 - is_terminal.float())
    if weights.continue_terminal_weight != 1.0:  # rare real ends count more (torch's pos_weight)
        cont = torch.where(terminal, cont * weights.continue_terminal_weight, cont)
    kl, kl_parts = dists.kl_balance(post, prior, weights.kl_dyn_weight, weights.kl_rep_weight, weights.free_nats)
    loss = (
        weights.decoder_weight * decoder_nll + weights.reward_weight * reward_nll + weights.continue_weight * cont + kl
    ).mean()
    parts = {
        "decoder": decoder_nll,
        "reward": reward_nll,
        "continue": cont,
        "kl_dyn": kl_parts["dyn"],
        "kl_rep": kl_parts["rep"],
        "kl": kl_parts["kl"],
    }
    return loss, parts


def return_percentiles(returns: Tensor, low: float, high: float) -> Tensor:
    """The ``low`` and ``high`` quantiles (fractions) of all ``returns`` -> ``[2]`` float32, no gradient."""
    ordered = returns.detach().flatten().float().sort().values
    return torch.stack([_quantile_of_sorted(ordered, q) for q in (low, high)])


def _quantile_of_sorted(ordered: Tensor, q: float) -> Tensor:
    """``torch.quantile``'s linear interpolation at fraction ``q`` of a sorted ``[N]`` tensor, its
    positions from Python numbers: no host-to-device copy and no host sync (a recorded step's
    form; ``torch.quantile`` needs ``q`` as a tensor on the device)."""
    position = q * (ordered.shape[0] - 1)
    below = min(int(position), ordered.shape[0] - 1)
    above = min(below + 1, ordered.shape[0] - 1)
    return torch.lerp(ordered[below], ordered[above], position - below)


def return_scale(low: Tensor, high: Tensor) -> Tensor:
    """DreamerV3's return scale ``S = max(1, high - low)`` of the (EMA) return percentiles: large
    spreads are scaled down, small ones are not scaled up."""
    return torch.clamp(high - low, min=1.0)


def actor_loss(
    returns: Tensor,
    value: Tensor,
    weight: Tensor,
    scale: Tensor,
    entropy: Tensor,
    entropy_weight: float,
    gradient: Literal["reinforce", "dynamics"],
    log_prob: Tensor | None = None,
) -> Tensor:
    """The actor's loss (scalar) over imagined steps ``[H, N]``.

    Args:
        returns: ``R_t`` λ-returns (with gradient through the dynamics for ``dynamics``).
        value: ``v(s_t)`` the critic's values (the REINFORCE baseline).
        weight: ``w_t`` the probability that the imagined episode still runs at ``s_t``.
        scale: ``S`` the return scale (:func:`return_scale`; 1 without return normalisation).
        entropy: ``H[π(·|s_t)]`` of the actor's distribution.
        entropy_weight: ``η``.
        gradient: ``reinforce`` (score function with the advantage ``(R_t - v(s_t)) / S``, no
            gradient through it) or ``dynamics`` (maximise ``R_t / S`` by backpropagation).
        log_prob: ``log π(a_t|s_t)`` of the taken actions (``reinforce`` only).
    """
    if gradient == "reinforce":
        if log_prob is None:
            raise ValueError("actor_loss: gradient 'reinforce' needs the actions' log_prob")
        objective = log_prob * ((returns - value) / scale).detach()
    elif gradient == "dynamics":
        objective = returns / scale
    else:
        raise ValueError(f"actor_loss: gradient must be reinforce or dynamics, got {gradient!r}")
    return -(weight * (objective + entropy_weight * entropy)).mean()


def critic_loss(
    logits: Tensor,
    returns: Tensor,
    slow_values: Tensor,
    weight: Tensor,
    slow_critic_weight: float,
    bins: Tensor | None,
    symlog: bool = True,
) -> Tensor:
    """The critic's loss (scalar) over imagined states ``[H, N]``: its regression onto the
    λ-returns plus ``slow_critic_weight`` times its regression onto the slow critic's values,
    weighted by ``weight`` (the probability the imagined episode still runs).

    Args:
        logits: ``[H, N, K or 1]`` the critic's output.
        returns: ``[H, N]`` the λ-returns (no gradient into them).
        slow_values: ``[H, N]`` the slow critic's values.
        weight: ``[H, N]``.
        slow_critic_weight: weight of the regulariser.
        bins: the two-hot bins ``[K]``: both targets are two-hot encoded and mixed into one
            cross-entropy (``CE(p, t1) + c CE(p, t2) = CE(p, t1 + c t2)``); None: squared errors.
        symlog: the squared errors are in symlog space (without ``bins``).
    """
    if bins is not None:
        target = dists.twohot_encode(returns, bins) + slow_critic_weight * dists.twohot_encode(slow_values, bins)
        terms = -(target * torch.log_softmax(logits.float(), -1)).sum(-1)
    else:
        terms = head_nll(logits, returns, None, symlog) + slow_critic_weight * head_nll(
            logits, slow_values, None, symlog
        )
    return (weight * terms).mean()


def replay_critic_loss(
    logits: Tensor, targets: Tensor, mask: Tensor, bins: Tensor | None, symlog: bool = True
) -> Tensor:
    """The critic's regression (scalar) onto the λ-returns of replayed rows: ``logits [T, B, K or 1]``
    of the rows' states, ``targets [T, B]`` and ``mask [T, B]`` from
    :func:`~lightning_wm.returns.replay_lambda_return` (steps outside an episode count 0)."""
    return (mask.to(targets.dtype) * head_nll(logits, targets, bins, symlog)).mean()
