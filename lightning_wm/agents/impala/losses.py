"""IMPALA's loss (Espeholt et al. 2018) as pure functions of tensors.

* :class:`~lightning_wm.agents.impala.settings.VTraceLossSettings` — the loss's settings group
  (IMPALA's ``loss``; defined in :mod:`~lightning_wm.agents.impala.settings`, importable from here).
* :func:`impala_loss` — policy gradient with V-trace advantages + ``value_weight`` * value
  loss - ``entropy_weight`` * entropy, on time-major tensors ``[T, B]``.
* :func:`unroll_loss` — runs an :class:`~lightning_wm.nn.actor_critic.ActorCritic` over a batch
  of unrolls in the row convention, batch-major ``[B, T+1, ...]``, and calls :func:`impala_loss`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from lightning_wm.agents.impala.settings import VTraceLossSettings
from lightning_wm.nn.actor_critic import ActorCritic
from lightning_wm.returns import UnrollSteps, unroll_steps, vtrace

__all__ = ["ImpalaLoss", "VTraceLossSettings", "entropy_weight_at", "impala_loss", "normalized", "unroll_loss"]


def entropy_weight_at(settings: VTraceLossSettings, step: int) -> float:
    """The entropy weight at learner step ``step``: ``entropy_weight`` held to
    ``entropy_anneal_start``, then moved linearly to ``entropy_weight_end`` over
    ``entropy_anneal_steps`` steps, then held (``entropy_weight`` when no end is set)."""
    if settings.entropy_weight_end is None:
        return settings.entropy_weight
    fraction = min(max(step - settings.entropy_anneal_start, 0) / settings.entropy_anneal_steps, 1.0)
    return settings.entropy_weight + fraction * (settings.entropy_weight_end - settings.entropy_weight)


def at_step(settings: VTraceLossSettings, step: int) -> VTraceLossSettings:
    """``settings`` with the entropy weight of learner step ``step`` (the same object when it has
    no entropy schedule)."""
    if settings.entropy_weight_end is None:
        return settings
    return replace(settings, entropy_weight=entropy_weight_at(settings, step), entropy_weight_end=None)


def masked_mean_std(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The mean and (population) standard deviation of ``x [T, B]`` over the real steps
    (``mask [T, B]`` bool), as 0-d tensors without gradient."""
    x = x.detach()
    count = mask.sum().clamp(min=1)
    mean = torch.where(mask, x, 0.0).sum() / count
    return mean, (torch.where(mask, x - mean, 0.0).square().sum() / count).sqrt()


def normalized(advantage: Tensor, mask: Tensor) -> Tensor:
    """``advantage [T, B]`` minus its mean, divided by its standard deviation (+1e-8), both over the
    real steps (``mask [T, B]`` bool); masked steps are left as they are."""
    mean, std = masked_mean_std(advantage, mask)
    return torch.where(mask, (advantage - mean) / (std + 1e-8), advantage)


class ImpalaLoss(NamedTuple):
    """Scalars ``total_loss = policy_loss + value_weight * value_loss - entropy_weight *
    entropy_loss`` (``entropy_loss`` is the mean entropy, DI-engine's name), statistics for
    logging and ``priority [B]`` (mean ``|vs - V|`` per unroll, for prioritized replay)."""

    total_loss: Tensor
    policy_loss: Tensor
    value_loss: Tensor
    entropy_loss: Tensor
    stats: dict[str, Tensor]
    priority: Tensor


