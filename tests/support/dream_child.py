"""What a spawned process does with ``lightning_wm/Dream-v0`` (test_env_ids.py): it imports only
the env factory, as an actor or env worker does, and makes a dream from its id."""

from __future__ import annotations

import sys
from typing import Any


def make_dream_here(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Make one dream and a batch of two from ``kwargs`` (the id's keyword arguments) in this
    process -> whether the Dreamer package was imported before (``dreamer_before``) and after
    (``dreamer_after``), and the first observations' shapes (``single``, ``vector``)."""
    from lightning_wm.envs import DREAM_ENV_ID, EnvConfig, make_env, make_vector_env

    before = "lightning_wm.agents.dreamer" in sys.modules
    single, _ = make_env(EnvConfig(id=DREAM_ENV_ID, kwargs=kwargs)).reset(seed=0)
    vector = make_vector_env(EnvConfig(id=DREAM_ENV_ID, num_envs=2, kwargs=kwargs))
    batch, _ = vector.reset(seed=1)
    return {
        "dreamer_before": before,
        "dreamer_after": "lightning_wm.agents.dreamer" in sys.modules,
        "single": tuple(single.shape),
        "vector": tuple(batch.shape),
    }
