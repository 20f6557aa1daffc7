"""Evaluation episodes: the validation of the datamodules that act in envs (online and generation
datamodules; an :class:`~lightning_wm.protocols.EvaluationRequest` loader and the episodes it
plays), and what the ``evaluate`` command writes beside its printed line: the filmed first episode
(``--video``) and the record ``--out`` appends (one JSON line a run: the result, every episode's
return, the checkpoint read and the model's settings), so tables of evaluations are printed from
files, not copied from a terminal."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
from torch.utils.data import DataLoader

from lightning_wm.data.collector import Collector, run_evaluation
from lightning_wm.data.settings import EvalSettings
from lightning_wm.envs import EnvConfig, EnvSpec, env_spec, make_env
from lightning_wm.protocols import Agent, EvaluationRequest
from lightning_wm.seeding import derive_seed
from lightning_wm.settings import as_settings, plain
from lightning_wm.video import write_video

__all__ = [
    "evaluation_loader",
    "eval_settings",
    "check_eval_env",
    "play_evaluation",
    "film_episode",
    "evaluation_record",
]


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


def film_episode(model: Any, config: EnvConfig, seed: int, path: str, explore: bool) -> dict[str, float]:
    """One episode in an env that also renders full frames; writes them to ``path`` (GIF or MP4).
    Returns the episode's ``{"return", "length"}`` as the collector reports it."""
    import gymnasium as gym

    one = EnvConfig(**{**vars(config), "num_envs": 1, "seed": seed})
    env = gym.vector.SyncVectorEnv(
        [lambda: make_env(one, render_mode="rgb_array")], autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP
    )
    try:
        collector = Collector(env, model, seeds=seed)
        frames: list[np.ndarray] = []
        collector.reset()
        frames.append(env.envs[0].render())
        while not (done := collector.collect(1, explore)):
            frames.append(env.envs[0].render())
    finally:
        env.close()
    write_video(frames, path)
    return done[0]


def evaluation_record(
    model: pl.LightningModule,
    env: EnvConfig,
    seed: int,
    checkpoint: tuple[Path, int | None] | None,
    run_dir: str,
    result: dict[str, float],
    returns: np.ndarray,
) -> dict[str, Any]:
    """The JSON record of one ``evaluate`` run.

    Args:
        model: the evaluated model; its class and saved hyperparameters (``model.hparams``) go in.
        env: the evaluation env's settings; ``seed`` the first episode's seed.
        checkpoint: the file the weights were read from and the training step it was saved at
            (``None``: the model as built).
        run_dir: the run folder of the config (``lightning_logs/<run_name>``).
        result: ``evaluate``'s summary (``return_mean``, ``return_std``, ``length_mean``, ``episodes``).
        returns: ``[episodes]`` every episode's return, in episode order.
    """
    hparams = plain({k: v for k, v in dict(getattr(model, "hparams", {})).items() if k != "env_spec"})
    return {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "run": Path(run_dir).name,
        "checkpoint": None if checkpoint is None else str(Path(checkpoint[0]).resolve()),
        "checkpoint_step": None if checkpoint is None else checkpoint[1],
        "model": f"{type(model).__module__}.{type(model).__name__}",
        "hparams": hparams,
        "env": {"id": env.id, "seed": seed, **({"kwargs": env.kwargs} if env.kwargs else {})},
        **result,
        "returns": [float(r) for r in returns],
    }
