""":class:`OfflineModel`: the base of World Models' V and M, fit offline on recorded episodes."""

from __future__ import annotations

import sys
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EarlyStopping
from torch import Tensor

from lightning_wm.agents.base import RLModule
from lightning_wm.optim import GradClipper, OptimSettings, build_optimizer, optimizer_beta, with_lr_schedule

__all__ = ["OfflineModel", "ReportedEarlyStopping", "check_patience"]


def check_patience(patience: int | None) -> None:
    """Refuse a ``patience`` below one validation (None: no early stopping)."""
    if patience is not None and patience < 1:
        raise ValueError(f"patience must be >= 1 validations (or null: no early stopping), got {patience}")


class ReportedEarlyStopping(EarlyStopping):
    """Lightning's ``EarlyStopping`` that says so: a fit it ends before ``max_epochs`` prints one
    line (to stderr, rank 0) with the best ``val/loss``, the patience and where it stopped, so a
    short fit is never mistaken for a finished one."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.stopped_epoch > 0 and trainer.is_global_zero:
            print(
                f"early stopping: {self.monitor} has not gone below {float(self.best_score):.4g} for "
                f"{self.patience} validations: stopped after epoch {self.stopped_epoch + 1} of "
                f"{trainer.max_epochs} (model.init_args.patience; null trains to the end)",
                file=sys.stderr,
            )


class OfflineModel(RLModule):
    """A model fit on batches of an :class:`~lightning_wm.data.modules.EpisodeDataModule`.

    Subclasses keep ``self.optim`` (:class:`~lightning_wm.optim.OptimSettings`) and
    ``self.patience`` and implement :meth:`losses`; this base gives:

    * ``training_step`` = :meth:`losses` -> :meth:`report` (``train/<term>``);
    * the optimizer from ``optim`` (:func:`~lightning_wm.optim.build_optimizer`, with its
      learning-rate schedule) and gradient clipping from ``optim.clip``
      (:class:`~lightning_wm.optim.GradClipper`; or the trainer's ``gradient_clip_val``, not both);
    * early stopping after ``patience`` validations without a lower ``val/loss`` (Lightning's
      ``EarlyStopping``; HumbleRL's ``patience``).

    It does not act; it is an :class:`~lightning_wm.agents.base.RLModule` for what every model of
    this project shares: ``save_settings`` (groups stored as plain dicts in checkpoints) and the
    warning when ``optim.lr_anneal_steps`` ends before the trainer's ``max_steps``.
    """

    optim: OptimSettings
    patience: int | None
    best_metric = ("val/loss", "min")  # best.ckpt: the lowest validation loss

    def losses(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """The loss terms of a batch: ``loss`` (what is minimised) and the terms it is made of."""
        raise NotImplementedError

    def report(self, stage: str, losses: dict[str, Tensor], batch_size: int | None = None) -> None:
        """Log ``losses`` as ``<stage>/<term>``: ``train/loss`` in the progress bar; validation
        and test terms averaged over the epoch's batches (and ranks)."""
        if stage == "train":
            self.log_dict({f"train/{k}": v for k, v in losses.items() if k != "loss"})
            self.log("train/loss", losses["loss"], prog_bar=True)
        else:
            self.log_dict({f"{stage}/{k}": v for k, v in losses.items()}, batch_size=batch_size, sync_dist=True)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        losses = self.losses(batch)
        self.report("train", losses)
        return losses["loss"]

    def configure_optimizers(self) -> Any:
        return with_lr_schedule(build_optimizer(self.parameters(), self.optim), self.optim)

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        if self.optim.clip.type is None:  # the trainer's gradient_clip_val, if any
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        if gradient_clip_val:
            raise ValueError(
                f"both optim.clip ({self.optim.clip.type}) and the trainer's gradient_clip_val "
                f"({gradient_clip_val}) clip {type(self).__name__}'s gradients: set one of them"
            )
        clipper = getattr(self, "_clipper", None)
        if clipper is None:  # built at the first step: the momentum variants use the optimizer's decay
            momentum = self.optim.clip.type in ("clip_momentum", "clip_momentum_norm")
            beta = optimizer_beta(optimizer) if momentum else 0.999
            self._clipper = clipper = GradClipper.from_settings(self.optim.clip, beta)
        clipper(self.parameters())

    def configure_callbacks(self) -> list[ReportedEarlyStopping]:
        if self.patience is None:
            return []
        # strict=False: a fit too short to validate (under one epoch) has no val/loss to compare
        return [ReportedEarlyStopping(monitor="val/loss", mode="min", patience=self.patience, strict=False)]
