"""The :class:`Imagination` callback: Dyna's loop between the trainer, the datamodule and the learner."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback

from lightning_wm.agents.dyna.imagination import DynaWorldModel
from lightning_wm.protocols import ImaginationHost

__all__ = ["Imagination"]


class Imagination(Callback):
    """Dyna's loop (DI-engine's ``eval`` / ``fill_img_buffer`` after each model training).

    After every training batch of a module with a ``dyna`` world model
    (:class:`~lightning_wm.agents.dyna.DynaWorldModel`, e.g. a
    :class:`~lightning_wm.agents.dyna.DynaLearner`) on a datamodule that is an
    :class:`~lightning_wm.protocols.ImaginationHost`, counting this rank's env steps
    (``module.env_steps``):

    * when the model is due for evaluation (``dyna.should_eval``, every ``eval_freq`` env steps
      once imagination began), log its one-step prediction error on the newest real rows
      (:meth:`~lightning_wm.agents.dyna.DynaWorldModel.evaluate`, ``world_model/eval_*``);
    * when it is due for training (``dyna.should_train``, every ``train_freq`` env steps), roll
      the module (the current policy) through the model from real rows of the datamodule's real
      buffer, hand the imagination buffer and ``real_ratio`` to the datamodule and record the
      model version (``dyna.trained``); log ``imagination/rows`` and ``imagination/fills``.

    Nothing happens for another module or datamodule. The CLI adds it to every run.
    """

    def __init__(self) -> None:
        self._buffer: Any = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        dyna, host = getattr(pl_module, "dyna", None), getattr(trainer, "datamodule", None)
        if not isinstance(dyna, DynaWorldModel) or not isinstance(host, ImaginationHost):
            return
        envstep = int(pl_module.env_steps)
        log = dict(on_step=True, rank_zero_only=True, batch_size=1)
        if dyna.should_eval(envstep):
            for name, value in dyna.evaluate(host.real_buffer()).items():
                pl_module.log(name, value, **log)
            dyna.evaluated(envstep)
        if not dyna.should_train(envstep):
            return
        self._buffer = dyna.fill_img_buffer(
            pl_module, host.real_buffer(), self._buffer, envstep, policy_version=int(trainer.global_step)
        )
        host.set_imagination(self._buffer, dyna.real_ratio)
        dyna.trained(envstep)
        pl_module.log("imagination/rows", float(len(self._buffer) if self._buffer is not None else 0), **log)
        pl_module.log("imagination/fills", float(dyna.fills), **log)
