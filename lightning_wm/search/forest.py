"""The forest of a batched search: ``B`` trees in flat tensors (:class:`Forest`, which holds the
search's discount), a simulation's three parts over it — selection by pointer doubling
(:meth:`Forest.descend`), expansion (:meth:`Forest.expand`) and backup (:meth:`Forest.backup`) —
one simulation past its selection, eager or compiled (:func:`simulate`: the network's step on the
chosen leaves, their expansion and backup, the next selection), and a search's loop of them
(:func:`run_simulations`); :class:`Rule` is what a selection asks of a selection rule
(:mod:`lightning_wm.search.rules` has them)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_wm.tree import tree_map

__all__ = ["Rule", "Forest", "simulate", "compiled_simulate", "run_simulations"]


class Rule:
    """How a node picks the child to descend to."""

    def select(self, tree: Forest, slot: Tensor, n: Tensor, w: Tensor, r: Tensor) -> Tensor:
        """Action ``[B, M]`` of every node (slot 0 the root; what an unexpanded node picks does not
        matter) before node ``slot [1]`` is expanded, given the children's visits, value sums and
        rewards ``[B, M, A]``."""
        raise NotImplementedError


class Forest:
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

    def reset(self, root_state: Any, root_prior: Tensor, root_value: Tensor) -> None:
        """Back to the roots alone (new root states, priors and values; the same shapes), in place:
        every tensor a simulation writes is refilled as ``__init__`` fills it, with device ops
        only (what a captured CUDA graph replays; :mod:`~lightning_wm.search.captured`)."""
        batch, slots = self.batch, self.slots
        rows = torch.arange(batch * slots, device=self.children.device).view(batch, slots)
        self.children.copy_(rows.unsqueeze(2).expand(self.shape).reshape(-1))
        for edge in (self.edge_n, self.edge_w, self.edge_r):
            edge.zero_()
        self.edge_n[self.num_edges :] = 1.0
        self.edge_w[self.num_edges :] = root_value
        self.prior.zero_()
        self.prior[:, 0] = root_prior
        self.raw_value.zero_()
        self.raw_value[:, 0] = root_value
        self.path.copy_(self.root_edge.view(batch, 1, 1).expand(batch, slots, slots).reshape(batch * slots, slots))
        self.depth.zero_()
        tree_map(lambda store, x: store.view(batch, slots, *x.shape[1:])[:, 0].copy_(x), self.states, root_state)
        self.lo.fill_(float("inf"))
        self.hi.fill_(float("-inf"))
        self.shift.zero_()
        self.scale.fill_(1.0)

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
    def descend(self, rule: Rule, slot: Tensor, walk: bool = False) -> tuple[Tensor, Tensor]:
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

    def expand(
        self, slot: Tensor, parent: Tensor, action: Tensor, state: Any, reward: Tensor, logits: Tensor, value: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Expansion: node ``slot [1]`` of every tree becomes the child ``action [B]`` of ``parent
        [B]`` with the model's latent ``state`` (pytree, ``[B, ...]``), ``reward [B]``, prior
        ``logits [B, A]`` and ``value [B]``; returns what :meth:`backup` takes: the new nodes'
        paths ``[B, M]`` (edges from the root, the root's own entry past the node), depths ``[B]``
        and values ``[B]`` in the tree's dtype."""
        self.store_states(slot, state)
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
        return path, depth, value

    def backup(self, path: Tensor, depth: Tensor, value: Tensor) -> None:
        """Backup: the new leaves' ``value [B]`` up their ``path [B, M]`` (at ``depth [B]``) to the
        roots: visit counts, value sums (``G[d]`` for every position ``d`` of the path; 0 past the
        leaf, whose entries are the root's own: they change no value sum, and their Q is the
        root's, already on the path) and the min-max statistics."""
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


def simulate(
    recurrent_fn: Callable[[Any, Tensor], tuple[Any, Tensor, Tensor, Tensor]],
    tree: Forest,
    rule: Rule,
    slot: Tensor,
    parent: Tensor,
    action: Tensor,
    walk: bool = False,
) -> tuple[Tensor, Tensor]:
    """One simulation past its selection: the network's step from the chosen leaves (``parent
    [B]``, ``action [B]``), the new nodes' expansion into ``slot [1]`` (:meth:`Forest.expand`) and
    backup (:meth:`Forest.backup`), then the selection of node ``slot + 1``
    (:meth:`Forest.descend`); the next ``(parent [B], action [B])``. Compiled
    (:func:`compiled_simulate`), network and tree are one graph; captured
    (:mod:`~lightning_wm.search.captured`), the whole loop of them is one."""
    next_state, reward, logits, value = recurrent_fn(tree.states_of(parent), action)
    tree.backup(*tree.expand(slot, parent, action, next_state, reward, logits, value))
    return tree.descend(rule, slot + 1, walk)


_COMPILED: list[Callable[..., tuple[Tensor, Tensor]]] = []


def compiled_simulate() -> Callable[..., tuple[Tensor, Tensor]]:
    """:func:`simulate` through ``torch.compile`` (the network's step inlined: modules of one class
    share the compiled code, their weights are inputs): compiled once per network class, batch
    size, tree size, action count, rule, dtype and device."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(simulate, dynamic=False))
    return _COMPILED[0]


def run_simulations(
    recurrent_fn: Callable[[Any, Tensor], tuple[Any, Tensor, Tensor, Tensor]],
    tree: Forest,
    rule: Rule,
    compile: bool = False,
) -> None:
    """Every simulation of a search on ``tree`` (from its roots): the first selection, then
    :func:`simulate` for slots ``1..N`` (the selection after the last is unused); with ``compile``
    each through :func:`compiled_simulate`, whose failure to compile is reported in one line."""
    step = compiled_simulate() if compile else simulate
    parent, action = tree.descend(rule, tree.slot_ids[1])
    try:
        for slot in range(1, tree.slots):
            parent, action = step(recurrent_fn, tree, rule, tree.slot_ids[slot], parent, action, compile)
    except Exception as err:
        if compile and type(err).__module__.startswith(("torch._dynamo", "torch._inductor")):
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise RuntimeError(
                f"the compiled search failed ({type(err).__name__}: {first}); torch.compile on CPU needs "
                "a working C++ compiler (g++ or clang). Install one, or turn the option off "
                "(search.compile: false / SearchSettings(compile=False))"
            ) from err
        raise
