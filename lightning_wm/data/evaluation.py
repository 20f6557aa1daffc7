"""Validation episodes of the datamodules that act in envs (online and generation datamodules):
an :class:`~lightning_wm.protocols.EvaluationRequest` loader and the episodes it plays."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch.utils.data import DataLoader

from lightning_wm.data.collector import run_evaluation
from lightning_wm.data.settings import EvalSettings
from lightning_wm.envs import EnvConfig, EnvSpec, env_spec
from lightning_wm.protocols import Agent, EvaluationRequest
from lightning_wm.seeding import derive_seed
from lightning_wm.settings import as_settings, plain

__all__ = ["evaluation_loader", "eval_settings", "check_eval_env", "play_evaluation"]


def evaluation_loader(evaluate: Callable[[Agent, int | None], list[dict[str, float]]]) -> DataLoader:
    """The validation loader of a datamodule that acts: ONE batch, an :class:`EvaluationRequest`
    around ``evaluate(agent, episodes)`` (the model's ``validation_step`` calls ``batch.run(self)``)."""
    return DataLoader([EvaluationRequest(evaluate)], batch_size=None, num_workers=0)


def eval_settings(value: EvalSettings | Mapping[str, Any] | None, default: EvalSettings) -> EvalSettings:
    """``value`` as :class:`EvalSettings`; a mapping fills in the fields it lacks from ``default``
    (the datamodule's own default, which may differ from the class's)."""
    if isinstance(value, Mapping):
        return as_settings(EvalSettings, {**plain(default), **value}, "eval")
    return default if value is None else as_settings(EvalSettings, value, "eval")


def check_eval_env(env: EnvConfig, spec: EnvSpec, settings: EvalSettings) -> None:
    """``eval.env`` must take the actions and give the observations of ``env``: the policy trained
    in one acts in the other."""
    if settings.env is None:
        return
    other = env_spec(settings.env)
    if other.action_space != spec.action_space or other.obs_shape != spec.obs_shape:
        raise ValueError(
            f"eval.env {settings.env.id} (actions {other.action_space}, observations {other.obs_shape}) "
            f"does not fit env {env.id} (actions {spec.action_space}, observations "
            f"{spec.obs_shape}): the policy trained in one must act in the other"
        )


def play_evaluation(
    env: EnvConfig, spec: EnvSpec | None, settings: EvalSettings, agent: Any, episodes: int | None, rank: int
) -> list[dict[str, float]]:
    """``episodes`` (default ``settings.episodes``) episodes of ``agent`` with ``explore=False`` in
    fresh envs of ``settings.env`` or ``env``, seeded from role ``eval`` of this rank; their
    ``{"return", "length", "env"}``."""
    config = settings.env or env
    return run_evaluation(
        config,
        agent,
        episodes or settings.episodes,
        settings.envs,
        derive_seed(config.seed, "eval", rank),
        spec=spec if settings.env is None else env_spec(config),
    )
