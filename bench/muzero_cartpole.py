"""MuZero on CartPole-v1: env steps, games and wall time until the evaluation return (10
episodes, no noise, argmax over visit counts) reaches 475, and every evaluation after it.

    # lightning_wm (configs/muzero/cartpole.yaml), one seed at a time, then the table:
    nice -n 10 python bench/muzero_cartpole.py --system lightning_wm --seeds 0 --out /tmp/mz_cartpole
    python bench/muzero_cartpole.py --summarize /tmp/mz_cartpole
    # LightZero 0.2.0 (venv: bash bench/install_lightzero.sh), its CartPole MuZero config on CPU, one seed:
    nice -n 10 /work/venvs/lightzero/bin/python bench/muzero_cartpole.py --system lightzero --seeds 0 \\
        --max-env-steps 30000 --out /tmp/lz_cartpole
    # three seeds back to back, then the summary table:
    /work/venvs/lightzero/bin/python bench/muzero_cartpole.py --system lightzero --seeds 0 1 2
    python bench/muzero_cartpole.py --summarize /tmp/lz_cartpole

LightZero runs as a new user would run it: ``zoo/classic_control/cartpole/config/
cartpole_muzero_config.py`` unchanged (25 simulations, 8 collected episodes then 100 updates of
batch 256, reanalyse off) except what CPU and this comparison need: ``env_id='CartPole-v1'``,
``policy.cuda=False``, ``env_manager.type='base'``, 10 evaluation episodes (10 evaluator envs),
``stop_value`` out of reach so that the run goes on after the first success, one torch thread.
Its evaluator is LightZero's own (every ``eval_freq=100`` updates, i.e. after every collect);
this script only records each evaluation's returns, the collector's env steps and games, and
the wall time since the start, into ``<out>/<system>_seed<k>.json``.

The lightning_wm side (``--system lightning_wm``) trains ``--config`` (default
``configs/muzero/cartpole.yaml``) with its own settings, seed ``k`` as the env seed and
``seed_everything``, evaluating every ``--eval-every`` gradient steps (the config's
validation: 10 episodes in 10 envs, ``explore=False``; the shipped config's ``EMAWeights``
callback plays them with its average of the weights), until ``--max-env-steps``. Env steps
and games are the training collector's (the random prefill included, evaluation episodes not);
env steps count simulator frames: with ``env.action_repeat`` k each agent step is k of them
(the record keeps ``agent_steps`` too), so systems with and without a repeat compare per frame;
wall time runs from the start of ``fit``. Both systems write the same JSON records, so
``--summarize`` prints one table for a folder holding both.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

TARGET = 475.0


# -- summaries (any system) --------------------------------------------------------------------
def summarize(
    evals: list[dict[str, Any]], target: float = TARGET, in_a_row: int = 3, tail_env_steps: int = 2000
) -> dict[str, Any]:
    """One run's evaluations (``env_steps``, ``games``, ``wall_s``, ``return_mean`` each, in order):
    the first at or above ``target`` (env steps, games, wall seconds), whether every later one
    stays there and the lowest of them, the env steps of the first ``in_a_row`` evaluations in a
    row at or above ``target`` (a measure that one lucky evaluation does not meet) and whether every
    evaluation from there on stays at or above ``target`` (``stays_after_held``), the mean
    return over the last ``tail_env_steps`` env steps of the run, and the last evaluation."""
    first = next((e for e in evals if e["return_mean"] >= target), None)
    out: dict[str, Any] = {"evaluations": len(evals), "solved": first is not None, "held_env_steps": None}
    if first is not None:
        later = [e for e in evals if e["env_steps"] >= first["env_steps"]]
        out.update(
            env_steps=first["env_steps"],
            games=first["games"],
            wall_s=first["wall_s"],
            stays=all(e["return_mean"] >= target for e in later),
            min_after=min(e["return_mean"] for e in later),
        )
    run = 0
    for e in evals:
        run = run + 1 if e["return_mean"] >= target else 0
        if run == in_a_row:
            out["held_env_steps"] = e["env_steps"]
            out["stays_after_held"] = all(x["return_mean"] >= target for x in evals if x["env_steps"] >= e["env_steps"])
            break
    if evals:
        out["last_return"] = evals[-1]["return_mean"]
        out["last_env_steps"] = evals[-1]["env_steps"]
        tail = [e["return_mean"] for e in evals if e["env_steps"] > evals[-1]["env_steps"] - tail_env_steps]
        out["tail_mean"] = statistics.fmean(tail)
    return out


def _steps(median: float) -> str:
    return "not (half the runs never got there)" if math.isinf(median) else f"{median:.0f}"


def median_counting_unsolved(values: list[float | None]) -> float:
    """Median of ``values`` where ``None`` (never got there) counts as slower than every number."""
    if not values:
        raise ValueError("no runs to take the median of")
    ordered = sorted(values, key=lambda v: (v is None, v or 0.0))
    mid = len(ordered) // 2
    pair = ordered[mid - 1 : mid + 1] if len(ordered) % 2 == 0 else [ordered[mid]]
    return math.inf if any(v is None for v in pair) else statistics.fmean(pair)


def print_runs(paths: list[str]) -> None:
    """A markdown table per run (every evaluation) and the medians over runs."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append((path, json.load(f)))
    runs.sort(key=lambda item: (item[1]["system"], item[1]["seed"]))  # seed 10 after seed 9
    rows = []
    for path, run in runs:
        s = summarize(run["evaluations"])
        rows.append((run, s))
        print(f"\n{run['system']} seed {run['seed']} ({path}):\n")
        print("| env steps | games | wall s | return mean | min | max |")
        print("| --- | --- | --- | --- | --- | --- |")
        for e in run["evaluations"]:
            print(
                f"| {e['env_steps']} | {e['games']} | {e['wall_s']:.0f} | {e['return_mean']:.1f} | "
                f"{min(e['returns']):.0f} | {max(e['returns']):.0f} |"
            )
    print(
        "\n| system | seed | env steps to 475 | games | wall s | stays >= 475 | min after | 3 in a row at "
        "| stays from there | mean of the last 2,000 | last |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run, s in rows:
        held = f"{s['held_env_steps']} | {s['stays_after_held']}" if s["held_env_steps"] is not None else "not | "
        tail = f"{s['tail_mean']:.1f}" if "tail_mean" in s else ""
        if s["solved"]:
            print(
                f"| {run['system']} | {run['seed']} | {s['env_steps']} | {s['games']} | {s['wall_s']:.0f} | "
                f"{s['stays']} | {s['min_after']:.1f} | {held} | {tail} | {s.get('last_return', float('nan')):.1f} |"
            )
        else:
            print(
                f"| {run['system']} | {run['seed']} | not reached in {s.get('last_env_steps', 0)} | | | | | "
                f"{held} | {tail} | {s.get('last_return', float('nan')):.1f} |"
            )
    for system in sorted({run["system"] for run, _ in rows}):
        mine = [s for run, s in rows if run["system"] == system]
        solved = [s for s in mine if s["solved"]]
        first = median_counting_unsolved([s.get("env_steps") for s in mine])
        held = median_counting_unsolved([s["held_env_steps"] for s in mine])
        line = (
            f"\n{system}: {len(solved)}/{len(mine)} runs reach 475, {sum(s['held_env_steps'] is not None for s in mine)}"
            f"/{len(mine)} hold it 3 evaluations in a row ({sum(bool(s.get('stays_after_held')) for s in mine)} of "
            f"them stay >= 475 from there to the end, {sum(bool(s.get('stays')) for s in mine)} from the first 475); medians (a run that never gets there counts as the "
            f"slowest): env steps to 475 {_steps(first)}, to 3 in a row {_steps(held)}, mean of the last 2,000 env steps "
            f"{statistics.median(s['tail_mean'] for s in mine if 'tail_mean' in s):.1f}"
        )
        if solved:
            line += f"; wall to 475 over the solved runs {statistics.median(s['wall_s'] for s in solved):.0f} s"
        print(line)


# -- lightning_wm ------------------------------------------------------------------------------
def _recorder(record: dict[str, Any], path: str, seed: int, max_env_steps: int) -> Any:
    """A callback that appends every evaluation to ``record`` (and writes it to ``path``), and stops
    the run at the env-step budget."""
    import pytorch_lightning as pl

    class Recorder(pl.Callback):
        """Every evaluation's returns, env steps, games and wall time; stop at the env-step budget."""

        def __init__(self) -> None:
            self.start = time.perf_counter()
            self.returns: list[float] = []

        def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            self.start = time.perf_counter()
            dm = trainer.datamodule
            evaluate = dm.evaluate

            def recorded(agent: Any, episodes: int | None = None) -> list[dict[str, float]]:
                out = evaluate(agent, episodes)
                self.returns = [float(e["return"]) for e in out]
                return out

            dm.evaluate = recorded

        def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            dm = trainer.datamodule
            collector = getattr(dm.acting, "collector", None)  # in process; actors count no games here
            games = int(collector.stats.episodes) if collector is not None else None
            wall = time.perf_counter() - self.start
            agent_steps = int(dm.env_steps)
            frames = agent_steps * dm.env.action_repeat
            record["evaluations"].append(
                {
                    "train_iter": trainer.global_step,
                    "env_steps": frames,
                    "agent_steps": agent_steps,
                    "games": games,
                    "wall_s": wall,
                    "returns": self.returns,
                    "return_mean": statistics.fmean(self.returns),
                }
            )
            with open(path, "w") as f:
                json.dump(record, f, indent=1)
            print(
                f"[lightning_wm seed {seed}] step {trainer.global_step}, env steps {frames}, games "
                f"{games}, wall {wall:.0f} s: eval return {statistics.fmean(self.returns):.1f}",
                flush=True,
            )
            if frames >= max_env_steps:
                trainer.should_stop = True

    return Recorder()


def _cli_args(config: str, seed: int, eval_every: int, overrides: list[str]) -> list[str]:
    """The command line of one lightning_wm run: the config, the seed, evaluation every ``eval_every``
    steps, no logger, checkpoints, progress bar or sanity check, then ``overrides``."""
    return [
        "--config",
        config,
        "--seed_everything",
        str(seed),
        "--data.init_args.env.seed",
        str(seed),
        "--trainer.val_check_interval",
        str(eval_every),
        "--trainer.max_steps",
        "10000000",
        "--trainer.logger",
        "false",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.num_sanity_val_steps",
        "0",
        *overrides,
    ]


def run_lightning_wm(
    seed: int, max_env_steps: int, out_dir: str, config: str, eval_every: int, overrides: list[str]
) -> str:
    """One run of our MuZero config; returns the path of its JSON record."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from lightning_wm.cli import CLI, Trainer

    path = os.path.join(out_dir, f"lightning_wm_seed{seed}.json")
    record: dict[str, Any] = {
        "system": "lightning_wm",
        "seed": seed,
        "max_env_steps": max_env_steps,
        "config": config,
        "overrides": overrides,
        "evaluations": [],
    }
    cli = CLI(
        model_class=None,
        datamodule_class=None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_class=Trainer,
        save_config_callback=None,
        parser_kwargs={"allow_abbrev": False},
        args=_cli_args(config, seed, eval_every, overrides),
        run=False,
    )
    recorder = _recorder(record, path, seed, max_env_steps)
    cli.trainer.callbacks.append(recorder)
    start = time.perf_counter()
    cli.trainer.fit(cli.model, cli.datamodule)
    record["total_wall_s"] = time.perf_counter() - start
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return path


# -- LightZero ---------------------------------------------------------------------------------
def _lightzero_config(main_config: Any, create_config: Any, seed: int) -> tuple[Any, Any]:
    """Copies of LightZero's CartPole MuZero configs with what CPU and this comparison need:
    CartPole-v1, no stop value, 10 evaluation episodes in 10 envs, no CUDA, the base env manager."""
    cfg, create = copy.deepcopy(main_config), copy.deepcopy(create_config)
    cfg.exp_name = f"lightzero_seed{seed}"
    cfg.env.env_id = "CartPole-v1"
    cfg.env.stop_value = 1e9  # keep going after the first success: every evaluation is reported
    cfg.env.evaluator_env_num = cfg.policy.evaluator_env_num = 10
    cfg.env.n_evaluator_episode = 10
    cfg.policy.cuda = False
    create.env_manager.type = "base"
    return cfg, create


@contextlib.contextmanager
def _recording_evaluations(
    collector_mod: Any, evaluator_mod: Any, record: dict[str, Any], path: str, seed: int, start: float
) -> Iterator[None]:
    """While inside: LightZero's evaluator appends every evaluation to ``record`` (and writes it to
    ``path``), with the games of its first collector; its methods are restored on the way out."""
    returns: list[list[float]] = []
    collectors: list[Any] = []

    get_returns = evaluator_mod.VectorEvalMonitor.get_episode_return

    def episode_returns(self: Any) -> Any:
        out = get_returns(self)
        returns.append([float(r) for r in out])
        return out

    evaluate = evaluator_mod.MuZeroEvaluator.eval

    def recorded_eval(
        self: Any, save_ckpt_fn: Any = None, train_iter: int = -1, envstep: int = -1, *args: Any, **kwargs: Any
    ) -> Any:
        out = evaluate(self, save_ckpt_fn, train_iter, envstep, *args, **kwargs)
        games = collectors[0]._total_episode_count if collectors else 0
        record["evaluations"].append(
            {
                "train_iter": int(train_iter),
                "env_steps": int(envstep),
                "games": int(games),
                "wall_s": time.perf_counter() - start,
                "returns": returns[-1],
                "return_mean": statistics.fmean(returns[-1]),
            }
        )
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
        print(
            f"[lightzero seed {seed}] env steps {envstep}, games {games}, wall {time.perf_counter() - start:.0f} s: "
            f"eval return {statistics.fmean(returns[-1]):.1f}",
            flush=True,
        )
        return out

    init = collector_mod.MuZeroCollector.__init__

    def remembered_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        collectors.append(self)

    evaluator_mod.VectorEvalMonitor.get_episode_return = episode_returns
    evaluator_mod.MuZeroEvaluator.eval = recorded_eval
    collector_mod.MuZeroCollector.__init__ = remembered_init
    try:
        yield
    finally:
        evaluator_mod.VectorEvalMonitor.get_episode_return = get_returns
        evaluator_mod.MuZeroEvaluator.eval = evaluate
        collector_mod.MuZeroCollector.__init__ = init


def run_lightzero(seed: int, max_env_steps: int, out_dir: str) -> str:
    """One LightZero CartPole MuZero run; returns the path of its JSON record."""
    import lzero.worker.muzero_collector as collector_mod
    import lzero.worker.muzero_evaluator as evaluator_mod
    import torch
    from lzero.entry import train_muzero
    from zoo.classic_control.cartpole.config.cartpole_muzero_config import create_config, main_config

    torch.set_num_threads(1)
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    os.chdir(
        out_dir
    )  # DI-engine puts "./" before exp_name: its logs and checkpoints land here, not in the caller's folder
    cfg, create = _lightzero_config(main_config, create_config, seed)

    start = time.perf_counter()
    record: dict[str, Any] = {
        "system": "lightzero",
        "seed": seed,
        "max_env_steps": max_env_steps,
        "config": "zoo/classic_control/cartpole/config/cartpole_muzero_config.py",
        "evaluations": [],
    }
    path = os.path.join(out_dir, f"lightzero_seed{seed}.json")
    with _recording_evaluations(collector_mod, evaluator_mod, record, path, seed, start):
        train_muzero([cfg, create], seed=seed, max_env_step=max_env_steps)
    record["total_wall_s"] = time.perf_counter() - start
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", choices=["lightning_wm", "lightzero"], default="lightning_wm")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-env-steps", type=int, default=30_000)
    parser.add_argument("--out", default="/tmp/muzero_cartpole")
    parser.add_argument("--summarize", metavar="DIR", help="only print the tables of the JSON records in DIR")
    parser.add_argument("--config", default="configs/muzero/cartpole.yaml", help="lightning_wm: the config to train")
    parser.add_argument("--eval-every", type=int, default=100, help="lightning_wm: gradient steps between evaluations")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="ARG",
        help="lightning_wm: an extra command-line override (repeatable), e.g. --override=--model.init_args.optim.lr=0.001",
    )
    args = parser.parse_args()
    args.out = os.path.abspath(args.out)  # LightZero runs chdir into it
    if args.summarize:
        if not os.path.isdir(args.summarize):
            sys.exit(f"error: {args.summarize} is not a folder of run records")
        paths = sorted(os.path.join(args.summarize, p) for p in os.listdir(args.summarize) if p.endswith(".json"))
        if not paths:
            sys.exit(f"error: no run records (*.json) in {args.summarize}")
        print_runs(paths)
        return
    os.makedirs(args.out, exist_ok=True)
    if args.system == "lightning_wm":
        paths = [
            run_lightning_wm(seed, args.max_env_steps, args.out, args.config, args.eval_every, args.override)
            for seed in args.seeds
        ]
        print_runs(paths)
        return
    try:
        import lzero  # noqa: F401
    except ImportError:
        sys.exit(
            "error: LightZero is not installed in this Python; run this with LightZero's venv, e.g. "
            "/work/venvs/lightzero/bin/python bench/muzero_cartpole.py --system lightzero"
        )
    paths = [run_lightzero(seed, args.max_env_steps, args.out) for seed in args.seeds]
    print_runs(paths)


if __name__ == "__main__":
    main()
