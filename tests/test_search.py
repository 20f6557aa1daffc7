"""Batched MCTS (lightning_wm.search) against a slow per-node reference on toy models."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from lightning_wm.search import (
    PolicyOutput,
    Root,
    SearchSettings,
    TemperatureSchedule,
    considered_visit_sequence,
    dirichlet_noise,
    gumbel_muzero_policy,
    muzero_policy,
    sample_gamma,
    sample_gumbel,
    select_action,
)

from support.mcts_reference import reference_search

torch.set_num_threads(1)


class TableModel:
    """A deterministic toy model over integer state ids: ``next_id [S, A]``, ``reward [S, A]``,
    ``logits [S, A]``, ``value [S]`` (float64)."""

    def __init__(self, next_id: torch.Tensor, reward: torch.Tensor, logits: torch.Tensor, value: torch.Tensor) -> None:
        self.next_id, self.reward_t = next_id.long(), reward.double()
        self.logits, self.value_t = logits.double(), value.double()
        self.prior = torch.softmax(self.logits, -1)

    def recurrent_fn(self, state: torch.Tensor, action: torch.Tensor):
        nxt = self.next_id[state, action]
        return nxt, self.reward_t[state, action], self.logits[nxt], self.value_t[nxt]

    def step(self, state: int, action: int):
        nxt = int(self.next_id[state, action])
        return nxt, float(self.reward_t[state, action]), self.prior[nxt].tolist(), float(self.value_t[nxt])

    def roots(self, ids: list[int]):
        ids_t = torch.tensor(ids)
        return ids_t, self.logits[ids_t], self.value_t[ids_t]


SETTING_NAMES = {"num_simulations", "pb_c_init", "pb_c_base", "dirichlet_alpha", "exploration_fraction"}
SETTING_NAMES |= {"max_num_considered_actions", "unvisited_q", "compile"}


def policy(
    recurrent_fn, root, *, discount: float, gumbel: bool = False, gumbel_scale: float = 1.0, **kw
) -> PolicyOutput:
    """:func:`muzero_policy` or :func:`gumbel_muzero_policy` with the settings among ``kw`` (the
    pseudocode's ``unvisited_q: zero`` and alpha 0.3 unless given; on the CPU) and the rest as
    the policy's arguments."""
    named = {k: kw.pop(k) for k in list(kw) if k in SETTING_NAMES}
    settings = SearchSettings(**{"unvisited_q": "zero", "dirichlet_alpha": 0.3, **named})
    if gumbel:
        kw.pop("temperature", None)
        return gumbel_muzero_policy(
            recurrent_fn, Root(*root), settings, discount=discount, gumbel_scale=gumbel_scale, **kw
        )
    return muzero_policy(recurrent_fn, Root(*root), settings, discount=discount, **kw)


def random_model(num_states: int = 300, num_actions: int = 3, seed: int = 0, reward_scale: float = 1.0) -> TableModel:
    g = torch.Generator().manual_seed(seed)
    return TableModel(
        torch.randint(0, num_states, (num_states, num_actions), generator=g),
        torch.randn(num_states, num_actions, generator=g, dtype=torch.float64) * reward_scale,
        torch.randn(num_states, num_actions, generator=g, dtype=torch.float64) * 1.5,
        torch.randn(num_states, generator=g, dtype=torch.float64),
    )


def bandit_model(arm_rewards: list[float]) -> TableModel:
    """Root 0; arm ``a`` pays ``arm_rewards[a]`` and leads to an absorbing state (reward 0)."""
    a = len(arm_rewards)
    s = a + 2
    next_id = torch.full((s, a), s - 1)
    next_id[0] = torch.arange(1, a + 1)
    reward = torch.zeros(s, a, dtype=torch.float64)
    reward[0] = torch.tensor(arm_rewards, dtype=torch.float64)
    return TableModel(next_id, reward, torch.zeros(s, a), torch.zeros(s))


def delayed_model(depth: int = 3, max_depth: int = 7) -> TableModel:
    """Binary tree of histories (heap ids, root 1); reward 1 only for the action sequence
    ``1, 1, ..., 1`` (``depth`` times), 0 everywhere else; uniform prior, zero values."""
    size = 2 ** (max_depth + 1)
    next_id = torch.zeros(size, 2, dtype=torch.long)
    for i in range(1, size // 2):
        next_id[i] = torch.tensor([2 * i, 2 * i + 1])
    reward = torch.zeros(size, 2, dtype=torch.float64)
    reward[2**depth - 1, 1] = 1.0  # ids 1 -> 3 -> 7 -> ... follow action 1
    return TableModel(next_id, reward, torch.zeros(size, 2), torch.zeros(size))


def run_both(
    model: TableModel,
    ids: list[int],
    legal: torch.Tensor | None = None,
    explore: bool = True,
    gumbel: bool = False,
    seed: int = 0,
    **kw,
):
    state, logits, value = model.roots(ids)
    out = policy(
        model.recurrent_fn,
        (state, logits, value),
        legal_actions_mask=legal,
        explore=explore,
        gumbel=gumbel,
        generator=torch.Generator().manual_seed(seed),
        **kw,
    )
    noise = None
    if gumbel:
        scale = kw.get("gumbel_scale", 1.0) if explore else 0.0
        noise = sample_gumbel(logits.shape, torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    refs = []
    ref_kw = {
        k: v
        for k, v in kw.items()
        if k not in ("dirichlet_alpha", "exploration_fraction", "gumbel_scale", "temperature", "compile")
    }
    for b, i in enumerate(ids):
        refs.append(
            reference_search(
                model.step,
                i,
                out.root_prior[b].tolist(),
                float(value[b]),
                legal=None if legal is None else legal[b].tolist(),
                gumbel=None if noise is None else noise[b].tolist(),
                **ref_kw,
            )
        )
    return out, refs


def assert_match(out, refs) -> None:
    for b, ref in enumerate(refs):
        assert out.visit_counts[b].tolist() == ref["visit_counts"], f"tree {b}"
        assert out.root_value[b].item() == pytest.approx(ref["root_value"], rel=1e-9, abs=1e-9)
        assert out.q_values[b].tolist() == pytest.approx(ref["q_values"], rel=1e-9, abs=1e-9)
        assert out.max_depth[b].item() == ref["max_depth"]
        if "action" in ref:
            assert out.action[b].item() == ref["action"]
            assert out.visit_probs[b].tolist() == pytest.approx(ref["policy"], rel=1e-9, abs=1e-12)


# -- PUCT against the reference -------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("discount", [0.997, 0.5])
@pytest.mark.parametrize("num_actions", [3, 2])
def test_puct_matches_reference_on_random_models(seed, discount, num_actions):
    model = random_model(seed=seed, num_actions=num_actions)
    out, refs = run_both(model, [0, 5, 17, 42, 99, 123], num_simulations=40, discount=discount, seed=seed)
    assert_match(out, refs)
    assert (out.visit_counts.sum(-1) == 40).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("num_actions", [3, 2])
def test_puct_with_the_mean_q_for_unvisited_children_matches_reference(seed, num_actions):
    model = random_model(seed=seed, num_actions=num_actions)
    out, refs = run_both(
        model, [0, 5, 17, 42, 99, 123], num_simulations=40, discount=0.997, seed=seed, unvisited_q="mean"
    )
    assert_match(out, refs)
    zero, _ = run_both(model, [0, 5, 17, 42, 99, 123], num_simulations=40, discount=0.997, seed=seed)
    # the option changes the search (the root's visits, or the trees below)
    assert not (torch.equal(out.visit_counts, zero.visit_counts) and torch.equal(out.max_depth, zero.max_depth))
    with pytest.raises(ValueError, match="unvisited_q"):
        run_both(model, [0], num_simulations=4, discount=0.9, unvisited_q="parent")


def test_mean_q_tries_other_actions_where_every_value_is_alike():
    """Two actions, reward 1 everywhere, a prior of 0.9 / 0.1 everywhere: with 0 for unvisited
    children every node keeps descending into its first child (Q_norm 1 against 0), so 50
    simulations build one chain 50 deep and the root never tries action 1; with the mean Q of the
    visited siblings an untried action counts as an average one, both are tried and the tree
    branches."""
    size = 64
    next_id = torch.stack([torch.arange(size) * 2 % size, (torch.arange(size) * 2 + 1) % size], 1)
    model = TableModel(
        next_id,
        torch.ones(size, 2, dtype=torch.float64),
        torch.log(torch.tensor([[0.9, 0.1]])).expand(size, 2).clone(),
        torch.full((size,), 50.0),
    )
    runs = {}
    for rule in ("zero", "mean"):
        out, refs = run_both(model, [1], explore=False, num_simulations=50, discount=0.997, unvisited_q=rule)
        assert_match(out, refs)
        runs[rule] = (out.visit_counts[0].tolist(), int(out.max_depth[0]))
    assert runs["zero"] == ([50.0, 0.0], 50)
    assert runs["mean"][0][1] >= 1 and runs["mean"][1] < 40, runs


def test_puct_without_noise_matches_reference_and_uses_the_plain_prior():
    model = random_model(seed=3, num_actions=4)
    out, refs = run_both(model, [1, 2, 3], explore=False, num_simulations=30, discount=0.9)
    assert_match(out, refs)
    _, logits, _ = model.roots([1, 2, 3])
    assert torch.allclose(out.root_prior, torch.softmax(logits, -1))
    assert torch.equal(out.action, out.visit_counts.argmax(-1))


def test_bandit_best_arm_gets_most_visits():
    model = bandit_model([0.1, 0.5, 0.9, 0.3])
    out, refs = run_both(model, [0, 0], explore=False, num_simulations=50, discount=0.997)
    assert_match(out, refs)
    assert out.action.tolist() == [2, 2]
    assert out.visit_counts[0, 2] == out.visit_counts[0].max()
    # Q of an arm = its reward + discount * 0: exactly the arm's reward once visited
    visited = out.visit_counts[0] > 0
    assert torch.allclose(out.q_values[0][visited], torch.tensor([0.1, 0.5, 0.9, 0.3], dtype=torch.float64)[visited])


@pytest.mark.parametrize("discount", [1.0, 0.5])
def test_delayed_reward_found_and_discounted(discount):
    model = delayed_model(depth=3)
    out, refs = run_both(model, [1], explore=False, num_simulations=80, discount=discount)
    assert_match(out, refs)
    assert out.action.item() == 1
    assert out.q_values[0, 1] > out.q_values[0, 0] == 0
    assert out.q_values[0, 1] <= discount**2 + 1e-12  # the reward is 3 steps away


def test_hand_checked_chain_values():
    """One action, a chain: rewards r1..r3, values v0..v3; three simulations expand depths 1..3."""
    r = [0.0, 1.0, -2.0, 0.5]
    v = [0.3, 2.0, 1.0, -1.0]
    next_id = torch.tensor([[1], [2], [3], [3]])
    reward = torch.tensor([[r[1]], [r[2]], [r[3]], [0.0]], dtype=torch.float64)
    model = TableModel(next_id, reward, torch.zeros(4, 1), torch.tensor(v, dtype=torch.float64))
    g = 0.9
    out = policy(
        model.recurrent_fn,
        (torch.tensor([0]), torch.zeros(1, 1, dtype=torch.float64), torch.tensor([v[0]], dtype=torch.float64)),
        num_simulations=3,
        discount=g,
        explore=False,
    )
    returns = [r[1] + g * v[1], r[1] + g * (r[2] + g * v[2]), r[1] + g * (r[2] + g * (r[3] + g * v[3]))]
    assert out.root_value.item() == pytest.approx((v[0] + sum(returns)) / 4)
    child_value = (v[1] + (r[2] + g * v[2]) + (r[2] + g * (r[3] + g * v[3]))) / 3
    assert out.q_values[0, 0].item() == pytest.approx(r[1] + g * child_value)
    assert out.visit_counts.tolist() == [[3.0]]
    assert out.max_depth.item() == 3


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_one_action_chain_reaches_the_full_depth(mode):
    """With one action every simulation extends a chain, so the last leaf sits at depth N: its path
    fills the whole stored width (N + 1 = 38 entries, not a power of two) and the returns along it
    are discounted over all 37 steps (checked by the reference)."""
    model = random_model(num_states=50, num_actions=1, seed=3)
    out, refs = run_both(model, [0, 7, 21], explore=False, num_simulations=37, discount=0.97, unvisited_q=mode)
    assert_match(out, refs)
    assert out.max_depth.tolist() == [37, 37, 37]


def test_legal_mask_applies_at_the_root_only():
    model = random_model(seed=4, num_actions=4)
    legal = torch.tensor([[True, False, True, False], [False, False, False, True], [True, True, True, True]])
    out, refs = run_both(model, [7, 8, 9], legal=legal, num_simulations=30, discount=0.95)
    assert_match(out, refs)
    assert (out.visit_counts[~legal] == 0).all()
    assert (out.root_prior[~legal] == 0).all()
    assert out.action[1].item() == 3
    assert (out.max_depth > 1).all()  # deeper nodes use every action


def test_dict_state_and_float32():
    model = random_model(seed=5)

    def rec(state, action):
        nxt, r, lg, v = model.recurrent_fn(state["id"], action)
        return {"id": nxt, "twice": 2 * nxt}, r.float(), lg.float(), v.float()

    ids = torch.tensor([3, 4])
    out = policy(
        rec,
        ({"id": ids, "twice": 2 * ids}, model.logits[ids].float(), model.value_t[ids].float()),
        num_simulations=20,
        discount=0.99,
        explore=False,
    )
    ref = policy(
        model.recurrent_fn,
        (ids, model.logits[ids], model.value_t[ids]),
        num_simulations=20,
        discount=0.99,
        explore=False,
    )
    assert out.root_value.dtype == torch.float32
    # outputs are plain tensors (the search runs in inference mode): usable in a graph
    assert not any(x.is_inference() for x in (out.action, out.visit_probs, out.root_value, out.q_values))
    w = torch.ones(2, requires_grad=True)
    (w * out.root_value).sum().backward()
    assert torch.equal(out.visit_counts.double(), ref.visit_counts)


def test_one_simulation_and_bad_inputs():
    model = random_model(seed=6)
    state, logits, value = model.roots([1, 2])
    out = policy(model.recurrent_fn, (state, logits, value), num_simulations=1, discount=0.9, explore=False)
    assert out.visit_counts.sum().item() == 2 and out.max_depth.tolist() == [1, 1]
    with pytest.raises(ValueError, match="num_simulations"):
        policy(model.recurrent_fn, (state, logits, value), num_simulations=0, discount=0.9)
    for gumbel in (False, True):
        with pytest.raises(ValueError, match="root_value"):
            policy(model.recurrent_fn, (state, logits, value[:1]), num_simulations=2, discount=0.9, gumbel=gumbel)
        with pytest.raises(ValueError, match="root logits must be"):
            policy(model.recurrent_fn, (state, logits[0], value), num_simulations=2, discount=0.9, gumbel=gumbel)
        with pytest.raises(ValueError, match="without any legal"):
            policy(
                model.recurrent_fn,
                (state, logits, value),
                num_simulations=2,
                discount=0.9,
                gumbel=gumbel,
                legal_actions_mask=torch.zeros(2, 3, dtype=torch.bool),
            )


# -- noise and action selection -------------------------------------------------------------------
def test_dirichlet_noise_is_reproducible_masked_and_mixed():
    legal = torch.tensor([[True, True, False, True]] * 2000)
    a = dirichlet_noise(0.3, legal, torch.Generator().manual_seed(1))
    b = dirichlet_noise(0.3, legal, torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    assert torch.allclose(a.sum(-1), torch.ones(2000))
    assert (a[:, 2] == 0).all()
    assert torch.allclose(a[:, [0, 1, 3]].mean(0), torch.full((3,), 1 / 3), atol=0.03)
    # Dir(alpha) over k actions: Var = (1/k)(1 - 1/k) / (k alpha + 1)
    assert a[:, 0].var().item() == pytest.approx((1 / 3) * (2 / 3) / (3 * 0.3 + 1), rel=0.15)
    model = random_model(seed=7)
    state, logits, value = model.roots([1])
    out = policy(
        model.recurrent_fn,
        (state, logits, value),
        num_simulations=4,
        discount=0.9,
        generator=torch.Generator().manual_seed(5),
        exploration_fraction=0.25,
    )
    noise = dirichlet_noise(0.3, torch.ones(1, 3, dtype=torch.bool), torch.Generator().manual_seed(5)).double()
    assert torch.allclose(out.root_prior, 0.75 * torch.softmax(logits, -1) + 0.25 * noise)


def test_sample_gamma_moments():
    g = torch.Generator().manual_seed(0)
    for alpha in (0.3, 1.0, 4.0):
        x = sample_gamma(torch.full((20000,), alpha), g)
        assert x.mean().item() == pytest.approx(alpha, rel=0.05)
        assert x.var().item() == pytest.approx(alpha, rel=0.1)


def test_select_action_temperature():
    counts = torch.tensor([[1.0, 3.0]]).expand(8000, 2)
    g = torch.Generator().manual_seed(0)
    assert select_action(counts, explore=True, temperature=1.0, generator=g).float().mean().item() == pytest.approx(
        0.75, abs=0.02
    )
    assert select_action(counts, explore=True, temperature=0.5, generator=g).float().mean().item() == pytest.approx(
        0.9, abs=0.015
    )
    assert (select_action(counts, explore=True, temperature=0.0) == 1).all()
    assert (select_action(torch.tensor([[2.0, 2.0, 1.0]]), explore=False) == 0).all()  # ties: lowest index


def test_temperature_schedule():
    paper = TemperatureSchedule()
    assert [paper(0), paper(499_999), paper(500_000), paper(749_999), paper(750_000), paper(10**7)] == [
        1.0,
        1.0,
        0.5,
        0.5,
        0.25,
        0.25,
    ]
    assert TemperatureSchedule((), (0.7,))(123) == 0.7
    with pytest.raises(ValueError, match="one value more"):
        TemperatureSchedule((10,), (1.0,))


# -- Gumbel MuZero ---------------------------------------------------------------------------------
def test_considered_visit_sequence_hand_values():
    assert considered_visit_sequence(4, 16) == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert considered_visit_sequence(1, 5) == [0, 1, 2, 3, 4]
    assert considered_visit_sequence(2, 6) == [0, 0, 1, 1, 2, 2]
    assert considered_visit_sequence(16, 8) == [0] * 8
    seq = considered_visit_sequence(8, 50)
    assert len(seq) == 50 and seq[:8] == [0] * 8


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("considered", [16, 2])
@pytest.mark.parametrize("num_actions", [4, 2])
def test_gumbel_matches_reference(seed, considered, num_actions):
    model = random_model(seed=seed, num_actions=num_actions)
    out, refs = run_both(
        model,
        [0, 11, 22, 33],
        gumbel=True,
        num_simulations=24,
        discount=0.95,
        seed=seed,
        max_num_considered_actions=considered,
    )
    assert_match(out, refs)
    assert torch.allclose(out.visit_probs.sum(-1), torch.ones(4, dtype=torch.float64))


def test_gumbel_with_mask_and_without_noise():
    model = random_model(seed=8, num_actions=5)
    legal = torch.tensor([[True, True, False, False, True], [False, True, True, True, True]])
    out, refs = run_both(
        model,
        [2, 3],
        legal=legal,
        gumbel=True,
        explore=False,
        num_simulations=16,
        discount=0.9,
        max_num_considered_actions=4,
    )
    assert_match(out, refs)
    assert (out.visit_counts[~legal] == 0).all()
    assert (out.visit_probs[~legal] == 0).all()


def test_gumbel_bandit_few_simulations():
    model = bandit_model([0.1, 0.5, 0.9, 0.3, 0.0, 0.2, 0.4, 0.6])
    out, refs = run_both(
        model, [0] * 4, gumbel=True, explore=False, num_simulations=8, discount=0.99, max_num_considered_actions=8
    )
    assert_match(out, refs)
    assert out.action.tolist() == [2] * 4  # every arm is tried once, the best one wins
    assert out.visit_probs[0].argmax().item() == 2


def test_search_statistics_are_consistent():
    model = random_model(seed=9)
    out, _ = run_both(model, list(range(8)), num_simulations=25, discount=0.97)
    assert torch.allclose(out.visit_probs, out.visit_counts / 25)
    assert (out.max_depth >= 1).all() and (out.max_depth <= 25).all()
    assert math.isfinite(out.root_value.sum().item())


# -- the compiled tree steps ----------------------------------------------------------------------
NO_CXX = not any(shutil.which(c) for c in ("c++", "g++", "clang++"))


@pytest.mark.slow  # torch.compile: seconds for the first compile of a process
@pytest.mark.skipif(NO_CXX, reason="torch.compile on CPU needs a C++ compiler")
@pytest.mark.parametrize("gumbel", [False, True])
def test_compiled_tree_steps_match_reference(gumbel):
    """``compile=True`` (the tree's steps through torch.compile, pointer walk instead of doubling)
    gives the reference search's visits, values and actions, with a legal mask."""
    model = random_model(num_states=200, num_actions=3, seed=11)
    ids = [0, 5, 9, 17]
    legal = torch.tensor([[True, True, True], [True, False, True], [False, True, True], [True, True, False]])
    kw = dict(num_simulations=12, discount=0.95, gumbel=gumbel, compile=True)
    if not gumbel:
        kw["unvisited_q"] = "mean"
    out, refs = run_both(model, ids, legal=legal, **kw)
    assert_match(out, refs)
    eager = policy(
        model.recurrent_fn,
        model.roots(ids),
        legal_actions_mask=legal,
        generator=torch.Generator().manual_seed(0),
        **{**kw, "compile": False},
    )
    for a, b in zip(eager.__dict__.values(), out.__dict__.values()):
        assert torch.allclose(a.double(), b.double(), rtol=1e-12, atol=1e-12)


def test_a_failing_compilation_says_what_to_do(monkeypatch):
    import lightning_wm.search.forest as search

    class CppCompileError(Exception):  # what inductor raises without a working C++ compiler
        pass

    CppCompileError.__module__ = "torch._inductor.exc"

    def broken(*args):
        raise CppCompileError("C++ compile error\n...")

    monkeypatch.setattr(search, "compiled_simulate", lambda: broken)
    model = random_model(seed=1)
    with pytest.raises(RuntimeError, match="needs a working C\\+\\+ compiler.*search.compile: false"):
        policy(model.recurrent_fn, model.roots([0, 1]), num_simulations=3, discount=0.9, compile=True)
