"""Command line: ``python main.py {fit,validate,test,predict,record,evaluate,convert} --config ...``.

* env spaces are linked from the datamodule (``data.spec``) into the model (``env_spec``);
* the default logger is TensorBoard under ``lightning_logs/<run_name>/version_N`` and
  checkpoints go to ``lightning_logs/<run_name>/checkpoints`` — stable across runs of one
  config, so ``fit --ckpt_path last`` resumes the last run; a final ``last.ckpt`` is written
  at the end of every fit;
* ``record`` rolls a policy out into the datamodule's episode store, ``evaluate`` reports
  mean ± std return of a trained agent, ``convert`` encodes a store with a trained Vision model.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from pytorch_lightning.cli import LightningCLI
from pytorch_lightning.loggers import TensorBoardLogger

from lightning_wm import runtime
from lightning_wm.callbacks import default_callbacks
from lightning_wm.data.collector import Collector, run_evaluation
from lightning_wm.data.episodes import EpisodeStore
from lightning_wm.envs import EnvConfig, make_env, make_vector_env
from lightning_wm.protocols import EnvHolder
from lightning_wm.video import check_video_path, write_video


class FinalCheckpoint(Callback):
    """Write ``last.ckpt`` when fit ends, so the steps after the last periodic save are kept."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(os.path.join(self.dirpath, "last.ckpt"))


class NonFiniteLossGuard(Callback):
    """Stop with a clear message when a logged loss becomes NaN or infinite."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        values: dict[str, Any] = {}
        if isinstance(outputs, torch.Tensor):
            values["loss"] = outputs
        elif isinstance(outputs, dict):
            values.update({k: v for k, v in outputs.items() if isinstance(v, torch.Tensor)})
        values.update({k: v for k, v in trainer.callback_metrics.items() if "loss" in k})
        for name, value in values.items():
            if value.numel() and not torch.isfinite(value.detach()).all():
                raise FloatingPointError(
                    f"{name} became {value.detach().flatten()[0].item()} at step {trainer.global_step}. "
                    "Training stopped; the last good checkpoint is untouched. Lower the learning rate, "
                    "tighten gradient clipping, or check the inputs (e.g. unnormalised rewards)."
                )


def resolve_checkpoint(trainer: pl.Trainer, ckpt_path: str | None) -> str | None:
    """``last`` -> the ``last.ckpt`` of this run's checkpoint directory."""
    if ckpt_path != "last":
        if ckpt_path is not None and not Path(ckpt_path).is_file():
            raise FileNotFoundError(f"checkpoint {ckpt_path!r} does not exist")
        return ckpt_path
    dirpath = getattr(trainer, "checkpoint_dir", None)
    candidate = Path(dirpath or "", "last.ckpt")
    if not candidate.is_file():
        raise FileNotFoundError(f"--ckpt_path last: no {candidate}; train first with `fit`")
    return str(candidate)


def load_weights(model: pl.LightningModule, ckpt_path: str) -> None:
    """Load a Lightning checkpoint's weights (and the module's own extra state) into ``model``."""
    checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    model.on_load_checkpoint(checkpoint)
    model.load_state_dict(checkpoint["state_dict"])


def _env_of(datamodule: Any) -> EnvConfig:
    env = datamodule.env if isinstance(datamodule, EnvHolder) else None
    if env is None:
        raise ValueError(f"{type(datamodule).__name__} names no env; set data.init_args.env")
    return env


