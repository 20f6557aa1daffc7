"""A trained Dreamer's dream as a gymnasium env: what the id ``lightning_wm/Dream-v0`` builds, so
that any agent with its own encoder (IMPALA, MuZero, ...) trains inside it by config and is
validated in the real env (``eval.env``).

:mod:`lightning_wm.env_ids` registers the id with gymnasium when ``lightning_wm`` is imported, its
entry points naming :func:`make_dream_env` and :func:`make_dream_vector_env` by string (so this
module is imported only when a dream is made); :mod:`lightning_wm.envs` knows its name
(``DREAM_ENV_ID``) and checks its options, but imports nothing of the agents."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from lightning_wm.agents.dreamer.agent import Dreamer
from lightning_wm.checkpoints import load_module
from lightning_wm.data.episodes import EpisodeStore
from lightning_wm.dream_env import DreamEnv, DreamSingleEnv, start_states
from lightning_wm.envs import EnvConfig, env_spec


def dream_from_checkpoint(
    dreamer_ckpt: str,
    episodes: str,
    real_env: str | Mapping[str, Any] = "CartPole-v1",
    num_envs: int = 1,
    starts: Literal["first", "all"] = "first",
    max_starts: int | None = None,
    max_episode_steps: int = 500,
    done_mode: Literal["threshold", "sample"] = "threshold",
    done_threshold: float = 0.5,
    reward: Literal["head", "survival"] = "head",
    seed: int | None = None,
    render_mode: str | None = "rgb_array",
) -> DreamEnv:
    """A :class:`DreamEnv` in a trained Dreamer's RSSM whose observations are decoded into the real
    env's format, so that any agent with its own encoder (IMPALA, MuZero, ...) trains inside it.

    This is what the gymnasium id ``lightning_wm/Dream-v0`` builds (registered by :mod:`lightning_wm.env_ids`;
    its keyword arguments are these, given as ``env.kwargs`` in a config): ``gym.make`` gives one dream (:class:`DreamSingleEnv`), ``make_vector_env`` all of
    ``num_envs`` stepped in one batch.

    Args:
        dreamer_ckpt: a Dreamer checkpoint trained on ``real_env``.
        episodes: an episode store of ``real_env`` (``main.py record``): dreams start from the
            RSSM's filtered states of its rows (``starts``: episodes' first rows, or ``all`` rows).
        real_env: the real env's id, or its :class:`~lightning_wm.envs.EnvConfig` fields as a
            mapping (``{"id": "CartPole-v1", "pixels": true, ...}``): the spaces the dream copies.
        max_starts: keep at most this many start states (a fixed random subset).
        max_episode_steps, done_mode, done_threshold, reward, seed, render_mode: as :class:`DreamEnv`.
    Raises:
        FileNotFoundError: no checkpoint, or a store without episodes (the message says what to run).
    """
    config = EnvConfig(**dict(real_env)) if isinstance(real_env, Mapping) else EnvConfig(id=str(real_env))
    spec = env_spec(config)
    model = load_module(Dreamer, dreamer_ckpt, env_spec=spec).wm
    store = EpisodeStore(episodes)
    if not store.paths():
        raise FileNotFoundError(
            f"dream start store {episodes!r} holds no episodes; record some of {config.id} first "
            "(python main.py record ...)"
        )
    with torch.random.fork_rng(devices=[]):  # the posterior's samples: the same bank in every process
        torch.manual_seed(0)
        bank = start_states(model, store.episodes(), where=starts, max_starts=max_starts, seed=0)
    return DreamEnv(
        model,
        spec.action_space,
        bank,
        num_envs=num_envs,
        max_episode_steps=max_episode_steps,
        done_mode=done_mode,
        done_threshold=done_threshold,
        reward=reward,
        observation="decoded",
        seed=seed,
        render_mode=render_mode,
    )


def make_dream_env(**kwargs: Any) -> DreamSingleEnv:
    """``gym.make("lightning_wm/Dream-v0", **kwargs)``: one dream (:func:`dream_from_checkpoint`)."""
    return DreamSingleEnv(dream_from_checkpoint(num_envs=1, **kwargs))


def make_dream_vector_env(num_envs: int = 1, **kwargs: Any) -> DreamEnv:
    """``gym.make_vec("lightning_wm/Dream-v0", num_envs, vectorization_mode="vector_entry_point")``:
    ``num_envs`` dreams stepped as one batch."""
    return dream_from_checkpoint(num_envs=num_envs, **kwargs)
