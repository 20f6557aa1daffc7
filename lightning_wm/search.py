"""Batched Monte-Carlo tree search over a learned model (MuZero; Gumbel MuZero at the root).

The whole forest lives in a few tensors on the device of the root inputs: ``B`` trees (one per
environment) of ``num_simulations + 1`` nodes each. A simulation scores the children of every
node of all ``B`` trees at once, finds each tree's leaf by pointer doubling (no loop over tree
levels, no host synchronisation in the simulation loop), expands one new node per tree with one
batched ``recurrent_fn`` call and backs the values up all ``B`` paths at once. Nothing here knows
the networks.

Tree conventions (what the per-node reference search in the tests implements too):

* Every expanded node counts its own evaluation as its first visit: the root starts with visit
  count 1 and value sum ``root_value``; a new leaf with 1 and its predicted value. So
  ``N(s) = 1 + sum_a N(s, a)`` everywhere, the root's value is the mean of its network value and
  the returns backed up through it, and the first selection at the root already uses the prior.
* ``Q(s, a) = r(s, a) + discount * V(child)`` with ``V = value_sum / visits``; a backup adds
  ``G_L = v(leaf)``, ``G_d = r_{d+1} + discount * G_{d+1}`` to the node at depth ``d`` and
  updates the min-max statistics with ``r(node) + discount * V(node)`` of every node on the path
  (the MuZero pseudocode's ``MinMaxStats``; no known bounds; values are left as they are until
  the maximum exceeds the minimum).
* PUCT (MuZero): ``score(a) = Q_norm(s, a) + P(s, a) sqrt(N(s)) / (1 + N(s, a))
  * (pb_c_init + log((N(s) + pb_c_base + 1) / pb_c_base))``; ties go to the lowest action index.
  An unvisited child's ``Q_norm`` is set by ``unvisited_q``: ``"zero"`` (the MuZero
  pseudocode: the bottom of the normalised range, so where all values are alike the search stays
  with the first action it tried) or ``"mean"`` (the mean ``Q`` of the node's visited children,
  the node's own value ``V(s)`` before any, normalised the same way: EfficientZero's and
  LightZero's rule, close to mctx's ``qtransform_by_parent_and_siblings``), so an untried action
  counts as an average one and the prior decides.
* Legal-action masks apply at the root only (inside the tree the model has no notion of
  legality, as in MuZero). Dirichlet noise is mixed into the root prior over the legal actions.
* Gumbel MuZero (Danihelka et al., 2022): at the root, Gumbel-top-k over ``g + logits``
  with ``k = max_num_considered_actions`` and sequential halving over the simulation budget,
  ranking by ``g + logits + sigma(q)``; inside the tree the deterministic rule
  ``argmax(pi'(a) - N(s, a) / (1 + sum_b N(s, b)))`` with ``pi' = softmax(logits + sigma(q))``,
  ``q`` completed with the mixed value for unvisited actions and rescaled to ``[0, 1]`` over
  the node's actions, ``sigma(q) = (c_visit + max_b N(s, b)) * c_scale * q``. The policy target
  is ``pi'`` at the root.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_wm.tree import tree_map

RecurrentFn = Callable[[Any, Tensor], tuple[Any, Tensor, Tensor, Tensor]]


@dataclass
class SearchOutput:
    """What one batched search returns (``B`` roots, ``A`` actions).

    Attributes:
        action: ``[B]`` int64, the action to take.
        visit_probs: ``[B, A]`` policy target, sums to 1: root visit counts normalised (PUCT) or
            the improved policy ``softmax(logits + sigma(completed q))`` (Gumbel).
        root_value: ``[B]`` the root's search value (mean over its visits).
        visit_counts: ``[B, A]`` root children's visit counts.
        q_values: ``[B, A]`` root ``r + discount * V(child)`` (0 for unvisited actions).
        root_prior: ``[B, A]`` the prior used at the root (after the mask and the noise).
        max_depth: ``[B]`` int64, depth of the deepest leaf expanded (1 = a root child).
    """

    action: Tensor
    visit_probs: Tensor
    root_value: Tensor
    visit_counts: Tensor
    q_values: Tensor
    root_prior: Tensor
    max_depth: Tensor


@dataclass
class TemperatureSchedule:
    """Visit-count temperature by training step: ``values[i]`` until ``boundaries[i]`` steps.

    The default is MuZero's Atari schedule: 1.0 for the first 500k training steps, 0.5 for the
    next 250k, 0.25 afterwards. ``TemperatureSchedule((), (1.0,))`` is a constant.
    """

    boundaries: Sequence[int] = (500_000, 750_000)
    values: Sequence[float] = (1.0, 0.5, 0.25)

    def __post_init__(self) -> None:
        if len(self.values) != len(self.boundaries) + 1:
            raise ValueError(
                f"TemperatureSchedule needs one value more than boundaries; got "
                f"{len(self.values)} values for {len(self.boundaries)} boundaries"
            )
        if list(self.boundaries) != sorted(self.boundaries):
            raise ValueError(f"TemperatureSchedule boundaries must increase, got {list(self.boundaries)}")

    def __call__(self, step: int) -> float:
        for boundary, value in zip(self.boundaries, self.values):
            if step < boundary:
                return float(value)
        return float(self.values[-1])


# -- random draws (all through one optional generator) -----------------------------------------
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


# -- Gumbel MuZero's sequential halving ----------------------------------------------------------
def considered_visit_sequence(num_considered: int, num_simulations: int) -> list[int]:
    """For each simulation, the visit count a root action must have to be chosen (sequential
    halving, Danihelka et al. 2022): phases of ``max(1, n / (ceil(log2 m) * k))`` rounds over the
    ``k`` actions still considered (``k = m, m/2, ... >= 2``), every round visiting each once."""
    if num_considered <= 1:
        return list(range(num_simulations))
    phases = math.ceil(math.log2(num_considered))
    sequence: list[int] = []
    visits = [0] * num_considered
    k = num_considered
    while len(sequence) < num_simulations:
        rounds = max(1, int(num_simulations / (phases * k)))
        for _ in range(rounds):
            sequence.extend(visits[:k])
            for i in range(k):
                visits[i] += 1
        k = max(2, k // 2)
    return sequence[:num_simulations]


# -- the search ------------------------------------------------------------------------------------
def mcts(
    recurrent_fn: RecurrentFn,
    root_state: Any,
    root_logits: Tensor,
    root_value: Tensor,
    *,
    num_simulations: int,
    discount: float,
    pb_c_init: float = 1.25,
    pb_c_base: float = 19652.0,
    dirichlet_alpha: float = 0.3,
    exploration_fraction: float = 0.25,
    explore: bool = True,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    legal_actions_mask: Tensor | None = None,
    gumbel: bool = False,
    max_num_considered_actions: int = 16,
    gumbel_scale: float = 1.0,
    c_visit: float = 50.0,
    c_scale: float = 0.1,
    unvisited_q: str = "zero",
    compile: bool = False,
) -> SearchOutput:
    """Search ``num_simulations`` times from each of ``B`` roots.

    Args:
        recurrent_fn: ``(state [B, ...], action [B] int64) -> (next_state [B, ...], reward [B],
            logits [B, A], value [B])`` — the model's dynamics and prediction (no grad needed).
            ``state`` may be any pytree of tensors with the batch first.
        root_state: the roots' latent states (pytree, batch first).
        root_logits: ``[B, A]`` prior logits at the roots.
        root_value: ``[B]`` predicted values at the roots (its dtype is the search's dtype).
        num_simulations: expansions per root (>= 1).
        discount: per-step discount inside the tree.
        pb_c_init, pb_c_base: PUCT constants (MuZero: 1.25, 19652).
        dirichlet_alpha, exploration_fraction: root noise ``(1 - f) P + f Dir(alpha)`` (PUCT, only
            when ``explore``).
        explore: noise at the root and a sampled action; ``False``: no noise, the argmax action.
        temperature: visit-count temperature for the sampled action (PUCT; see
            :class:`TemperatureSchedule`).
        generator: makes the noise and the sampled action reproducible.
        legal_actions_mask: ``[B, A]`` bool, actions allowed at the root (default: all).
        gumbel: Gumbel MuZero root selection and interior rule instead of PUCT + Dirichlet.
        max_num_considered_actions: Gumbel's ``m`` (actions sampled without replacement).
        gumbel_scale: scale of the Gumbel noise when ``explore`` (0: deterministic).
        c_visit, c_scale: Gumbel's ``sigma(q) = (c_visit + max N) * c_scale * q``.
        unvisited_q: PUCT's value of an unvisited child, ``"zero"`` or ``"mean"`` (see the
            module docstring).
        compile: run the tree's steps between two network calls (backup, then the next descent)
            through ``torch.compile`` as one graph (the networks are not compiled): the same
            search up to float rounding with a fraction of the per-simulation overhead, after a
            one-time compilation per batch size, number of simulations, action count, rule, dtype
            and device (about 25 s on a 2-core CPU, about 3 s from the on-disk cache). Needs a C++
            compiler on CPU.
    """
    with torch.inference_mode():  # no autograd bookkeeping: ~15% less overhead per tiny op
        out = _search(
            recurrent_fn,
            root_state,
            root_logits,
            root_value,
            num_simulations,
            discount,
            pb_c_init,
            pb_c_base,
            dirichlet_alpha,
            exploration_fraction,
            explore,
            temperature,
            generator,
            legal_actions_mask,
            gumbel,
            max_num_considered_actions,
            gumbel_scale,
            c_visit,
            c_scale,
            unvisited_q,
            compile,
        )
    # plain tensors for the caller (inference tensors cannot be saved for backward)
    return SearchOutput(
        *(
            x.clone()
            for x in (
                out.action,
                out.visit_probs,
                out.root_value,
                out.visit_counts,
                out.q_values,
                out.root_prior,
                out.max_depth,
            )
        )
    )


def _search(
    recurrent_fn: RecurrentFn,
    root_state: Any,
    root_logits: Tensor,
    root_value: Tensor,
    num_simulations: int,
    discount: float,
    pb_c_init: float,
    pb_c_base: float,
    dirichlet_alpha: float,
    exploration_fraction: float,
    explore: bool,
    temperature: float,
    generator: torch.Generator | None,
    legal_actions_mask: Tensor | None,
    gumbel: bool,
    max_num_considered_actions: int,
    gumbel_scale: float,
    c_visit: float,
    c_scale: float,
    unvisited_q: str = "zero",
    compile: bool = False,
) -> SearchOutput:
    if unvisited_q not in ("zero", "mean"):
        raise ValueError(f"unvisited_q must be 'zero' or 'mean', got {unvisited_q!r}")
    if num_simulations < 1:
        raise ValueError(f"num_simulations must be >= 1, got {num_simulations}")
    if root_logits.dim() != 2:
        raise ValueError(f"root_logits must be [B, A], got {tuple(root_logits.shape)}")
    batch, num_actions = root_logits.shape
    if root_value.shape != (batch,):
        raise ValueError(f"root_value must be [B] = [{batch}], got {tuple(root_value.shape)}")
    dtype, device = root_value.dtype, root_value.device
    if legal_actions_mask is None:
        legal = torch.ones(batch, num_actions, dtype=torch.bool, device=device)
    else:
        legal = legal_actions_mask.to(device=device, dtype=torch.bool)
        if legal.shape != (batch, num_actions):
            raise ValueError(f"legal_actions_mask must be [B, A] = [{batch}, {num_actions}], got {tuple(legal.shape)}")
        if not bool(legal.any(-1).all()):
            raise ValueError("legal_actions_mask has a root without any legal action")
    neg_inf = torch.tensor(float("-inf"), dtype=dtype, device=device)
    logits = torch.where(legal, root_logits.to(dtype), neg_inf)
    prior = torch.softmax(logits, -1)

    if gumbel:
        scale = gumbel_scale if explore else 0.0
        noise = sample_gumbel((batch, num_actions), generator, device, dtype) * scale
        rule: _Rule = _GumbelRule(logits, noise, legal, num_simulations, max_num_considered_actions, c_visit, c_scale)
    else:
        if explore and exploration_fraction > 0:
            noise = dirichlet_noise(dirichlet_alpha, legal, generator).to(dtype)
            prior = (1 - exploration_fraction) * prior + exploration_fraction * noise
        rule = _PuctRule(discount, pb_c_init, pb_c_base, num_simulations, legal, unvisited_q == "mean")

    tree = _Tree(root_state, prior, root_value.to(dtype), num_simulations, discount)
    step = _compiled_record_descend() if compile else _record_descend
    parent, action = tree.descend(rule, tree.slot_ids[1])
    for slot in range(1, num_simulations + 1):
        next_state, reward, next_logits, value = recurrent_fn(tree.states_of(parent), action)
        tree.store_states(tree.slot_ids[slot], next_state)
        # the new leaf's backup, then the next simulation's descent (after the last: unused)
        try:
            parent, action = step(tree, rule, tree.slot_ids[slot], parent, action, reward, next_logits, value, compile)
        except Exception as err:
            if compile and type(err).__module__.startswith(("torch._dynamo", "torch._inductor")):
                raise RuntimeError(
                    f"the compiled search failed ({type(err).__name__}: "
                    f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}); torch.compile "
                    "on CPU needs a working C++ compiler (g++ or clang). Install one, or turn "
                    "the option off (compile_search: false / mcts(compile=False))"
                ) from err
            raise

    visits, q = tree.root_children()
    root_val = tree.root_value()
    if gumbel:
        assert isinstance(rule, _GumbelRule)
        action = rule.final_action(tree)
        probs = rule.improved_policy(tree)
    else:
        action = select_action(visits, explore, temperature, generator)
        probs = visits / visits.sum(-1, keepdim=True)
    return SearchOutput(
        action=action,
        visit_probs=probs,
        root_value=root_val,
        visit_counts=visits,
        q_values=q,
        root_prior=prior,
        max_depth=tree.max_depth(),
    )


class _Tree:
    """``B`` trees of ``M = N + 1`` nodes (slot 0 the root, slot ``s`` the node expanded by
    simulation ``s``), rows ``b * M + slot`` of flat tensors. Edges ``(node, action)`` are entries
    ``row * A + action`` of flat tensors holding the child's row (the node's own row while the
    child is unexpanded), visit count, value sum and reward, so the children of the first ``S``
    nodes are contiguous ``[B, S, A]`` slices; ``B`` extra entries (one per tree, after the
    ``B * M * A`` edges) hold the roots' own statistics (their reward is 0), so a backup treats
    the root like any node.

    A simulation has no per-level loop: the rule scores the children of every node at once
    (fixed shapes, so one compiled graph serves every simulation; an unexpanded node has only
    itself as children), each node's best child becomes a pointer (the node itself where that
    child is unexpanded), and pointer doubling follows them from the root to the node whose best
    child is the new leaf in ``ceil(log2(M))`` gathers (compiled: a walk of ``M - 1`` gathers of
    ``[B]`` from the roots, one loop, where doubling would be inlined exponentially). Every node
    keeps the edges from its root to itself
    (``[B * M, M]``, written once when it is expanded: its parent's plus its own), so the backup
    reads the leaf's path in one gather, and one matrix product sums the discounted rewards along
    it. Positions past the leaf's depth point to the root's own entry: their reward and return
    are 0, so adding them changes no value sum and their Q is the root's (already on the path);
    only the visit counts take a 0/1 row. Memory: ``B * M^2`` int64 for the paths.
    """

    def __init__(
        self, root_state: Any, root_prior: Tensor, root_value: Tensor, num_simulations: int, discount: float
    ) -> None:
        batch, num_actions = root_prior.shape
        dtype, device = root_value.dtype, root_value.device
        self.batch, self.num_actions, self.discount = batch, num_actions, float(discount)
        self.slots = slots = num_simulations + 1
        self.base = torch.arange(batch, device=device) * slots
        rows = torch.arange(batch * slots, device=device).view(batch, slots)
        num_edges = batch * slots * num_actions
        shape = (batch, slots, num_actions)
        # an unexpanded child is the node itself: following it goes nowhere
        self.children = rows.unsqueeze(2).expand(shape).reshape(-1).clone()
        self.slot_ids = torch.arange(slots + 1, device=device).view(slots + 1, 1)  # [1] slot indices
        # a chain of best children from the root passes at most M nodes: 2^steps >= M
        self.doubling_steps = max(0, math.ceil(math.log2(slots)))
        self.edge_n = torch.zeros(num_edges + batch, dtype=dtype, device=device)
        self.edge_w = torch.zeros(num_edges + batch, dtype=dtype, device=device)
        self.edge_r = torch.zeros(num_edges + batch, dtype=dtype, device=device)
        self.edge_n[num_edges:] = 1.0  # a root's own evaluation is its first visit
        self.edge_w[num_edges:] = root_value
        self.root_edge = num_edges + torch.arange(batch, device=device)
        self.num_edges, self.shape = num_edges, shape
        self.prior = torch.zeros(shape, dtype=dtype, device=device)
        self.prior[:, 0] = root_prior
        self.raw_value = torch.zeros(batch, slots, dtype=dtype, device=device)
        self.raw_value[:, 0] = root_value
        # path[row, d]: the edge into the node at depth d on the way to node `row`; the root's
        # own entry at d = 0 and past the node's depth
        self.path = self.root_edge.view(batch, 1, 1).expand(batch, slots, slots).contiguous().view(batch * slots, slots)
        self.depth = torch.zeros(batch * slots, dtype=torch.long, device=device)
        self.depth_view = self.depth.view(batch, slots)
        self.states = tree_map(lambda x: x.new_empty((batch * slots, *x.shape[1:])), root_state)
        tree_map(lambda store, x: store.view(batch, slots, *x.shape[1:])[:, 0].copy_(x), self.states, root_state)
        self.zero = torch.zeros((), dtype=dtype, device=device)
        self.one = torch.ones((), dtype=dtype, device=device)
        self.lo = torch.full((batch, 1, 1), float("inf"), dtype=dtype, device=device)
        self.hi = torch.full((batch, 1, 1), float("-inf"), dtype=dtype, device=device)
        self.shift = torch.zeros(batch, 1, 1, dtype=dtype, device=device)
        self.scale = torch.ones(batch, 1, 1, dtype=dtype, device=device)
        # returns along a path of leaf depth L: G[d] = sum_{d < k <= L} discount^(k - d - 1) r[k]
        # + discount^(L - d) v(leaf) for d <= L, i.e. r @ discounts + v * leaf_discounts[L]
        k = torch.arange(slots, dtype=torch.float64)
        power = k.unsqueeze(1) - k.unsqueeze(0)  # [k, d] (and [L, d])
        self.discounts = torch.where(power >= 1, float(discount) ** (power - 1).clamp(min=0), 0.0).to(device, dtype)
        self.leaf_discounts = torch.where(power >= 0, float(discount) ** power.clamp(min=0), 0.0).to(device, dtype)
        self.on_path = (k.unsqueeze(0) <= k.unsqueeze(1)).to(device, dtype)  # [L, d]: d <= L

    # -- reading ---------------------------------------------------------------------------
    def edges(self, count: int) -> tuple[Tensor, Tensor, Tensor]:
        """Visits, value sums and rewards ``[B, S, A]`` of the children of slots ``0..S-1``."""
        return tuple(x[: self.num_edges].view(self.shape)[:, :count] for x in (self.edge_n, self.edge_w, self.edge_r))

    def q(self, visits: Tensor, value_sum: Tensor, reward: Tensor) -> Tensor:
        """``r + discount * value_sum / visits`` (``r`` where unvisited: 0 for an unexpanded child)."""
        return torch.addcdiv(reward, value_sum, visits.clamp(min=1), value=self.discount)

    def root_children(self) -> tuple[Tensor, Tensor]:
        """Root children's visit counts ``[B, A]`` and Q values ``[B, A]`` (0 where unvisited)."""
        n, w, r = (x[:, 0] for x in self.edges(1))
        return n, torch.where(n > 0, self.q(n, w, r), self.zero)

    def root_value(self) -> Tensor:
        return self.edge_w[self.root_edge] / self.edge_n[self.root_edge]

    def max_depth(self) -> Tensor:
        """``[B]`` depth of the deepest node expanded (1 = a root child)."""
        return self.depth_view.amax(1)

    def states_of(self, rows: Tensor) -> Any:
        """Latent states ``[B, ...]`` of the nodes ``rows [B]``."""
        return tree_map(lambda store: store.index_select(0, rows), self.states)

    def store_states(self, slot: Tensor, state: Any) -> None:
        """Write the new leaves' latent states (pytree, ``[B, ...]``) into ``slot [1]`` of every tree."""
        rows = self.base + slot
        tree_map(lambda store, x: store.index_copy_(0, rows, x), self.states, state)

    # -- one simulation (fixed shapes: every slot is scored, so one compiled graph serves all) ----
    def descend(self, rule: _Rule, slot: Tensor, walk: bool = False) -> tuple[Tensor, Tensor]:
        """``(parent row [B], action [B])`` of the leaf each tree expands as node ``slot [1]``.
        ``walk``: follow the best children from the roots one level at a time (``M - 1``
        gathers of ``[B]``: one loop when compiled) instead of pointer doubling (``log2 M``
        gathers of ``[B * M]``: few eager ops, but compiled code inlines it exponentially)."""
        action = rule.select(self, slot, *self.edges(self.slots))  # [B, M]
        # every node points to its best child, which is itself where that child is unexpanded
        # (slots not yet expanded have no expanded children: they point to themselves too)
        pointer = self.children.view(-1, self.num_actions).gather(1, action.view(-1, 1)).view(-1)
        if walk:
            parent = self.base
            for _ in range(self.slots - 1):
                parent = pointer.index_select(0, parent)
        else:  # 2^j pointer steps for every node, then the roots'
            for _ in range(self.doubling_steps):
                pointer = pointer.index_select(0, pointer)
            parent = pointer.index_select(0, self.base)
        return parent, action.view(-1).index_select(0, parent)

    def record(
        self, slot: Tensor, parent: Tensor, action: Tensor, reward: Tensor, logits: Tensor, value: Tensor
    ) -> None:
        """Node ``slot [1]`` of every tree becomes the child ``action [B]`` of ``parent [B]`` with
        the model's ``reward [B]``, prior ``logits [B, A]`` and ``value [B]``; its value is then
        backed up to the root: visit counts, value sums, min-max statistics."""
        dtype = self.edge_w.dtype
        reward, logits, value = reward.to(dtype), logits.to(dtype), value.to(dtype)
        rows = self.base + slot
        edge = torch.add(action, parent, alpha=self.num_actions)
        self.children.index_copy_(0, edge, rows)
        self.edge_r.index_copy_(0, edge, reward)
        self.prior.view(-1, self.num_actions).index_copy_(0, rows, torch.softmax(logits, -1))
        self.raw_value.view(-1).index_copy_(0, rows, value)
        # the leaf's path: its parent's, and its own edge at its depth
        depth = self.depth.index_select(0, parent).add_(1)
        path = self.path.index_select(0, parent)
        path.scatter_(1, depth.unsqueeze(1), edge.unsqueeze(1))
        self.path.index_copy_(0, rows, path)
        self.depth.index_copy_(0, rows, depth)
        # backup: G[d] for every position d of the path (0 past the leaf, whose entries are the
        # root's own: they change no value sum, and their Q is the root's, already on the path)
        batch = self.batch
        edges = path.view(-1)
        rewards = self.edge_r.index_select(0, edges).view(batch, -1)  # r[k], 0 past the leaf
        returns = torch.addcmul(
            rewards @ self.discounts, value.unsqueeze(1), self.leaf_discounts.index_select(0, depth)
        )
        self.edge_n.index_add_(0, edges, self.on_path.index_select(0, depth).view(-1))
        self.edge_w.index_add_(0, edges, returns.view(-1))
        q = self.q(
            self.edge_n.index_select(0, edges).view(batch, -1),
            self.edge_w.index_select(0, edges).view(batch, -1),
            rewards,
        )
        lo, hi = torch.aminmax(q, dim=1)
        self.lo.copy_(torch.minimum(self.lo, lo.view(-1, 1, 1)))
        self.hi.copy_(torch.maximum(self.hi, hi.view(-1, 1, 1)))
        span = self.hi - self.lo
        ok = span > 0
        self.scale.copy_(torch.where(ok, span, self.one).reciprocal())
        self.shift.copy_(torch.addcmul(self.zero, torch.where(ok, self.lo, self.zero), self.scale, value=-1))


def _record_descend(
    tree: _Tree,
    rule: _Rule,
    slot: Tensor,
    parent: Tensor,
    action: Tensor,
    reward: Tensor,
    logits: Tensor,
    value: Tensor,
    walk: bool = False,
) -> tuple[Tensor, Tensor]:
    """:meth:`_Tree.record` of node ``slot``, then :meth:`_Tree.descend` to node ``slot + 1``:
    everything between two network calls (one compiled graph)."""
    tree.record(slot, parent, action, reward, logits, value)
    return tree.descend(rule, slot + 1, walk)


_COMPILED: list[Callable[..., tuple[Tensor, Tensor]]] = []


def _compiled_record_descend() -> Callable[..., tuple[Tensor, Tensor]]:
    """:func:`_record_descend` through ``torch.compile``: compiled once per batch size, tree
    size, action count, rule, dtype and device (the networks stay outside)."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(_record_descend, dynamic=False))
    return _COMPILED[0]


def _sum_actions(x: Tensor) -> Tensor:
    """``x.sum(-1)``; for two actions one add (reductions over a last dimension of 2 are slow)."""
    if x.shape[-1] == 2:
        first, second = x.unbind(-1)
        return first + second
    return x.sum(-1)


def _argmax_actions(score: Tensor) -> Tensor:
    """``score.argmax(-1)`` (ties: the lowest index); for two actions one comparison."""
    if score.shape[-1] == 2:
        first, second = score.unbind(-1)
        return (second > first).long()
    return score.argmax(-1)


class _Rule:
    """How a node picks the child to descend to."""

    def select(self, tree: _Tree, slot: Tensor, n: Tensor, w: Tensor, r: Tensor) -> Tensor:
        """Action ``[B, M]`` of every node (slot 0 the root; what an unexpanded node picks does not
        matter) before node ``slot [1]`` is expanded, given the children's visits, value sums and
        rewards ``[B, M, A]``."""
        raise NotImplementedError


class _PuctRule(_Rule):
    def __init__(
        self,
        discount: float,
        pb_c_init: float,
        pb_c_base: float,
        num_simulations: int,
        legal: Tensor,
        mean_q: bool = False,
    ) -> None:
        self.mean_q = mean_q
        # exploration factor by the node's children's visits k (the node's visits n = k + 1):
        # (pb_c_init + log((n + base + 1) / base)) sqrt(n)
        n = torch.arange(1, num_simulations + 2, dtype=torch.float64)
        self.factor = (pb_c_init + torch.log((n + pb_c_base + 1) / pb_c_base)) * torch.sqrt(n)
        self.illegal = None if bool(legal.all()) else ~legal

    def select(self, tree: _Tree, slot: Tensor, n: Tensor, w: Tensor, r: Tensor) -> Tensor:
        if self.factor.dtype != n.dtype or self.factor.device != n.device:
            self.factor = self.factor.to(device=n.device, dtype=n.dtype)
        children_n = _sum_actions(n)  # [B, S]; a node's visits are its own evaluation + these
        c = self.factor.index_select(0, children_n.long().view(-1)).view(children_n.shape)  # [B, S]
        q = tree.q(n, w, r)  # 0 for an unvisited (unexpanded) child
        if self.mean_q:
            # an unvisited child counts as the mean Q of its visited siblings, or as V(s) before
            # any (a node without visited children has visits 1: V(s) is its own evaluation)
            visited = n.clamp(max=1)  # 1.0 / 0.0
            tried = _sum_actions(visited)
            mean = torch.where(tried > 0, _sum_actions(q), tree.raw_value[:, : n.shape[1]]) / tried.clamp(min=1)
            q = torch.addcmul(q, 1 - visited, mean.unsqueeze(2))
            value_score = torch.addcmul(tree.shift, q, tree.scale)  # (q - offset) * scale
        else:  # an unvisited child sits at the bottom of the normalised range
            value_score = torch.addcmul(tree.shift, q, tree.scale).mul_(n.clamp(max=1))
        score = torch.addcdiv(value_score, tree.prior[:, : n.shape[1]] * c.unsqueeze(2), n + 1)
        if self.illegal is not None:
            score[:, 0].masked_fill_(self.illegal, float("-inf"))
        return _argmax_actions(score)


class _GumbelRule(_Rule):
    def __init__(
        self,
        logits: Tensor,
        gumbel: Tensor,
        legal: Tensor,
        num_simulations: int,
        max_considered: int,
        c_visit: float,
        c_scale: float,
    ) -> None:
        self.log_prior = torch.log_softmax(logits, -1)
        self.gumbel = gumbel
        self.c_visit, self.c_scale = c_visit, c_scale
        considered = legal.sum(-1).clamp(max=max_considered)
        table = torch.tensor(
            [considered_visit_sequence(m, num_simulations) for m in range(max_considered + 1)],
            dtype=gumbel.dtype,
            device=gumbel.device,
        ).view(max_considered + 1, num_simulations)
        # [B, 2 + num_simulations]: column s for the simulation that expands slot s (columns 0 and
        # N + 1 unused: the descent after the last simulation is discarded)
        self.considered_visit = torch.nn.functional.pad(table.index_select(0, considered), (1, 1))

    def sigma_q(self, tree: _Tree, n: Tensor, w: Tensor, r: Tensor) -> Tensor:
        """``sigma(completed, rescaled q)`` ``[B, S, A]`` of the first ``S`` slots."""
        count = n.shape[1]
        q = tree.q(n, w, r)
        visited = n > 0
        total = n.sum(-1)
        w = torch.where(visited, tree.prior[:, :count], torch.zeros_like(q))
        weighted_q = (w * q).sum(-1) / w.sum(-1).clamp(min=torch.finfo(q.dtype).tiny)
        mixed = (tree.raw_value[:, :count] + total * weighted_q) / (1 + total)
        completed = torch.where(visited, q, mixed.unsqueeze(-1))
        lo = completed.amin(-1, keepdim=True)
        hi = completed.amax(-1, keepdim=True)
        rescaled = (completed - lo) / (hi - lo).clamp(min=1e-8)
        return (self.c_visit + n.amax(-1, keepdim=True)) * self.c_scale * rescaled

    def _root_score(self, sigma: Tensor, n: Tensor, target: Tensor) -> Tensor:
        """``[B, A]`` Gumbel + log prior + sigma(q) where the visit count is ``target [B]``."""
        score = self.gumbel + self.log_prior + sigma
        return score.masked_fill(n != target.unsqueeze(1), float("-inf"))

    def select(self, tree: _Tree, slot: Tensor, n: Tensor, w: Tensor, r: Tensor) -> Tensor:
        count = n.shape[1]
        sigma = self.sigma_q(tree, n, w, r)
        logits = torch.log(tree.prior[:, :count]) + sigma
        score = torch.softmax(logits, -1) - n / (1 + _sum_actions(n).unsqueeze(-1))
        action = _argmax_actions(score)
        target = self.considered_visit.index_select(1, slot).squeeze(1)  # simulation slot - 1
        action[:, 0] = self._root_score(sigma[:, 0], n[:, 0], target).argmax(-1)
        return action

    def _root(self, tree: _Tree) -> tuple[Tensor, Tensor]:
        n, w, r = tree.edges(1)
        return n[:, 0], self.sigma_q(tree, n, w, r)[:, 0]

    def final_action(self, tree: _Tree) -> Tensor:
        n, sigma = self._root(tree)
        return self._root_score(sigma, n, n.amax(-1)).argmax(-1)

    def improved_policy(self, tree: _Tree) -> Tensor:
        _, sigma = self._root(tree)
        return torch.softmax(self.log_prior + sigma, -1)
