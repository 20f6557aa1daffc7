"""Callbacks between the learner and its replay buffers: feedback written back, buffers checkpointed.

* :class:`ReplayFeedback` — a ``training_step`` that returns ``"priority"`` and/or ``"write"``
  beside its loss has them written into the datamodule's buffer (``apply_feedback``), on every
  DDP rank into its own buffer. Generations make late feedback safe: Lightning fetches one batch
  ahead, so rows of batch ``N`` may have been overwritten while batch ``N + 1`` was made; those
  rows are skipped and counted (``replay/stale_feedback``, the skipped share).
* :class:`BufferCheckpoint` — every buffer of the datamodule's ``replay_buffers()`` whose
  ``checkpoint`` flag is set is saved beside each checkpoint (one file per buffer, DDP rank and
  global step, written atomically, older ones pruned) and restored from the file of the
  checkpoint's step on resume; each stream's restart is then marked as an episode boundary.

A datamodule without ``apply_feedback`` / ``replay_buffers`` is left alone.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback

from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.io import clean_stale_temps

__all__ = ["ReplayFeedback", "BufferCheckpoint"]


class ReplayFeedback(Callback):
    """Writes ``training_step``'s ``"priority"`` / ``"write"`` outputs back into the replay buffer
    (``trainer.datamodule.apply_feedback(batch, outputs)``) and logs the share of feedback rows
    skipped because they were overwritten since sampling (``replay/stale_feedback``)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not isinstance(outputs, Mapping) or ("priority" not in outputs and "write" not in outputs):
            return
        apply = getattr(trainer.datamodule, "apply_feedback", None)
        if apply is None:
            return
        result = apply(batch, outputs)
        total = result["applied"] + result["stale"]
        if total:
            pl_module.log("replay/stale_feedback", result["stale"] / total, on_step=True, batch_size=1)


def _step_files(directory: Path, name: str, rank: int) -> list[tuple[int, Path]]:
    pattern = re.compile(rf"{re.escape(name)}_rank{rank}_step(\d+)\.pt")
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := pattern.fullmatch(p.name))]
    return sorted(found)


class BufferCheckpoint(Callback):
    """Saves checkpointed replay buffers beside the trainer's checkpoints and restores them on resume.

    Files are ``<name>_rank<r>_step<N>.pt`` in the checkpoint folder (the ``ModelCheckpoint``'s
    ``dirpath``, else the trainer's ``default_root_dir``); the checkpoint records the step and the
    folder under ``"replay_buffers"``. Each holds the buffer's rows (memory maps flushed first),
    write heads, generations, priorities and RNG state. A buffer unchanged since it was saved for
    the same step is not written again (Lightning saves ``last.ckpt`` and the periodic checkpoint
    of one step one after the other).

    On resume every rank loads its own file of the checkpoint's step, looked up beside the
    checkpoint file first, then in the recorded folder; a missing file gives a warning and that
    buffer starts empty (and prefills again). After loading, ``mark_episode_end()`` ends each
    stream's last episode, so the rows acting adds after the restart begin a new one.

    Args:
        keep: the newest files kept per buffer and rank (the last checkpoint's and the one before).
    """

    def __init__(self, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"BufferCheckpoint keep must be >= 1, got {keep}")
        self.keep = keep
        self._saved: dict[tuple[str, int], tuple[int, int, int]] = {}  # (name, rank) -> (step, id, revision)

    @staticmethod
    def filename(name: str, rank: int, step: int) -> str:
        return f"{name}_rank{rank}_step{step}.pt"

    @staticmethod
    def _buffers(trainer: pl.Trainer) -> dict[str, ReplayBuffer]:
        holder = getattr(trainer.datamodule, "replay_buffers", None)
        if holder is None:
            return {}
        return {name: buf for name, buf in holder().items() if buf.checkpoint}

    @staticmethod
    def _directory(trainer: pl.Trainer) -> Path:
        callback = trainer.checkpoint_callback
        dirpath = getattr(callback, "dirpath", None) if callback is not None else None
        return Path(dirpath or trainer.default_root_dir)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        buffers = self._buffers(trainer)
        if not buffers:
            return
        directory = self._directory(trainer).resolve()
        directory.mkdir(parents=True, exist_ok=True)
        step, rank = int(trainer.global_step), int(trainer.global_rank)
        for name, buffer in buffers.items():
            path = directory / self.filename(name, rank, step)
            stamp = (step, id(buffer), buffer.revision)
            if self._saved.get((name, rank)) == stamp and path.is_file():
                continue
            buffer.save(path)
            self._saved[(name, rank)] = stamp
            for _, old in _step_files(directory, name, rank)[: -self.keep]:
                old.unlink(missing_ok=True)
        clean_stale_temps(directory)
        # every rank fills this dict; Lightning writes rank 0's, and every rank names its file by the same step
        checkpoint["replay_buffers"] = {"step": step, "dir": str(directory), "names": sorted(buffers)}

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        record = checkpoint.get("replay_buffers")
        if record is None:
            return
        rank, step = int(trainer.global_rank), int(record["step"])
        folders = [Path(record["dir"])]
        if trainer.ckpt_path:
            folders.insert(0, Path(os.path.dirname(os.path.abspath(trainer.ckpt_path))))
        for name, buffer in self._buffers(trainer).items():
            if name not in record["names"]:
                continue
            filename = self.filename(name, rank, step)
            path = next((f / filename for f in folders if (f / filename).is_file()), None)
            if path is None:
                warnings.warn(f"rank {rank}: no replay file {filename} for this checkpoint (looked in "
                              f"{', '.join(map(str, folders))}); buffer {name!r} starts empty and prefills again",
                              stacklevel=2)
                continue
            buffer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            buffer.mark_episode_end()
            self._saved[(name, rank)] = (step, id(buffer), buffer.revision)
