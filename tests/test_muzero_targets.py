"""MuZero targets over replayed windows: n-step values with episode ends, truncation, the write
head and Monte Carlo; rewards, policies, game over and unroll actions."""

from __future__ import annotations

import pytest
import torch

from lightning_wm.agents.muzero.targets import bootstrap_rows, muzero_targets
from lightning_wm.returns import window_nstep_values

torch.set_num_threads(1)
G = 0.9


def slow_values(reward, value, is_terminal, valid, discount, n, positions):
    """Per-window, per-position loops (one window: lists)."""
    w = len(reward)
    e = max(j for j in range(w) if valid[j])
    out, mask = [], []
    for p in range(positions):
        if p > e:
            out.append(0.0)
            mask.append(bool(is_terminal[e]))
            continue
        m = e if n == -1 else min(p + n, e)
        z = sum(discount ** (i - p - 1) * reward[i] for i in range(p + 1, m + 1))
        if not is_terminal[m]:
            z += discount ** (m - p) * value[m]
        out.append(z)
        mask.append(True)
    return out, mask


def window(length, end=None, terminal=False, head=None):
    """One hand-built window: reward[j] = j + 1 (row 0 has 0), value[j] = 10 * (j + 1); an episode
    end at row ``end`` (terminal or truncated) or the write head after row ``head``."""
    reward = [0.0] + [float(j + 1) for j in range(1, length)]
    value = [10.0 * (j + 1) for j in range(length)]
    last = end if end is not None else (head if head is not None else length - 1)
    valid = [j <= last for j in range(length)]
    is_last = [end is not None and j == end for j in range(length)]
    is_terminal = [terminal and j == end for j in range(length)]
    return reward, value, is_last, is_terminal, valid


def run(reward, value, is_terminal, valid, n, positions):
    t = lambda x, dt=torch.float64: torch.tensor(x, dtype=dt).unsqueeze(1)  # noqa: E731 - [W, 1]
    target, mask = window_nstep_values(
        t(reward), t(value), t(is_terminal, torch.bool), t(valid, torch.bool), G, n, positions
    )
    return target[:, 0].tolist(), mask[:, 0].tolist()


def test_no_episode_end_hand_values():
    reward, value, _, term, valid = window(7)
    target, mask = run(reward, value, term, valid, n=3, positions=4)
    # z_0 = r1 + g r2 + g^2 r3 + g^3 v3 with r_j = j + 1, v_j = 10 (j + 1)
    assert target[0] == pytest.approx(2 + G * 3 + G**2 * 4 + G**3 * 40)
    assert target[3] == pytest.approx(5 + G * 6 + G**2 * 7 + G**3 * 70)
    assert mask == [True] * 4


def test_termination_inside_the_window():
    reward, value, _, term, valid = window(7, end=2, terminal=True)
    target, mask = run(reward, value, term, valid, n=3, positions=4)
    assert target == pytest.approx([2 + G * 3, 3, 0.0, 0.0])  # no bootstrap from the terminal row
    assert mask == [True, True, True, True]  # past a termination: value 0, trained


def test_truncation_bootstraps_and_masks_past_the_end():
    reward, value, _, term, valid = window(7, end=2, terminal=False)
    target, mask = run(reward, value, term, valid, n=3, positions=4)
    assert target[:3] == pytest.approx([2 + G * 3 + G**2 * 30, 3 + G * 30, 30])
    assert mask == [True, True, True, False]


def test_write_head_bootstraps_from_the_last_written_row():
    reward, value, _, term, valid = window(7, head=4)
    target, mask = run(reward, value, term, valid, n=5, positions=3)
    assert target[0] == pytest.approx(2 + G * 3 + G**2 * 4 + G**3 * 5 + G**4 * 50)
    assert target[2] == pytest.approx(4 + G * 5 + G**2 * 50)
    assert mask == [True] * 3


def test_monte_carlo_to_the_episode_end():
    reward, value, _, term, valid = window(8, end=5, terminal=True)
    target, _ = run(reward, value, term, valid, n=-1, positions=3)
    assert target[0] == pytest.approx(sum(G ** (i - 1) * (i + 1) for i in range(1, 6)))
    reward, value, _, term, valid = window(8, end=5, terminal=False)
    target, _ = run(reward, value, term, valid, n=-1, positions=3)
    assert target[1] == pytest.approx(sum(G ** (i - 2) * (i + 1) for i in range(2, 6)) + G**4 * 60)


@pytest.mark.parametrize("n", [1, 3, 5, -1])
def test_matches_slow_loops_on_random_windows(n):
    g = torch.Generator().manual_seed(n + 10)
    w, b, positions = 9, 40, 4
    reward = torch.randn(w, b, generator=g, dtype=torch.float64)
    value = torch.randn(w, b, generator=g, dtype=torch.float64)
    last = torch.randint(0, w, (b,), generator=g)
    valid = torch.arange(w).unsqueeze(1) <= last
    is_terminal = (torch.arange(w).unsqueeze(1) == last) & (torch.rand(b, generator=g) < 0.5)
    target, mask = window_nstep_values(reward, value, is_terminal, valid, G, n, positions)
    for j in range(b):
        want, want_mask = slow_values(
            reward[:, j].tolist(),
            value[:, j].tolist(),
            is_terminal[:, j].tolist(),
            valid[:, j].tolist(),
            G,
            n,
            positions,
        )
        assert target[:, j].tolist() == pytest.approx(want)
        assert mask[:, j].tolist() == want_mask


