"""Command line: ``python main.py {fit,validate,test,predict,record,evaluate,convert} --config ...``.

* env spaces are linked from the datamodule (``data.spec``) into the model (``env_spec``);
* the default logger is TensorBoard under ``lightning_logs/<run_name>/version_N`` and
  checkpoints (:mod:`lightning_wm.checkpoints`: ``last.ckpt``, ``step=N.ckpt``, ``best.ckpt``)
  go to ``lightning_logs/<run_name>/checkpoints`` — stable across runs of one config, so
  ``fit --ckpt_path last`` resumes the last run; ``--ckpt_path`` is checked against the config
  before Lightning reads it;
* ``record`` rolls a policy out into the datamodule's episode store, ``evaluate`` reports
  mean ± std return of a trained agent, ``convert`` encodes a store with a trained Vision model;
* what is printed (hidden lines, progress, command-line errors) is :mod:`lightning_wm.console`'s.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from pytorch_lightning.callbacks.progress.progress_bar import ProgressBar
from pytorch_lightning.cli import LightningCLI
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.utilities.exceptions import SIGTERMException

from lightning_wm import console, runtime
from lightning_wm.agents.dyna import Imagination
from lightning_wm.callbacks import NonFiniteLossGuard, default_callbacks
from lightning_wm.checkpoints import (
    LAST,
    AtomicCheckpointIO,
    RunCheckpoints,
    check_compatible,
    load_weights,
    open_checkpoint,
    resume_point,
)
from lightning_wm.command_line import (
    ArgumentParser,
    check_config_files,
    interrupted_line,
    nothing_to_save,
    user_message,
    wants_verbose,
)
from lightning_wm.data.acting.base import ActorError
from lightning_wm.data.collector import Collector, run_evaluation
from lightning_wm.data.episodes import EpisodeStore
from lightning_wm.data.evaluation import evaluation_record, film_episode
from lightning_wm.data.offline import EpisodeDataModule
from lightning_wm.envs import EnvConfig, make_vector_env
from lightning_wm.io import DiskFullError, append_json_line, check_writable
from lightning_wm.protocols import EnvHolder
from lightning_wm.run_folder import RunFolderLock, check_new_run, derive_run_name, is_rank_zero, lease_s
from lightning_wm.seeding import derive_seed
from lightning_wm.signals import (
    RunAborted,
    RunStopped,
    check_stop,
    requeue_slurm_job,
    stop_on_signals,
    stop_requested,
)
from lightning_wm.video import check_video_path


def _env_of(datamodule: Any) -> EnvConfig:
    env = datamodule.env if isinstance(datamodule, EnvHolder) else None
    if env is None:
        raise ValueError(f"{type(datamodule).__name__} names no env; set data.init_args.env")
    return env


def cli_callbacks() -> list[Callback]:
    """The callbacks every CLI run gets: :func:`~lightning_wm.callbacks.default_callbacks` and Dyna's
    :class:`~lightning_wm.agents.dyna.Imagination` (added here, above the layers it joins)."""
    return [*default_callbacks(), Imagination()]


class Trainer(pl.Trainer):
    """Lightning's Trainer plus stable run folders and the ``record``/``evaluate``/``convert`` commands.

    Checkpoints (:mod:`lightning_wm.checkpoints`) go to ``<root>/lightning_logs/<run_name>/checkpoints``:
    ``last.ckpt`` (every ``checkpoint_every_n_steps`` steps and at the end of fit), the newest
    periodic ``step=N.ckpt`` files and ``best.ckpt`` (highest ``val/return``), all written
    atomically. ``--ckpt_path`` takes ``last``, ``best`` or a file; a checkpoint keeps its
    architecture (a contradicting config is refused, see :func:`~lightning_wm.checkpoints.check_compatible`).

    Args:
        run_name: folder under ``lightning_logs`` for logs and checkpoints (the CLI derives it
            from the config file's path when not given).
        checkpoint_every_n_steps: periodic checkpoints (``last.ckpt`` and ``step=N.ckpt``); 0:
            only at the end of fit.
        checkpoint_keep: how many of the newest ``step=N.ckpt`` files stay (the older are deleted);
            e.g. a controller run with ``checkpoint_every_n_steps: 1`` keeps every generation.
        torch_threads: ``torch.set_num_threads`` for this process (``None`` keeps torch's
            default). Small networks on a few CPU cores train several times faster with 1.
        float32_matmul_precision: ``torch.set_float32_matmul_precision`` (``highest``, ``high``:
            TF32 tensor cores for fp32 matrix multiplies on Ampere and later GPUs, ``medium``);
            ``None`` keeps torch's default (``highest``). No effect on CPUs without such units.
        keep_freed_memory: let glibc's malloc reuse freed memory instead of unmapping it
            (:func:`lightning_wm.runtime.keep_freed_memory`): faster CPU steps, resident memory
            stays at its peak. ``false`` keeps the defaults.
        overwrite: a new fit (no ``--ckpt_path``) may replace the checkpoints another run left in
            this run folder (they are deleted first); without it such a fit is refused
            (:mod:`lightning_wm.run_folder`).
    """

    def __init__(
        self,
        *args: Any,
        run_name: str | None = None,
        checkpoint_every_n_steps: int = 1000,
        checkpoint_keep: int = 2,
        torch_threads: int | None = None,
        float32_matmul_precision: str | None = None,
        keep_freed_memory: bool = True,
        overwrite: bool = False,
        **kwargs: Any,
    ) -> None:
        self.overwrite = overwrite
        if keep_freed_memory:
            runtime.keep_freed_memory()
        if torch_threads is not None:
            if torch_threads < 1:
                raise ValueError(f"trainer.torch_threads must be >= 1, got {torch_threads}")
            torch.set_num_threads(torch_threads)
        if float32_matmul_precision is not None:
            if float32_matmul_precision not in ("highest", "high", "medium"):
                raise ValueError(
                    f"trainer.float32_matmul_precision must be highest, high or medium, got {float32_matmul_precision!r}"
                )
            torch.set_float32_matmul_precision(float32_matmul_precision)
        run_name = run_name or "default"
        root = kwargs.get("default_root_dir") or os.getcwd()
        self.run_dir = os.path.join(root, "lightning_logs", run_name)
        if kwargs.get("logger") in (None, True):
            kwargs["logger"] = TensorBoardLogger(save_dir=os.path.dirname(self.run_dir), name=run_name)
        self.checkpoint_dir = os.path.join(self.run_dir, "checkpoints")
        callbacks = list(kwargs.get("callbacks") or [])
        if kwargs.get("enable_checkpointing", True) is not False:
            own = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
            if own:  # the user's ModelCheckpoint decides where checkpoints go
                self.checkpoint_dir = own[0].dirpath or self.checkpoint_dir
            else:  # (Lightning adds no ModelCheckpoint of its own beside it)
                callbacks.append(RunCheckpoints(self.checkpoint_dir, checkpoint_every_n_steps, checkpoint_keep))
        callbacks.append(NonFiniteLossGuard())
        callbacks += [c for c in cli_callbacks() if not any(type(x) is type(c) for x in callbacks)]
        if kwargs.get("enable_progress_bar", True) is not False and not any(
            isinstance(c, ProgressBar) for c in callbacks
        ):
            callbacks.append(console.RunProgress())
        kwargs["callbacks"] = callbacks
        plugins = list(kwargs.get("plugins") or [])
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            plugins.append(AtomicCheckpointIO())
        kwargs["plugins"] = plugins
        super().__init__(*args, **kwargs)

    # -- checkpoints -------------------------------------------------------------------
    def _checkpoint_for(
        self,
        model: pl.LightningModule | None,
        ckpt_path: str | None,
        action: str,
        resume_if_exists: bool = False,
        settings: str = "warn",
    ) -> str | None:
        """Resolve ``ckpt_path`` (``last``, ``best``, a file), read it and check it against ``model``
        before Lightning does anything with it; the checked checkpoint is handed to the
        checkpoint reader so it is not read twice."""
        what = ""
        if resume_if_exists and ckpt_path in (None, "last"):
            point = resume_point(self.checkpoint_dir)
            if point is None:
                print(f"no checkpoint in {self.checkpoint_dir}: starting a new run", file=sys.stderr)
                return None
            ckpt_path, what = point
        found = open_checkpoint(ckpt_path, self.checkpoint_dir)
        if found is None:
            return None
        path, checkpoint = found
        self._checkpoint_step = int(checkpoint.get("global_step", -1))
        if what:
            print(f"no {LAST} in {self.checkpoint_dir}: resuming from {what} (step {self._checkpoint_step})")
        if model is not None:
            check_compatible(checkpoint, model, path, action, settings)
        reader = self.strategy.checkpoint_io
        if isinstance(reader, AtomicCheckpointIO):
            reader.preload(path, checkpoint)
        return str(path)

    def fit(
        self,
        model: pl.LightningModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: pl.LightningDataModule | None = None,
        ckpt_path: str | None = None,
        resume_if_exists: bool = False,
    ) -> None:
        """Lightning's ``fit``; ``ckpt_path``: ``last``, ``best`` or a checkpoint file to resume from.

        Args:
            resume_if_exists: resume from ``last.ckpt`` when it exists and start a new run when
                it does not (``--ckpt_path last`` alone refuses to start without it).
        """
        # the checkpoint first (a missing one creates no folder), then, before any work: a run whose
        # results cannot be saved does not start
        path = self._checkpoint_for(model, ckpt_path, "resume", resume_if_exists, settings="refuse")
        check_writable(self.run_dir, "log folder")
        checkpoints = any(isinstance(c, RunCheckpoints) for c in self.callbacks)
        if checkpoints:
            check_writable(self.checkpoint_dir, "checkpoint folder")
        if path is not None and self._nothing_left(path):
            return
        # an unattended requeue (--resume_if_exists) waits for another machine's lease to run out
        lock = RunFolderLock(self.run_dir, wait_s=lease_s() + 5.0 if resume_if_exists else 0.0)
        if checkpoints and is_rank_zero():  # the other DDP ranks are its children
            lock.acquire()
            try:
                if path is None:
                    check_new_run(self.checkpoint_dir, self.overwrite, resume_if_exists)
            except BaseException:
                lock.release()
                raise
        signum = None
        try:
            with stop_on_signals():
                super().fit(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path=path, weights_only=True)
                signum = stop_requested()  # a stop that came after the last step
        except SIGTERMException:  # Lightning's own check (DDP ranks told by rank 0)
            signum = signal.SIGTERM
        except RunAborted as stop:
            raise RunAborted(stop.signum, self._stop_report(checkpoints, aborted=True)) from None
        except RunStopped as stop:
            signum = stop.signum
        except ActorError as err:
            if stop_requested() is None:  # a real failure: say what was saved, and fail
                err.saved = self._stop_report(checkpoints)  # type: ignore[attr-defined]
                raise
            signum = stop_requested()  # the group's signal ended an actor too: that is the stop
        finally:
            lock.release()
            close_envs = getattr(model, "close_envs", None)  # env workers (the controller's): none outlive fit
            if callable(close_envs):
                close_envs()
        if signum is not None:
            where = self._stop_report(checkpoints)
            if signum == signal.SIGUSR1 and checkpoints and is_rank_zero():
                where += requeue_slurm_job()
            raise RunStopped(signum, where)

    def _stop_report(self, checkpoints: bool, aborted: bool = False) -> str:
        """Where a stopped fit's state is, for the one line the command prints; ``aborted``: a
        second Ctrl-C, after which nothing more was saved."""
        last = os.path.join(self.checkpoint_dir, LAST)
        if not checkpoints:
            return f"at step {self.global_step}; nothing was saved (checkpointing is off)"
        saved = next((c.last_step for c in self.callbacks if isinstance(c, RunCheckpoints)), None)
        resume = "resume with --ckpt_path last (or --resume_if_exists true)"
        if not aborted and os.path.isfile(last):
            return f"at step {self.global_step}; {last} holds it: {resume}"
        if saved is not None and os.path.isfile(last):
            return f"at step {self.global_step}; nothing more was saved: {last} holds step {saved}: {resume}"
        if os.path.isfile(last):
            return f"at step {self.global_step}; nothing was saved by this fit: {last} is the one it started from"
        return f"at step {self.global_step}; nothing was saved (no {LAST} was written yet)"

    def _nothing_left(self, path: str) -> bool:
        """Resuming a checkpoint at or past ``max_steps``: say so (Lightning would end at once, silently)."""
        step = self._checkpoint_step
        if 0 <= self.max_steps <= step:
            print(
                f"nothing to do: {path} is at step {step} and --trainer.max_steps is {self.max_steps}; raise "
                "max_steps to train on",
                file=sys.stderr,
            )
            return True
        return False

    def validate(
        self,
        model: pl.LightningModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | None = None,
        verbose: bool = True,
        datamodule: pl.LightningDataModule | None = None,
    ) -> Any:
        """Lightning's ``validate``; ``ckpt_path``: ``last``, ``best`` or a checkpoint file."""
        return self._checked_loop(super().validate, "validate", model, dataloaders, ckpt_path, verbose, datamodule)

    def test(
        self,
        model: pl.LightningModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | None = None,
        verbose: bool = True,
        datamodule: pl.LightningDataModule | None = None,
    ) -> Any:
        """Lightning's ``test``; ``ckpt_path``: ``last``, ``best`` or a checkpoint file."""
        return self._checked_loop(super().test, "test", model, dataloaders, ckpt_path, verbose, datamodule)

    def _checked_loop(
        self,
        loop: Callable[..., Any],
        command: str,
        model: pl.LightningModule | None,
        dataloaders: Any,
        ckpt_path: str | None,
        verbose: bool,
        datamodule: pl.LightningDataModule | None,
    ) -> Any:
        """Lightning's ``validate`` or ``test`` (``loop``, the ``command``) on the checkpoint
        ``ckpt_path`` names, after the log folder's check; a stop meanwhile says that nothing was lost."""
        path = self._checkpoint_for(model, ckpt_path, "validation" if command == "validate" else command)
        self._check_log_folder()
        with nothing_to_save(command):
            return loop(model, dataloaders, path, verbose, datamodule, weights_only=True)

    def _check_log_folder(self) -> None:
        """The logger writes into the run folder: a read-only one is one line before any work."""
        if isinstance(self.logger, TensorBoardLogger):
            check_writable(self.run_dir, "log folder", hint="(or write no logs: --trainer.logger false)")

    def _load_weights(
        self, model: pl.LightningModule, ckpt_path: str | None, action: str
    ) -> tuple[Path, int | None] | None:
        """Load ``--ckpt_path``'s weights into ``model``; returns the file read and the training
        step it was saved at (``None``: no checkpoint)."""
        found = open_checkpoint(ckpt_path, self.checkpoint_dir)
        if found is None:
            return None
        load_weights(model, found[1], found[0], action=action)
        return found[0], found[1].get("global_step")

    # -- extra subcommands -------------------------------------------------------------
    def record(
        self,
        model: pl.LightningModule,
        datamodule: pl.LightningDataModule,
        episodes: int = 10,
        ckpt_path: str | None = None,
        explore: bool = True,
    ) -> int:
        """Roll ``model`` (random by default; trained weights from ``ckpt_path``) out for
        ``episodes`` episodes into the datamodule's episode store. Returns rows written."""
        if episodes < 1:
            raise ValueError(f"--episodes must be >= 1, got {episodes}")
        if not isinstance(datamodule, EpisodeDataModule):
            raise ValueError(
                "record writes episodes into an episode store and needs an EpisodeDataModule "
                "(--data lightning_wm.data.offline.EpisodeDataModule --data.init_args.directory DIR "
                f"--data.init_args.env {{...}}); this config's datamodule is a {type(datamodule).__name__}"
            )
        env = _env_of(datamodule)
        self._load_weights(model, ckpt_path, "record")
        store = EpisodeStore(check_writable(datamodule.directory, "episode store"))
        first = store.start_recording({**dataclasses.asdict(env), "size": list(env.size)}, episodes, env.num_envs)
        seeds = [derive_seed(env.seed, "record", index=first + i) for i in range(env.num_envs)]
        vector_env = make_vector_env(env)
        try:
            with console.progress(episodes, f"record {env.id}", unit="ep") as bar:
                collector = Collector(vector_env, model, store=store, seeds=seeds)
                model.eval()
                finished = collector.run_episodes(episodes, explore=explore, progress=bar.update)
        except RunStopped as stop:  # the finished episodes are on disk already
            where = (
                f"after {store.episodes_written} of {episodes} episodes: they ({store.rows_written} rows) are in "
                f"{store.directory}; the episodes in progress were not kept"
            )
            raise type(stop)(stop.signum, where) from None
        finally:
            vector_env.close()
        returns = [e["return"] for e in finished]
        print(
            f"recorded {store.episodes_written} episodes, {store.rows_written} rows into {store.directory} "
            f"(return {np.mean(returns):.1f} ± {np.std(returns):.1f}; the store holds {len(store)} episodes)"
        )
        return store.rows_written

    def evaluate(
        self,
        model: pl.LightningModule,
        datamodule: pl.LightningDataModule,
        ckpt_path: str | None = None,
        episodes: int = 10,
        video: str | None = None,
        explore: bool = False,
        out: str | None = None,
    ) -> dict[str, float]:
        """Run ``episodes`` episodes (``explore=False``), print mean ± std return; with
        ``video=path.gif`` or ``path.mp4`` the first of them is filmed (MP4 needs the ``video``
        extra, imageio-ffmpeg); with ``out=path.jsonl`` the result, every episode's return, the
        checkpoint and the model's settings are appended to that file as one JSON line."""
        if episodes < 1:
            raise ValueError(f"--episodes must be >= 1, got {episodes}")
        if video:
            check_video_path(video)  # before the episodes, not after
        if out:
            check_writable(Path(out).resolve().parent, "folder of --out")
        env = _env_of(datamodule)
        loaded = self._load_weights(model, ckpt_path, "evaluation")
        model.eval()
        seed = derive_seed(env.seed, "evaluate")
        finished: list[dict[str, float]] = []
        with console.progress(episodes, f"evaluate {env.id}", unit="ep") as bar, nothing_to_save("evaluate"):
            if video:  # episode 1 in a rendering env, the others as usual
                finished.append(film_episode(model, env, seed, video, explore))
                bar.update(1)
            if episodes > len(finished):
                finished += run_evaluation(
                    env, model, episodes - len(finished), 8, seed + len(finished), explore=explore, progress=bar.update
                )
        returns = np.array([e["return"] for e in finished])
        lengths = np.array([e["length"] for e in finished])
        result = {
            "return_mean": float(returns.mean()),
            "return_std": float(returns.std()),
            "length_mean": float(lengths.mean()),
            "episodes": float(len(returns)),
        }
        print(
            f"{env.id}: return {result['return_mean']:.2f} ± {result['return_std']:.2f} over {len(returns)} "
            f"episodes (mean length {result['length_mean']:.1f})"
        )
        if video:
            print(f"wrote {video} (episode 1, return {finished[0]['return']:.2f})")
        if out:
            record = evaluation_record(model, env, seed, loaded, self.run_dir, result, returns)
            print(f"appended the result to {append_json_line(out, record)}")
        return result

    def convert(
        self,
        model: pl.LightningModule,
        datamodule: pl.LightningDataModule,
        ckpt_path: str | None = None,
        target: str = "latents",
        batch_size: int = 256,
    ) -> int:
        """Encode every episode of the datamodule's store with a trained Vision model
        (``ckpt_path``) into the latent store ``target``. Returns episodes written."""
        from lightning_wm.agents.worldmodels.vision import Vision, convert_episodes

        if not isinstance(model, Vision) or not isinstance(datamodule, EpisodeDataModule):
            raise ValueError(
                "convert encodes an episode store with a World Models vision model; this config builds a "
                f"{type(model).__name__} with a {type(datamodule).__name__}: use a vision config (e.g. "
                "configs/worldmodels/cartpole_pixels/vision.yaml) and its checkpoint"
            )
        self._load_weights(model, ckpt_path, "convert")
        source = EpisodeStore(datamodule.directory)
        out = EpisodeStore(check_writable(target, "convert target"))
        out.write_metadata({**source.read_metadata(), "source": str(source.directory)})
        done = [0]

        def step(k: int) -> None:
            bar.update(k)
            done[0] += k
            check_stop()

        with console.progress(len(source), "convert", unit="ep") as bar:
            try:
                written = convert_episodes(model, source, out, batch_size=batch_size, progress=step)
            except RunStopped as stop:
                where = f"after {done[0]} of {len(source)} episodes: they are in {out.directory}"
                raise type(stop)(stop.signum, where) from None
        print(f"converted {written} episodes from {source.directory} into {out.directory}")
        return written


class CLI(LightningCLI):
    """LightningCLI with env-space links, stable run folders and extra subcommands."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        commands = dict(LightningCLI.subcommands())
        for name in ("record", "evaluate", "convert"):
            commands[name] = {"model", "datamodule"}
        return commands

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> Any:
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if subcommand == "record":  # random episodes unless a --model (and --ckpt_path) is given
            parser.set_defaults({"model": {"class_path": "lightning_wm.agents.random.RandomPolicy"}})
        if not any(action.dest == "verbose" for action in parser._actions):  # validate/test have their own
            parser.add_argument(
                "--verbose",
                action="store_true",
                help=f"show every warning and log line (or set {console.VERBOSE_ENV}=1)",
            )
        return parser

    def _parse_ckpt_path(self) -> None:
        """Lightning would read ``--ckpt_path`` here (with ``torch.load``, before any error handling)
        and silently replace the config's model by the checkpoint's; the Trainer checks the
        checkpoint against the config instead (:func:`lightning_wm.checkpoints.check_compatible`)."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.link_arguments(
            "data", "model.init_args.env_spec", compute_fn=lambda data: data.spec, apply_on="instantiate"
        )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.trainer.get("run_name") is None:
            config.trainer.run_name = derive_run_name(config)


