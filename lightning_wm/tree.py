"""Pytrees of arrays: the one place nested data (dict observations, recurrent states, rows) is walked.

A *tree* is a leaf (tensor, numpy array, scalar), ``None``, or a ``Mapping`` / ``tuple`` / ``list``
of trees. Mappings keep their keys, tuples and lists their type. Functions taking several trees
expect them to have the same structure as the first.

* :func:`tree_map` ``(fn, *trees)`` — apply ``fn`` leaf-wise;
* :func:`flatten` / :func:`unflatten` — nested mappings <-> ``{"obs/image": leaf}`` (storage keys);
* :func:`first_leaf` — e.g. the batch size of a dict observation;
* :func:`stack` — a list of trees -> one tree of stacked leaves (torch or numpy);
* :func:`where` — ``mask ? new : old`` over the batch dimension (reset recurrent states where an
  episode begins).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

Tree = Any

__all__ = ["Tree", "tree_map", "flatten", "unflatten", "first_leaf", "leaves", "stack", "concat", "where"]


def tree_map(fn: Callable[..., Any], tree: Tree, *rest: Tree) -> Tree:
    """``fn(leaf, *matching leaves of rest)`` for every leaf; ``None`` stays ``None``."""
    if tree is None:
        return None
    if isinstance(tree, Mapping):
        return {k: tree_map(fn, v, *(r[k] for r in rest)) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(tree_map(fn, v, *(r[i] for r in rest)) for i, v in enumerate(tree))
    return fn(tree, *rest)


def leaves(tree: Tree) -> list[Any]:
    """The leaves of ``tree`` in traversal order (``None`` has none)."""
    out: list[Any] = []
    tree_map(out.append, tree)
    return out


def first_leaf(tree: Tree) -> Any:
    """A leaf of ``tree`` (e.g. to read the batch size of a dict observation)."""
    while isinstance(tree, (Mapping, tuple, list)):
        tree = next(iter(tree.values())) if isinstance(tree, Mapping) else tree[0]
    return tree


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> ``{"a/b": leaf}``; keys must be non-empty strings without ``/``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if not isinstance(key, str) or not key or "/" in key:
            raise ValueError(f"key {prefix + str(key)!r} is invalid: keys must be non-empty strings without '/'")
        name = prefix + key
        if isinstance(value, Mapping):
            if not value:
                raise ValueError(f"key {name!r} is an empty mapping")
            flat.update(flatten(value, name + "/"))
        else:
            flat[name] = value
    return flat


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`flatten`."""
    out: dict[str, Any] = {}
    for name, value in flat.items():
        parts = name.split("/")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def stack(trees: list[Tree], dim: int = 0) -> Tree:
    """Stack matching leaves of ``trees`` along a new dimension ``dim`` (torch leaves with
    ``torch.stack``, anything else with ``numpy.stack``)."""
    if not trees:
        raise ValueError("stack() needs at least one tree")

    def _stack(*xs: Any) -> Any:
        if isinstance(xs[0], Tensor):
            return torch.stack(xs, dim)
        return np.stack(xs, dim)

    return tree_map(_stack, trees[0], *trees[1:])


def concat(trees: list[Tree], dim: int = 0) -> Tree:
    """Join matching leaves of ``trees`` along their existing dimension ``dim`` (torch leaves with
    ``torch.cat``, anything else with ``numpy.concatenate``; ``None`` stays ``None``)."""
    if not trees:
        raise ValueError("concat() needs at least one tree")

    def _concat(*xs: Any) -> Any:
        if isinstance(xs[0], Tensor):
            return torch.cat(xs, dim)
        return np.concatenate(xs, dim)

    return tree_map(_concat, trees[0], *trees[1:])


def where(mask: Tensor, new: Tree, old: Tree) -> Tree:
    """Per batch entry: ``new`` where ``mask [B]`` is true, else ``old`` (tensor leaves, batch
    dimension first; ``new`` is cast to ``old``'s device and dtype)."""

    def _where(o: Tensor, n: Tensor) -> Tensor:
        shaped = mask.to(o.device).view(-1, *([1] * (o.dim() - 1)))
        return torch.where(shaped, n.to(o.device, o.dtype), o)

    return tree_map(_where, old, new)
