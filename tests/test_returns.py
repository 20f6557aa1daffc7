"""Return estimators against slow, independent implementations and hand-checked values."""

import math

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


# -- V-trace ----------------------------------------------------------------------------------
from lightning_wm.returns import unroll_steps, vtrace  # noqa: E402


def _slow_vtrace(blogp, tlogp, r, v, boot, g, rho_clip, c_clip, rho_pg_clip, lam):
    """The paper's definition written out for one column (python floats, O(T^2)):
    vs_s = V_s + sum_{t=s}^{T-1} (prod_{i=s}^{t-1} gamma_i c_i) delta_t,
    delta_t = min(rho_clip, rho_t) (r_t + gamma_t V_{t+1} - V_t), c_i = lam * min(c_clip, rho_i),
    adv_s = min(rho_pg_clip, rho_s) (r_s + gamma_s vs_{s+1} - V_s), with V_T = vs_T = boot."""
    import math

    T = len(r)
    rho = [math.exp(tl - bl) for bl, tl in zip(blogp, tlogp)]
    values = list(v) + [boot]
    delta = [min(rho_clip, rho[t]) * (r[t] + g[t] * values[t + 1] - values[t]) for t in range(T)]
    vs = []
    for s in range(T):
        total = values[s]
        for t in range(s, T):
            prod = 1.0
            for i in range(s, t):
                prod *= g[i] * lam * min(c_clip, rho[i])
            total += prod * delta[t]
        vs.append(total)
    vs_next = vs[1:] + [boot]
    adv = [min(rho_pg_clip, rho[s]) * (r[s] + g[s] * vs_next[s] - values[s]) for s in range(T)]
    return vs, adv


def _columns(x):
    return [x[:, b].tolist() for b in range(x.shape[1])]


@pytest.mark.parametrize("lam", [1.0, 0.9])
def test_vtrace_matches_paper_definition(lam):
    torch.manual_seed(3)
    T, B = 9, 4
    blogp = torch.log(torch.rand(T, B, dtype=torch.float64) * 0.9 + 0.05)
    tlogp = torch.log(torch.rand(T, B, dtype=torch.float64) * 0.9 + 0.05)
    reward = torch.randn(T, B, dtype=torch.float64)
    value = torch.randn(T, B, dtype=torch.float64)
    boot = torch.randn(B, dtype=torch.float64)
    # a different gamma per column, an episode end (terminal) inside the unroll of columns 1 and 3
    discount = torch.tensor([0.99, 0.9, 0.8, 0.5], dtype=torch.float64).expand(T, B).clone()
    discount[4, 1] = 0.0
    discount[2, 3] = 0.0
    rho_clip, c_clip, rho_pg_clip = 1.5, 0.8, 1.2
    rho = (tlogp - blogp).exp()
    for clip in (rho_clip, c_clip, rho_pg_clip):  # the thresholds are crossed both ways
        assert (rho > clip).any() and (rho < clip).any()
    vs, adv = vtrace(blogp, tlogp, reward, value, boot, discount, rho_clip, c_clip, rho_pg_clip, lam)
    assert vs.shape == adv.shape == (T, B)
    for b, cols in enumerate(zip(*map(_columns, (blogp, tlogp, reward, value, discount)))):
        bl, tl, r, v, g = cols
        want_vs, want_adv = _slow_vtrace(bl, tl, r, v, boot[b].item(), g, rho_clip, c_clip, rho_pg_clip, lam)
        assert torch.allclose(vs[:, b], torch.tensor(want_vs, dtype=torch.float64), atol=1e-10)
        assert torch.allclose(adv[:, b], torch.tensor(want_adv, dtype=torch.float64), atol=1e-10)


def test_vtrace_hand_values():
    # rho_0 = 2 (clipped to 1), rho_1 = 0.5; V = 1, 2, bootstrap 3; r = 1, 0; gamma 0.9
    # delta_1 = 0.5 (0 + 0.9*3 - 2) = 0.35 -> vs_1 = 2.35
    # delta_0 = 1 (1 + 0.9*2 - 1) = 1.8, c_0 = 1 -> vs_0 = 1 + 1.8 + 0.9 (2.35 - 2) = 3.115
    # adv_1 = 0.5 (0 + 0.9*3 - 2) = 0.35; adv_0 = 1 (1 + 0.9*2.35 - 1) = 2.115
    blogp = torch.log(torch.tensor([[0.25], [0.5]]))
    tlogp = torch.log(torch.tensor([[0.5], [0.25]]))
    vs, adv = vtrace(
        blogp,
        tlogp,
        torch.tensor([[1.0], [0.0]]),
        torch.tensor([[1.0], [2.0]]),
        torch.tensor([3.0]),
        torch.full((2, 1), 0.9),
    )
    assert torch.allclose(vs, torch.tensor([[3.115], [2.35]]))
    assert torch.allclose(adv, torch.tensor([[2.115], [0.35]]))


