"""symlog, two-hot, KL balancing, categorical and Gaussian helpers."""

import math

import pytest
import torch

from lightning_wm.nn import dists

torch.set_num_threads(1)


def test_symlog_symexp_inverse_and_values():
    x = torch.tensor([-1e6, -3.0, -1.0, 0.0, 0.5, 1.0, 1e3, 1e8], dtype=torch.float64)
    assert torch.allclose(dists.symexp(dists.symlog(x)), x, rtol=1e-10)
    assert torch.allclose(dists.symlog(torch.tensor([0.0, 1.0, -1.0])), torch.tensor([0.0, math.log(2), -math.log(2)]))
    y = torch.linspace(-20, 20, 41, dtype=torch.float64)
    assert torch.allclose(dists.symlog(dists.symexp(y)), y)


def test_symexp_bins():
    bins = dists.symexp_bins(255, -20, 20)
    assert bins.shape == (255,)
    assert bins[127] == 0
    assert torch.all(bins[1:] > bins[:-1])
    assert torch.allclose(bins, -bins.flip(0))
    assert math.isclose(bins[-1].item(), math.expm1(20), rel_tol=1e-5)


def test_twohot_round_trip_two_neighbours():
    bins = dists.symexp_bins(255)
    x = torch.tensor([0.0, 0.3, -0.7, 1.0, 2.5, -13.0, 100.0, 5e4, -2e6])
    enc = dists.twohot_encode(x, bins)
    assert enc.shape == (9, 255)
    assert torch.allclose(enc.sum(-1), torch.ones(9))
    assert ((enc > 0).sum(-1) <= 2).all()
    for i in range(len(x)):
        nz = torch.nonzero(enc[i]).flatten()
        if len(nz) == 2:
            assert nz[1] - nz[0] == 1  # neighbours
            assert bins[nz[0]] <= x[i] <= bins[nz[1]]
    dec = dists.twohot_decode(enc, bins)
    assert torch.allclose(dec, x, rtol=1e-5, atol=1e-5)


def test_twohot_hand_values_and_clipping():
    bins = torch.tensor([-2.0, 0.0, 1.0, 3.0])
    enc = dists.twohot_encode(torch.tensor([0.25, 2.5, -5.0, 3.0, 1.0]), bins)
    want = torch.tensor(
        [
            [0.0, 0.75, 0.25, 0.0],
            [0.0, 0.0, 0.25, 0.75],
            [1.0, 0.0, 0.0, 0.0],  # clipped to the lowest bin
            [0.0, 0.0, 0.0, 1.0],
            [0.0, 0.0, 1.0, 0.0],
        ]
    )
    assert torch.allclose(enc, want)


@pytest.mark.parametrize("bins", [dists.symexp_bins(255), dists.symexp_bins(8), torch.linspace(-3.0, 5.0, 9)])
def test_weighted_bin_mean_is_the_float64_sum(bins):
    """Against a float64 ``sum_k p_k b_k`` for mirrored (odd and even K) and unmirrored bins."""
    probs = torch.softmax(torch.randn(6, 5, bins.shape[0], generator=torch.Generator().manual_seed(0)), -1)
    want = (probs.double() * bins.double()).sum(-1)
    got = dists.weighted_bin_mean(probs, bins)
    assert got.shape == (6, 5) and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


def _uniform_decodes_to_exactly_zero(device: str, compiled: bool) -> None:
    bins = dists.symexp_bins(255).to(device)
    fn = torch.compile(dists.twohot_mean, dynamic=False) if compiled else dists.twohot_mean
    out = fn(torch.zeros(3, 17, 255, device=device), bins)
    assert out.abs().max().item() == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_uniform_logits_decode_to_zero_in_compiled_cuda_kernels():
    """Inductor's CUDA kernels fuse products into adds (FMA): the outer pairs must still cancel
    exactly (they left 0.28 of float32 noise in Dreamer's critic at initialisation)."""
    _uniform_decodes_to_exactly_zero("cuda", compiled=False)
    _uniform_decodes_to_exactly_zero("cuda", compiled=True)


