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
