"""Dreamer learning bench: env steps and wall time until the evaluation return (mean of 10
episodes, actor mode) reaches a target, or a budget runs out. Any vector-observation Dreamer
config; CartPole-v1 by default.

    python bench/dreamer_cartpole.py                       # configs/dreamer/cartpole.yaml, target 475
    python bench/dreamer_cartpole.py --env-steps 20000 --minutes 30 --eval-every 250 --seed 1
    python bench/dreamer_cartpole.py --config configs/dreamer/pendulum.yaml --minutes 35   # target -200
    python bench/dreamer_cartpole.py --keep-going --minutes 120 --seed 1   # the config's whole run: stable?

Trains with the real ReplayDataModule (online collection with the current actor, streamed
replay) and Lightning's Trainer, using the model and data settings of the config file;
evaluates every ``--eval-every`` gradient steps. Env steps are training env steps (the random
prefill included, evaluation episodes not), counted as agent steps: with ``action_repeat`` k
the simulator ran k frames per step (printed too). ``--target`` defaults to the env's "solved"
return (CartPole-v1 475, Pendulum-v1 -200). Prints a markdown table, every evaluation and the
stability verdict (:func:`stability_verdict`): with ``--keep-going`` the run trains on after
reaching the target (by default for the config's whole run, ``trainer.max_steps`` gradient
steps) and is stable when the median of the evaluations after the first one at the target and
the final evaluation both hold the target.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import statistics
import sys
import time
from typing import Any

import pytorch_lightning as pl
import torch
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_wm.agents.dreamer import Dreamer  # noqa: E402
from lightning_wm.callbacks import default_callbacks  # noqa: E402
from lightning_wm.data.modules import ReplayDataModule  # noqa: E402
from lightning_wm.data.samplers import SequenceSampler  # noqa: E402
from lightning_wm.envs import EnvConfig  # noqa: E402
from lightning_wm.runtime import keep_freed_memory  # noqa: E402

TARGETS = {"CartPole-v1": 475.0, "Pendulum-v1": -200.0}


class StopAtReturn(pl.Callback):
    """Record every evaluation; stop at ``target`` return or when the env-step budget is spent."""

    def __init__(
        self,
        target: float,
        env_steps: int,
        keep_going: bool = False,
        checkpoints: str | None = None,
        also_eval: str | None = None,
    ) -> None:
        self.target, self.env_steps, self.keep_going = target, env_steps, keep_going
        self.checkpoints, self.also_eval = checkpoints, also_eval
        self.also: list[float] = []  # returns of the --also-eval policy at each evaluation
        self.start = time.perf_counter()
        self.history: list[tuple[int, int, float, float]] = []  # (grad steps, env steps, return, seconds)
        self.solved: tuple[int, int, float, float] | None = None

    def _env_steps(self, trainer: pl.Trainer) -> int:
        return int(trainer.lightning_module.env_steps)  # kept current by EnvStatsLogger

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        value = trainer.callback_metrics.get("val/return")
        if value is None:
            return
        row = (trainer.global_step, self._env_steps(trainer), float(value), time.perf_counter() - self.start)
        self.history.append(row)
        if self.checkpoints:
            trainer.save_checkpoint(os.path.join(self.checkpoints, f"step_{row[0]}.ckpt"))
        other = ""
        if self.also_eval:  # the same weights, acting the other way (not counted in the wall time)
            kept = pl_module.eval_policy
            pl_module.eval_policy = self.also_eval
            clock = time.perf_counter()
            stats = trainer.datamodule.evaluate(pl_module)
            self.start += time.perf_counter() - clock
            pl_module.eval_policy = kept
            self.also.append(statistics.fmean(s["return"] for s in stats))
            other = f"  ({self.also_eval}: {self.also[-1]:7.1f})"
        print(
            f"[eval] step {row[0]:6d}  env steps {row[1]:6d}  return {row[2]:7.1f}{other}  {row[3] / 60:5.1f} min",
            flush=True,
        )
        if row[2] >= self.target and self.solved is None:
            self.solved = row
            trainer.should_stop = not self.keep_going

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._env_steps(trainer) >= self.env_steps:
            trainer.should_stop = True


def stability_verdict(returns: list[float], target: float) -> dict[str, Any]:
    """Does a run hold the target once it reached it? ``returns``: every evaluation, in order.

    Stable means: some evaluation reached ``target``, the median of the evaluations after the
    first one that did is ``>= target`` (at least one later evaluation is needed), and the final
    evaluation is ``>= target``. Returns ``{"stable", "first", "later", "median_later",
    "min_later", "final", "reason"}`` (``first``: index of the first evaluation at the target).
    """
    first = next((i for i, r in enumerate(returns) if r >= target), None)
    later = returns[first + 1 :] if first is not None else []
    median_later = float(statistics.median(later)) if later else float("nan")
    out: dict[str, Any] = {
        "first": first,
        "later": len(later),
        "median_later": median_later,
        "min_later": min(later) if later else float("nan"),
        "final": returns[-1] if returns else float("nan"),
    }
    if first is None:
        out.update(stable=False, reason=f"never reached {target:g}")
    elif not later:
        out.update(stable=False, reason="no evaluation after the first at the target (train on with --keep-going)")
    elif median_later < target:
        out.update(stable=False, reason=f"median of the later evaluations {median_later:.1f} < {target:g}")
    elif out["final"] < target:
        out.update(stable=False, reason=f"final evaluation {out['final']:.1f} < {target:g}")
    else:
        out.update(stable=True, reason="holds the target")
    return out


def _parse_value(text: str) -> Any:
    """A ``--set`` value as YAML, except that numbers YAML 1.1 reads as strings (``3e-4``) are floats."""
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _overrides(base: dict[str, Any], items: list[str]) -> dict[str, Any]:
    """``base`` (a config's ``init_args``) with ``["key=value", ...]`` (``--set``, ``--data-set``)
    set, values parsed as YAML; a dotted key sets one field of a group (``optim.actor.lr=3e-4``)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for key, value in (item.split("=", 1) for item in items):
        *groups, name = key.split(".")
        target = out
        for group in groups:
            target[group] = dict(target.get(group) or {})
            target = target[group]
        target[name] = _parse_value(value)
    return out


def add_budget_args(parser: argparse.ArgumentParser) -> None:
    """The config, the budget, the evaluations and the target, and what to do at each evaluation."""
    default_config = os.path.join(os.path.dirname(__file__), "..", "configs/dreamer/cartpole.yaml")
    parser.add_argument("--config", default=default_config)
    parser.add_argument(
        "--env-steps",
        type=int,
        default=None,
        help="training env-step budget (default: the config's run, prefill + trainer.max_steps / replay_ratio)",
    )
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="gradient steps between evaluations (default: the config's val_check_interval)",
    )
    parser.add_argument("--eval-episodes", type=int, default=10)
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help=f"evaluation return that counts as solved (default per env: {TARGETS})",
    )
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="train on to the env-step/time budget after reaching the target (is it stable?)",
    )
    parser.add_argument(
        "--checkpoints",
        default=None,
        metavar="DIR",
        help="save the model at every evaluation to DIR/step_<N>.ckpt (to inspect it later)",
    )
    parser.add_argument(
        "--also-eval",
        choices=["mode", "sample"],
        default=None,
        help="at every evaluation also play the episodes with this eval_policy (the "
        "actor's mode or its samples) and print both returns and both verdicts",
    )