def test_twohot_loss_and_mean():
    bins = dists.symexp_bins(255)
    # uniform logits decode to exactly 0 despite the +-4.9e8 outer bins
    _uniform_decodes_to_exactly_zero("cpu", compiled=False)
    target = torch.tensor([1.0, -4.0])
    logits = torch.log(dists.twohot_encode(target, bins) + 1e-12)
    assert torch.allclose(dists.twohot_mean(logits, bins), target, rtol=1e-4)
    # loss is the cross-entropy: minimal (= entropy of the two-hot) at the matching logits
    loss = dists.twohot_loss(logits, target, bins)
    p = dists.twohot_encode(target, bins)
    entropy = -(p * torch.log(p.clamp_min(1e-12))).sum(-1)
    assert torch.allclose(loss, entropy, atol=1e-4)
    assert (dists.twohot_loss(torch.zeros(2, 255), target, bins) > loss).all()


def test_unimix_and_straight_through_sample():
    logits = torch.tensor([[10.0, -10.0, -10.0, -10.0]], requires_grad=True)
    probs = dists.unimix_probs(logits, 0.01)
    assert torch.allclose(probs.sum(-1), torch.ones(1))
    assert probs.min() >= 0.01 / 4 - 1e-7
    assert torch.allclose(dists.unimix_logits(logits, 0.01).exp(), probs)
    torch.manual_seed(0)
    sample = dists.sample_onehot(probs)
    assert torch.equal(sample.detach(), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))  # value is an exact one-hot
    (sample * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0  # gradient through the probs
    # sampling frequencies follow the probabilities
    p = torch.tensor([0.2, 0.5, 0.3])
    counts = dists.sample_onehot(p.expand(20000, 3)).sum(0) / 20000
    assert torch.allclose(counts, p, atol=0.02)


def test_kl_balance_categorical_hand_values():
    # one group of two classes: post (0.5, 0.5), prior (0.9, 0.1)
    post = torch.log(torch.tensor([[[0.5, 0.5]]]))
    prior = torch.log(torch.tensor([[[0.9, 0.1]]]))
    kl = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)  # 0.5108...
    loss, parts = dists.kl_balance(post, prior, dyn_scale=0.5, rep_scale=0.1, free_nats=0.0)
    assert math.isclose(parts["kl"].item(), kl, rel_tol=1e-5)
    assert math.isclose(loss.item(), 0.6 * kl, rel_tol=1e-5)
    # free bits: KL below 1 nat is clipped to 1 nat and gives no gradient
    post_p = post.clone().requires_grad_(True)
    prior_p = prior.clone().requires_grad_(True)
    loss, parts = dists.kl_balance(post_p, prior_p, 0.5, 0.1, free_nats=1.0)
    assert math.isclose(loss.item(), 0.6, rel_tol=1e-6)
    assert math.isclose(parts["kl"].item(), kl, rel_tol=1e-5)
    loss.sum().backward()
    assert post_p.grad.abs().sum() == 0 and prior_p.grad.abs().sum() == 0


def test_kl_balance_gradients_split_dyn_and_rep():
    # two groups -> KL summed over groups; check dyn trains only the prior and rep only the posterior
    post = torch.log(torch.tensor([[[0.5, 0.5], [0.2, 0.8]]])).requires_grad_(True)
    prior = torch.log(torch.tensor([[[0.9, 0.1], [0.6, 0.4]]])).requires_grad_(True)
    kl = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1) + 0.2 * math.log(0.2 / 0.6) + 0.8 * math.log(0.8 / 0.4)
    loss, parts = dists.kl_balance(post, prior, dyn_scale=1.0, rep_scale=0.0, free_nats=0.0)
    assert math.isclose(parts["kl"].item(), kl, rel_tol=1e-5)
    loss.sum().backward()
    assert post.grad.abs().sum() == 0 and prior.grad.abs().sum() > 0
    post.grad = prior.grad = None
    loss, _ = dists.kl_balance(post, prior, dyn_scale=0.0, rep_scale=1.0, free_nats=0.0)
    loss.sum().backward()
    assert post.grad.abs().sum() > 0 and prior.grad.abs().sum() == 0


def test_kl_balance_gaussian_hand_values():
    # KL(N(0,1) || N(1,2)) = log 2 + (1 + 1)/8 - 1/2
    post = (torch.zeros(1, 1), torch.ones(1, 1))
    prior = (torch.ones(1, 1), torch.full((1, 1), 2.0))
    kl = math.log(2) + 2 / 8 - 0.5
    loss, parts = dists.kl_balance(post, prior, 0.5, 0.1, free_nats=0.0)
    assert math.isclose(parts["kl"].item(), kl, rel_tol=1e-5)
    assert math.isclose(loss.item(), 0.6 * kl, rel_tol=1e-5)
    # D=3 identical dims: 3x the KL, above 1 free nat
    post3 = (torch.zeros(1, 3), torch.ones(1, 3))
    prior3 = (torch.ones(1, 3), torch.full((1, 3), 2.0))
    loss, parts = dists.kl_balance(post3, prior3, 0.5, 0.1, free_nats=0.5)
    assert math.isclose(parts["dyn"].item(), 3 * kl, rel_tol=1e-5)


