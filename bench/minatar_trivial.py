"""The MinAtar bench's trivial policies: uniform random and each constant action of a game's
minimal action set, scored with the same greedy evaluation as the trained agents (same env
settings, same episode seeds), so that a degenerate policy (Freeway's "always up" is 14.30) is seen
beside every figure; and the cache of their scores that the bench's records carry.

numpy and torch only (imported lazily): the RLlib worker's venv imports this module too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ACTION_NAMES", "TrivialPolicy", "cached_trivial", "trivial_key", "trivial_policies", "trivial_scores"]

# MinAtar's action codes (minatar.Environment's action map) -> the trivial policies' names
ACTION_NAMES = {0: "no-op", 1: "left", 2: "up", 3: "right", 4: "down", 5: "fire"}


class TrivialPolicy:
    """The Agent protocol for a policy that ignores its observations: ``action`` every step, or
    uniformly random actions (``action`` None) from a numpy generator seeded ``seed``."""

    def __init__(self, num_actions: int, action: int | None = None, seed: int = 0) -> None:
        import numpy as np

        self.num_actions, self.action, self.rng = num_actions, action, np.random.default_rng(seed)

    def initial_state(self, batch_size: int) -> Any:
        import torch

        return torch.zeros(batch_size)

    def act(self, obs: Any, state: Any, explore: bool) -> tuple[Any, Any, dict[str, Any]]:
        """Actions ``int64 [N]`` for observations ``[N, ...]`` (a tensor or a numpy array)."""
        import torch

        n = len(obs)
        if self.action is None:
            return torch.from_numpy(self.rng.integers(self.num_actions, size=n)), state, {}
        return torch.full((n,), self.action, dtype=torch.int64), state, {}

    def __call__(self, obs: Any) -> Any:  # benchlib.greedy_episodes' policy: numpy in, numpy out
        return self.act(obs, None, False)[0].numpy()


def trivial_policies(env: Any, seed: int) -> dict[str, TrivialPolicy]:
    """``{"random": ..., "always <action>": ...}`` for a MinAtar env (its minimal action set named)."""
    action_set = getattr(env.unwrapped, "action_set", None)
    action_set = list(range(env.action_space.n)) if action_set is None else list(action_set)
    policies = {"random": TrivialPolicy(len(action_set), None, seed)}
    for index, code in enumerate(action_set):
        policies[f"always {ACTION_NAMES.get(int(code), index)}"] = TrivialPolicy(len(action_set), index)
    return policies


def trivial_scores(play: Callable[[Any], list[float]], make: Callable[[], Any], seed: int) -> dict[str, float]:
    """The mean greedy-evaluation return of every trivial policy (:func:`trivial_policies` of an
    env from ``make``); ``play(policy)`` plays the evaluation's episodes with it."""
    env = make()
    try:
        policies = trivial_policies(env, seed)
    finally:
        env.close()
    return {name: statistics.fmean(play(policy)) for name, policy in policies.items()}


def trivial_key(evaluator: str, env: dict[str, Any], episodes: int, seed: int) -> str:
    """What the trivial scores depend on, as one string (the records' cache key)."""
    return json.dumps({"evaluator": evaluator, "env": env, "episodes": episodes, "seed": seed}, sort_keys=True)


def cached_trivial(args: argparse.Namespace, key: str, compute: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """``{"key", "scores"}``: from ``--trivial-cache`` where it holds ``key``, else computed."""
    cache = json.loads(args.trivial_cache) if args.trivial_cache else {}
    scores = cache.get(key)
    if scores is None:
        start = time.perf_counter()
        scores = compute()
        print(
            f"[trivial] {args.game} seed {args.seed}: {scores} ({time.perf_counter() - start:.1f} s)", file=sys.stderr
        )
    return {"key": key, "scores": scores}
