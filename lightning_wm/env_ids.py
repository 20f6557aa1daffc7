"""The gymnasium ids this package adds, registered when ``lightning_wm`` is imported.

``lightning_wm/Dream-v0`` (:data:`DREAM_ENV_ID`) is a trained Dreamer's dream as an env, so any
agent with its own encoder trains inside it by config (``configs/impala/cartpole_in_dream.yaml``).
It is registered here with *string* entry points: gymnasium imports the Dreamer package only when
such an env is made. Every process that can make an env has imported ``lightning_wm`` (the env
factory is :mod:`lightning_wm.envs`), so a spawned actor or env worker finds the id without
importing an agent first, and :mod:`lightning_wm.envs` itself names no agent (the layer rule of
``docs/architecture.md``).
"""

from __future__ import annotations

import gymnasium as gym

__all__ = ["DREAM_ENV_ID", "register_env_ids"]

DREAM_ENV_ID = "lightning_wm/Dream-v0"
_DREAM_MODULE = "lightning_wm.agents.dreamer.dream"


def register_env_ids() -> None:
    """Register the package's ids with gymnasium (once; an id already there is left as it is).

    ``gym.make(DREAM_ENV_ID, **kwargs)`` builds one dream (``make_dream_env``),
    ``gym.make_vec(DREAM_ENV_ID, n, vectorization_mode="vector_entry_point", **kwargs)`` ``n`` dreams
    stepped as one batch (``make_dream_vector_env``); the keyword arguments are those of
    ``lightning_wm.agents.dreamer.dream_from_checkpoint``.
    """
    if DREAM_ENV_ID not in gym.registry:
        gym.register(
            DREAM_ENV_ID,
            entry_point=f"{_DREAM_MODULE}:make_dream_env",
            vector_entry_point=f"{_DREAM_MODULE}:make_dream_vector_env",
        )


register_env_ids()