def add_settings_args(parser: argparse.ArgumentParser) -> None:
    """The seed, threads, precision and action repeat, and overrides of the config's settings."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", default="32-true", help="e.g. bf16-mixed")
    parser.add_argument(
        "--action-repeat",
        type=int,
        default=None,
        help="env steps per agent step (the config's env action_repeat; env steps above count agent steps)",
    )
    parser.add_argument(
        "--data-set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="override data init_args, e.g. --data-set replay_ratio=0.5",
    )
    parser.add_argument(
        "--terminal-fraction",
        type=float,
        default=None,
        help="replay batches: this fraction of windows holds an episode end (SequenceSampler terminal_fraction)",
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="override model init_args, e.g. --set optim.actor.lr=3e-4 net.deter=256 behavior.discount=0.997",
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line (kept for ``parser.error`` on settings that only the config can rule out)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_budget_args(parser)
    add_settings_args(parser)
    return parser


def fill_defaults(
    parser: argparse.ArgumentParser, args: argparse.Namespace, config: dict[str, Any], env: EnvConfig
) -> None:
    """``--target`` (the env's solved return) and ``--eval-every`` (the config's) where not given."""
    if args.target is None:
        if env.id not in TARGETS:
            parser.error(f"no default --target for {env.id}; pass one")
        args.target = TARGETS[env.id]
    if args.eval_every is None:
        args.eval_every = int(config["trainer"].get("val_check_interval", 250))


def build_datamodule(
    parser: argparse.ArgumentParser, args: argparse.Namespace, data_args: dict[str, Any], env: EnvConfig
) -> ReplayDataModule:
    """The config's ReplayDataModule with the evaluation settings, its sampler built as the CLI
    would, and ``--terminal-fraction``'s windows."""
    data_args["eval"] = {"episodes": args.eval_episodes, "envs": min(args.eval_episodes, 5)}
    sampler = data_args.get("sampler")
    if isinstance(sampler, dict):  # the config's class_path / init_args, built as the CLI would
        module, _, name = sampler["class_path"].rpartition(".")
        data_args["sampler"] = getattr(importlib.import_module(module), name)(**sampler.get("init_args", {}))
    datamodule = ReplayDataModule(env=env, **data_args)
    if args.terminal_fraction is not None:  # the config's own windows, a share of them holding an episode end
        windows = datamodule.sampler
        if not isinstance(windows, SequenceSampler):
            parser.error(f"--terminal-fraction needs sequence replay; the config samples {type(windows).__name__}")
        datamodule.sampler = SequenceSampler(
            windows.length, windows.cross_episodes, terminal_fraction=args.terminal_fraction
        )
    return datamodule


