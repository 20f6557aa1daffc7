"""A fit for unit tests: no logger, checkpoints, progress bar or validation; the project's default
callbacks (the agent attached to the datamodule, feedback written back) plus the test's own."""

import pytorch_lightning as pl

from lightning_wm.callbacks import default_callbacks


def quiet_trainer(**settings: object) -> pl.Trainer:
    """A Lightning Trainer that writes and prints nothing of its own: no logger, checkpoints,
    progress bar or model summary; ``settings`` add to (or replace) those."""
    return pl.Trainer(
        **{
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            **settings,
        }
    )


def fit_quietly(
    model: pl.LightningModule, datamodule: pl.LightningDataModule, steps: int, *callbacks: pl.Callback
) -> pl.Trainer:
    """Train ``model`` on ``datamodule`` for ``steps`` optimizer steps; returns the trainer."""
    trainer = quiet_trainer(
        max_steps=steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[*default_callbacks(), *callbacks],
    )
    trainer.fit(model, datamodule)
    return trainer