def impala_loss(
    target_log_prob: Tensor,
    behaviour_log_prob: Tensor,
    entropy: Tensor,
    value: Tensor,
    steps: UnrollSteps,
    settings: VTraceLossSettings | None = None,
    weight: Tensor | None = None,
) -> ImpalaLoss:
    """IMPALA's loss on time-major steps.

    Args:
        target_log_prob: ``log pi(a_t|x_t)`` ``[T, B]`` with gradient.
        behaviour_log_prob: ``log mu(a_t|x_t)`` ``[T, B]`` of the acting policy.
        entropy: of ``pi(.|x_t)`` ``[T, B]`` with gradient.
        value: ``V(x_t)`` ``[T+1, B]`` with gradient (the last row bootstraps).
        steps: rewards, discounts and the mask of real steps ``[T, B]`` (:func:`unroll_steps`).
        settings: weights, clips and lambda (:class:`VTraceLossSettings`; its defaults if None).
        weight: importance-sampling weights ``[B]`` of prioritized replay, or None.
    Returns:
        :class:`ImpalaLoss`. Means run over the real steps (``steps.mask``) only: the policy
        term ``-mean(w * log pi * A)`` with V-trace advantages ``A``, the value term
        ``mean(w * (V - vs)^2)`` (DI-engine's squared error, no 1/2), the entropy
        ``mean(w * H)``; ``w`` the IS weight of the step's unroll (1 without). Steps out of a
        last row or into a first row (their extras may be zeros) are masked, not computed.
    """
    cfg = settings or VTraceLossSettings()
    mask = steps.mask.bool()
    zero = torch.zeros((), dtype=target_log_prob.dtype, device=target_log_prob.device)
    # masked steps may hold zeroed extras (log of sigma 0): keep their values out of every sum
    blogp = torch.where(mask, behaviour_log_prob.detach(), zero)
    tlogp = torch.where(mask, target_log_prob, zero)
    reward = torch.where(mask, steps.reward, zero)
    vs, advantage = vtrace(
        blogp,
        tlogp.detach(),
        reward,
        value[:-1],
        value[-1],
        steps.discount,
        cfg.rho_clip,
        cfg.c_clip,
        cfg.rho_pg_clip,
        cfg.lambda_,
        mask=mask,
    )
    entropy_weight = cfg.entropy_weight
    if cfg.entropy_relative:  # in units of the advantages' batch std
        entropy_weight = entropy_weight * masked_mean_std(advantage, mask)[1]
    if cfg.normalize_advantage:
        advantage = normalized(advantage, mask)
    w = mask.to(tlogp.dtype)
    if weight is not None:
        w = w * weight.to(w.dtype).unsqueeze(0)
    count = mask.sum().clamp(min=1).to(w.dtype)
    policy_loss = -(w * tlogp * advantage).sum() / count
    td = value[:-1] - vs
    value_loss = (w * td.square()).sum() / count
    entropy_loss = (w * torch.where(mask, entropy, zero)).sum() / count
    total = policy_loss + cfg.value_weight * value_loss - entropy_weight * entropy_loss
    with torch.no_grad():
        valid = mask.to(tlogp.dtype)
        log_rho = tlogp.detach() - blogp
        stats = {
            "rho_mean": (log_rho.exp() * valid).sum() / count,
            # clipped by more than float noise (an on-policy ratio is 1 only up to rounding)
            "rho_clipped_fraction": ((log_rho > np.log(cfg.rho_clip) + 1e-4).to(valid.dtype) * valid).sum() / count,
            "vs_mean": (vs * valid).sum() / count,
            "advantage_mean": (advantage * valid).sum() / count,
            # the weight in effect: the step's (schedule) and, with entropy_relative, times the std
            "entropy_weight": torch.as_tensor(entropy_weight, dtype=total.dtype, device=total.device),
        }
        per_unroll = valid.sum(0).clamp(min=1)
        priority = (td.detach().abs() * valid).sum(0) / per_unroll
    return ImpalaLoss(total, policy_loss, value_loss, entropy_loss, stats, priority)


def unroll_loss(
    net: ActorCritic,
    batch: dict[str, Any],
    settings: VTraceLossSettings | None = None,
    weight: Tensor | None = None,
) -> ImpalaLoss:
    """The loss of ``net`` on a batch of unrolls in the row convention, batch-major ``[B, T+1, ...]``.

    ``batch`` holds ``obs``, ``reward``, ``is_first``, ``is_last``, ``is_terminal``,
    ``action`` and the behaviour policy the rows were acted with (``logits``, or ``mu`` and
    ``sigma``); with an LSTM core, ``core_h`` / ``core_c`` of row 0 start the unroll (zeros if
    absent). ``weight [B]``: prioritized replay's IS weights, or None.
    """
    cfg = settings or VTraceLossSettings()
    missing = [
        k
        for k in ("obs", "reward", "is_first", "is_last", "is_terminal", "action", *net.head.behaviour_keys)
        if k not in batch
    ]
    if missing:
        raise KeyError(f"unroll batch lacks {missing}; rows must carry the behaviour policy the actors acted with")

    def tm(x: Tensor) -> Tensor:  # batch-major [B, T+1, ...] -> time-major [T+1, B, ...]
        return x.transpose(0, 1)

    obs = tm(batch["obs"]) if isinstance(batch["obs"], Tensor) else {k: tm(v) for k, v in batch["obs"].items()}
    is_first = tm(batch["is_first"])
    state = None
    if net.core is not None and "core_h" in batch:
        state = (batch["core_h"][:, 0].float(), batch["core_c"][:, 0].float())
    params, value, _ = net.unroll(obs, is_first, state)
    reward = tm(batch["reward"]).float() * cfg.reward_scale
    steps = unroll_steps(reward, is_first, tm(batch["is_last"]), tm(batch["is_terminal"]), cfg.discount)
    action = tm(batch["action"])[:-1]
    target = {k: v[:-1] for k, v in params.items()}
    behaviour = {k: tm(batch[k])[:-1].float() for k in net.head.behaviour_keys}
    return impala_loss(
        net.head.log_prob(target, action),
        net.head.log_prob(behaviour, action),
        net.head.entropy(target),
        value,
        steps,
        cfg,
        weight,
    )
