"""Nested mappings of arrays (dict observations) <-> flat ``{'obs/key': array}`` dicts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings into ``{'a/b': value}``; keys must be non-empty and have no ``/``."""
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


def tree_map(fn: Any, tree: Any) -> Any:
    """Apply ``fn`` to every leaf of nested mappings (a bare leaf is a tree of one)."""
    if isinstance(tree, Mapping):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    return fn(tree)


def first_leaf(tree: Any) -> Any:
    """A leaf of ``tree`` (e.g. to read the batch size of a dict observation)."""
    while isinstance(tree, Mapping):
        tree = next(iter(tree.values()))
    return tree
