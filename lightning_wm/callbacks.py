"""Callbacks: the glue between the trainer, the datamodule and the module.

Each callback finds what it needs on ``trainer.datamodule`` through a protocol of
:mod:`lightning_wm.protocols`; a datamodule without that protocol makes it do nothing. The
CLI's Trainer adds :func:`default_callbacks` to every run.

* :class:`EnvStatsLogger` — env steps, episode returns/lengths and actor gauges (``env/*``,
  ``actors/*``) from an :class:`~lightning_wm.protocols.EnvStatsSource`.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback

from lightning_wm.protocols import EnvStats, EnvStatsSource

__all__ = ["EnvStatsLogger", "default_callbacks"]


def _datamodule(trainer: pl.Trainer) -> Any:
    return getattr(trainer, "datamodule", None)


class EnvStatsLogger(Callback):
    """Log the datamodule's env statistics every ``trainer.log_every_n_steps`` steps.

    Around every training batch it pops :class:`~lightning_wm.protocols.EnvStats` from the
    datamodule and accumulates the finished episodes; when ``global_step`` is a multiple of
    ``log_every_n_steps`` it logs, reduced over DDP ranks:

    * ``env/steps``: env steps of all ranks together (progress bar);
    * ``env/episode_return``, ``env/episode_length``: means over the episodes of all ranks
      finished since the last log (return in the progress bar), ``env/episodes`` their count;
    * every gauge of ``EnvStats.metrics`` (latest value per rank, averaged over the ranks that
      report it).

    It also keeps ``pl_module.env_steps`` (this rank's env steps) current before every
    training step, for modules whose schedules count env steps (the module never reads the
    datamodule itself).
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._return_sum = 0.0
        self._length_sum = 0.0
        self._count = 0
        self._metrics: dict[str, float] = {}

    def _pop(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> EnvStats | None:
        source = _datamodule(trainer)
        if not isinstance(source, EnvStatsSource):
            return None
        stats = source.pop_env_stats()
        for episode in stats.episodes:
            self._return_sum += float(episode["return"])
            self._length_sum += float(episode["length"])
            self._count += 1
        self._metrics.update(stats.metrics)
        if hasattr(pl_module, "env_steps"):
            pl_module.env_steps = int(stats.env_steps)
        return stats

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._pop(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        stats = self._pop(trainer, pl_module)
        if stats is None:
            return
        if trainer.global_step % max(1, trainer.log_every_n_steps) != 0:
            return
        strategy, device = trainer.strategy, pl_module.device
        totals = torch.tensor([float(stats.env_steps), self._return_sum, self._length_sum, float(self._count)],
                              dtype=torch.float64, device=device)
        env_steps, return_sum, length_sum, count = strategy.reduce(totals, reduce_op="sum").tolist()
        log = dict(on_step=True, rank_zero_only=True, batch_size=1)
        pl_module.log("env/steps", env_steps, prog_bar=True, **log)
        if count > 0:
            pl_module.log("env/episode_return", return_sum / count, prog_bar=True, **log)
            pl_module.log("env/episode_length", length_sum / count, **log)
            pl_module.log("env/episodes", count, **log)
        names = _union_over_ranks(sorted(self._metrics), trainer.world_size)
        if names:
            pairs = torch.tensor([[self._metrics[n], 1.0] if n in self._metrics else [0.0, 0.0] for n in names],
                                 dtype=torch.float64, device=device)
            pairs = strategy.reduce(pairs, reduce_op="sum")
            for name, (total, ranks) in zip(names, pairs.tolist()):
                if ranks > 0:
                    pl_module.log(name, total / ranks, **log)
        metrics = self._metrics
        self._reset()
        self._metrics = metrics  # gauges keep their latest value until a new one arrives


def _union_over_ranks(names: list[str], world_size: int) -> list[str]:
    """The sorted union of ``names`` over all DDP ranks (every rank must then reduce the same
    metrics in the same order, or the collectives would not match)."""
    if world_size <= 1 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return names
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, names)
    return sorted({n for part in gathered for n in part})


def default_callbacks() -> list[Callback]:
    """The callbacks every CLI run gets (the Trainer skips a type the config already lists)."""
    return [EnvStatsLogger()]