@pytest.mark.parametrize("lam", [0.0, 0.95, 1.0])
def test_vtrace_on_policy_equals_lambda_return(lam):
    torch.manual_seed(4)
    T, B = 8, 3
    logp = torch.randn(T, B, dtype=torch.float64)
    reward = torch.randn(T, B, dtype=torch.float64)
    value = torch.randn(T + 1, B, dtype=torch.float64)
    discount = 0.95 * (torch.rand(T, B, dtype=torch.float64) > 0.2).double()
    vs, adv = vtrace(logp, logp, reward, value[:-1], value[-1], discount, lambda_=lam)
    assert torch.allclose(vs, lambda_return(reward, value, discount, lam), atol=1e-10)
    next_vs = torch.cat([vs[1:], value[-1:]])
    assert torch.allclose(adv, reward + discount * next_vs - value[:-1], atol=1e-10)
    if lam == 1.0:  # the discounted return to the end of the unroll, bootstrapped there
        assert torch.allclose(vs, nstep_return(reward, value, discount, T), atol=1e-10)


def test_vtrace_has_no_gradient_and_checks_shapes():
    T, B = 4, 2
    args = [torch.randn(T, B, requires_grad=True) for _ in range(4)]
    boot = torch.randn(B, requires_grad=True)
    vs, adv = vtrace(args[0], args[1], args[2], args[3], boot, torch.full((T, B), 0.9))
    assert not vs.requires_grad and not adv.requires_grad
    with pytest.raises(ValueError, match="bootstrap_value"):
        vtrace(*args, torch.randn(T, B), torch.full((T, B), 0.9))
    with pytest.raises(ValueError, match="value"):
        vtrace(args[0], args[1], args[2], torch.randn(T + 1, B), boot, torch.full((T, B), 0.9))
    with pytest.raises(ValueError, match="rho_clip must be > 0"):
        vtrace(*args, boot, torch.full((T, B), 0.9), rho_clip=0.0)


def test_vtrace_huge_ratios_stay_finite():
    blogp = torch.full((3, 1), -200.0)
    tlogp = torch.zeros(3, 1)
    assert torch.isinf((tlogp - blogp).exp()).all()  # rho = e^200 overflows float32 ...
    vs, adv = vtrace(blogp, tlogp, torch.ones(3, 1), torch.zeros(3, 1), torch.zeros(1), torch.full((3, 1), 0.5))
    # ... clipped in log space it is exactly 1: on-policy returns 1 + 0.5 (1 + 0.5 * 1) etc.
    assert torch.allclose(vs, torch.tensor([[1.75], [1.5], [1.0]]))
    assert torch.allclose(adv, torch.tensor([[1.75], [1.5], [1.0]]))


# rows (time-major [T+1, B]) for the unroll helper: column 0 has a terminal episode end at row 2
# and a new episode from row 3; column 1 restarts at row 2 without a last row before it (a
# stream restart) and is truncated at row 4.
ROWS = {
    "reward": torch.tensor([[0.0, 5.0], [1.0, 1.0], [2.0, 0.0], [0.0, 2.0], [3.0, 3.0], [4.0, 0.0]]),
    "is_first": torch.tensor([[1, 0], [0, 0], [0, 1], [1, 0], [0, 0], [0, 1]], dtype=torch.bool),
    "is_last": torch.tensor([[0, 0], [0, 0], [1, 0], [0, 0], [0, 1], [0, 0]], dtype=torch.bool),
    "is_terminal": torch.tensor([[0, 0], [0, 0], [1, 0], [0, 0], [0, 0], [0, 0]], dtype=torch.bool),
}


def test_unroll_steps_hand_values():
    steps = unroll_steps(ROWS["reward"], ROWS["is_first"], ROWS["is_last"], ROWS["is_terminal"], 0.9)
    assert torch.equal(steps.reward, torch.tensor([[1.0, 1.0], [2.0, 0.0], [0.0, 2.0], [3.0, 3.0], [4.0, 0.0]]))
    assert torch.allclose(steps.discount, torch.tensor([[0.9, 0.9], [0.0, 0.9], [0.9, 0.9], [0.9, 0.9], [0.9, 0.9]]))
    assert steps.mask.tolist() == [[True, True], [True, False], [False, True], [True, True], [True, False]]
    with pytest.raises(ValueError, match="is_last"):
        unroll_steps(ROWS["reward"], ROWS["is_first"], ROWS["is_last"][:-1], ROWS["is_terminal"], 0.9)
    with pytest.raises(ValueError, match="T\\+1 >= 2"):
        unroll_steps(*(x[:1] for x in ROWS.values()), 0.9)


