"""Dreamer's losses as pure tensor functions, in the paper's terms (DreamerV3, Hafner et al. 2023).

World model (:func:`world_model_loss`), over replayed rows ``[B, L]``::

    L(φ) = mean( β_dec L_dec + β_rew L_rew + β_con L_con + β_dyn L_dyn + β_rep L_rep )
    L_dyn = max(free, KL[sg(q(z|h,x)) || p(z|h)])     L_rep = max(free, KL[q(z|h,x) || sg(p(z|h))])

Actor (:func:`actor_loss`), over imagined steps ``[H, N]`` weighted by the probability ``w_t``
that the imagined episode still runs, with returns scaled by ``S = max(1, P95 - P05)``
(:func:`return_scale`)::

    REINFORCE:  L(θ) = -mean( w_t (log π(a_t|s_t) sg((R_t - v(s_t)) / S) + η H[π(·|s_t)]) )
    dynamics:   L(θ) = -mean( w_t (R_t / S + η H[π(·|s_t)]) )
    mix:        L(θ) = ρ L_REINFORCE + (1 - ρ) L_dynamics          (:func:`mixed_actor_loss`)

The return scale's state, the EMAs of the low and high return percentiles, is passed in and
returned (:func:`update_return_range`); :func:`behaviour_losses` composes the actor's and the
critic's losses of one imagined rollout from it.

Critic (:func:`critic_loss`): the two-hot cross-entropy of the critic against the λ-returns
``R_t`` plus a regulariser towards the slow (EMA) critic's values, weighted the same way;
:func:`replay_critic_loss` the same regression on the replayed rows' own λ-returns.

Scalar heads (reward, critic) are categoricals over symexp-spaced ``bins`` (two-hot targets) or,
without bins, a squared error in symlog space (:func:`head_nll`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

import torch
from torch import Tensor

from lightning_wm.agents.dreamer.settings import BehaviorSettings, WorldModelLoss
from lightning_wm.nn import dists

ReturnRange = tuple[Tensor, Tensor]  # (low, high): EMAs of the return percentiles, 0-dim float32

__all__ = [
    "ReturnRange",
    "actor_loss",
    "behaviour_losses",
    "critic_loss",
    "head_nll",
    "mixed_actor_loss",
    "replay_critic_loss",
    "return_percentiles",
    "return_scale",
    "update_return_range",
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


def update_return_range(
    return_range: ReturnRange,
    returns: Tensor,
    settings: BehaviorSettings,
    reduce: Callable[[Tensor], Tensor] | None = None,
) -> tuple[ReturnRange, Tensor]:
    """Move the EMAs ``(low, high)`` of the return percentiles towards those of ``returns [...]``
    and give the scale ``S`` (:func:`return_scale` of the moved EMAs): ``(new (low, high), S)``.

    ``EMA <- decay * EMA + (1 - decay) * P`` with ``P`` the ``return_norm_low`` and
    ``return_norm_high`` quantiles of ``returns`` (no gradient); ``reduce`` maps those ``[2]``
    percentiles before they enter the EMAs (the caller's mean over DDP ranks, so every rank keeps
    the same scale; None: as they are). Without ``settings.return_norm`` the EMAs stay and ``S`` is 1.
    """
    low, high = return_range
    if not settings.return_norm:
        return (low, high), returns.new_ones(())
    q = return_percentiles(returns, settings.return_norm_low, settings.return_norm_high)
    if reduce is not None:
        q = reduce(q)
    decay = settings.return_norm_decay
    low = low * decay + (1 - decay) * q[0]
    high = high * decay + (1 - decay) * q[1]
    return (low, high), return_scale(low, high)


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


def mixed_actor_loss(
    returns: Tensor,
    value: Tensor,
    weight: Tensor,
    scale: Tensor,
    entropy_weight: float,
    reinforce_weight: float,
    log_prob: Tensor | None = None,
    entropy_reinforce: Tensor | None = None,
    entropy_dynamics: Tensor | None = None,
) -> Tensor:
    """``ρ L_REINFORCE + (1 - ρ) L_dynamics`` (scalar), each an :func:`actor_loss` over ``[H, N]``
    with ``ρ = reinforce_weight`` in [0, 1]; at ``ρ = 1`` the REINFORCE loss alone and at ``ρ = 0``
    the dynamics loss alone (the other's inputs may then be None).

    ``returns``, ``value``, ``weight``, ``scale``, ``entropy_weight`` as :func:`actor_loss`;
    ``log_prob`` and ``entropy_reinforce`` ``[H, N]`` the REINFORCE term's (of the actor on
    features without gradient), ``entropy_dynamics`` ``[H, N]`` the dynamics term's (of the actor
    on features with the gradient through the dynamics). The REINFORCE term's advantage carries
    no gradient, so the returns' gradient (through the dynamics) comes from the dynamics term only.
    """
    if not 0.0 <= reinforce_weight <= 1.0:
        raise ValueError(f"mixed_actor_loss: reinforce_weight must be in [0, 1], got {reinforce_weight}")
    if reinforce_weight > 0 and entropy_reinforce is None:
        raise ValueError("mixed_actor_loss: a REINFORCE share needs entropy_reinforce")
    if reinforce_weight < 1 and entropy_dynamics is None:
        raise ValueError("mixed_actor_loss: a dynamics share needs entropy_dynamics")
    args = (returns, value, weight, scale)
    if reinforce_weight == 1.0:
        return actor_loss(*args, entropy_reinforce, entropy_weight, "reinforce", log_prob)
    if reinforce_weight == 0.0:
        return actor_loss(*args, entropy_dynamics, entropy_weight, "dynamics")
    reinforce = actor_loss(*args, entropy_reinforce, entropy_weight, "reinforce", log_prob)
    dynamics = actor_loss(*args, entropy_dynamics, entropy_weight, "dynamics")
    return reinforce_weight * reinforce + (1.0 - reinforce_weight) * dynamics


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


def behaviour_losses(
    imagined: Mapping[str, Tensor],
    return_range: ReturnRange,
    settings: BehaviorSettings,
    reinforce_weight: float,
    bins: Tensor | None,
    symlog: bool = True,
    reduce: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor, ReturnRange, dict[str, Tensor]]:
    """The actor's and the critic's losses (scalars) of one imagined rollout, the moved return
    range and the logged values: ``(actor, critic, (low, high), logs)``.

    Args:
        imagined: ``[H, N]`` unless said: ``returns`` (the λ-returns), ``value [H+1, N]`` (the
            values they bootstrap from; the REINFORCE baseline), ``weight [H+1, N]`` (the
            probability that the imagined episode still runs), ``critic_out [H+1, N, K or 1]``,
            ``slow_values`` (the slow critic's values, the critic's regulariser target),
            ``rewards``, ``dones``; ``log_prob`` and ``entropy_reinforce`` where
            ``reinforce_weight > 0``, ``entropy_dynamics`` where it is below 1
            (:func:`mixed_actor_loss`).
        return_range: the EMAs ``(low, high)`` of the return percentiles before this step.
        settings: entropy weight, slow-critic weight, return normalisation.
        reinforce_weight: ``ρ`` of :func:`mixed_actor_loss`.
        bins: the critic's two-hot bins ``[K]`` (None: a squared error, in symlog space with ``symlog``).
        reduce: applied to the step's return percentiles (:func:`update_return_range`).
    """
    weight, returns, value = imagined["weight"], imagined["returns"], imagined["value"]
    return_range, scale = update_return_range(return_range, returns, settings, reduce)
    entropy = imagined.get("entropy_reinforce", imagined.get("entropy_dynamics"))
    actor = mixed_actor_loss(
        returns,
        value[:-1],
        weight[:-1],
        scale,
        settings.entropy_weight,
        reinforce_weight,
        imagined.get("log_prob"),
        imagined.get("entropy_reinforce"),
        imagined.get("entropy_dynamics"),
    )
    critic = critic_loss(
        imagined["critic_out"][:-1],
        returns,
        imagined["slow_values"],
        weight[:-1],
        settings.slow_critic_weight,
        bins,
        symlog,
    )
    logs = {
        "train/loss_actor": actor.detach(),
        "train/loss_critic": critic.detach(),
        "train/entropy": entropy.mean().detach(),
        "train/imag_return": returns.mean().detach(),
        "train/imag_reward": imagined["rewards"].mean().detach(),
        "train/imag_value": value.mean().detach(),
        "train/return_scale": scale.detach(),
        "train/return_low": return_range[0].detach().clone(),
        "train/return_high": return_range[1].detach().clone(),
        "train/imag_end": imagined["dones"].mean().detach(),
        "train/adv_abs": ((returns - value[:-1]).abs() / scale).mean().detach(),
        "train/horizon": torch.tensor(float(imagined["rewards"].shape[0])),
    }
    return actor, critic, return_range, logs
