"""How a node of the search picks the child to descend to: PUCT with min-max normalised values
(:class:`PuctRule`) or Gumbel MuZero's deterministic rule with sequential halving at the root
(:class:`GumbelRule`, :func:`considered_visit_sequence`)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_wm.search.forest import Forest, Rule

__all__ = ["PuctRule", "GumbelRule", "considered_visit_sequence", "sum_actions", "argmax_actions"]


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


def sum_actions(x: Tensor) -> Tensor:
    """``x.sum(-1)``; for two actions one add (reductions over a last dimension of 2 are slow)."""
    if x.shape[-1] == 2:
        first, second = x.unbind(-1)
        return first + second
    return x.sum(-1)


def argmax_actions(score: Tensor) -> Tensor:
    """``score.argmax(-1)`` (ties: the lowest index); for two actions one comparison."""
    if score.shape[-1] == 2:
        first, second = score.unbind(-1)
        return (second > first).long()
    return score.argmax(-1)


class PuctRule(Rule):
    """MuZero's PUCT with min-max normalised ``Q`` (the tree's ``shift`` and ``scale``); an unvisited
    child's ``Q`` is 0 or, with ``mean_q``, the mean ``Q`` of its visited siblings; ``legal``
    ``[B, A]`` masks the root's actions (the tree's discount is the forest's, :meth:`Forest.q`)."""

    def __init__(
        self,
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

    def select(self, tree: Forest, slot: Tensor, n: Tensor, w: Tensor, r: Tensor) -> Tensor:
        if self.factor.dtype != n.dtype or self.factor.device != n.device:
            self.factor = self.factor.to(device=n.device, dtype=n.dtype)
        children_n = sum_actions(n)  # [B, S]; a node's visits are its own evaluation + these
        c = self.factor.index_select(0, children_n.long().view(-1)).view(children_n.shape)  # [B, S]
        q = tree.q(n, w, r)  # 0 for an unvisited (unexpanded) child
        if self.mean_q:
            # an unvisited child counts as the mean Q of its visited siblings, or as V(s) before
            # any (a node without visited children has visits 1: V(s) is its own evaluation)
            visited = n.clamp(max=1)  # 1.0 / 0.0
            tried = sum_actions(visited)
            mean = torch.where(tried > 0, sum_actions(q), tree.raw_value[:, : n.shape[1]]) / tried.clamp(min=1)
            q = torch.addcmul(q, 1 - visited, mean.unsqueeze(2))
            value_score = torch.addcmul(tree.shift, q, tree.scale)  # (q - offset) * scale
        else:  # an unvisited child sits at the bottom of the normalised range
            value_score = torch.addcmul(tree.shift, q, tree.scale).mul_(n.clamp(max=1))
        score = torch.addcdiv(value_score, tree.prior[:, : n.shape[1]] * c.unsqueeze(2), n + 1)
        if self.illegal is not None:
            score[:, 0].masked_fill_(self.illegal, float("-inf"))
        return argmax_actions(score)


class GumbelRule(Rule):
    """Gumbel MuZero's selection: at the root the considered action with the fewest visits by
    ``gumbel + log prior + sigma(q)`` (sequential halving), inside the tree the deterministic
    ``argmax(pi'(a) - N(s, a) / (1 + sum_b N(s, b)))``."""

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

    def sigma_q(self, tree: Forest, n: Tensor, w: Tensor, r: Tensor) -> Tensor:
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

    def select(self, tree: Forest, slot: Tensor, n: Tensor, w: Tensor, r: Tensor) -> Tensor:
        count = n.shape[1]
        sigma = self.sigma_q(tree, n, w, r)
        logits = torch.log(tree.prior[:, :count]) + sigma
        score = torch.softmax(logits, -1) - n / (1 + sum_actions(n).unsqueeze(-1))
        action = argmax_actions(score)
        target = self.considered_visit.index_select(1, slot).squeeze(1)  # simulation slot - 1
        action[:, 0] = self._root_score(sigma[:, 0], n[:, 0], target).argmax(-1)
        return action

    def _root(self, tree: Forest) -> tuple[Tensor, Tensor]:
        n, w, r = tree.edges(1)
        return n[:, 0], self.sigma_q(tree, n, w, r)[:, 0]

    def final_action(self, tree: Forest) -> Tensor:
        n, sigma = self._root(tree)
        return self._root_score(sigma, n, n.amax(-1)).argmax(-1)

    def improved_policy(self, tree: Forest) -> Tensor:
        _, sigma = self._root(tree)
        return torch.softmax(self.log_prior + sigma, -1)