def build_trainer(
    args: argparse.Namespace, config: dict[str, Any], datamodule: ReplayDataModule, env: EnvConfig
) -> tuple[pl.Trainer, StopAtReturn]:
    """The Trainer for the budget (``--env-steps``, or the config's own run) and its stopper."""
    if args.env_steps is None:  # the config's own run (what `main.py fit --config ...` trains)
        budget_steps = int(config["trainer"]["max_steps"])
        args.env_steps = datamodule.prefill + math.ceil(budget_steps / datamodule.replay_ratio)
        stopper = StopAtReturn(args.target, sys.maxsize, args.keep_going, args.checkpoints, args.also_eval)
    else:
        budget_steps = int((args.env_steps - datamodule.prefill) * datamodule.replay_ratio) + 1
        stopper = StopAtReturn(args.target, args.env_steps, args.keep_going, args.checkpoints, args.also_eval)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=budget_steps,
        max_time={"minutes": args.minutes},
        val_check_interval=args.eval_every,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        log_every_n_steps=50,
        enable_checkpointing=False,
        callbacks=[*default_callbacks(), stopper],
        enable_progress_bar=False,
        logger=pl.loggers.TensorBoardLogger("lightning_logs", name=f"bench-dreamer-{env.id}"),
        precision=args.precision,
    )
    return trainer, stopper


