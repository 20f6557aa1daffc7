"""Callbacks that probe a fit, given by ``class_path`` (``support.fit_probes.<name>``): crash it at a
given step, record what a resumed fit starts from, mark in a file that training has reached a step,
send the fit's own process a signal at a step."""

import os
import signal
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

SEEN: dict[str, Any] = {}


class CrashAt(pl.Callback):
    """Raise (like a killed process, nothing saved on the way out) once ``step`` steps are done."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            raise RuntimeError(f"simulated crash at step {trainer.global_step}")


class RecordStart(pl.Callback):
    """Copy the state a fit starts training from into ``SEEN``."""

    def on_train_start(self, trainer, pl_module) -> None:
        dm = trainer.datamodule
        SEEN.clear()
        SEEN.update(
            global_step=trainer.global_step,
            env_steps=dm.collector.stats.env_steps,
            buffer=dm.buffer.state_dict(),
            model={k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            optimizers=[
                {
                    k: {n: t.clone() if torch.is_tensor(t) else t for n, t in s.items()}
                    for k, s in opt.state_dict()["state"].items()
                }
                for opt in trainer.optimizers
            ],
        )


class MarkAt(pl.Callback):
    """Write ``path`` (with the step) once ``step`` training steps are done: another process can wait
    for the file instead of sleeping until training is surely going."""

    def __init__(self, path: str, step: int = 1) -> None:
        self.path, self.step = Path(path), step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step and not self.path.exists():
            self.path.write_text(str(trainer.global_step))


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


class StuckStopping(pl.Callback):
    """A shutdown that hangs: on a stop (any exception) write ``path`` and then wait for ever, as a
    fit stuck in its graceful stop would (only a second Ctrl-C ends it)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_exception(self, trainer, pl_module, exception) -> None:
        import threading

        self.path.write_text(type(exception).__name__)
        threading.Event().wait()