# errors that describe bad input (config values, env ids, files, a diverged loss): on the command
# line they are printed as one message, without a traceback
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, FloatingPointError, DiskFullError)


def main(args: list[str] | None = None) -> CLI:
    """Entry point of ``python main.py`` and the ``lightning-wm`` console script.

    From the command line (``args`` None) an error about bad input (:data:`USER_ERRORS`) is
    printed as ``error: <message>`` and the process exits with code 1; set
    ``LIGHTNING_WM_TRACEBACK=1`` to see the traceback instead. Config errors (unknown key, wrong
    type, unknown class) exit with code 2 from the argument parser. Called with ``args``
    (tests, scripts), exceptions propagate.
    """
    argv = sys.argv[1:] if args is None else list(args)
    with console.quiet(verbose=console.is_verbose() or wants_verbose(argv)), stop_on_signals():
        check_config_files(argv)
        if args is not None or os.environ.get("LIGHTNING_WM_TRACEBACK"):
            return build_cli(args)
        try:
            return build_cli(args)
        except RunStopped as stop:  # a signal: the command saved what it had (128 + the signal)
            print(f"{stop}", file=sys.stderr)
            raise SystemExit(stop.code) from None
        except KeyboardInterrupt:  # a Ctrl-C before our handlers were in force
            print(interrupted_line(), file=sys.stderr)
            raise SystemExit(128 + signal.SIGINT) from None
        except ActorError as err:  # the learner's stack says nothing; the actor's own is in the message
            first = str(err).splitlines()[0].rstrip(":")
            saved = getattr(err, "saved", "")
            print(
                f"error: {first} (the fit stopped{' ' + saved if saved else ''}; set LIGHTNING_WM_TRACEBACK=1 for "
                "the actor's traceback)",
                file=sys.stderr,
            )
            raise SystemExit(1) from None
        except USER_ERRORS as err:
            print(f"error: {user_message(err)}\n(set LIGHTNING_WM_TRACEBACK=1 for the traceback)", file=sys.stderr)
            raise SystemExit(1) from None


def build_cli(args: list[str] | None, run: bool = True) -> CLI:
    """The application's LightningCLI for ``args`` (``None``: the command line). ``run=False``
    parses ``--config ...`` and options without a subcommand and only builds the model, the
    datamodule and the trainer (what the benches train with). Denormal floats are flushed to zero
    first, before torch starts any thread (:func:`lightning_wm.runtime.flush_denormals`)."""
    runtime.flush_denormals()
    try:
        return _make_cli(args, run)
    except ValueError as err:
        # an error raised while jsonargparse builds --model / --data comes back wrapped in a
        # ValueError listing every Union alternative; the error itself is its cause
        if "Union subtypes" in str(err) and isinstance(err.__cause__, Exception):
            raise err.__cause__ from None
        raise


def _make_cli(args: list[str] | None, run: bool) -> CLI:
    return CLI(
        model_class=None,
        datamodule_class=None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_class=Trainer,
        trainer_defaults={"num_sanity_val_steps": 0},
        seed_everything_default=0,  # explicit: Lightning warns "No seed found" and then uses 0 anyway
        parser_class=ArgumentParser,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"allow_abbrev": False},
        args=args,
        run=run,
    )
