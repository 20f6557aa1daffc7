"""A slow, per-node MCTS in plain Python (one tree, one node object per state) that follows the
rules documented in :mod:`lightning_wm.search`, written independently of its tensor layout.
The tests run both on the same toy models and compare visit counts, values and actions."""

from __future__ import annotations

import math
from collections.abc import Callable

from lightning_wm.search import considered_visit_sequence

# step(state, action) -> (next_state, reward, prior probabilities (list), value)
StepFn = Callable[[object, int], tuple[object, float, list[float], float]]


class Node:
    def __init__(self, prior: float) -> None:
        self.prior = prior
        self.children: dict[int, Node] = {}
        self.visits = 0
        self.value_sum = 0.0
        self.reward = 0.0
        self.raw_value = 0.0
        self.state: object = None
        self.depth = 0

    def expanded(self) -> bool:
        return bool(self.children)

    def value(self) -> float:
        return self.value_sum / self.visits


class MinMax:
    def __init__(self) -> None:
        self.lo, self.hi = math.inf, -math.inf

    def update(self, v: float) -> None:
        self.lo, self.hi = min(self.lo, v), max(self.hi, v)

    def normalize(self, v: float) -> float:
        if self.hi > self.lo:
            return (v - self.lo) / (self.hi - self.lo)
        return v


def _argmax(scores: list[float]) -> int:
    best = 0
    for i, s in enumerate(scores):
        if s > scores[best]:
            best = i
    return best


def _expand(node: Node, state: object, reward: float, priors: list[float], value: float, depth: int) -> None:
    node.state, node.reward, node.raw_value, node.depth = state, reward, value, depth
    for a, p in enumerate(priors):
        node.children[a] = Node(p)


def _q(node: Node, child: Node, discount: float) -> float:
    return child.reward + discount * child.value()


def _puct_child(
    node: Node, discount: float, c1: float, c2: float, mm: MinMax, legal: list[bool] | None, mean_q: bool = False
) -> int:
    scores = []
    for a, child in node.children.items():
        if legal is not None and not legal[a]:
            scores.append(-math.inf)
            continue
        c = (math.log((node.visits + c2 + 1) / c2) + c1) * math.sqrt(node.visits)
        unvisited = 0.0
        if mean_q:  # the mean Q of the visited children, the node's own value before any
            tried = [_q(node, k, discount) for k in node.children.values() if k.visits > 0]
            unvisited = mm.normalize(sum(tried) / len(tried) if tried else node.value())
        value_score = mm.normalize(_q(node, child, discount)) if child.visits > 0 else unvisited
        scores.append(value_score + c * child.prior / (child.visits + 1))
    return _argmax(scores)


def _sigma(node: Node, discount: float, c_visit: float, c_scale: float) -> list[float]:
    kids = [node.children[a] for a in range(len(node.children))]
    total = sum(k.visits for k in kids)
    visited = [k for k in kids if k.visits > 0]
    mass = sum(k.prior for k in visited)
    if visited:
        weighted = sum(k.prior * _q(node, k, discount) for k in visited) / max(mass, 1e-300)
    else:
        weighted = 0.0
    mixed = (node.raw_value + total * weighted) / (1 + total)
    completed = [_q(node, k, discount) if k.visits > 0 else mixed for k in kids]
    lo, hi = min(completed), max(completed)
    rescaled = [(c - lo) / max(hi - lo, 1e-8) for c in completed]
    top = max(k.visits for k in kids)
    return [(c_visit + top) * c_scale * r for r in rescaled]


def _log(p: float) -> float:
    return math.log(p) if p > 0 else -math.inf


def _gumbel_interior(node: Node, discount: float, c_visit: float, c_scale: float) -> int:
    sigma = _sigma(node, discount, c_visit, c_scale)
    logits = [_log(node.children[a].prior) + sigma[a] for a in range(len(sigma))]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    z = sum(exps)
    total = sum(k.visits for k in node.children.values())
    return _argmax([exps[a] / z - node.children[a].visits / (1 + total) for a in range(len(sigma))])


def _gumbel_root(node: Node, gumbel: list[float], target: int, discount: float, c_visit: float, c_scale: float) -> int:
    sigma = _sigma(node, discount, c_visit, c_scale)
    scores = []
    for a in range(len(sigma)):
        kid = node.children[a]
        s = gumbel[a] + _log(kid.prior) + sigma[a]
        scores.append(s if kid.visits == target else -math.inf)
    return _argmax(scores)


def reference_search(
    step: StepFn,
    root_state: object,
    root_prior: list[float],
    root_value: float,
    *,
    num_simulations: int,
    discount: float,
    pb_c_init: float = 1.25,
    pb_c_base: float = 19652.0,
    legal: list[bool] | None = None,
    gumbel: list[float] | None = None,
    max_num_considered_actions: int = 16,
    c_visit: float = 50.0,
    c_scale: float = 0.1,
    unvisited_q: str = "zero",
) -> dict:
    """One tree. ``root_prior`` is the final root prior (after masking and noise); ``gumbel`` the
    root's Gumbel draws (Gumbel mode) or ``None`` (PUCT)."""
    root = Node(1.0)
    _expand(root, root_state, 0.0, root_prior, root_value, 0)
    root.visits, root.value_sum = 1, root_value
    mm = MinMax()
    num_legal = sum(legal) if legal is not None else len(root_prior)
    schedule = considered_visit_sequence(min(max_num_considered_actions, num_legal), num_simulations)
    max_depth = 0
    for sim in range(num_simulations):
        node, path = root, [root]
        while True:
            if gumbel is None:
                a = _puct_child(
                    node, discount, pb_c_init, pb_c_base, mm, legal if node is root else None, unvisited_q == "mean"
                )
            elif node is root:
                a = _gumbel_root(node, gumbel, schedule[sim], discount, c_visit, c_scale)
            else:
                a = _gumbel_interior(node, discount, c_visit, c_scale)
            child = node.children[a]
            if not child.expanded():
                break
            node = child
            path.append(node)
        state, reward, priors, value = step(node.state, a)
        _expand(child, state, reward, priors, value, node.depth + 1)
        max_depth = max(max_depth, child.depth)
        path.append(child)
        g = value
        for n in reversed(path):
            n.value_sum += g
            n.visits += 1
            mm.update(n.reward + discount * n.value())
            g = n.reward + discount * g
    kids = [root.children[a] for a in range(len(root_prior))]
    out = {
        "visit_counts": [k.visits for k in kids],
        "q_values": [_q(root, k, discount) if k.visits else 0.0 for k in kids],
        "root_value": root.value(),
        "max_depth": max_depth,
    }
    if gumbel is not None:
        sigma = _sigma(root, discount, c_visit, c_scale)
        top = max(k.visits for k in kids)
        out["action"] = _argmax(
            [
                gumbel[a] + _log(kids[a].prior) + sigma[a] if kids[a].visits == top else -math.inf
                for a in range(len(kids))
            ]
        )
        logits = [_log(kids[a].prior) + sigma[a] for a in range(len(kids))]
        m = max(logits)
        exps = [math.exp(x - m) for x in logits]
        out["policy"] = [e / sum(exps) for e in exps]
    return out