def test_gaussian_helpers_match_torch_distributions():
    torch.manual_seed(0)
    m, s, x = torch.randn(5, 3), torch.rand(5, 3) + 0.1, torch.randn(5, 3)
    ref = torch.distributions.Normal(m, s)
    assert torch.allclose(dists.normal_log_prob(x, m, s), ref.log_prob(x).sum(-1), atol=1e-5)
    assert torch.allclose(dists.normal_entropy(s), ref.entropy().sum(-1), atol=1e-5)
    m2, s2 = torch.randn(5, 3), torch.rand(5, 3) + 0.1
    ref_kl = torch.distributions.kl_divergence(ref, torch.distributions.Normal(m2, s2)).sum(-1)
    assert torch.allclose(dists.normal_kl((m, s), (m2, s2)), ref_kl, atol=1e-5)
    logits, logits2 = torch.randn(4, 6), torch.randn(4, 6)
    c1, c2 = torch.distributions.Categorical(logits=logits), torch.distributions.Categorical(logits=logits2)
    assert torch.allclose(dists.categorical_entropy(logits), c1.entropy(), atol=1e-5)
    assert torch.allclose(dists.categorical_kl(logits, logits2), torch.distributions.kl_divergence(c1, c2), atol=1e-5)


def test_action_distributions():
    torch.manual_seed(0)
    raw = torch.randn(1000, 4) * 3
    mean, std = dists.bounded_normal(raw, 0.1, 1.0)
    assert mean.abs().max() <= 1 and std.min() >= 0.1 and std.max() <= 1.0
    action, x = dists.bounded_normal_sample(mean, std)
    assert action.abs().max() <= 1.0
    mean, std = dists.tanh_normal(raw)
    action, logp = dists.tanh_normal_sample(mean, std)
    assert action.abs().max() <= 1.0
    # log-density of the tanh-transformed sample by change of variables
    u = torch.atanh(action.clamp(-0.999999, 0.999999).double())
    ref = dists.normal_log_prob(u, mean.double(), std.double()) - torch.log1p(-action.double().square()).sum(-1)
    ok = action.abs().max(-1).values < 0.999
    assert torch.allclose(logp.double()[ok], ref[ok], atol=1e-3)


def test_bernoulli_nll():
    logits = torch.tensor([0.0, 2.0, -1.0])
    target = torch.tensor([1.0, 0.0, 1.0])
    want = torch.tensor([math.log(2), math.log1p(math.exp(2)), math.log1p(math.exp(1))])
    assert torch.allclose(dists.bernoulli_nll(logits, target), want, atol=1e-6)
    assert torch.allclose(dists.bernoulli_nll(logits, torch.tensor([True, False, True])), want, atol=1e-6)


def test_symlog_mse():
    pred = torch.tensor([[math.log(2), 0.0]])
    assert torch.allclose(dists.symlog_mse(pred, torch.tensor([[1.0, 0.0]])), torch.zeros(1), atol=1e-6)
    want = torch.tensor([math.log(2) ** 2 + 1])
    assert torch.allclose(dists.symlog_mse(pred, torch.tensor([[0.0, 1.0]]), transform=False), want)


# -- MuZero value transform ---------------------------------------------------------------------
def test_h_transform_hand_values():
    x = torch.tensor([0.0, 3.0, -8.0, 9999.0, 0.25])
    # sign(x)(sqrt(|x|+1) - 1) + 0.001 x
    want = torch.tensor([0.0, 2 - 1 + 0.003, -(3 - 1) - 0.008, 100 - 1 + 9.999, math.sqrt(1.25) - 1 + 0.00025])
    assert torch.allclose(dists.h_transform(x), want, rtol=1e-6, atol=1e-7)
    assert torch.allclose(dists.h_transform(x, eps=0.0)[:3], torch.tensor([0.0, 1.0, -2.0]))
    assert torch.allclose(dists.h_inverse(want), x, rtol=1e-5)