def test_one_td_per_window_matches_each_window_alone():
    g = torch.Generator().manual_seed(3)
    w, b = 9, 12
    reward = torch.randn(w, b, generator=g, dtype=torch.float64)
    value = torch.randn(w, b, generator=g, dtype=torch.float64)
    last = torch.randint(0, w, (b,), generator=g)
    valid = torch.arange(w).unsqueeze(1) <= last
    is_terminal = (torch.arange(w).unsqueeze(1) == last) & (torch.rand(b, generator=g) < 0.5)
    n = torch.tensor([1, 2, 3, -1, 5, 1, 4, 8, -1, 2, 3, 6])
    target, mask = window_nstep_values(reward, value, is_terminal, valid, G, n, 4)
    for j in range(b):
        alone, alone_mask = window_nstep_values(
            reward[:, j : j + 1], value[:, j : j + 1], is_terminal[:, j : j + 1], valid[:, j : j + 1], G, int(n[j]), 4
        )
        torch.testing.assert_close(target[:, j : j + 1], alone, rtol=0, atol=1e-12)
        assert torch.equal(mask[:, j : j + 1], alone_mask)
    with pytest.raises(ValueError, match="one per window"):
        window_nstep_values(reward, value, is_terminal, valid, G, n[:3], 4)


def test_bad_arguments():
    x = torch.zeros(4, 2)
    ok = torch.ones(4, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="td_steps"):
        window_nstep_values(x, x, ~ok, ok, G, 0, 2)
    with pytest.raises(ValueError, match="num_positions"):
        window_nstep_values(x, x, ~ok, ok, G, 2, 5)
    with pytest.raises(ValueError, match="one shape"):
        window_nstep_values(x, x[:3], ~ok, ok, G, 2, 2)


# -- the MuZero assembly ---------------------------------------------------------------------------
def batch_of(windows, actions=3):
    """Stack hand-built windows into a batch-major window dict."""
    cols = {k: [] for k in ("reward", "root_value", "is_last", "is_terminal", "mask")}
    for reward, value, is_last, is_terminal, valid in windows:
        for k, v in zip(cols, (reward, value, is_last, is_terminal, valid)):
            cols[k].append(v)
    out = {k: torch.tensor(v) for k, v in cols.items()}
    b, w = out["mask"].shape
    out["action"] = torch.arange(w).repeat(b, 1) % actions  # action j % A at row j
    probs = torch.zeros(b, w, actions)
    probs[..., 0] = 0.7
    probs[..., 1] = 0.3
    out["visit_probs"] = probs
    out["action"] = torch.where(out["is_last"], torch.zeros_like(out["action"]), out["action"])
    return out


def test_muzero_targets_with_termination_truncation_and_running_episode():
    k, n = 4, 2
    w = k + n + 1
    batch = batch_of([window(w, end=2, terminal=True), window(w, end=2, terminal=False), window(w)])
    t = muzero_targets(batch, num_unroll_steps=k, td_steps=n, discount=G)
    # values
    assert t.value[0].tolist() == pytest.approx([2 + G * 3, 3, 0, 0, 0])
    assert t.value_mask.tolist() == [[True] * 5, [True, True, True, False, False], [True] * 5]
    assert t.value[2, 1].item() == pytest.approx(3 + G * 4 + G**2 * 40)
    # rewards: step 0 has none; past a termination 0; past a truncation unknown
    assert t.reward[0].tolist() == [0, 2, 3, 0, 0]
    assert t.reward_mask.tolist() == [[False] + [True] * 4, [False, True, True, False, False], [False] + [True] * 4]
    # policy: stored where an action was taken; uniform at and past a termination; masked past a truncation
    assert t.policy[0, 1].tolist() == pytest.approx([0.7, 0.3, 0.0])
    assert t.policy[0, 2].tolist() == pytest.approx([1 / 3] * 3) and t.policy[0, 4].tolist() == pytest.approx(
        [1 / 3] * 3
    )
    assert t.policy_mask.tolist() == [[True] * 5, [True, True, False, False, False], [True] * 5]
    masked = muzero_targets(batch, num_unroll_steps=k, td_steps=n, discount=G, policy_after_end="mask")
    assert masked.policy_mask[0].tolist() == [True, True, False, False, False]
    # game over: the terminal state and the absorbing ones after it
    assert t.game_over.tolist() == [[False, False, True, True, True], [False] * 5, [False] * 5]
    assert t.game_over_mask.tolist() == [[True] * 5, [True, True, True, False, False], [True] * 5]
    # actions: rows 0, 1 are real (action j % 3); afterwards the last real one is repeated
    assert t.actions.tolist() == [[0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 2, 0]]