def test_vtrace_masked_unroll_equals_separate_episodes():
    """Off-policy V-trace over the rows above equals V-trace run on each episode's piece alone
    (terminal: no bootstrap; truncation and restart: bootstrap from the last row's value);
    the steps out of a last row / into a first row get vs = V and advantage 0."""
    torch.manual_seed(5)
    gamma, lam, clips = 0.9, 0.95, (1.3, 0.7, 1.1)
    steps = unroll_steps(ROWS["reward"], ROWS["is_first"], ROWS["is_last"], ROWS["is_terminal"], gamma)
    T, B = steps.reward.shape
    blogp, tlogp = torch.randn(T, B).double() * 0.5, torch.randn(T, B).double() * 0.5
    values = torch.randn(T + 1, B, dtype=torch.float64)
    vs, adv = vtrace(
        blogp,
        tlogp,
        steps.reward.double(),
        values[:-1],
        values[-1],
        steps.discount.double(),
        *clips,
        lambda_=lam,
        mask=steps.mask,
    )
    # pieces: (column, first step, end step exclusive) of each episode; the piece bootstraps from values[end]
    pieces = [(0, 0, 2), (0, 3, 5), (1, 0, 1), (1, 2, 4)]
    for b, s, e in pieces:
        sl = slice(s, e)
        want_vs, want_adv = _slow_vtrace(
            blogp[sl, b].tolist(),
            tlogp[sl, b].tolist(),
            steps.reward[sl, b].tolist(),
            values[sl, b].tolist(),
            values[e, b].item(),
            steps.discount[sl, b].tolist(),
            *clips,
            lam,
        )
        assert torch.allclose(vs[sl, b], torch.tensor(want_vs, dtype=torch.float64), atol=1e-10)
        assert torch.allclose(adv[sl, b], torch.tensor(want_adv, dtype=torch.float64), atol=1e-10)
    for b, t in [(0, 2), (1, 1), (1, 4)]:  # masked steps
        assert vs[t, b] == values[t, b] and adv[t, b] == 0
    # truncation bootstraps: the last step of column 1's second episode targets r + gamma V(last obs)
    rho3 = min(clips[0], math.exp(tlogp[3, 1] - blogp[3, 1]))
    assert torch.isclose(vs[3, 1], values[3, 1] + rho3 * (3.0 + gamma * values[4, 1] - values[3, 1]))


# -- lambda returns along replayed rows --------------------------------------------------------
from lightning_wm.returns import replay_lambda_return  # noqa: E402


def _slow_replay_targets(r, v, first, term, last, gamma, lam):
    """One column of rows, by episode segments: for each row t with a transition out of it (not
    last, and row t+1 not first), the segment t..e (e = first row > t that ends the episode or
    before which a new one starts, else the final row) and the plain lambda return of that
    segment via _slow_lambda (bootstrap V(s_e), nothing after a terminal s_e)."""
    T = len(r)
    out, mask = [], []
    for t in range(T - 1):
        if last[t] or first[t + 1]:
            out.append(None)
            mask.append(False)
            continue
        e = t + 1
        while e < T - 1 and not last[e] and not first[e + 1]:
            e += 1
        rewards = [r[k] for k in range(t + 1, e + 1)]
        discounts = [gamma * (0.0 if term[k] else 1.0) for k in range(t + 1, e + 1)]
        values = [v[k] for k in range(t, e + 1)]
        out.append(_slow_lambda(rewards, values, discounts, lam)[0])
        mask.append(True)
    return out, mask


def test_replay_lambda_return_matches_per_episode_segments():
    g = torch.Generator().manual_seed(3)
    T = 12
    # column 0: a terminal end at row 4 then a new episode; column 1: a truncated end at row 6;
    # column 2: one long episode; column 3: terminal at 3, truncation at 8, terminal at the final
    # row; column 4: a new episode at row 7 without a last row before it (a restarted stream)
    term = torch.zeros(T, 5, dtype=torch.bool)
    trunc = torch.zeros(T, 5, dtype=torch.bool)
    term[4, 0] = term[3, 3] = term[T - 1, 3] = True
    trunc[6, 1] = trunc[8, 3] = True
    last = term | trunc
    first = torch.zeros_like(last)
    first[1:] = last[:-1]
    first[7, 4] = True
    reward = torch.rand(T, 5, generator=g, dtype=torch.float64)
    reward[first] = 0.0  # row convention: no reward on the first row of an episode
    value = torch.randn(T, 5, generator=g, dtype=torch.float64) * 3
    targets, mask = replay_lambda_return(reward, value, first, last, term, 0.9, 0.8)
    assert targets.shape == mask.shape == (T - 1, 5)
    for b in range(5):
        slow, slow_mask = _slow_replay_targets(
            reward[:, b].tolist(),
            value[:, b].tolist(),
            first[:, b].tolist(),
            term[:, b].tolist(),
            last[:, b].tolist(),
            0.9,
            0.8,
        )
        assert mask[:, b].tolist() == slow_mask
        for t in range(T - 1):
            if slow_mask[t]:
                assert targets[t, b].item() == pytest.approx(slow[t], abs=1e-10), (b, t)
    # hand-checked: the step into a terminal row gets just its reward; into a truncated one,
    # reward + gamma V(s_last); before a restart, reward + gamma V(s)
    assert targets[3, 0].item() == pytest.approx(reward[4, 0].item())
    assert targets[5, 1].item() == pytest.approx(reward[6, 1].item() + 0.9 * value[6, 1].item())
    assert targets[5, 4].item() == pytest.approx(reward[6, 4].item() + 0.9 * value[6, 4].item())
    with pytest.raises(ValueError, match="must have the shape of reward"):
        replay_lambda_return(reward, value[:-1], first, last, term, 0.9, 0.8)
