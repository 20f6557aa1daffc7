"""``GenerationDataModule``: the "dataset" of an evolution-strategy learner.

Each training batch is a :class:`~lightning_wm.protocols.GenerationTask` — a generation number
and the real env to evaluate the population in — in an infinite stream (stop with
``trainer.max_steps``); the learner does the work itself (one CMA-ES generation per step).
The module holds the real env and exposes ``.spec`` for the CLI's link into the model.
Validation yields one :class:`~lightning_wm.protocols.EvaluationRequest` that the model's
``validation_step`` runs (real episodes, seeds distinct per DDP rank).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytorch_lightning as pl
from torch.utils.data import DataLoader, IterableDataset

from lightning_wm.data.evaluation import check_eval_env, eval_settings, evaluation_loader, play_evaluation
from lightning_wm.data.ranks import rank_and_world
from lightning_wm.data.settings import EvalSettings
from lightning_wm.envs import EnvConfig, EnvSpec, env_spec
from lightning_wm.protocols import GenerationTask
from lightning_wm.signals import check_stop_between_batches

DEFAULT_EVAL = EvalSettings(episodes=10, envs=10)


class _Generations(IterableDataset):
    def __init__(self, env: EnvConfig | None) -> None:
        self.env = env

    def __iter__(self) -> Iterator[GenerationTask]:
        for generation in itertools.count():
            check_stop_between_batches()  # a scheduler's stop: end after the generation before
            yield GenerationTask(generation, self.env)


class GenerationDataModule(pl.LightningDataModule):
    """Generation tasks for training; real-env episodes for validation.

    Args:
        env: the real environment (population fitness in the real env, validation, evaluate).
        eval: the validation episodes (:class:`~lightning_wm.data.settings.EvalSettings`; here 10
            episodes in 10 envs unless set).
    """

    def __init__(self, env: EnvConfig = EnvConfig(), eval: EvalSettings = DEFAULT_EVAL) -> None:
        super().__init__()
        self.env = env
        self.spec: EnvSpec = env_spec(env)
        self.eval = eval_settings(eval, DEFAULT_EVAL)
        check_eval_env(env, self.spec, self.eval)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Generations(self.env), batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        return evaluation_loader(self.evaluate)

    test_dataloader = val_dataloader

    def evaluate(self, agent: Any, episodes: int | None = None) -> list[dict[str, float]]:
        """Run ``episodes`` real episodes of ``agent`` with ``explore=False`` (seeds distinct per DDP rank)."""
        return play_evaluation(self.env, self.spec, self.eval, agent, episodes, rank_and_world(self)[0])
