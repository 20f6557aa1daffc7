"""Callbacks: the glue between the trainer, the datamodule and the module.

Each callback finds what it needs on ``trainer.datamodule`` through a protocol of
:mod:`lightning_wm.protocols`; a datamodule without that protocol makes it do nothing. The
CLI's Trainer adds :func:`default_callbacks` to every run.

* :class:`EnvStatsLogger` — env steps, episode returns/lengths and actor gauges (``env/*``,
  ``actors/*``) from an :class:`~lightning_wm.protocols.EnvStatsSource`.
* :class:`ReplayFeedback` — a ``training_step`` that returns ``"priority"`` and/or ``"write"``
  beside its loss has them written into the buffer of a :class:`~lightning_wm.protocols.FeedbackSink`,
  on every DDP rank into its own. Generations make late feedback safe: Lightning fetches one
  batch ahead, so rows of batch ``N`` may have been overwritten while batch ``N + 1`` was made;
  those rows are skipped and counted (``replay/stale_feedback``, the skipped share).
* :class:`BufferCheckpoint` — every buffer of a :class:`~lightning_wm.protocols.ReplayHolder`
  whose ``checkpoint`` flag is set is saved beside each checkpoint (one file per buffer, DDP rank
  and global step, written atomically, older ones pruned) and restored from the file of the
  checkpoint's step on resume; each stream's restart is then marked as an episode boundary.
* :class:`AgentPublisher` — attaches the module being trained to an
  :class:`~lightning_wm.protocols.AgentSink` (the datamodule acts with it, or with copies in actors).
* :class:`EMAWeights` — Lightning's ``EMAWeightAveraging`` (the evaluation episodes and the saved
  ``state_dict`` use an exponential moving average of the weights) whose checkpoints always keep
  the weights training continues from. Not a default: a config lists it under ``trainer.callbacks``.
* :class:`NonFiniteLossGuard` — stops a run whose loss became NaN or infinite, before any checkpoint
  holds the weights it made (the CLI's Trainer adds it).
* :class:`OnlineWeightsOnResume` — a run resumed without a weight-averaging callback from a
  checkpoint written with one continues from the online weights, not from the saved average.

Dyna's ``Imagination`` callback lives with Dyna (:mod:`lightning_wm.agents.dyna`); the CLI adds it.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, WeightAveraging
from pytorch_lightning.utilities import rank_zero_info

from lightning_wm.io import clean_stale_temps
from lightning_wm.nn.blocks import soft_update_tensors
from lightning_wm.protocols import AgentSink, EnvStats, EnvStatsSource, FeedbackSink, ReplayHolder

__all__ = [
    "EnvStatsLogger",
    "ReplayFeedback",
    "BufferCheckpoint",
    "AgentPublisher",
    "EMAWeights",
    "OnlineWeightsOnResume",
    "NonFiniteLossGuard",
    "default_callbacks",
]


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
        return stats

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._pop(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = self._pop(trainer, pl_module)
        if stats is None:
            return
        if trainer.global_step % max(1, trainer.log_every_n_steps) != 0:
            return
        strategy, device = trainer.strategy, pl_module.device
        totals = torch.tensor(
            [float(stats.env_steps), self._return_sum, self._length_sum, float(self._count)],
            dtype=torch.float64,
            device=device,
        )
        env_steps, return_sum, length_sum, count = strategy.reduce(totals, reduce_op="sum").tolist()
        log = dict(on_step=True, rank_zero_only=True, batch_size=1)
        pl_module.log("env/steps", env_steps, prog_bar=True, **log)
        if count > 0:
            pl_module.log("env/episode_return", return_sum / count, prog_bar=True, **log)
            pl_module.log("env/episode_length", length_sum / count, **log)
            pl_module.log("env/episodes", count, **log)
        names = _union_over_ranks(sorted(self._metrics), trainer.world_size)
        if names:
            pairs = torch.tensor(
                [[self._metrics[n], 1.0] if n in self._metrics else [0.0, 0.0] for n in names],
                dtype=torch.float64,
                device=device,
            )
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


class ReplayFeedback(Callback):
    """Writes ``training_step``'s ``"priority"`` / ``"write"`` outputs back into the replay buffer
    (``trainer.datamodule.apply_feedback(batch, outputs)``) and, where the datamodule reports
    ``{"applied", "stale"}`` row counts, logs the share of feedback rows skipped because they
    were overwritten since sampling (``replay/stale_feedback``)."""

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not isinstance(outputs, Mapping) or ("priority" not in outputs and "write" not in outputs):
            return
        sink = _datamodule(trainer)
        if not isinstance(sink, FeedbackSink):
            return
        result = sink.apply_feedback(batch, outputs)
        total = result["applied"] + result["stale"] if isinstance(result, Mapping) else 0
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

    @classmethod
    def saved_file(
        cls, record: dict[str, Any], name: str, rank: int, ckpt_path: str | os.PathLike | None
    ) -> tuple[Path | None, list[Path]]:
        """The file buffer ``name`` of ``rank`` was saved to for a checkpoint whose
        ``replay_buffers`` entry is ``record``, looked for beside the checkpoint file
        (``ckpt_path``, if given) and then in the folder it was written to (``record["dir"]``):
        ``(path or None, the folders looked in)``."""
        folders = [Path(record["dir"])]
        if ckpt_path:
            folders.insert(0, Path(os.path.dirname(os.path.abspath(ckpt_path))))
        filename = cls.filename(name, rank, int(record["step"]))
        return next((f / filename for f in folders if (f / filename).is_file()), None), folders

    @staticmethod
    def _buffers(trainer: pl.Trainer) -> dict[str, Any]:
        holder = _datamodule(trainer)
        if not isinstance(holder, ReplayHolder):
            return {}
        return {name: buf for name, buf in holder.replay_buffers().items() if buf.checkpoint}

    @staticmethod
    def _directory(trainer: pl.Trainer) -> Path:
        callback = trainer.checkpoint_callback  # the first ModelCheckpoint, if any
        return Path((callback.dirpath if callback is not None else None) or trainer.default_root_dir)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
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

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        record = checkpoint.get("replay_buffers")
        if record is None:
            return
        rank, step = int(trainer.global_rank), int(record["step"])
        for name, buffer in self._buffers(trainer).items():
            if name not in record["names"]:
                continue
            path, folders = self.saved_file(record, name, rank, trainer.ckpt_path)
            if path is None:
                warnings.warn(
                    f"rank {rank}: no replay file {self.filename(name, rank, step)} for this checkpoint (looked in "
                    f"{', '.join(map(str, folders))}); buffer {name!r} starts empty and prefills again",
                    stacklevel=2,
                )
                continue
            buffer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            buffer.mark_episode_end()
            self._saved[(name, rank)] = (step, id(buffer), buffer.revision)


class AgentPublisher(Callback):
    """Attach the module being trained to the datamodule: ``trainer.datamodule.attach_agent(pl_module,
    version=trainer.global_step)`` (an :class:`~lightning_wm.protocols.AgentSink`) when fit starts
    (before the first batch is fetched: actors start then), when training starts (the restored step
    of a resumed run) and after every optimizer step (once per step). The datamodule decides what
    to do with it: acting in process keeps the live module and its version; actors get
    ``module.acting_copy()`` every ``acting.publish_every`` steps.
    """

    def __init__(self) -> None:
        self._last: int | None = None

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sink = _datamodule(trainer)
        if isinstance(sink, AgentSink):
            sink.attach_agent(pl_module, version=int(trainer.global_step))
            self._last = int(trainer.global_step)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._attach(trainer, pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._attach(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if int(trainer.global_step) != self._last:
            self._attach(trainer, pl_module)


def _ema_update(decay: float, average: list[torch.Tensor], current: list[torch.Tensor], _count: Any) -> None:
    """``AveragedModel``'s ``multi_avg_fn`` of :class:`EMAWeights`: ``average <- decay * average +
    (1 - decay) * current`` (one group of tensors of one device and dtype)."""
    soft_update_tensors(average, current, 1.0 - decay)


class EMAWeights(WeightAveraging):
    """An exponential moving average of the module's weights, for evaluation and for the weights a
    run hands on: Lightning's ``EMAWeightAveraging`` (same options: ``decay``, default 0.999;
    ``update_every_n_steps``, ``update_starting_at_step``, ``use_buffers``, ``device``).

    After every ``update_every_n_steps``-th optimizer step ``average <- decay * average +
    (1 - decay) * weights`` (the first update copies; buffers too unless ``use_buffers: false``).
    The validation episodes play with the average (swapped in for the validation and back out
    after it), ``best.ckpt`` / ``last.ckpt`` / ``step=N.ckpt`` hold it as their ``state_dict``
    (what ``evaluate``, ``record`` and the bench load), and the module holds it after ``fit``.
    Training, acting and the weights sent to actors stay the online weights, which every
    checkpoint keeps under ``current_model_state`` (the average's count under
    ``averaging_state``); ``fit --ckpt_path`` resumes both.

    Where it differs from Lightning's callback: (1) at the end of ``fit`` Lightning copies the
    average over the module before the last checkpoint is written, so that ``last.ckpt`` held the
    average twice and a longer run resumed from it went on from the average instead of where
    training stood; here that checkpoint keeps the online weights of that moment. (2) The average
    is updated with one fused ``lerp`` per device and dtype (:func:`~lightning_wm.nn.blocks.soft_update_tensors`
    with ``tau = 1 - decay``, the update of ``torch.optim.swa_utils.get_ema_multi_avg_fn``)
    instead of one per tensor.
    """

    def __init__(
        self,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        use_buffers: bool = True,
        device: str | None = None,
    ) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMAWeights decay must be in [0, 1) (0.99 averages over about 100 steps), got {decay}")
        if update_every_n_steps < 1:
            raise ValueError(f"EMAWeights update_every_n_steps must be >= 1, got {update_every_n_steps}")
        super().__init__(device=device, use_buffers=use_buffers, multi_avg_fn=functools.partial(_ema_update, decay))
        self.decay, self.update_every_n_steps = decay, update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self._online_at_end: dict[str, torch.Tensor] | None = None

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """After optimizer steps (``step_idx`` counts from 0) from ``update_starting_at_step`` on,
        every ``update_every_n_steps``-th; never at an epoch's end. (``EMAWeightAveraging``'s
        schedule, restated: that class always passes ``avg_fn``, and ``AveragedModel`` refuses
        ``avg_fn`` together with ``multi_avg_fn``, so this one subclasses ``WeightAveraging``.)"""
        if step_idx is None:
            return False
        return step_idx >= (self.update_starting_at_step or 0) and step_idx % self.update_every_n_steps == 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._online_at_end = None
        super().setup(trainer, pl_module, stage)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._online_at_end = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        super().on_train_end(trainer, pl_module)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if self._online_at_end is not None and "current_model_state" in checkpoint:
            checkpoint["current_model_state"] = self._online_at_end


class OnlineWeightsOnResume(Callback):
    """``fit --ckpt_path`` from a checkpoint written with a weight-averaging callback
    (:class:`EMAWeights`, Lightning's ``WeightAveraging``), by a run that lists none: training goes
    on from the online weights (the checkpoint's ``current_model_state``), not from the average
    that its ``state_dict`` holds (what Lightning alone would load). A run that lists such a
    callback lets it restore both; ``evaluate`` and ``record`` load the average either way."""

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        online = checkpoint.get("current_model_state")
        if online is None or trainer.state.fn != "fit":
            return
        if any(isinstance(c, WeightAveraging) for c in trainer.callbacks):
            return
        pl_module.load_state_dict(online)
        rank_zero_info(
            "the checkpoint holds averaged weights and the online weights beside them; this run lists no "
            "weight averaging, so training continues from the online weights"
        )


def default_callbacks() -> list[Callback]:
    """This module's callbacks that every CLI run gets (the CLI's Trainer adds them and Dyna's
    ``Imagination``, skipping a type the config already lists)."""
    return [
        EnvStatsLogger(),
        ReplayFeedback(),
        BufferCheckpoint(),
        AgentPublisher(),
        OnlineWeightsOnResume(),
    ]


class NonFiniteLossGuard(Callback):
    """Stop with a clear message when a loss (the step's output, a logged ``*loss*``) becomes NaN
    or infinite, before any checkpoint holds the weights it made.

    A step only queues a device-side flag per value (no host sync: a GPU step is not waited for);
    the flags are read every ``trainer.log_every_n_steps`` steps, before every checkpoint is written
    and at the end of training, and the first non-finite value is named with its step.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[int, list[str], torch.Tensor]] = []  # (step, names, values [N])

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        values: dict[str, torch.Tensor] = {}
        if isinstance(outputs, torch.Tensor):
            values["loss"] = outputs
        elif isinstance(outputs, Mapping):
            values.update({k: v for k, v in outputs.items() if isinstance(v, torch.Tensor)})
        values.update({k: v for k, v in trainer.callback_metrics.items() if "loss" in k})
        values = {k: v for k, v in values.items() if v.numel()}
        if values:
            # one value per loss (a multi-element loss is finite where its sum is), one stack for all
            flat = torch.stack([v.detach().sum().float().to(pl_module.device) for v in values.values()])
            self._pending.append((int(trainer.global_step), list(values), flat))
        if len(self._pending) >= max(1, trainer.log_every_n_steps):
            self.check()

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self.check()  # raising here leaves the checkpoint file unwritten

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``FloatingPointError`` naming the first non-finite value queued since the last check."""
        pending, self._pending = self._pending, []
        if not pending or bool(torch.isfinite(torch.cat([flat for _, _, flat in pending])).all()):
            return
        for step, names, flat in pending:
            bad = (~torch.isfinite(flat)).nonzero()
            if len(bad):
                i = int(bad[0])
                raise FloatingPointError(
                    f"{names[i]} became {flat[i].item()} at step {step}. Training stopped; the last good "
                    "checkpoint is untouched. Lower the learning rate, tighten gradient clipping, or check the "
                    "inputs (e.g. unnormalised rewards)."
                )
