"""Return estimators as pure tensor functions (time-major: ``[T, B]``): lambda and n-step
returns, V-trace, the helper that turns row-convention unrolls into steps and lambda returns
along replayed rows (:func:`replay_lambda_return`).

Conventions shared by all functions here:

* ``reward[t]`` is ``r_t``, received on the transition ``s_t -> s_{t+1}``;
* ``value[t]`` is ``V(s_t)`` for ``t = 0..T`` (``value[T]`` bootstraps the tail);
* ``discount[t]`` is ``gamma_t = gamma * continue_{t+1}`` (0 where ``s_{t+1}`` is terminal).

:func:`vtrace` takes ``V(s_T)`` apart, as ``bootstrap_value [B]`` beside ``value [T, B]``.
Unrolls of replayed rows (row convention, ``[T+1, B]``) become these steps with
:func:`unroll_steps`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


def _check(reward: Tensor, value: Tensor, discount: Tensor) -> None:
    if reward.shape != discount.shape:
        raise ValueError(f"reward {tuple(reward.shape)} and discount {tuple(discount.shape)} must match")
    if value.shape[0] != reward.shape[0] + 1 or value.shape[1:] != reward.shape[1:]:
        raise ValueError(
            f"value must be [T+1, ...] for reward [T, ...]; got value {tuple(value.shape)}, "
            f"reward {tuple(reward.shape)}"
        )


def lambda_return(reward: Tensor, value: Tensor, discount: Tensor, lambda_: float | Tensor) -> Tensor:
    """TD(lambda) returns ``[T, B]``.

    ``G_t = r_t + gamma_t * ((1 - lambda) * V(s_{t+1}) + lambda * G_{t+1})`` with
    ``G_T = V(s_T)``, so ``G_{T-1} = r_{T-1} + gamma_{T-1} V(s_T)``.

    Args:
        reward: ``[T, B, ...]``.
        value: ``[T+1, B, ...]``; the last entry bootstraps.
        discount: ``[T, B, ...]``.
        lambda_: in ``[0, 1]``; 0 gives one-step TD targets, 1 the discounted Monte-Carlo
            return bootstrapped at ``T``. A ``[T, B, ...]`` tensor gives one ``lambda_t`` per step
            (``G_t`` mixes ``V(s_{t+1})`` and ``G_{t+1}`` with ``lambda_t``; 0 cuts the chain there).
    Returns:
        ``[T, B, ...]``, differentiable w.r.t. all inputs (a reverse loop over ``T`` only).
    """
    _check(reward, value, discount)
    # everything that does not depend on G_{t+1} is computed for all t at once
    base = reward + discount * (1.0 - lambda_) * value[1:]
    carry = discount * lambda_
    out = [None] * reward.shape[0]
    nxt = value[-1]
    for t in range(reward.shape[0] - 1, -1, -1):
        nxt = torch.addcmul(base[t], carry[t], nxt)
        out[t] = nxt
    return torch.stack(out)


def nstep_return(reward: Tensor, value: Tensor, discount: Tensor, n: int) -> Tensor:
    """n-step returns ``[T, B, ...]``:
    ``G_t = sum_{k<n} (prod_{j<k} gamma_{t+j}) r_{t+k} + (prod_{j<n} gamma_{t+j}) V(s_{t+n})``,
    truncated at the end: where ``t + n > T`` the sum stops at ``T`` and bootstraps from
    ``V(s_T)``. A loop over ``n`` only.
    """
    _check(reward, value, discount)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    T = reward.shape[0]
    pad_shape = (n, *reward.shape[1:])
    r = torch.cat([reward, reward.new_zeros(pad_shape)])
    g = torch.cat([discount, discount.new_ones(pad_shape)])
    ret = torch.zeros_like(reward)
    disc = torch.ones_like(reward)
    for k in range(n):
        ret = ret + disc * r[k : k + T]
        disc = disc * g[k : k + T]
    boot = torch.arange(T, device=value.device).add(n).clamp(max=T)
    return ret + disc * value[boot]


def window_nstep_values(
    reward: Tensor,
    value: Tensor,
    is_terminal: Tensor,
    valid: Tensor,
    discount: float,
    td_steps: int | Tensor,
    num_positions: int,
) -> tuple[Tensor, Tensor]:
    """n-step value targets for the first ``num_positions`` rows of windows that may hold an
    episode end (MuZero's targets; rows in the row convention, time-major).

    Row ``j`` of a window holds ``reward[j]`` (received on arriving at it), ``value[j]`` (an
    estimate of ``V(o_j)`` to bootstrap from; it must be meaningful on the last row of a
    truncated episode), ``is_terminal[j]`` and ``valid[j]`` (the row exists and belongs to the
    episode of row 0, up to and including its last row; a prefix of the window). With ``e`` the
    last valid row and ``n = td_steps`` (``-1``: no limit, Monte Carlo to ``e``), position
    ``p <= e`` gets ``z_p = sum_{i=p+1}^{m} discount^(i-p-1) reward[i] + discount^(m-p) value[m]``
    with ``m = min(p + n, e)``, the bootstrap dropped where row ``m`` is terminal (game over:
    discount 0). A truncated episode, or one cut by the write head, bootstraps from its last row.
    Positions past ``e``: target 0 if the episode terminated (absorbing state), masked otherwise.

    Args:
        reward, value: ``[W, B]`` float.
        is_terminal, valid: ``[W, B]`` bool.
        td_steps: ``n >= 1``, or ``-1``; one for all windows or one per window (int64 ``[B]``,
            e.g. reanalyse's horizon by sample age).
        num_positions: ``P <= W`` positions to compute.
    Returns:
        ``(target [P, B], mask [P, B] bool)``.
    """
    if reward.shape != value.shape or reward.shape != valid.shape or reward.shape != is_terminal.shape:
        raise ValueError(
            f"reward {tuple(reward.shape)}, value {tuple(value.shape)}, is_terminal "
            f"{tuple(is_terminal.shape)} and valid {tuple(valid.shape)} must have one shape [W, B]"
        )
    window, batch = reward.shape
    device, dtype = reward.device, reward.dtype
    n = torch.as_tensor(td_steps, device=device).long()
    if n.dim() > 1 or (n.dim() == 1 and n.shape[0] != batch):
        raise ValueError(f"td_steps must be an int or one per window [B] = [{batch}], got shape {tuple(n.shape)}")
    if bool(((n == 0) | (n < -1)).any()):
        raise ValueError(f"td_steps must be >= 1 or -1 (Monte Carlo), got {td_steps}")
    if not 1 <= num_positions <= window:
        raise ValueError(f"num_positions must be in [1, W={window}], got {num_positions}")
    n = torch.where(n == -1, torch.full_like(n, window), n).reshape(1, 1, -1)  # [1, 1, B or 1]
    last = valid.long().sum(0) - 1  # [B] e: the last valid row (valid is a prefix)
    if bool((last < 0).any()):
        raise ValueError("every window needs a valid first row")
    terminated = is_terminal.gather(0, last.unsqueeze(0)).squeeze(0)  # [B]
    p = torch.arange(num_positions, device=device).view(-1, 1, 1)  # [P, 1, 1]
    i = torch.arange(window, device=device).view(1, -1, 1)  # [1, W, 1]
    # weights[p, i, b] = discount^(i - p - 1) for p < i <= p + n_b: discounted rewards in one contraction
    power = (i - p - 1).to(dtype)
    band = (i > p) & (i <= p + n)
    weights = torch.where(
        band,
        torch.tensor(float(discount), dtype=dtype, device=device) ** power.clamp(min=0),
        torch.zeros((), dtype=dtype, device=device),
    )  # [P, W, B or 1]
    rewards = torch.where(valid, reward, torch.zeros_like(reward))  # rewards past e are 0
    if weights.shape[2] == 1:
        rewards = weights.squeeze(2) @ rewards  # [P, B]
    else:
        rewards = torch.einsum("piw,iw->pw", weights, rewards)
    end = torch.minimum(p.squeeze(2) + n.squeeze(0), last.unsqueeze(0))  # [P, B]
    boot = value.gather(0, end) * (~is_terminal.gather(0, end)).to(dtype)
    target = rewards + float(discount) ** (end - p.squeeze(2)).clamp(min=0).to(dtype) * boot
    inside = p.squeeze(2) <= last.unsqueeze(0)
    target = torch.where(inside, target, torch.zeros_like(target))
    mask = inside | terminated.unsqueeze(0)
    return target, mask


# -- V-trace (IMPALA) -----------------------------------------------------------------------
class UnrollSteps(NamedTuple):
    """Per-step quantities ``[T, B]`` of an unroll of ``T+1`` rows (see :func:`unroll_steps`)."""

    reward: Tensor  # r for the step s_t -> s_{t+1}: the reward stored on row t+1
    discount: Tensor  # gamma * (1 - is_terminal[t+1])
    mask: Tensor  # bool: step t is a real transition of one episode


def unroll_steps(reward: Tensor, is_first: Tensor, is_last: Tensor, is_terminal: Tensor, gamma: float) -> UnrollSteps:
    """Turn ``T+1`` rows of the row convention into ``T`` steps for the return estimators.

    Row ``t`` holds ``o_t``, the reward received on arriving at ``o_t`` and the action taken
    at ``o_t`` (see ``docs/architecture.md``). Step ``t`` is the transition ``o_t -> o_{t+1}``:

    * ``reward[t] = row_reward[t+1]``;
    * ``discount[t] = gamma * (1 - is_terminal[t+1])``: a truncated episode (``is_last``
      without ``is_terminal``) bootstraps from the value of its last observation;
    * ``mask[t] = ~is_last[t] & ~is_first[t+1]``: no action is taken on a last row, and a
      first row starts a new episode even without a last row before it (e.g. where a stream
      restarted), so the step into it belongs to no episode.

    Args:
        reward, is_first, is_last, is_terminal: rows ``[T+1, B]`` (time-major).
        gamma: discount factor.
    Returns:
        :class:`UnrollSteps` of ``[T, B]`` tensors (reward and discount in ``reward``'s float dtype).
    """
    shape = reward.shape
    for name, x in (("is_first", is_first), ("is_last", is_last), ("is_terminal", is_terminal)):
        if x.shape != shape:
            raise ValueError(f"{name} {tuple(x.shape)} must have the shape of reward {tuple(shape)}")
    if reward.dim() < 1 or shape[0] < 2:
        raise ValueError(f"an unroll needs T+1 >= 2 rows along dim 0; got reward {tuple(shape)}")
    dtype = reward.dtype if reward.is_floating_point() else torch.float32
    discount = gamma * (1.0 - is_terminal[1:].to(dtype))
    mask = ~is_last[:-1].bool() & ~is_first[1:].bool()
    return UnrollSteps(reward[1:].to(dtype), discount, mask)


def replay_lambda_return(
    reward: Tensor,
    value: Tensor,
    is_first: Tensor,
    is_last: Tensor,
    is_terminal: Tensor,
    gamma: float,
    lambda_: float,
) -> tuple[Tensor, Tensor]:
    """TD(lambda) targets along replayed rows ``[T+1, B]`` (row convention), which may cross
    episode borders: the lambda return of each step of :func:`unroll_steps` within its episode.

    For a real step ``t`` (``s_t -> s_{t+1}``, ``mask[t]``)::

        G_t = r_t + gamma_t ((1 - lambda_t) V(s_{t+1}) + lambda_t G_{t+1})

    with ``lambda_t = 0`` where step ``t+1`` is no transition of the episode (it ended at
    ``s_{t+1}``: a truncated end bootstraps from ``V(s_{t+1})``, a terminal one has
    ``gamma_t = 0``) and ``G_T = V(s_T)``.

    Args:
        reward, is_first, is_last, is_terminal: rows ``[T+1, B]`` (flags bool or float).
        value: ``[T+1, B]`` critic values ``V(s_t)`` of the rows.
    Returns:
        ``(targets [T, B], mask [T, B] bool)``; targets where ``mask`` is false are meaningless.
    """
    if value.shape != reward.shape:
        raise ValueError(f"value {tuple(value.shape)} must have the shape of reward {tuple(reward.shape)} [T+1, B]")
    steps = unroll_steps(reward, is_first, is_last, is_terminal, gamma)
    next_real = torch.cat([steps.mask[1:], steps.mask.new_ones(steps.mask[:1].shape)])
    lambdas = lambda_ * next_real.to(value.dtype)
    targets = lambda_return(steps.reward.to(value.dtype), value, steps.discount.to(value.dtype), lambdas)
    return targets, steps.mask


class VTrace(NamedTuple):
    """V-trace targets ``vs [T, B]`` and policy-gradient advantages ``pg_advantage [T, B]``."""

    vs: Tensor
    pg_advantage: Tensor


def _log_clip(log_rho: Tensor, clip: float, name: str) -> Tensor:
    """``min(clip, exp(log_rho))`` computed in log space (no overflow for large ratios)."""
    if not clip > 0:
        raise ValueError(f"{name} must be > 0 (math.inf for no clipping), got {clip}")
    return torch.exp(log_rho.clamp(max=math.log(clip)))


def vtrace(
    behaviour_log_prob: Tensor,
    target_log_prob: Tensor,
    reward: Tensor,
    value: Tensor,
    bootstrap_value: Tensor,
    discount: Tensor,
    rho_clip: float = 1.0,
    c_clip: float = 1.0,
    rho_pg_clip: float = 1.0,
    lambda_: float = 1.0,
    mask: Tensor | None = None,
) -> VTrace:
    """V-trace (Espeholt et al. 2018, eq. 1 and section 4.2), time-major.

    With ``rho_t = pi(a_t|x_t) / mu(a_t|x_t)`` (from log-probabilities, in log space),
    ``rho'_t = min(rho_clip, rho_t)``, ``c_t = lambda_ * min(c_clip, rho_t)`` (DI-engine's
    placement of lambda) and ``V_T = bootstrap_value``::

        delta_t = rho'_t * (r_t + gamma_t V(x_{t+1}) - V(x_t))
        vs_t    = V(x_t) + delta_t + gamma_t c_t (vs_{t+1} - V(x_{t+1})),    vs_T = V_T
        pg_advantage_t = min(rho_pg_clip, rho_t) * (r_t + gamma_t vs_{t+1} - V(x_t))

    Args:
        behaviour_log_prob: ``log mu(a_t|x_t)`` ``[T, B]`` (the acting policy, stored in rows).
        target_log_prob: ``log pi(a_t|x_t)`` ``[T, B]`` (the learner's policy).
        reward: ``r_t`` ``[T, B]`` for the step ``x_t -> x_{t+1}``.
        value: ``V(x_t)`` ``[T, B]``.
        bootstrap_value: ``V(x_T)`` ``[B]``.
        discount: ``gamma_t = gamma * (1 - terminal_{t+1})`` ``[T, B]``.
        rho_clip, c_clip, rho_pg_clip: clip thresholds (``math.inf``: no clipping).
        lambda_: trace-cutting factor in ``[0, 1]`` (1 in the paper's eq. 1).
        mask: optional bool ``[T, B]``; false where step ``t`` is no transition of one
            episode (:func:`unroll_steps`). There ``rho'_t = c_t = 0``: ``vs_t = V(x_t)``, the
            trace is cut and the advantage is 0, so earlier steps bootstrap from ``V(x_t)``.
    Returns:
        :class:`VTrace` ``(vs, pg_advantage)``, both ``[T, B]`` and without gradient.
    """
    T = reward.shape[0]
    for name, x in (
        ("behaviour_log_prob", behaviour_log_prob),
        ("target_log_prob", target_log_prob),
        ("value", value),
        ("discount", discount),
    ):
        if x.shape != reward.shape:
            raise ValueError(f"{name} {tuple(x.shape)} must have the shape of reward {tuple(reward.shape)} [T, B]")
    if bootstrap_value.shape != reward.shape[1:]:
        raise ValueError(
            f"bootstrap_value {tuple(bootstrap_value.shape)} must be reward's shape without "
            f"time {tuple(reward.shape[1:])}"
        )
    if mask is not None and mask.shape != reward.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must have the shape of reward {tuple(reward.shape)}")
    with torch.no_grad():
        log_rho = target_log_prob.detach() - behaviour_log_prob.detach()
        rho = _log_clip(log_rho, rho_clip, "rho_clip")
        c = lambda_ * _log_clip(log_rho, c_clip, "c_clip")
        rho_pg = _log_clip(log_rho, rho_pg_clip, "rho_pg_clip")
        if mask is not None:
            keep = mask.to(rho.dtype)
            rho, c, rho_pg = rho * keep, c * keep, rho_pg * keep
        value, bootstrap_value = value.detach(), bootstrap_value.detach()
        reward, discount = reward.detach(), discount.detach()
        next_value = torch.cat([value[1:], bootstrap_value.unsqueeze(0)])
        delta = rho * (reward + discount * next_value - value)
        carry = discount * c
        acc = torch.zeros_like(bootstrap_value)  # vs_{t+1} - V(x_{t+1})
        diffs = [None] * T
        for t in range(T - 1, -1, -1):
            acc = torch.addcmul(delta[t], carry[t], acc)
            diffs[t] = acc
        vs = value + torch.stack(diffs) if T else value.clone()
        next_vs = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)])
        pg_advantage = rho_pg * (reward + discount * next_vs - value)
    return VTrace(vs, pg_advantage)
