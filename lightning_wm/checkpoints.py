"""Checkpoints: the one place they are written, found and read.

* **Writing** (:class:`AtomicCheckpointIO`, Lightning's ``CheckpointIO`` plugin of the CLI's
  Trainer): every checkpoint goes to a temp file *beside* its target, is fsync'ed and renamed
  onto it (:mod:`lightning_wm.io`), so ``kill -9`` mid-write leaves the previous file intact and
  only a ``.*.tmp`` that the next run removes. A failed write raises (Lightning's own writer
  swallows a ``PermissionError``).
* **Finding** (:func:`open_checkpoint`): ``last`` / ``best`` name ``last.ckpt`` / ``best.ckpt``
  of the run's checkpoint folder; a missing one is an error naming the folder that was searched;
  a corrupt ``last.ckpt`` falls back to the newest intact checkpoint beside it, with a warning
  naming both.
* **Reading** (:func:`load_checkpoint`): ``torch.load(weights_only=True)`` (a checkpoint holds
  tensors and plain values, never code); an empty, truncated or foreign file is one
  :class:`CheckpointError` line naming the file.
* **The resume rule** (:func:`check_compatible`): a checkpoint keeps its architecture. A config
  whose model class differs, or whose weights do not fit, is refused by name (resume and
  evaluation alike); for resuming, a config whose model settings differ is refused too, naming
  the differing keys (``--ckpt_path last`` and a file path alike); weights that are only
  evaluated (``evaluate`` / ``record`` / ``convert`` / ``validate`` / ``test``) report such
  differences in one warning.
* **Weights into a module** (:func:`load_weights`, :func:`load_module`).
"""

from __future__ import annotations

import contextvars
import math
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning.callbacks import Checkpoint
from pytorch_lightning.utilities.exceptions import SIGTERMException

from lightning_wm.io import atomic_torch_save, atomic_write, clean_stale_temps
from lightning_wm.settings import flatten, group_defaults
from lightning_wm.signals import ActorError, RunAborted, RunStopped

__all__ = [
    "AtomicCheckpointIO",
    "CheckpointError",
    "CheckpointWarning",
    "RunCheckpoints",
    "check_compatible",
    "load_checkpoint",
    "load_module",
    "load_weights",
    "open_checkpoint",
    "resume_point",
]

LAST, BEST = "last.ckpt", "best.ckpt"
DEFAULT_BEST_METRIC = ("val/return", "max")  # a module's ``best_metric`` attribute overrides it
CLASS_KEY = "model_class"  # "package.module.Class" of the module a checkpoint was saved from
# the layout of the saved model settings: 2 = typed groups (``search.num_simulations``); checkpoints
# of lightning_wm before the groups (flat settings under other names) carry no format key
FORMAT_KEY, SETTINGS_FORMAT = "settings_format", 2
_IGNORED_HPARAMS = {"_instantiator", "_class_path"}


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the one-line message names the file, the cause and what to do."""


class CheckpointWarning(UserWarning):
    """Something about the checkpoints of a run that the user must know (e.g. a fallback)."""


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a Lightning checkpoint onto the CPU with ``weights_only=True``.

    Raises:
        FileNotFoundError: there is no such file.
        CheckpointError: the file is a folder, empty, truncated, not a checkpoint, holds
            Python objects other than tensors and plain values, or holds no ``state_dict``.
    """
    checkpoint = read_torch_file(path)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), Mapping):
        raise CheckpointError(f"{str(path)!r} is not a Lightning checkpoint (it holds no 'state_dict')")
    return checkpoint


