"""The MinAtar bench's evaluation callback, and the run folder that lets one of its runs span sessions.

* :class:`BenchEvaluation` — a Lightning callback: at every point the bench's schedule says, it
  plays the greedy episodes and appends a row (both metrics, the clocks, the learner's values) to
  ``history``. Its state (the rows, the clocks, the training returns, what the run was started
  with) is part of every checkpoint the trainer writes, so a resumed run continues its record.

With ``--run-dir`` the bench's ``RunFolder`` gets a checkpoint after every evaluation and when a
stop request (SIGTERM, SIGUSR1, Ctrl-C) ends the run between two steps (weights, optimizer,
replay, loops and this callback's state, through the CLI's atomic checkpoint writer): a run
stopped so loses nothing, one killed outright (SIGKILL, the kill past ``--wall-minutes``) at most
the frames since its last evaluation, and the same command resumes it. ``--minutes`` and ``--wall-minutes``
count over all the sessions of a run.

Imported by the bench's workers of our systems only (it imports Lightning; the RLlib worker's venv
has none).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.exceptions import SIGTERMException

from lightning_wm.signals import RunAborted, RunStopped

__all__ = ["BenchEvaluation"]


class BenchEvaluation(pl.Callback):
    """Evaluate whenever ``schedule`` says so; keep the rows; stop the trainer at the schedule's end.

    Args:
        schedule: the bench's ``EvalSchedule`` (``due`` / ``over`` / ``resume_after``).
        play: plays the evaluation episodes with the module, returns their returns.
        training: the bench's ``TrainingReturns`` (teed from the datamodule).
        make_row: ``(trainer, frames, seconds, wall, returns) -> row`` (both metrics, the learner's values).
        report: prints a row.
        identity: what the run was started with (system, game, seed, overrides, budget): a
            checkpoint of another run is refused by name.
        checkpoint: where to save after each evaluation and on a stop request (None: no checkpoints).
        wall_start: when this session of the run started (``time.perf_counter()``; default now):
            wall time counts from there, training time from the construction.
    """

    def __init__(
        self,
        schedule: Any,
        play: Callable[[Any], list[float]],
        training: Any,
        make_row: Callable[..., dict[str, Any]],
        report: Callable[[dict[str, Any]], None],
        identity: dict[str, Any],
        checkpoint: Path | None = None,
        wall_start: float | None = None,
    ) -> None:
        self.schedule, self.play, self.training, self.make_row, self.report = schedule, play, training, make_row, report
        self.identity, self.checkpoint = identity, checkpoint
        self.history: list[dict[str, Any]] = []
        self.frames = 0  # the frames of the last training step seen (over every session of the run)
        self.saved_on_stop = False
        self.eval_time = 0.0  # over every session of the run
        self.seconds_before = self.wall_before = 0.0  # training / wall seconds of earlier sessions
        self.start = time.perf_counter()
        self.wall_start = self.start if wall_start is None else wall_start
        self._eval_here = 0.0  # evaluation seconds of this session

    def seconds(self) -> float:
        return self.seconds_before + time.perf_counter() - self.start - self._eval_here

    def wall(self) -> float:
        return self.wall_before + time.perf_counter() - self.wall_start

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        trainer.datamodule.pop_env_stats()  # the episodes finished so far reach `training`
        frames = self.frames = int(pl_module.env_steps)
        if not self.schedule.due(frames, self.seconds(), self.wall()):
            return
        start = time.perf_counter()
        modes = [(m, m.training) for m in pl_module.modules()]
        pl_module.eval()
        with torch.no_grad():
            returns = self.play(pl_module)
        for m, was_training in modes:
            m.train(was_training)
        spent = time.perf_counter() - start
        self.eval_time += spent
        self._eval_here += spent
        row = self.make_row(trainer, frames, self.seconds(), self.wall(), returns)
        self.history.append(row)
        self.report(row)
        self._save(trainer)
        if self.schedule.over(frames, self.seconds(), self.wall()):
            trainer.should_stop = True

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """A stop request ends a fit between two steps (:class:`~lightning_wm.signals.RunStopped`,
        or Lightning's own SIGTERM check): the run's checkpoint at the step reached, so that a
        session's end costs no frames. A second Ctrl-C and errors save nothing (the state may be
        what went wrong; the checkpoint of the last evaluation stays)."""
        if isinstance(exception, RunAborted) or not isinstance(exception, (RunStopped, SIGTERMException)):
            return
        trainer.datamodule.pop_env_stats()  # the episodes that ended since the last step count too
        self.saved_on_stop = self._save(trainer)

    def _refuse_if_past_the_caps(self) -> None:
        """A run short of its frames whose earlier sessions already spent this call's ``--minutes``
        or ``--wall-minutes`` (they count over all sessions) would stop at its first step and be
        recorded as finished there: say so and stop instead, the run folder untouched."""
        schedule = self.schedule
        if self.frames >= schedule.frames or not schedule.over(self.frames, self.seconds_before, self.wall_before):
            return
        raise SystemExit(
            f"error: {self.identity['system']} {self.identity['game']} seed {self.identity['seed']} in "
            f"{self.checkpoint.parent if self.checkpoint else 'its run folder'} has {self.frames} of {schedule.frames} "
            f"frames after {self.seconds_before / 60:.1f} min of training and {self.wall_before / 60:.1f} min of wall "
            f"over its sessions, past --minutes {schedule.seconds / 60:g} / --wall-minutes {schedule.wall_seconds / 60:g} "
            "(they count over all sessions); run it again with larger caps to go on"
        )

    # -- checkpoints ---------------------------------------------------------------------
    def _save(self, trainer: Any) -> bool:
        """Write the run's checkpoint (if it has one); whether one was written."""
        if self.checkpoint is None:
            return False
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(self.checkpoint)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {
            "identity": self.identity,
            "frames": self.frames,
            "history": self.history,
            "eval_time": self.eval_time,
            "seconds": self.seconds(),
            "wall": self.wall(),
            "training": {"recent": list(self.training.recent), "count": self.training.count},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict["identity"] != self.identity:
            raise SystemExit(
                f"error: {self.checkpoint} is a run started with {state_dict['identity']}, not "
                f"{self.identity}; give another --run-dir or remove {self.checkpoint.parent if self.checkpoint else 'it'}"
            )
        self.history = list(state_dict["history"])
        last_evaluated = self.history[-1]["frames"] if self.history else 0
        self.frames = int(state_dict.get("frames", last_evaluated))  # checkpoints before 2026-11-30: none
        self.eval_time = float(state_dict["eval_time"])
        self.seconds_before, self.wall_before = float(state_dict["seconds"]), float(state_dict["wall"])
        self.start, self._eval_here = time.perf_counter(), 0.0
        self._refuse_if_past_the_caps()
        self.training.recent.extend(state_dict["training"]["recent"])
        self.training.count = int(state_dict["training"]["count"])
        if self.history:
            self.schedule.resume_after(self.history[-1]["frames"])
        print(
            f"[resume] {self.identity['system']} {self.identity['game']} seed {self.identity['seed']}: "
            f"{self.frames} frames, {self.seconds_before:.0f} s of training and {len(self.history)} evaluations "
            f"so far (the last at {last_evaluated} frames)",
            file=sys.stderr,
            flush=True,
        )