def print_outcome(
    args: argparse.Namespace, env: EnvConfig, stopper: StopAtReturn, trainer: pl.Trainer, wall: float, env_steps: int
) -> None:
    """The run's settings and the markdown table of its outcome (solved, end of run, or not solved)."""
    print()
    print(
        f"Dreamer on {env.id} (vector), config {os.path.relpath(args.config)}, seed {args.seed}, "
        f"{args.threads} thread(s), precision {args.precision}, action repeat {env.action_repeat}"
        + (f", overrides {' '.join(args.set)}" if args.set else "")
        + (f", terminal_fraction {args.terminal_fraction:g}" if args.terminal_fraction is not None else "")
        + (f", data {' '.join(args.data_set)}" if args.data_set else "")
    )
    print()
    print("| outcome | env steps | gradient steps | wall time | best eval return |")
    print("| --- | --- | --- | --- | --- |")
    best = max((h[2] for h in stopper.history), default=float("nan"))
    if stopper.solved is not None:
        g, e, r, s = stopper.solved
        print(f"| solved (eval >= {args.target:g}) | {e} | {g} | {s / 60:.1f} min | {best:.1f} |")
        if args.keep_going:
            print(
                f"| end of run (--keep-going) | {env_steps} | {trainer.global_step} | {wall / 60:.1f} min "
                f"| last {stopper.history[-1][2]:.1f} |"
            )
    else:
        print(
            f"| not solved within {args.env_steps} env steps / {args.minutes:g} min | {env_steps} | "
            f"{trainer.global_step} | {wall / 60:.1f} min | {best:.1f} |"
        )


def print_evaluations(args: argparse.Namespace, env: EnvConfig, model: Dreamer, stopper: StopAtReturn) -> None:
    """Every evaluation, the stability verdict of each policy's curve, and the load average."""
    print()
    print(f"evaluations (gradient steps, env steps, frames = env steps x {env.action_repeat}, return, minutes):")
    for i, (g, e, r, s) in enumerate(stopper.history):
        other = f" {stopper.also[i]:8.1f} ({args.also_eval})" if i < len(stopper.also) else ""
        print(f"  {g:6d} {e:6d} {e * env.action_repeat:6d} {r:8.1f}{other} {s / 60:5.1f}")
    curves = [(model.eval_policy, [h[2] for h in stopper.history])]
    if stopper.also:
        curves.append((args.also_eval, stopper.also))
    for policy, returns in curves:
        verdict = stability_verdict(returns, args.target)
        if verdict["first"] is not None and verdict["later"]:
            print(
                f"stability (eval_policy {policy}): first >= {args.target:g} at evaluation {verdict['first'] + 1} "
                f"of {len(returns)}; the {verdict['later']} later evaluations: median {verdict['median_later']:.1f}, "
                f"min {verdict['min_later']:.1f}; final {verdict['final']:.1f} -> "
                f"{'STABLE' if verdict['stable'] else 'NOT STABLE'} ({verdict['reason']})"
            )
        else:
            print(f"stability (eval_policy {policy}): not assessed ({verdict['reason']})")
    print("load average:", " ".join(f"{x:.2f}" for x in os.getloadavg()))


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    pl.seed_everything(args.seed, workers=True)

    with open(args.config) as f:
        config = yaml.safe_load(f)
    model_args = _overrides(config["model"].get("init_args", {}), args.set)
    data_args = _overrides(config["data"]["init_args"], args.data_set)
    env = EnvConfig(
        **{
            **data_args.pop("env"),
            "seed": args.seed,
            **({"action_repeat": args.action_repeat} if args.action_repeat else {}),
        }
    )
    fill_defaults(parser, args, config, env)
    datamodule = build_datamodule(parser, args, data_args, env)
    model = Dreamer(datamodule.spec, **model_args)

    trainer, stopper = build_trainer(args, config, datamodule, env)
    start = time.perf_counter()
    trainer.fit(model, datamodule)
    wall = time.perf_counter() - start
    env_steps = stopper._env_steps(trainer)

    print_outcome(args, env, stopper, trainer, wall, env_steps)
    print_evaluations(args, env, model, stopper)


if __name__ == "__main__":
    main()
