"""Callbacks that send the fit's own process a signal at a chosen point (the subprocess tests of
scheduler signals list them under ``trainer.callbacks``)."""

import os
import signal

import pytorch_lightning as pl


class SignalAtStep(pl.Callback):
    """``kill -<signum> <own pid>`` after optimizer step ``step`` (0: when training starts, before
    the first batch, i.e. while the learner waits for its first rows)."""

    def __init__(self, step: int = 0, signum: int = int(signal.SIGTERM)) -> None:
        self.step, self.signum, self.sent = step, signum, False

    def _maybe(self, trainer: pl.Trainer) -> None:
        if not self.sent and trainer.global_step >= self.step:
            self.sent = True
            print(f"sending signal {self.signum} at step {trainer.global_step}", flush=True)
            os.kill(os.getpid(), self.signum)

    def on_train_start(self, trainer, pl_module):
        if self.step == 0:
            self._maybe(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.step > 0:
            self._maybe(trainer)
