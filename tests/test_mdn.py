"""MDN log-likelihood and sampling against torch.distributions."""

import math

import pytest
import torch
from torch import distributions as td

from lightning_wm.nn.mdn import gaussian_kl_standard, mdn_log_prob, mdn_mean, mdn_sample, per_dim_layout

torch.set_num_threads(1)


def _reference(logit_pi, mu, log_sigma, x):
    mix = td.Categorical(logits=logit_pi)
    comp = td.Independent(td.Normal(mu, log_sigma.exp()), 1)
    return td.MixtureSameFamily(mix, comp).log_prob(x)


def test_joint_mixture_matches_mixture_same_family():
    g = torch.Generator().manual_seed(0)
    b, t, k, d = 3, 4, 5, 7
    logit_pi = torch.randn(b, t, k, generator=g)
    mu = torch.randn(b, t, k, d, generator=g)
    log_sigma = 0.5 * torch.randn(b, t, k, d, generator=g)
    x = torch.randn(b, t, d, generator=g)
    ours = mdn_log_prob(logit_pi, mu, log_sigma, x)
    assert ours.shape == (b, t)
    torch.testing.assert_close(ours, _reference(logit_pi, mu, log_sigma, x), rtol=1e-5, atol=1e-5)


def test_per_dim_mixture_matches_product_of_1d_mixtures():
    g = torch.Generator().manual_seed(1)
    b, d, k = 6, 4, 3
    logit_pi = torch.randn(b, d, k, generator=g)
    mu = torch.randn(b, d, k, generator=g)
    log_sigma = 0.3 * torch.randn(b, d, k, generator=g)
    x = torch.randn(b, d, generator=g)
    lp, m, ls = per_dim_layout(logit_pi, mu, log_sigma)
    ours = mdn_log_prob(lp, m, ls, x.unsqueeze(-1)).sum(-1)
    ref = td.MixtureSameFamily(td.Categorical(logits=logit_pi), td.Normal(mu, log_sigma.exp())).log_prob(x).sum(-1)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_single_component_is_a_gaussian_hand_checked():
    # one component, D=1, mu=1, sigma=2, x=3: log N = -0.5*(1)^2 - log 2 - 0.5 log(2 pi)
    lp = mdn_log_prob(torch.zeros(1), torch.tensor([[1.0]]), torch.tensor([[math.log(2.0)]]), torch.tensor([3.0]))
    assert lp.item() == pytest.approx(-0.5 - math.log(2.0) - 0.5 * math.log(2 * math.pi), abs=1e-6)


def test_far_points_are_finite():
    lp = mdn_log_prob(torch.zeros(2), torch.zeros(2, 3), torch.full((2, 3), -5.0), torch.full((3,), 1e3))
    assert torch.isfinite(lp) and lp < -1e6


def test_sampling_statistics_and_temperature():
    g = torch.Generator().manual_seed(2)
    n = 20000
    logit_pi = torch.log(torch.tensor([0.25, 0.75])).expand(n, 2)
    mu = torch.tensor([[-3.0], [2.0]]).expand(n, 2, 1)
    log_sigma = torch.log(torch.tensor([[0.5], [1.0]])).expand(n, 2, 1)
    x = mdn_sample(logit_pi, mu, log_sigma, 1.0, generator=g)
    assert x.shape == (n, 1)
    assert x.mean().item() == pytest.approx(0.25 * -3 + 0.75 * 2, abs=0.05)
    assert (x < -0.5).float().mean().item() == pytest.approx(0.25, abs=0.02)
    # tau = 0: the mean of the most likely component, exactly
    assert torch.equal(mdn_sample(logit_pi[:3], mu[:3], log_sigma[:3], 0.0), torch.full((3, 1), 2.0))
    # higher temperature: flatter mixture weights and wider components
    hot = mdn_sample(logit_pi, mu, log_sigma, 4.0, generator=g)
    assert (hot < -0.5).float().mean().item() > 0.3
    x2 = mdn_sample(torch.zeros(n, 1), torch.zeros(n, 1, 1), torch.zeros(n, 1, 1), 4.0, generator=g)
    assert x2.std().item() == pytest.approx(2.0, abs=0.05)


def test_sampling_is_reproducible_with_a_generator():
    args = (torch.randn(4, 3), torch.randn(4, 3, 2), torch.randn(4, 3, 2))
    a = mdn_sample(*args, 1.0, generator=torch.Generator().manual_seed(5))
    b = mdn_sample(*args, 1.0, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def test_gaussian_kl_standard_hand_checked():
    # KL(N(1, e^0) || N(0,1)) = 0.5 * 1^2 = 0.5 per dim; KL(N(0, e^{2}) || N(0,1)) = 0.5*(e^2 - 1 - 2)
    kl = gaussian_kl_standard(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 2.0]]))
    assert kl.item() == pytest.approx(0.5 + 0.5 * (math.exp(2) - 3), abs=1e-5)
    ref = td.kl_divergence(
        td.Normal(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0]).mul(0.5).exp()), td.Normal(0.0, 1.0)
    ).sum()
    assert kl.item() == pytest.approx(ref.item(), abs=1e-5)


def test_mixture_mean_hand_checked_and_in_both_layouts():
    # weights softmax([0, log 3]) = (1/4, 3/4); means (0, 4) and (8, -4) -> (6, -2)
    logit_pi = torch.tensor([[0.0, math.log(3.0)]])
    mu = torch.tensor([[[0.0, 4.0], [8.0, -4.0]]])
    torch.testing.assert_close(mdn_mean(logit_pi, mu), torch.tensor([[6.0, -2.0]]))
    # per-dimension layout: each dimension's own 1-D mixture mean, against a loop
    g = torch.Generator().manual_seed(0)
    logits, means = torch.randn(5, 3, 4, generator=g), torch.randn(5, 3, 4, generator=g)
    lp, m, _ = per_dim_layout(logits, means, torch.zeros_like(means))
    slow = torch.tensor(
        [
            [sum(torch.softmax(logits[b, d], 0)[k] * means[b, d, k] for k in range(4)) for d in range(3)]
            for b in range(5)
        ]
    )
    torch.testing.assert_close(mdn_mean(lp, m).squeeze(-1), slow)