def test_random_actions_after_the_end_and_explicit_values():
    k, n = 4, 2
    batch = batch_of([window(k + n + 1, end=1, terminal=True)] * 64)
    t = muzero_targets(
        batch,
        num_unroll_steps=k,
        td_steps=n,
        discount=G,
        random_action_after_episode_end=True,
        generator=torch.Generator().manual_seed(0),
    )
    assert (t.actions[:, 0] == 0).all()  # the real one
    after = t.actions[:, 1:]
    assert after.min() >= 0 and after.max() <= 2 and len(after.unique()) == 3
    zero = torch.zeros(64, k + n + 1)
    truncated = batch_of([window(k + n + 1, end=3, terminal=False)])
    with_value = muzero_targets(truncated, num_unroll_steps=k, td_steps=n, discount=G, value=zero[:1] + 5.0)
    assert with_value.value[0, 3].item() == pytest.approx(5.0)  # bootstraps from the given value
    with pytest.raises(ValueError, match="too short"):
        muzero_targets(truncated, num_unroll_steps=9, td_steps=n, discount=G)
    with pytest.raises(ValueError, match="policy_after_end"):
        muzero_targets(truncated, num_unroll_steps=k, td_steps=n, discount=G, policy_after_end="zero")


def test_targets_from_real_windows_of_the_replay_buffer():
    """Episodes through the ReplayBuffer and WindowSampler: every sampled window's value targets
    equal a direct computation on the episode list (termination, truncation, running episode)."""
    import numpy as np

    from lightning_wm.data.replay import ReplayBuffer
    from lightning_wm.data.samplers import WindowSampler

    k, n, actions = 3, 2, 3
    # (length in rows, terminated): the last one is still running (no last row yet)
    episodes = [(5, True), (4, False), (6, None)]
    rows = []
    for length, terminated in episodes:
        for j in range(length):
            last = terminated is not None and j == length - 1
            rows.append(
                {
                    "obs": np.array([len(rows)], np.float32),
                    "reward": np.float32(0.0 if j == 0 else len(rows) % 7),
                    "is_first": j == 0,
                    "is_last": last,
                    "is_terminal": bool(last and terminated),
                    "action": np.int64(0 if last else len(rows) % actions),
                    "root_value": np.float32(len(rows) * 0.5),
                    "visit_probs": np.full(actions, 1.0 / actions, np.float32),
                }
            )
    buffer = ReplayBuffer(64, 1, seed=0)
    for row in rows:
        buffer.add({key: np.asarray(v)[None] for key, v in row.items()})
    batch = WindowSampler(k, n).sample(buffer, 64)
    t = muzero_targets(batch, num_unroll_steps=k, td_steps=n, discount=G)
    assert (~t.value_mask).any() and t.game_over.any()  # windows past a truncation and a termination
    bounds, start = [], 0
    for length, terminated in episodes:
        bounds.append((start, start + length - 1, terminated))
        start += length
    for b, pos in enumerate(batch["index"].tolist()):
        first, last, terminated = next(x for x in bounds if x[0] <= pos <= x[1])
        for step in range(k + 1):
            p = pos + step
            if p > last:
                assert t.value_mask[b, step] == bool(terminated)
                continue
            m = min(p + n, last)
            want = sum(G ** (i - p - 1) * rows[i]["reward"] for i in range(p + 1, m + 1))
            if not (m == last and terminated):
                want += G ** (m - p) * rows[m]["root_value"]
            assert t.value_mask[b, step]
            assert t.value[b, step].item() == pytest.approx(want, rel=1e-5), (pos, step)


def test_bootstrap_rows_are_the_rows_the_values_are_read_from():
    valid = torch.tensor(
        [
            [1, 1, 1, 1, 1, 1, 1],  # e = 6
            [1, 1, 1, 0, 0, 0, 0],  # e = 2
            [1, 1, 1, 1, 1, 0, 0],
        ],
        dtype=torch.bool,
    )  # e = 4, Monte Carlo
    rows = bootstrap_rows(valid, torch.tensor([2, 3, -1]), 3)
    assert rows.long().tolist() == [
        [0, 0, 1, 1, 1, 0, 0],  # p = 0, 1, 2 -> rows 2, 3, 4
        [0, 0, 1, 0, 0, 0, 0],  # every position bootstraps from e = 2
        [0, 0, 0, 0, 1, 0, 0],
    ]  # Monte Carlo: e
    # against window_nstep_values: changing the value of any other row changes no target
    g = torch.Generator().manual_seed(0)
    reward = torch.randn(7, 3, generator=g, dtype=torch.float64)
    value = torch.randn(7, 3, generator=g, dtype=torch.float64)
    td = torch.tensor([2, 3, -1])
    target, _ = window_nstep_values(reward, value, torch.zeros(7, 3, dtype=torch.bool), valid.t(), G, td, 3)
    other = torch.where(rows.t(), value, value + 100.0)
    again, _ = window_nstep_values(reward, other, torch.zeros(7, 3, dtype=torch.bool), valid.t(), G, td, 3)
    torch.testing.assert_close(target, again)