def test_h_inverse_round_trip_wide_range():
    x = torch.cat([-torch.logspace(-6, 6, 3000), torch.zeros(1), torch.logspace(-6, 6, 3000)])
    for eps in (0.001, 0.01, 0.0):
        back = dists.h_inverse(dists.h_transform(x, eps), eps)
        rel = ((back - x).abs() / x.abs().clamp(min=1e-12)).max()
        assert rel < 1e-4, (eps, rel)
    y = torch.linspace(-300, 300, 6001)
    assert torch.allclose(dists.h_transform(dists.h_inverse(y)), y, atol=2e-4, rtol=1e-5)
    # the textbook closed form agrees in float64 where it is accurate
    y64 = torch.tensor([0.5, 3.0, 50.0, 300.0], dtype=torch.float64)
    e = 0.001
    textbook = ((torch.sqrt(1 + 4 * e * (y64 + 1 + e)) - 1) / (2 * e)) ** 2 - 1
    assert torch.allclose(dists.h_inverse(y64), textbook, rtol=1e-9)


def test_h_support_and_twohot_targets():
    bins = dists.h_support(300)
    assert bins.shape == (601,) and bins[0] == -300 and bins[300] == 0 and bins[-1] == 300
    small = dists.h_support(2)
    enc = dists.h_twohot_encode(torch.tensor([3.0, 0.0, -1e6]), small)
    # h(3) = 1.003: 0.997 on bin 1, 0.003 on bin 2; beyond the support: the end bin
    assert torch.allclose(enc, torch.tensor([[0, 0, 0, 0.997, 0.003], [0, 0, 1.0, 0, 0], [1.0, 0, 0, 0, 0]]), atol=1e-6)
    x = torch.tensor([0.0, 0.7, -3.5, 12.0, 150.0, -400.0])
    bins = dists.h_support(25)
    logits = torch.log(dists.h_twohot_encode(x, bins).clamp(min=1e-30))
    assert torch.allclose(dists.h_twohot_mean(logits, bins), x, rtol=1e-4, atol=1e-4)
    target_logits = torch.zeros(6, 51, requires_grad=True)
    loss = dists.h_twohot_loss(target_logits, x, bins)
    assert loss.shape == (6,)
    loss.sum().backward()
    assert torch.allclose(loss, torch.full((6,), math.log(51)), atol=1e-5)  # uniform logits: log K
    with pytest.raises(ValueError, match="support_size"):
        dists.h_support(0)


def test_count_at_most_counts_like_searchsorted_in_both_forms():
    """The compare-and-sum form (taken when compiled) gives searchsorted's integers, ties
    and ends included, for one shared sequence and for one sequence per row."""
    g = torch.Generator().manual_seed(0)
    bins = torch.tensor([-2.0, -1.0, 0.0, 0.0, 1.5, 3.0])
    values = torch.cat([bins, torch.tensor([-5.0, 5.0, 0.7]), torch.randn(50, generator=g) * 3])
    assert torch.equal(dists.count_at_most(bins, values), torch.searchsorted(bins, values, right=True))
    strided = values.view(59, 1).expand(59, 2)[:, 1]  # a non-contiguous view
    assert torch.equal(dists.searchsorted_right(bins, strided), torch.searchsorted(bins, values, right=True))
    cdf = torch.rand(4, 3, 5, generator=g).cumsum(-1)
    u = torch.rand(4, 3, 1, generator=g) * 3
    u[0, 0, 0] = cdf[0, 0, 2]  # a tie counts the equal entry
    got = dists.count_at_most(cdf, u)
    assert got.shape == (4, 3, 1) and got.dtype == torch.int64
    assert torch.equal(got, torch.searchsorted(cdf, u, right=True))
    assert got[0, 0, 0] == 3


@pytest.mark.parametrize("classes", [1, 2, 5, 32, 33])
def test_prefix_sum_is_the_cumulative_sum(classes):
    x = torch.rand(7, 3, classes, generator=torch.Generator().manual_seed(classes))
    torch.testing.assert_close(dists.prefix_sum(x), x.cumsum(-1))


def test_the_fused_forms_draw_the_classes_searchsorted_draws():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(64, 16, 5, generator=g), -1)
    uniform = torch.rand(64, 16, generator=g)
    eager = dists.sample_index(probs, uniform)
    fused = dists.count_at_most(dists.prefix_sum(probs), uniform.unsqueeze(-1)).clamp(max=4).squeeze(-1)
    assert torch.equal(fused, eager)
    assert eager.min() >= 0 and eager.max() <= 4 and len(eager.unique()) == 5
