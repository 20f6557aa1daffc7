"""The search's random draws, all through one optional ``torch.Generator``: Dirichlet root noise
(from reproducible Gamma draws), Gumbel noise, and the action from root visit counts."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["sample_gamma", "dirichlet_noise", "sample_gumbel", "select_action"]


def sample_gamma(alpha: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """``Gamma(alpha, 1)`` draws of ``alpha.shape`` (Marsaglia-Tsang; ``alpha < 1`` boosted with
    ``U^(1/alpha)``), reproducible with ``generator`` (``torch._standard_gamma`` takes none)."""
    alpha = alpha.double()
    boost = alpha < 1
    a = torch.where(boost, alpha + 1, alpha)
    d = a - 1.0 / 3.0
    c = 1.0 / torch.sqrt(9.0 * d)
    out = torch.zeros_like(a)
    todo = torch.ones_like(a, dtype=torch.bool)
    while bool(todo.any()):
        x = torch.randn(a.shape, generator=generator, dtype=a.dtype, device=a.device)
        u = torch.rand(a.shape, generator=generator, dtype=a.dtype, device=a.device)
        v = (1.0 + c * x) ** 3
        ok = (v > 0) & (torch.log(u) < 0.5 * x * x + d - d * v + d * torch.log(v.clamp(min=1e-300)))
        take = todo & ok
        out = torch.where(take, d * v, out)
        todo = todo & ~ok
    u = torch.rand(a.shape, generator=generator, dtype=a.dtype, device=a.device)
    return torch.where(boost, out * u ** (1.0 / alpha), out)


def dirichlet_noise(alpha: float, legal: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """``Dir(alpha)`` over the legal actions of each row: ``legal [B, A]`` bool -> ``[B, A]``
    (0 on illegal actions, rows sum to 1)."""
    gamma = sample_gamma(torch.full(legal.shape, float(alpha), device=legal.device), generator)
    gamma = torch.where(legal, gamma, torch.zeros_like(gamma))
    return (gamma / gamma.sum(-1, keepdim=True).clamp(min=1e-300)).float()


def sample_gumbel(
    shape: Sequence[int],
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Standard Gumbel draws ``-log(-log(U))``."""
    u = torch.rand(tuple(shape), generator=generator, device=device, dtype=torch.float64)
    return (-torch.log(-torch.log(u.clamp(min=1e-300)))).to(dtype)


def select_action(
    visit_counts: Tensor, explore: bool, temperature: float = 1.0, generator: torch.Generator | None = None
) -> Tensor:
    """Action ``[B]`` from root visit counts ``[B, A]``: the most visited (lowest index on ties)
    unless ``explore``, then sampled from ``N^(1/temperature)`` (``temperature == 0``: argmax)."""
    if not explore or temperature <= 0:
        return visit_counts.argmax(-1)
    logits = torch.log(visit_counts.double()) / temperature
    probs = torch.softmax(logits, -1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
