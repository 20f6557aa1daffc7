"""``GenerationDataModule``: the "dataset" of an evolution-strategy learner.

Each training batch is a generation number (an infinite stream: stop with
``trainer.max_steps``); the learner does the work itself (one CMA-ES generation per step).
The module holds the real env the population and validation run in and exposes ``.spec``
for the CLI's link into the model. Validation yields one dummy item; the model's
``validation_step`` calls :meth:`evaluate` to run real episodes.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_wm.data.collector import run_evaluation
from lightning_wm.data.modules import OneItem
from lightning_wm.envs import EnvConfig, EnvSpec, env_spec


class _Generations(IterableDataset):
    def __iter__(self) -> Iterator[torch.Tensor]:
        for generation in itertools.count():
            yield torch.tensor(generation)


class GenerationDataModule(pl.LightningDataModule):
    """Generation numbers for training; real-env episodes for validation.

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
        return DataLoader(_Generations(), batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(OneItem(), batch_size=None, num_workers=0)

    test_dataloader = val_dataloader

    def evaluate(self, agent: Any, episodes: int | None = None) -> list[dict[str, float]]:
        """Run ``episodes`` real episodes of ``agent`` with ``explore=False`` (seeds distinct per DDP rank)."""
        trainer = getattr(self, "trainer", None)
        rank = trainer.global_rank if trainer is not None else 0
        return run_evaluation(self.env, agent, episodes or self.eval_episodes, self.eval_envs,
                              self.env.seed + 500_000 + 1000 * rank, spec=self.spec)