def read_torch_file(path: str | os.PathLike) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU, with the errors of :func:`load_checkpoint`."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} is a folder, not a checkpoint file")
    if path.stat().st_size == 0:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is empty (0 bytes; a write was cut off): delete it "
            "and use another checkpoint of the run"
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types here (UnpicklingError, RuntimeError, EOFError, ...)
        text = str(err).strip()
        unsupported = next((line.strip() for line in text.splitlines() if "Unsupported global" in line), None)
        if unsupported:
            raise CheckpointError(
                f"checkpoint {str(path)!r} holds Python objects, not only tensors and plain values "
                f"({unsupported}); it was not written by lightning_wm and is not loaded"
            ) from None
        boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation")
        lines = [
            line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith(boilerplate)
        ]
        reason = lines[0] if lines else type(err).__name__
        with open(path, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"  # torch.save writes a zip archive
        what = "is truncated or corrupt" if zipped else "is not a checkpoint file"
        raise CheckpointError(
            f"checkpoint {str(path)!r} {what} ({reason}): delete it and use another checkpoint of the run"
        ) from None
    return checkpoint


def open_checkpoint(
    ckpt_path: str | os.PathLike | None, checkpoint_dir: str | os.PathLike
) -> tuple[Path, dict[str, Any]] | None:
    """Find and read the checkpoint that ``--ckpt_path`` means (``None``: none).

    ``last`` / ``best`` are ``last.ckpt`` / ``best.ckpt`` in ``checkpoint_dir``; anything else is
    a path. A ``last.ckpt`` that cannot be read is replaced by the newest intact ``*.ckpt``
    beside it (a :class:`CheckpointWarning` names both); ``best`` and paths are used as given.

    Returns:
        ``(path, checkpoint)``, the checkpoint read by :func:`load_checkpoint`.
    Raises:
        FileNotFoundError: the file (or ``last.ckpt`` / ``best.ckpt`` in ``checkpoint_dir``) does
            not exist; the message names the folder that was searched.
        CheckpointError: the checkpoint cannot be read (for ``last``: nor any beside it).
    """
    if ckpt_path is None:
        return None
    folder = Path(checkpoint_dir)
    if str(ckpt_path) == "best":
        path = folder / BEST
        if not path.is_file():
            raise FileNotFoundError(
                f"--ckpt_path best: there is no {BEST} in {str(folder)!r}; it is written when "
                "validation logs its best val/return (agents that play episodes) or lowest val/loss (World Models V "
                "and M), beside last.ckpt"
            )
        return path, load_checkpoint(path)
    if str(ckpt_path) != "last":
        path = Path(ckpt_path)
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
        return path, load_checkpoint(path)
    last = folder / LAST
    if not last.is_file():
        raise FileNotFoundError(
            f"--ckpt_path last: there is no {LAST} in {str(folder)!r} (searched there)"
            f"{_runs_hint(folder)}; train first with `fit`, or check --trainer.run_name"
        )
    try:
        return last, load_checkpoint(last)
    except CheckpointError as err:
        others = sorted(
            (p for p in folder.glob("*.ckpt") if p.name != LAST), key=lambda p: p.stat().st_mtime, reverse=True
        )
        for fallback in others:
            try:
                checkpoint = load_checkpoint(fallback)
            except (CheckpointError, FileNotFoundError):
                continue
            why = str(err).replace(f"checkpoint {str(last)!r} ", "").split(": delete it")[0]
            warnings.warn(
                f"{LAST} in {str(folder)!r} cannot be read (it {why}); using {fallback.name}, the newest "
                "intact checkpoint beside it, instead",
                CheckpointWarning,
                stacklevel=2,
            )
            return fallback, checkpoint
        raise CheckpointError(f"{err}; no intact checkpoint is beside it to resume from") from None


def step_of(path: Path) -> int:
    """The step ``N`` of a periodic checkpoint ``step=N.ckpt``; -1 for any other name."""
    try:
        return int(path.stem.split("=", 1)[1])
    except (IndexError, ValueError):
        return -1


def resume_point(checkpoint_dir: str | os.PathLike) -> tuple[str, str] | None:
    """What ``--resume_if_exists`` resumes from: ``last.ckpt``; else the newest ``step=N.ckpt`` (a
    run preempted between its periodic save and the copy to ``last.ckpt``); else ``best.ckpt`` (a
    run preempted before its first periodic checkpoint but after a validation). Returns
    ``(ckpt_path, what)`` (``what`` is "" for ``last``) or ``None`` when the folder holds none."""
    folder = Path(checkpoint_dir)
    if (folder / LAST).is_file():
        return "last", ""

    steps = sorted((p for p in folder.glob("step=*.ckpt") if step_of(p) >= 0), key=step_of)
    if steps:
        return str(steps[-1]), f"the newest periodic checkpoint {steps[-1].name}"
    if (folder / BEST).is_file():
        return str(folder / BEST), f"{BEST}, the only checkpoint there"
    return None


def _runs_hint(folder: Path) -> str:
    """`` (runs there: a, b)`` when ``folder`` is ``<root>/<run>/checkpoints`` and other runs exist."""
    root = folder.parent.parent
    if folder.name != "checkpoints" or not root.is_dir():
        return ""
    runs = sorted(p.name for p in root.iterdir() if (p / "checkpoints" / LAST).is_file())
    return f" (runs with a {LAST} in {str(root)!r}: {', '.join(runs)})" if runs else ""


# ---------------------------------------------------------------------------------------
# The resume rule
# ---------------------------------------------------------------------------------------


def check_settings_format(checkpoint: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Refuse a checkpoint of this project whose settings predate the typed groups.

    Raises:
        CheckpointError: one line naming the file and what to do.
    """
    if checkpoint.get(CLASS_KEY) and checkpoint.get(FORMAT_KEY, 1) < SETTINGS_FORMAT:
        raise CheckpointError(
            f"{str(path)!r} was written by an older lightning_wm whose model settings were flat (before the "
            "settings groups of 0.1: net, search, loss, optim, ...); this version cannot rebuild its model: "
            "train it again with the current configs"
        )


def _checkpoint_class(checkpoint: Mapping[str, Any]) -> str | None:
    """``package.module.Class`` of the module a checkpoint was saved from, if it says."""
    if checkpoint.get(CLASS_KEY):
        return str(checkpoint[CLASS_KEY])
    hparams = checkpoint.get("hyper_parameters") or {}
    return str(hparams["_class_path"]) if hparams.get("_class_path") else None


def _plain(value: Any) -> Any:
    """Tuples as lists, recursively: YAML, jsonargparse and ``save_hyperparameters`` differ there."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def _speed_only(key: str) -> bool:
    """Settings that change how fast a step runs, not what it computes (``compile``, ``search.compile``,
    ``compile.mode``, ``*.cuda_graphs``, ``optim.implementation``): a run resumes with them changed."""
    parts = key.split(".")
    return "compile" in parts or parts[-1] in ("cuda_graphs", "implementation")


def hparam_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (checkpoint value, config value)}`` for every hyperparameter that differs; settings
    groups are compared field by field (``search.num_simulations``); speed-only settings are not."""
    defaults = group_defaults(current)
    saved, current = flatten(saved), flatten(current)
    missing = object()
    keys = {k for k in (set(saved) | set(current)) - _IGNORED_HPARAMS if not _speed_only(k)}
    out = {}
    for key in sorted(keys):
        a, b = saved.get(key, missing), current.get(key, missing)
        if a is missing and key in defaults and _plain(b) == _plain(defaults[key]):
            continue  # a setting added after the checkpoint was written, left at its default
        if (a is missing) != (b is missing) or _plain(a) != _plain(b):
            out[key] = (None if a is missing else a, None if b is missing else b)
    return out


def _listing(differences: Mapping[str, tuple[Any, Any]]) -> str:
    """``key: checkpoint A, config B; ...`` of :func:`hparam_differences`' output."""
    return "; ".join(f"{k}: checkpoint {a!r}, config {b!r}" for k, (a, b) in differences.items())


def check_compatible(
    checkpoint: Mapping[str, Any],
    model: pl.LightningModule,
    path: str | os.PathLike,
    action: str = "loading",
    settings: str = "refuse",
) -> None:
    """Refuse a checkpoint that ``model`` (built from the config) contradicts.

    The checkpoint keeps its architecture: another model class is refused by name, and so are
    weights whose names or shapes do not match the model's. Model settings (hyperparameters)
    that differ between the checkpoint and the config are listed with both values and refused
    (``settings="refuse"``: resuming, where the config would silently train another model; those
    the model lists in ``resume_may_change``, budgets such as episodes per fitness, are warned) or
    reported in one :class:`CheckpointWarning` (``settings="warn"``: evaluating or recording
    with trained weights, where e.g. a population size or an env-step budget of training does
    not matter).

    Raises:
        CheckpointError: one line naming the classes, the differing keys or the weights.
    """
    check_settings_format(checkpoint, path)
    saved_class = _checkpoint_class(checkpoint)
    own = type(model)
    if saved_class is not None and saved_class.rsplit(".", 1)[-1] != own.__name__:
        raise CheckpointError(
            f"{action} refused: {str(path)!r} holds a {saved_class.rsplit('.', 1)[-1]} "
            f"({saved_class}), but this config builds a {own.__name__}; use the config the "
            "checkpoint was trained with"
        )
    saved = checkpoint.get("hyper_parameters") or {}
    current = dict(model.hparams)
    differences = hparam_differences(saved, current) if saved and current else {}
    listed = _listing(differences)
    free = set(getattr(model, "resume_may_change", ()))  # a budget, not the model: warned below
    refused = {k: pair for k, pair in differences.items() if k not in free}
    if refused and settings == "refuse":
        raise CheckpointError(
            f"{action} refused: the config contradicts the model in {str(path)!r} ({_listing(refused)}); a "
            "checkpoint keeps its architecture: use the config it was trained with or set these keys "
            "to its values (another model is a new run: another --trainer.run_name)"
        )
    # weights a module keeps out of its checkpoints (loaded from elsewhere) but older checkpoints hold
    unsaved = tuple(getattr(model, "unsaved_state_prefixes", ()))
    given = {k: v for k, v in checkpoint["state_dict"].items() if not (unsaved and k.startswith(unsaved))}
    mismatch = _state_dict_mismatch(model.state_dict(), given)
    if mismatch:
        raise CheckpointError(
            f"{action} refused: the weights in {str(path)!r} do not fit this "
            f"{own.__name__} ({mismatch}){f' (settings that differ: {listed})' if listed else ''}; "
            "use the config the checkpoint was trained with"
        )
    if differences:
        warnings.warn(
            f"{action}: the model in {str(path)!r} was trained with other settings than this config's "
            f"({listed}); its weights are used with the config's settings",
            CheckpointWarning,
            stacklevel=3,
        )


def _state_dict_mismatch(expected: Mapping[str, torch.Tensor], given: Mapping[str, Any]) -> str:
    """What keeps ``given`` from loading into a module whose state dict is ``expected`` ('' if nothing)."""
    parts = []
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    shapes = [
        f"{k} {tuple(given[k].shape)} vs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in given and hasattr(given[k], "shape") and tuple(given[k].shape) != tuple(v.shape)
    ]

    def listing(items: list[str]) -> str:
        return ", ".join(items[:3]) + (f", ... ({len(items)} in all)" if len(items) > 3 else "")

    if shapes:
        parts.append(f"shapes differ (checkpoint vs model): {listing(shapes)}")
    if missing:
        parts.append(f"missing in the checkpoint: {listing(missing)}")
    if unexpected:
        parts.append(f"not in the model: {listing(unexpected)}")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------
# Weights into modules
# ---------------------------------------------------------------------------------------


def load_weights(
    model: pl.LightningModule,
    checkpoint: str | os.PathLike | Mapping[str, Any],
    path: str | os.PathLike | None = None,
    action: str = "loading",
    settings: str = "warn",
) -> dict[str, Any]:
    """Load a checkpoint's weights (and the module's own extra state) into ``model``.

    Args:
        checkpoint: a path, or a checkpoint already read by :func:`load_checkpoint` (then
            ``path`` names it in messages).
        action, settings: see :func:`check_compatible` (other settings give a warning here).

    Returns the checkpoint dict. Raises :class:`CheckpointError` (one line) when it does not fit.
    """
    if not isinstance(checkpoint, Mapping):
        path = checkpoint
        checkpoint = load_checkpoint(checkpoint)
    path = path if path is not None else "<checkpoint>"
    check_compatible(checkpoint, model, path, action, settings)
    model.on_load_checkpoint(dict(checkpoint))
    model.load_state_dict(checkpoint["state_dict"])
    return dict(checkpoint)


M = TypeVar("M", bound=pl.LightningModule)


def load_module(
    cls: type[M], path: str | os.PathLike, device: torch.device | str = "cpu", what: str | None = None, **init_args: Any
) -> M:
    """Build a ``cls`` with the settings saved in the checkpoint at ``path`` (plus ``init_args``:
    constructor arguments a checkpoint does not hold, e.g. ``env_spec``), load its weights, and
    return it frozen (no gradients) in eval mode on ``device``.

    Raises:
        FileNotFoundError: no such checkpoint (the message says to train ``cls`` first).
        CheckpointError: unreadable, or it holds another class (named).
    """
    what = what or cls.__name__
    if not Path(path).is_file():
        raise FileNotFoundError(f"{what} checkpoint {str(path)!r} does not exist; train it first with `fit`")
    checkpoint = load_checkpoint(path)
    check_settings_format(checkpoint, path)
    saved_class = _checkpoint_class(checkpoint)
    if saved_class is not None and saved_class.rsplit(".", 1)[-1] != cls.__name__:
        raise CheckpointError(f"{str(path)!r} holds a {saved_class.rsplit('.', 1)[-1]} checkpoint, not a {what}")
    hparams = {k: v for k, v in (checkpoint.get("hyper_parameters") or {}).items() if k not in _IGNORED_HPARAMS}
    # built in an empty context: inside a module that the CLI is building (e.g. the controller
    # loading V and M), Lightning's context variable would make save_hyperparameters record the
    # outer module's settings instead of these
    module = contextvars.Context().run(cls, **{**hparams, **init_args})
    load_weights(module, checkpoint, path)
    module.to(device)
    module.eval()
    module.requires_grad_(False)
    return module


# ---------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint reader/writer, made atomic and loud.

    ``save_checkpoint`` writes beside the target (temp file, fsync, rename; see
    :func:`lightning_wm.io.atomic_write`) and raises when it cannot; ``load_checkpoint`` reads
    through :func:`load_checkpoint` (``weights_only=True``, one-line errors). A checkpoint that
    the CLI already read and checked is handed over once instead of being read again
    (:meth:`preload`).
    """

    def __init__(self) -> None:
        super().__init__()
        self._preloaded: dict[str, dict[str, Any]] = {}

    def preload(self, path: str | os.PathLike, checkpoint: dict[str, Any]) -> None:
        self._preloaded[os.path.abspath(path)] = checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        preloaded = self._preloaded.pop(os.path.abspath(path), None)
        # not only checkpoints: e.g. DDP-spawn hands the trained weights back as a bare state dict
        return preloaded if preloaded is not None else read_torch_file(path)


def copy_atomic(source: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Copy ``source`` onto ``target`` atomically (temp file beside ``target``, fsync, rename)."""

    def write(f: Any) -> None:
        with open(source, "rb") as src:
            shutil.copyfileobj(src, f, 1 << 20)

    return atomic_write(target, write)


class RunCheckpoints(Checkpoint):
    """The checkpoints of a run, all in ``dirpath``.

    * every ``every_n_train_steps`` optimizer steps: ``step=N.ckpt`` (the ``keep`` newest are
      kept) and a copy of it as ``last.ckpt``;
    * at the end of fit: ``last.ckpt`` (the steps after the last multiple are not lost);
    * ``best.ckpt`` whenever validation logs the module's ``best_metric`` at least as good as the
      best so far (ties go to the newer checkpoint): ``("val/return", "max")`` for agents that play
      evaluation episodes, ``("val/loss", "min")`` for models trained offline (World Models V and
      M); the best value is part of the callback's state, so a resumed run keeps comparing
      against it.

    One writer instead of Lightning's ``ModelCheckpoint``: no version counter (``last-v1.ckpt``
    that ``--ckpt_path last`` would miss), no ``epoch=`` names, nothing tied to automatic
    optimization. As a Lightning ``Checkpoint`` it is ``trainer.checkpoint_callback`` (its
    ``dirpath`` is where other callbacks put files beside the checkpoints) and runs after the
    other callbacks. Stale temp files of killed writes are removed when training starts.
    """

    def __init__(self, dirpath: str | os.PathLike, every_n_train_steps: int = 1000, keep: int = 2) -> None:
        if every_n_train_steps < 0:
            raise ValueError(f"checkpoint_every_n_steps must be >= 0 (0: only at the end), got {every_n_train_steps}")
        if keep < 1:
            raise ValueError(f"trainer.checkpoint_keep must be >= 1, got {keep}")
        self.dirpath = Path(dirpath)
        self.every_n_train_steps, self.keep = every_n_train_steps, keep
        self.best: float | None = None
        self.best_step: int | None = None
        self._last_saved_step = -1
        self.last_step: int | None = None  # the step this fit last wrote into last.ckpt

    @property
    def state_key(self) -> str:
        return "RunCheckpoints"

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best, self.best_step = state_dict.get("best"), state_dict.get("best_step")

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        cls = type(pl_module)
        checkpoint[CLASS_KEY] = f"{cls.__module__}.{cls.__qualname__}"
        checkpoint[FORMAT_KEY] = SETTINGS_FORMAT

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            clean_stale_temps(self.dirpath)

    def _save(self, trainer: pl.Trainer, name: str) -> Path:
        path = self.dirpath / name
        trainer.save_checkpoint(path, weights_only=False)
        return path

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.every_n_train_steps < 1 or step % self.every_n_train_steps or step == self._last_saved_step:
            return
        self._last_saved_step = step
        saved = self._save(trainer, f"step={step}.ckpt")
        if trainer.is_global_zero:
            copy_atomic(saved, self.dirpath / LAST)
            self.last_step = step
            self._prune()

    def _prune(self) -> None:
        periodic = sorted(self.dirpath.glob("step=*.ckpt"), key=step_of)
        for old in periodic[: -self.keep]:
            old.unlink(missing_ok=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        monitor, mode = getattr(pl_module, "best_metric", DEFAULT_BEST_METRIC)
        value = trainer.callback_metrics.get(monitor)
        if value is None:
            return
        value = float(value) if mode == "max" else -float(value)  # compared as "higher is better"
        if not math.isfinite(value) or (self.best is not None and value < self.best):
            return
        self.best, self.best_step = value, trainer.global_step
        self._save(trainer, BEST)

    def _save_last(self, trainer: pl.Trainer) -> None:
        self._save(trainer, LAST)
        self.last_step = trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save_last(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A stop request (a scheduler's SIGTERM, Slurm's SIGUSR1, Ctrl-C) ends a fit by raising
        :class:`~lightning_wm.signals.RunStopped` between steps, and an actor's death is seen while
        waiting for the next batch: save ``last.ckpt`` (and, through the buffer callback, the
        replay buffers) at the step reached. A second Ctrl-C (:class:`~lightning_wm.signals.RunAborted`,
        anywhere in a step) and other errors save nothing (the state may be what went wrong; the
        previous checkpoints stay)."""
        if isinstance(exception, RunAborted) or trainer.state.fn != "fit":
            return
        if isinstance(exception, (RunStopped, SIGTERMException, ActorError)):
            self._save_last(trainer)
