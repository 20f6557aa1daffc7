"""Return estimators as pure tensor functions (time-major: ``[T, B]``).

Conventions shared by all functions here:

* ``reward[t]`` is ``r_t``, received on the transition ``s_t -> s_{t+1}``;
* ``value[t]`` is ``V(s_t)`` for ``t = 0..T`` (``value[T]`` bootstraps the tail);
* ``discount[t]`` is ``gamma_t = gamma * continue_{t+1}`` (0 where ``s_{t+1}`` is terminal).
"""

from __future__ import annotations

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


def lambda_return(reward: Tensor, value: Tensor, discount: Tensor, lambda_: float) -> Tensor:
    """TD(lambda) returns ``[T, B]``.

    ``G_t = r_t + gamma_t * ((1 - lambda) * V(s_{t+1}) + lambda * G_{t+1})`` with
    ``G_T = V(s_T)``, so ``G_{T-1} = r_{T-1} + gamma_{T-1} V(s_T)``.

    Args:
        reward: ``[T, B, ...]``.
        value: ``[T+1, B, ...]``; the last entry bootstraps.
        discount: ``[T, B, ...]``.
        lambda_: in ``[0, 1]``; 0 gives one-step TD targets, 1 the discounted Monte-Carlo
            return bootstrapped at ``T``.
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


def window_nstep_values(reward: Tensor, value: Tensor, is_terminal: Tensor, valid: Tensor, discount: float,
                        td_steps: int | Tensor, num_positions: int) -> tuple[Tensor, Tensor]:
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
        raise ValueError(f"reward {tuple(reward.shape)}, value {tuple(value.shape)}, is_terminal "
                         f"{tuple(is_terminal.shape)} and valid {tuple(valid.shape)} must have one shape [W, B]")
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
    weights = torch.where(band, torch.tensor(float(discount), dtype=dtype, device=device) ** power.clamp(min=0),
                          torch.zeros((), dtype=dtype, device=device))  # [P, W, B or 1]
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
