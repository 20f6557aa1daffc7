"""Return estimators against slow, independent implementations and hand-checked values."""

import pytest
import torch

from lightning_wm.returns import lambda_return, nstep_return

torch.set_num_threads(1)


def _slow_nstep(r, v, g, t, n):
    """n-step return from time t written as an explicit sum (python floats); n <= T - t."""
    total, disc = 0.0, 1.0
    for k in range(n):
        total += disc * r[t + k]
        disc *= g[t + k]
    return total + disc * v[t + n]


def _slow_lambda(r, v, g, lam):
    """G^lambda_t = (1-lam) sum_{n=1}^{N-1} lam^(n-1) G^(n)_t + lam^(N-1) G^(N)_t, N = T - t."""
    T = len(r)
    out = []
    for t in range(T):
        N = T - t
        total = sum((1 - lam) * lam ** (n - 1) * _slow_nstep(r, v, g, t, n) for n in range(1, N))
        total += lam ** (N - 1) * _slow_nstep(r, v, g, t, N)
        out.append(total)
    return out


@pytest.mark.parametrize("lam", [0.0, 0.5, 0.95, 1.0])
def test_lambda_return_matches_mixture_of_nstep_returns(lam):
    torch.manual_seed(0)
    T, B = 7, 3
    reward = torch.randn(T, B, dtype=torch.float64)
    value = torch.randn(T + 1, B, dtype=torch.float64)
    discount = 0.9 * (torch.rand(T, B, dtype=torch.float64) > 0.2).double()  # some terminals
    got = lambda_return(reward, value, discount, lam)
    assert got.shape == (T, B)
    for b in range(B):
        want = _slow_lambda(reward[:, b].tolist(), value[:, b].tolist(), discount[:, b].tolist(), lam)
        assert torch.allclose(got[:, b], torch.tensor(want, dtype=torch.float64), atol=1e-10)


def test_lambda_return_hand_values():
    # T=2, gamma 0.5, lambda 0.5: G1 = 1 + 0.5*4 = 3; G0 = 2 + 0.5*(0.5*V1 + 0.5*G1) = 2 + 0.5*(1 + 1.5) = 3.25
    reward = torch.tensor([[2.0], [1.0]])
    value = torch.tensor([[0.0], [2.0], [4.0]])
    discount = torch.full((2, 1), 0.5)
    got = lambda_return(reward, value, discount, 0.5)
    assert torch.allclose(got, torch.tensor([[3.25], [3.0]]))
    # lambda=0: one-step targets; a terminal transition ignores the bootstrap
    got0 = lambda_return(reward, value, torch.tensor([[0.5], [0.0]]), 0.0)
    assert torch.allclose(got0, torch.tensor([[3.0], [1.0]]))


def test_lambda_return_gradient_and_shape_errors():
    reward = torch.zeros(4, 2, requires_grad=True)
    value = torch.zeros(5, 2, requires_grad=True)
    lambda_return(reward, value, torch.ones(4, 2), 0.9).sum().backward()
    assert reward.grad is not None and value.grad is not None
    assert value.grad[-1].abs().sum() > 0
    with pytest.raises(ValueError, match="value must be"):
        lambda_return(torch.zeros(4, 2), torch.zeros(4, 2), torch.ones(4, 2), 0.9)


@pytest.mark.parametrize("n", [1, 3, 10])
def test_nstep_return_matches_slow_sum(n):
    torch.manual_seed(1)
    T, B = 6, 2
    reward = torch.randn(T, B, dtype=torch.float64)
    value = torch.randn(T + 1, B, dtype=torch.float64)
    discount = 0.8 * (torch.rand(T, B, dtype=torch.float64) > 0.3).double()
    got = nstep_return(reward, value, discount, n)
    for b in range(B):
        r, v, g = reward[:, b].tolist(), value[:, b].tolist(), discount[:, b].tolist()
        want = [_slow_nstep(r, v, g, t, min(n, T - t)) for t in range(T)]
        assert torch.allclose(got[:, b], torch.tensor(want, dtype=torch.float64), atol=1e-10)


def test_nstep_full_horizon_equals_lambda_one():
    torch.manual_seed(2)
    reward, value, discount = torch.randn(5, 4), torch.randn(6, 4), torch.rand(5, 4)
    full = nstep_return(reward, value, discount, 5)
    assert torch.allclose(full, lambda_return(reward, value, discount, 1.0), atol=1e-5)
