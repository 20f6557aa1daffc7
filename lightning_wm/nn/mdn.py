"""Mixture density network (MDN) math: diagonal-Gaussian mixtures, pure functions.

One function serves both layouts used for World Models' MDN-RNN:

* **joint** mixture: ``K`` components over the whole ``D``-vector,
  ``p(x) = sum_k pi_k prod_d N(x_d; mu_kd, sigma_kd)``, with ``logit_pi [..., K]``,
  ``mu, log_sigma [..., K, D]``, ``x [..., D]``;
* **per-dimension** mixtures (the reference implementation: every latent dimension has its
  own ``K``-component 1-D mixture): move ``D`` into the batch and use a trailing size-1
  dimension, ``logit_pi [..., D, K]``, ``mu, log_sigma [..., D, K, 1]``, ``x [..., D, 1]``,
  then sum the ``[..., D]`` result over ``D``. :func:`per_dim_layout` does the reshaping.

Sampling with a temperature ``tau`` follows the reference: mixture logits are divided by
``tau`` and standard deviations are multiplied by ``sqrt(tau)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_LOG_2PI = math.log(2.0 * math.pi)


def mdn_log_prob(logit_pi: Tensor, mu: Tensor, log_sigma: Tensor, x: Tensor) -> Tensor:
    """Log-likelihood of ``x`` under a mixture of diagonal Gaussians.

    Args:
        logit_pi: ``[..., K]`` unnormalised mixture log-weights.
        mu: ``[..., K, D]`` component means.
        log_sigma: ``[..., K, D]`` component log standard deviations.
        x: ``[..., D]`` points.
    Returns:
        ``[...]`` ``log sum_k softmax(logit_pi)_k N(x; mu_k, diag(exp(log_sigma_k))^2)``,
        computed with log-sum-exp (stable for far-away points).
    """
    if mu.shape != log_sigma.shape:
        raise ValueError(f"mu {tuple(mu.shape)} and log_sigma {tuple(log_sigma.shape)} differ")
    if logit_pi.shape[-1] != mu.shape[-2] or x.shape[-1] != mu.shape[-1]:
        raise ValueError(
            f"shapes do not form a mixture: logit_pi {tuple(logit_pi.shape)} [..., K], "
            f"mu {tuple(mu.shape)} [..., K, D], x {tuple(x.shape)} [..., D]"
        )
    diff = (x.unsqueeze(-2) - mu) * torch.exp(-log_sigma)  # [..., K, D]
    log_normal = -0.5 * (diff.square() + _LOG_2PI) - log_sigma  # [..., K, D]
    log_component = log_normal.sum(-1)  # [..., K]
    log_weights = torch.log_softmax(logit_pi, dim=-1)
    return torch.logsumexp(log_weights + log_component, dim=-1)


def mdn_sample(
    logit_pi: Tensor,
    mu: Tensor,
    log_sigma: Tensor,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Draw one sample per batch entry from the mixture, with a temperature.

    Args:
        logit_pi: ``[..., K]``; mu, log_sigma: ``[..., K, D]``.
        temperature: ``tau > 0``; ``logit_pi / tau`` and ``sigma * sqrt(tau)``. ``tau -> 0``
            tends to the mean of the most likely component; ``tau = 0`` returns exactly that.
        generator: torch RNG for reproducible draws.
    Returns:
        ``[..., D]`` samples.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    batch = logit_pi.shape[:-1]
    k, d = mu.shape[-2], mu.shape[-1]
    flat_logits = logit_pi.reshape(-1, k)
    if temperature == 0:
        index = flat_logits.argmax(-1)
    else:
        probs = torch.softmax(flat_logits / temperature, dim=-1)
        index = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    flat_mu = mu.reshape(-1, k, d)
    flat_sigma = log_sigma.reshape(-1, k, d).exp()
    rows = torch.arange(flat_mu.shape[0], device=mu.device)
    chosen_mu, chosen_sigma = flat_mu[rows, index], flat_sigma[rows, index]  # [N, D]
    if temperature == 0:
        return chosen_mu.reshape(*batch, d)
    noise = torch.randn(chosen_mu.shape, generator=generator, device=mu.device, dtype=mu.dtype)
    return (chosen_mu + chosen_sigma * math.sqrt(temperature) * noise).reshape(*batch, d)


def mdn_mean(logit_pi: Tensor, mu: Tensor) -> Tensor:
    """The mixture's mean ``sum_k softmax(logit_pi)_k mu_k``: ``logit_pi [..., K]``,
    ``mu [..., K, D]`` -> ``[..., D]``."""
    return (torch.softmax(logit_pi, dim=-1).unsqueeze(-1) * mu).sum(-2)


def per_dim_layout(logit_pi: Tensor, mu: Tensor, log_sigma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-dimension mixtures ``[..., D, K]`` each -> the layout of :func:`mdn_log_prob`:
    ``logit_pi [..., D, K]``, ``mu, log_sigma [..., D, K, 1]`` (then use ``x[..., None]``)."""
    return logit_pi, mu.unsqueeze(-1), log_sigma.unsqueeze(-1)


def gaussian_kl_standard(mu: Tensor, logvar: Tensor) -> Tensor:
    """``KL(N(mu, exp(logvar)) || N(0, I))`` summed over the last dimension: ``[..., D] -> [...]``."""
    return -0.5 * (1.0 + logvar - mu.square() - logvar.exp()).sum(-1)
