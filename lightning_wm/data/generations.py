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

from lightning_wm.data.collector import run_evaluation
from lightning_wm.data.modules import evaluation_loader
from lightning_wm.envs import EnvConfig, EnvSpec, env_spec
from lightning_wm.protocols import GenerationTask
from lightning_wm.seeding import derive_seed


class _Generations(IterableDataset):
    def __init__(self, env: EnvConfig | None) -> None:
        self.env = env

    def __iter__(self) -> Iterator[GenerationTask]:
        for generation in itertools.count():
            yield GenerationTask(generation, self.env)


class GenerationDataModule(pl.LightningDataModule):
    """Generation tasks for training; real-env episodes for validation.

    Args:
        env: the real environment (population fitness in the real env, validation, evaluate).
        eval_episodes: episodes per validation.
        eval_envs: envs those episodes run in together.
    """

    def __init__(self, env: EnvConfig = EnvConfig(), eval_episodes: int = 10, eval_envs: int = 10) -> None:
        super().__init__()
        self.env = env
        self.spec: EnvSpec = env_spec(env)
        self.eval_episodes, self.eval_envs = eval_episodes, eval_envs

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Generations(self.env), batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        return evaluation_loader(self.evaluate)

    test_dataloader = val_dataloader

    def evaluate(self, agent: Any, episodes: int | None = None) -> list[dict[str, float]]:
        """Run ``episodes`` real episodes of ``agent`` with ``explore=False`` (seeds distinct per DDP rank)."""
        trainer = getattr(self, "trainer", None)
        rank = trainer.global_rank if trainer is not None else 0
        return run_evaluation(
            self.env,
            agent,
            episodes or self.eval_episodes,
            self.eval_envs,
            derive_seed(self.env.seed, "eval", rank),
            spec=self.spec,
        )
