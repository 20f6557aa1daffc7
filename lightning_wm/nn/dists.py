"""Distributions and losses for Dreamer-style models, as small pure tensor functions.

Nothing here builds ``torch.distributions`` objects: the training hot path works on raw
logits / means / standard deviations.

* symlog / symexp squashing (DreamerV3);
* MuZero's value transform :func:`h_transform` / :func:`h_inverse` and categorical values over a
  support in transformed space (:func:`h_support`, :func:`h_twohot_encode`, :func:`h_twohot_mean`,
  :func:`h_twohot_loss`);
* two-hot encoding over a bins tensor (e.g. :func:`symexp_bins`), its cross-entropy loss and
  its mean; :func:`searchsorted_right`, the bin search both it and the categorical sampling use
  (compiled: :func:`prefix_sum` and :func:`count_at_most`, forms the compiler fuses);
* categorical latents: 1% uniform mix (``unimix``), straight-through one-hot sampling,
  entropy and KL over groups ``[..., G, C]``;
* diagonal Gaussians: KL, log-prob, entropy; bounded Normal and tanh-Normal actions;
* :func:`kl_balance` — DreamerV3's dynamics/representation KL with free bits;
* :func:`bernoulli_nll` for the continue head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

Gaussian = tuple[Tensor, Tensor]  # (mean, std), both [..., D]

_LOG_2PI = math.log(2 * math.pi)


# -- symlog ---------------------------------------------------------------------------------
def symlog(x: Tensor) -> Tensor:
    """``sign(x) * log(1 + |x|)``, elementwise."""
    return torch.sign(x) * torch.log1p(torch.abs(x))


def symexp(x: Tensor) -> Tensor:
    """Inverse of :func:`symlog`: ``sign(x) * (exp(|x|) - 1)``, elementwise."""
    return torch.sign(x) * torch.expm1(torch.abs(x))


def symlog_mse(pred: Tensor, target: Tensor, transform: bool = True) -> Tensor:
    """Squared error summed over the last dim: ``pred [..., D]`` regresses
    ``symlog(target) [..., D]`` (or ``target`` itself when ``transform`` is false) -> ``[...]``."""
    if transform:
        target = symlog(target)
    return (pred - target).square().sum(-1)


# -- two-hot --------------------------------------------------------------------------------
def symexp_bins(n: int = 255, low: float = -20.0, high: float = 20.0) -> Tensor:
    """``symexp(linspace(low, high, n))``: DreamerV3's bins ``[n]`` float32 (dense near 0, up
    to ~±4.9e8). With ``low == -high`` they are exactly mirrored (middle bin exactly 0)."""
    bins = symexp(torch.linspace(low, high, n, dtype=torch.float64))
    if low == -high:
        bins = (bins - bins.flip(0)) / 2
    return bins.float()


def searchsorted_right(sorted_sequence: Tensor, values: Tensor) -> Tensor:
    """``torch.searchsorted(sorted_sequence, values, right=True)``: per value, how many entries of
    the sorted last dim are ``<= value`` (int64, the shape of ``values``).

    ``sorted_sequence`` is ``[K]`` (one sequence for every value) or ``[..., K]`` with ``values
    [..., M]``. Compiled it is :func:`count_at_most`, a compare and a sum the compiler fuses with
    what surrounds it (``searchsorted`` stays a call of its own there, a launch and copies of its
    inputs); the integers are the same. Eager it is ``searchsorted`` (``log K`` compares a value).
    """
    if torch.compiler.is_compiling():
        return count_at_most(sorted_sequence, values)
    return torch.searchsorted(sorted_sequence, values.contiguous(), right=True)


def count_at_most(sorted_sequence: Tensor, values: Tensor) -> Tensor:
    """How many entries of ``sorted_sequence``'s last dim are ``<= value``, as a compare and a sum
    (:func:`searchsorted_right`'s shapes and integers)."""
    if sorted_sequence.dim() == 1:
        return (sorted_sequence <= values.unsqueeze(-1)).sum(-1)
    return (sorted_sequence.unsqueeze(-2) <= values.unsqueeze(-1)).sum(-1)


def prefix_sum(x: Tensor) -> Tensor:
    """``x.cumsum(-1)`` for ``x [..., C]`` as ``ceil(log2 C)`` shifted adds (Hillis and Steele's
    scan): pointwise work the compiler fuses into the kernels around it, where ``cumsum`` is a
    call of its own on the CPU. Equal up to rounding (another order of the same sums)."""
    c, shift = x.shape[-1], 1
    while shift < c:
        x = x + torch.nn.functional.pad(x[..., :-shift], (shift, 0))
        shift *= 2
    return x


def twohot_encode(x: Tensor, bins: Tensor) -> Tensor:
    """Two-hot encoding of ``x [...]`` over increasing ``bins [K]`` -> ``[..., K]``.

    The weight sits on the two bins around ``x`` and is split so that the weighted mean of the
    bins is ``x``; values outside ``[bins[0], bins[-1]]`` are clipped to the end bins.
    """
    k = bins.shape[0]
    x = x.detach().to(bins.dtype).clamp(bins[0], bins[-1])
    above = searchsorted_right(bins, x).clamp_(1, k - 1)
    below = above - 1
    lo, hi = bins[below], bins[above]
    w_above = ((x - lo) / (hi - lo)).clamp_(0.0, 1.0)
    out = torch.zeros(*x.shape, k, dtype=bins.dtype, device=bins.device)
    out.scatter_(-1, below.unsqueeze(-1), (1.0 - w_above).unsqueeze(-1))
    out.scatter_add_(-1, above.unsqueeze(-1), w_above.unsqueeze(-1))
    return out


def weighted_bin_mean(probs: Tensor, bins: Tensor) -> Tensor:
    """``sum_k probs[..., k] * bins[k]`` -> ``[...]``, pair by pair from the outside in.

    Bins mirrored around the middle (``symexp_bins``) reach ~4.9e8, so float32 products of order
    1e6 must cancel exactly for a uniform distribution to decode to 0 instead of noise of order 1.
    Each outer pair ``(lo, hi)`` is summed as ``(p_hi - p_lo) * b_hi + p_lo * (b_lo + b_hi)``: for
    equal probabilities and mirrored bins both products have an exact-zero factor, which holds
    also where the compiler fuses a product into an add (FMA contraction: Inductor's CUDA kernels
    did, and ``p_lo * b_lo + p_hi * b_hi`` then kept one product's rounding error, 0.28 here).
    """
    k = bins.shape[0]
    m = k // 2
    low, high = probs[..., :m].flip(-1), probs[..., k - m :]
    bins_high = bins[k - m :]
    skew = bins[:m].flip(0) + bins_high  # 0 for mirrored bins
    out = ((high - low) * bins_high + low * skew).sum(-1)
    if k % 2:
        out = out + probs[..., m] * bins[m]
    return out


def twohot_decode(weights: Tensor, bins: Tensor) -> Tensor:
    """Value of a two-hot (or any probability) vector ``[..., K]`` over ``bins [K]`` -> ``[...]``."""
    return weighted_bin_mean(weights, bins)


def twohot_mean(logits: Tensor, bins: Tensor) -> Tensor:
    """Mean of the categorical over ``bins`` given ``logits [..., K]`` -> ``[...]``."""
    return weighted_bin_mean(torch.softmax(logits, -1), bins)


def twohot_loss(logits: Tensor, target: Tensor, bins: Tensor) -> Tensor:
    """Cross-entropy of ``logits [..., K]`` against the two-hot encoding of ``target [...]``
    (no gradient into the target) -> ``[...]``."""
    return -(twohot_encode(target, bins) * torch.log_softmax(logits, -1)).sum(-1)


# -- MuZero value transform ------------------------------------------------------------------
def h_transform(x: Tensor, eps: float = 0.001) -> Tensor:
    """MuZero's (Pohlen et al.) value squashing ``h(x) = sign(x) (sqrt(|x| + 1) - 1) + eps x``,
    elementwise; ``sqrt(|x| + 1) - 1`` is computed as ``|x| / (sqrt(|x| + 1) + 1)`` (no cancellation
    for small ``|x|``)."""
    return x / (torch.sqrt(torch.abs(x) + 1.0) + 1.0) + eps * x


def h_inverse(y: Tensor, eps: float = 0.001) -> Tensor:
    """Exact inverse of :func:`h_transform`, elementwise.

    With ``u = sqrt(|x| + 1) - 1``, ``|y| = u + eps (u^2 + 2u)``, a quadratic in ``u`` whose root,
    rationalised so that nothing cancels for small ``|y|`` (the textbook form
    ``((sqrt(1 + 4 eps (|y| + 1 + eps)) - 1) / (2 eps))^2 - 1`` loses every digit there in
    float32), is ``u = 2|y| / (a + sqrt(a^2 + 4 eps |y|))`` with ``a = 1 + 2 eps``; then
    ``x = sign(y) u (u + 2)``. ``eps = 0`` gives ``x = y (|y| + 2)``.
    """
    a = 1.0 + 2.0 * eps
    ay = torch.abs(y)
    d = 2.0 / (torch.sqrt(ay * (4.0 * eps) + a * a) + a)  # u = |y| d
    return y * d * (ay * d + 2.0)


def h_support(support_size: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Bins ``[2 S + 1]`` of the categorical value / reward: the integers ``-S..S`` in
    :func:`h_transform` space (MuZero Atari: ``S = 300`` -> 601 bins, reaching ``|x| ~ 9e4``;
    CartPole: ``S = 10``-``25``)."""
    if support_size < 1:
        raise ValueError(f"support_size must be >= 1, got {support_size}")
    return torch.arange(-support_size, support_size + 1, dtype=dtype)


def h_twohot_encode(x: Tensor, bins: Tensor, eps: float = 0.001) -> Tensor:
    """Target distribution ``[..., K]`` of scalars ``x [...]``: the two-hot encoding of
    ``h_transform(x)`` over ``bins`` (values beyond the support go to the end bins)."""
    return twohot_encode(h_transform(x.to(bins.dtype), eps), bins)


def h_twohot_mean(logits: Tensor, bins: Tensor, eps: float = 0.001) -> Tensor:
    """Scalar ``[...]`` a categorical over transformed ``bins`` stands for:
    ``h_inverse(E[bin])`` for ``logits [..., K]`` (the expectation is taken in transformed
    space, as in MuZero). The bins are small integers, so a plain dot product is exact enough
    (the outside-in sum of :func:`weighted_bin_mean` is for bins up to ~1e8), and it is the
    search's hot path."""
    return h_inverse(torch.softmax(logits, -1) @ bins, eps)


def h_twohot_loss(logits: Tensor, target: Tensor, bins: Tensor, eps: float = 0.001) -> Tensor:
    """Cross-entropy ``[...]`` of ``logits [..., K]`` against :func:`h_twohot_encode` of the
    scalar ``target [...]`` (no gradient into the target)."""
    return -(h_twohot_encode(target, bins, eps) * torch.log_softmax(logits, -1)).sum(-1)


# -- categorical ----------------------------------------------------------------------------
def unimix_probs(logits: Tensor, mix: float = 0.01) -> Tensor:
    """``(1 - mix) * softmax(logits) + mix / C`` over the last dim ``C``."""
    probs = torch.softmax(logits, -1)
    if mix > 0:
        probs = probs * (1.0 - mix) + mix / logits.shape[-1]
    return probs


def unimix_logits(logits: Tensor, mix: float = 0.01) -> Tensor:
    """Log-probabilities of :func:`unimix_probs` (normalised logits) ``[..., C]``."""
    if mix <= 0:
        return torch.log_softmax(logits, -1)
    return torch.log(unimix_probs(logits, mix))


def onehot_argmax(scores: Tensor) -> Tensor:
    """One-hot ``[..., C]`` of the argmax over the last dim (float, no gradient)."""
    index = scores.argmax(-1, keepdim=True)
    return torch.zeros_like(scores).scatter_(-1, index, 1.0)


def sample_index(probs: Tensor, uniform: Tensor | None = None) -> Tensor:
    """Class indices ``[...]`` (int64) drawn from ``probs [..., C]`` by inverting the CDF.

    ``uniform [...]`` are ``U(0, 1)`` draws (drawn if omitted), so that callers can draw
    them for many steps at once. One uniform per sample instead of one Gumbel per class
    (the Gumbel-max trick): ``C`` times fewer random draws.
    """
    probs = probs.detach()
    cdf = prefix_sum(probs) if torch.compiler.is_compiling() else probs.cumsum(-1)
    if uniform is None:
        uniform = torch.rand(probs.shape[:-1], device=probs.device, dtype=probs.dtype)
    # a draw above a total that rounding left just below 1 falls in the last class (the clamp)
    index = searchsorted_right(cdf, uniform.unsqueeze(-1).to(cdf.dtype))
    return index.clamp_(max=probs.shape[-1] - 1).squeeze(-1)


def onehot_st(index: Tensor, probs: Tensor) -> Tensor:
    """One-hot of ``index [...]`` over ``probs [..., C]`` classes with a straight-through gradient:
    the value is an exact one-hot, the gradient that of ``probs`` (``onehot + p - sg(p)``)."""
    onehot = torch.zeros_like(probs, memory_format=torch.contiguous_format).scatter_(-1, index.unsqueeze(-1), 1.0)
    if probs.requires_grad:
        onehot = onehot + probs - probs.detach()
    return onehot


def sample_onehot(probs: Tensor, uniform: Tensor | None = None) -> Tensor:
    """One-hot sample ``[..., C]`` from ``probs`` with a straight-through gradient (see
    :func:`sample_index`, :func:`onehot_st`)."""
    return onehot_st(sample_index(probs, uniform), probs)


def categorical_entropy(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last dim -> ``[...]``."""
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


def categorical_kl(p_logits: Tensor, q_logits: Tensor) -> Tensor:
    """``KL(p || q)`` of categoricals given by logits ``[..., C]`` -> ``[...]``."""
    logp = torch.log_softmax(p_logits, -1)
    logq = torch.log_softmax(q_logits, -1)
    return (logp.exp() * (logp - logq)).sum(-1)


# -- Gaussian -------------------------------------------------------------------------------
def normal_kl(p: Gaussian, q: Gaussian) -> Tensor:
    """``KL(N(m1, s1) || N(m2, s2))`` of diagonal Gaussians, summed over the last dim -> ``[...]``."""
    (m1, s1), (m2, s2) = p, q
    var_ratio = (s1 / s2).square()
    return 0.5 * (var_ratio + ((m1 - m2) / s2).square() - 1.0 - torch.log(var_ratio)).sum(-1)


def normal_log_prob(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Log-density of diagonal ``N(mean, std)`` at ``x``, summed over the last dim -> ``[...]``."""
    return (-0.5 * ((x - mean) / std).square() - torch.log(std) - 0.5 * _LOG_2PI).sum(-1)


def normal_entropy(std: Tensor) -> Tensor:
    """Entropy of a diagonal Gaussian with ``std [..., D]`` -> ``[...]``."""
    return (torch.log(std) + 0.5 * (1.0 + _LOG_2PI)).sum(-1)


def bounded_normal(raw: Tensor, min_std: float = 0.1, max_std: float = 1.0) -> Gaussian:
    """DreamerV3's continuous action head: ``raw [..., 2A]`` -> ``(mean, std)`` ``[..., A]`` with
    ``mean = tanh(raw_mean)`` in ``[-1, 1]`` and ``std`` in ``[min_std, max_std]``."""
    mean, std = raw.chunk(2, -1)
    return torch.tanh(mean), (max_std - min_std) * torch.sigmoid(std + 2.0) + min_std


def bounded_normal_sample(mean: Tensor, std: Tensor) -> tuple[Tensor, Tensor]:
    """Reparameterised sample ``x = mean + std * eps`` and the action ``clip(x, -1, 1)`` whose
    gradient passes straight through the clip. Returns ``(action, x)``."""
    x = mean + std * torch.randn_like(mean)
    action = x + (x.clamp(-1.0, 1.0) - x).detach()
    return action, x


def tanh_normal(raw: Tensor, min_std: float = 0.1, max_std: float = 1.0) -> Gaussian:
    """``raw [..., 2A]`` -> ``(mean, std)`` of the pre-tanh Gaussian (DreamerV1/V2 actor)."""
    mean, std = raw.chunk(2, -1)
    return mean, (max_std - min_std) * torch.sigmoid(std + 2.0) + min_std


def tanh_normal_sample(mean: Tensor, std: Tensor) -> tuple[Tensor, Tensor]:
    """Reparameterised ``a = tanh(mean + std * eps)`` and its log-density -> ``(a [..., A], logp [...])``."""
    u = mean + std * torch.randn_like(mean)
    return torch.tanh(u), tanh_normal_log_prob(u, mean, std)


def tanh_normal_log_prob(u: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Log-density of the action ``tanh(u)`` where ``u [..., A]`` is a draw of the pre-tanh
    ``N(mean, std)``, summed over the last dim -> ``[...]`` (from ``u``: no ``atanh`` of a
    saturated action)."""
    # log(1 - tanh(u)^2) = 2 * (log 2 - u - softplus(-2u)), stable for large |u|
    log_det = (2.0 * (math.log(2.0) - u - F.softplus(-2.0 * u))).sum(-1)
    return normal_log_prob(u, mean, std) - log_det


# -- KL balancing ---------------------------------------------------------------------------
def _kl(p: Tensor | Gaussian, q: Tensor | Gaussian) -> Tensor:
    if isinstance(p, Tensor):
        # categorical groups [..., G, C]: sum over classes and groups
        return categorical_kl(p, q).sum(-1)
    return normal_kl(p, q)


def _detach(x: Tensor | Gaussian) -> Tensor | Gaussian:
    return x.detach() if isinstance(x, Tensor) else tuple(t.detach() for t in x)


def kl_balance(
    post: Tensor | Gaussian,
    prior: Tensor | Gaussian,
    dyn_scale: float = 0.5,
    rep_scale: float = 0.1,
    free_nats: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DreamerV3's balanced KL with free bits.

    ``post``/``prior`` are either categorical logits ``[..., G, C]`` (``G`` groups of ``C``
    classes; pass unimixed log-probabilities) or Gaussians ``(mean, std)`` ``[..., D]``.

    * dynamics loss ``dyn = max(free_nats, KL(sg(post) || prior))`` trains the prior;
    * representation loss ``rep = max(free_nats, KL(post || sg(prior)))`` trains the posterior;
    * ``loss = dyn_scale * dyn + rep_scale * rep`` -> ``[...]``.

    Free bits clip each per-sample KL from below, so below ``free_nats`` it gives no gradient.
    Returns ``(loss, parts)`` with parts ``kl`` (the unclipped KL), ``dyn`` and ``rep`` (clipped).
    """
    dyn_kl = _kl(_detach(post), prior)
    rep_kl = _kl(post, _detach(prior))
    dyn = dyn_kl.clamp(min=free_nats)
    rep = rep_kl.clamp(min=free_nats)
    loss = dyn_scale * dyn + rep_scale * rep
    return loss, {"kl": dyn_kl.detach(), "dyn": dyn, "rep": rep}


# -- Bernoulli ------------------------------------------------------------------------------
def bernoulli_nll(logits: Tensor, target: Tensor) -> Tensor:
    """Negative log-likelihood of ``target [...]`` (in ``[0, 1]``) under ``Bernoulli(sigmoid(logits))``."""
    return F.binary_cross_entropy_with_logits(logits, target.to(logits.dtype), reduction="none")