class Trainer(pl.Trainer):
    """Lightning's Trainer plus stable run folders and the ``record``/``evaluate``/``convert`` commands.

    Args:
        run_name: folder under ``lightning_logs`` for logs and checkpoints (the CLI derives it
            from the config file's path when not given).
        checkpoint_every_n_steps: periodic checkpoints (``last.ckpt`` and the newest step).
        torch_threads: ``torch.set_num_threads`` for this process (``None`` keeps torch's
            default). Small networks on a few CPU cores train several times faster with 1.
        keep_freed_memory: let glibc's malloc reuse freed memory instead of unmapping it
            (:func:`lightning_wm.runtime.keep_freed_memory`): faster CPU steps, resident memory
            stays at its peak. ``false`` keeps the defaults.
    """

    def __init__(self, *args: Any, run_name: str | None = None, checkpoint_every_n_steps: int = 1000,
                 torch_threads: int | None = None, keep_freed_memory: bool = True, **kwargs: Any) -> None:
        if keep_freed_memory:
            runtime.keep_freed_memory()
        if torch_threads is not None:
            if torch_threads < 1:
                raise ValueError(f"trainer.torch_threads must be >= 1, got {torch_threads}")
            torch.set_num_threads(torch_threads)
        run_name = run_name or "default"
        root = kwargs.get("default_root_dir") or os.getcwd()
        log_root = os.path.join(root, "lightning_logs")
        if kwargs.get("logger") in (None, True):
            kwargs["logger"] = TensorBoardLogger(save_dir=log_root, name=run_name)
        self.checkpoint_dir = os.path.join(log_root, run_name, "checkpoints")
        callbacks = list(kwargs.get("callbacks") or [])
        if kwargs.get("enable_checkpointing", True) is not False:
            if not any(isinstance(c, ModelCheckpoint) for c in callbacks):
                # no version counter: a later run of the same config overwrites last.ckpt instead of
                # writing last-v1.ckpt beside it (which `--ckpt_path last` would never find)
                callbacks.append(ModelCheckpoint(dirpath=self.checkpoint_dir, save_last=True,
                                                 every_n_train_steps=checkpoint_every_n_steps, save_top_k=1,
                                                 enable_version_counter=False))
            self.checkpoint_dir = next(c for c in callbacks if isinstance(c, ModelCheckpoint)).dirpath or self.checkpoint_dir
            callbacks.append(FinalCheckpoint(self.checkpoint_dir))
        callbacks.append(NonFiniteLossGuard())
        callbacks += [c for c in default_callbacks() if not any(type(x) is type(c) for x in callbacks)]
        kwargs["callbacks"] = callbacks
        super().__init__(*args, **kwargs)

    # -- extra subcommands -------------------------------------------------------------
    def record(self, model: pl.LightningModule, datamodule: pl.LightningDataModule, episodes: int = 10,
               ckpt_path: str | None = None, explore: bool = True) -> int:
        """Roll ``model`` (random by default; trained weights from ``ckpt_path``) out for
        ``episodes`` episodes into the datamodule's episode store. Returns rows written."""
        from tqdm import tqdm

        env = _env_of(datamodule)
        ckpt = resolve_checkpoint(self, ckpt_path)
        if ckpt is not None:
            load_weights(model, ckpt)
        store = EpisodeStore(datamodule.directory)
        store.write_metadata({"env": {**vars(env), "size": list(env.size)}})
        before = store.total_steps()
        vector_env = make_vector_env(env)
        try:
            with tqdm(total=episodes, desc=f"record {env.id}", unit="ep") as bar:
                collector = Collector(vector_env, model, store=store, seed=env.seed)
                model.eval()
                finished = collector.run_episodes(episodes, explore=explore, progress=bar.update)
        finally:
            vector_env.close()
        returns = [e["return"] for e in finished]
        print(f"recorded {len(finished)} episodes, {store.total_steps() - before} rows into {store.directory} "
              f"(return {np.mean(returns):.1f} ± {np.std(returns):.1f})")
        return store.total_steps() - before

    def evaluate(self, model: pl.LightningModule, datamodule: pl.LightningDataModule, ckpt_path: str | None = None,
                 episodes: int = 10, video: str | None = None, explore: bool = False) -> dict[str, float]:
        """Run ``episodes`` episodes (``explore=False``), print mean ± std return; with
        ``video=path.gif`` or ``path.mp4`` the first of them is filmed (MP4 needs the ``video``
        extra, imageio-ffmpeg)."""
        from tqdm import tqdm

        if episodes < 1:
            raise ValueError(f"--episodes must be >= 1, got {episodes}")
        if video:
            check_video_path(video)  # before the episodes, not after
        env = _env_of(datamodule)
        ckpt = resolve_checkpoint(self, ckpt_path)
        if ckpt is not None:
            load_weights(model, ckpt)
        model.eval()
        seed = env.seed + 777_000
        finished: list[dict[str, float]] = []
        with tqdm(total=episodes, desc=f"evaluate {env.id}", unit="ep") as bar:
            if video:  # episode 1 in a rendering env, the others as usual
                finished.append(self._film_episode(model, env, seed, video, explore))
                bar.update(1)
            if episodes > len(finished):
                finished += run_evaluation(env, model, episodes - len(finished), 8, seed + len(finished),
                                           explore=explore, progress=bar.update)
        returns = np.array([e["return"] for e in finished])
        lengths = np.array([e["length"] for e in finished])
        result = {"return_mean": float(returns.mean()), "return_std": float(returns.std()),
                  "length_mean": float(lengths.mean()), "episodes": float(len(returns))}
        print(f"{env.id}: return {result['return_mean']:.2f} ± {result['return_std']:.2f} over {len(returns)} "
              f"episodes (mean length {result['length_mean']:.1f})")
        if video:
            print(f"wrote {video} (episode 1, return {finished[0]['return']:.2f})")
        return result

    @staticmethod
    def _film_episode(model: Any, config: EnvConfig, seed: int, path: str, explore: bool) -> dict[str, float]:
        """One episode in an env that also renders full frames; writes them to ``path``."""
        import gymnasium as gym

        one = EnvConfig(**{**vars(config), "num_envs": 1, "seed": seed})
        env = gym.vector.SyncVectorEnv([lambda: make_env(one, render_mode="rgb_array")],
                                       autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)
        try:
            collector = Collector(env, model, seed=seed)
            frames: list[np.ndarray] = []
            collector.reset()
            frames.append(env.envs[0].render())
            while not (done := collector.collect(1, explore)):
                frames.append(env.envs[0].render())
        finally:
            env.close()
        write_video(frames, path)
        return done[0]

    def convert(self, model: pl.LightningModule, datamodule: pl.LightningDataModule, ckpt_path: str | None = None,
                target: str = "latents", batch_size: int = 256) -> int:
        """Encode every episode of the datamodule's store with a trained Vision model
        (``ckpt_path``) into the latent store ``target``. Returns episodes written."""
        from lightning_wm.agents.vision import convert_episodes

        ckpt = resolve_checkpoint(self, ckpt_path)
        if ckpt is not None:
            load_weights(model, ckpt)
        source = EpisodeStore(datamodule.directory)
        out = EpisodeStore(target)
        out.write_metadata({**source.read_metadata(), "source": str(source.directory)})
        written = convert_episodes(model, source, out, batch_size=batch_size)
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
        return parser

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.link_arguments("data", "model.init_args.env_spec", compute_fn=lambda data: data.spec,
                              apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.trainer.get("run_name") is None:
            config.trainer.run_name = derive_run_name(config)


def derive_run_name(config: Any) -> str:
    """``configs/dreamer/cartpole.yaml`` -> ``dreamer-cartpole``; else the model class name."""
    paths = [str(p) for p in (config.get("config") or []) if p is not None]
    if paths:
        path = Path(os.path.relpath(os.path.abspath(str(paths[0]))))
        parts = [p for p in path.with_suffix("").parts if p not in ("configs", "..", ".")]
        return "-".join(parts[-3:]) or "default"
    class_path = str(config.model.get("class_path", "model")) if config.get("model") else "model"
    return class_path.rsplit(".", 1)[-1].lower()


# errors that describe bad input (config values, env ids, files, a diverged loss): on the command
# line they are printed as one message, without a traceback
USER_ERRORS = (ValueError, FileNotFoundError, FloatingPointError)


def main(args: list[str] | None = None) -> CLI:
    """Entry point of ``python main.py`` and the ``lightning-wm`` console script.

    From the command line (``args`` None) an error about bad input (:data:`USER_ERRORS`) is
    printed as ``error: <message>`` and the process exits with code 1; set
    ``LIGHTNING_WM_TRACEBACK=1`` to see the traceback instead. Config errors (unknown key, wrong
    type, unknown class) exit with code 2 from the argument parser. Called with ``args``
    (tests, scripts), exceptions propagate.
    """
    if args is not None or os.environ.get("LIGHTNING_WM_TRACEBACK"):
        return _cli(args)
    try:
        return _cli(args)
    except USER_ERRORS as err:
        print(f"error: {user_message(err)}\n(set LIGHTNING_WM_TRACEBACK=1 for the traceback)", file=sys.stderr)
        raise SystemExit(1) from None


def user_message(err: BaseException) -> str:
    """The message of ``err`` without jsonargparse's wrapping: an error raised while a subclass
    (``--data``/``--model``) is built comes back as "Does not validate against any of the Union
    subtypes" followed by every alternative and the whole namespace; keep only the real cause."""
    text = str(err)
    if "Union subtypes" not in text:
        return text
    causes = [line.strip()[2:] for line in text.splitlines()
              if line.startswith("  - ") and "Expected a <class 'NoneType'>" not in line]
    return "\n".join(causes) or text


def _cli(args: list[str] | None) -> CLI:
    return CLI(
        model_class=None,
        datamodule_class=None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_class=Trainer,
        trainer_defaults={"num_sanity_val_steps": 0},
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"allow_abbrev": False},
        args=args,
    )
