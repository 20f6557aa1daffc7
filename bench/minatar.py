"""MinAtar learning bench: per system, game and seed, the greedy evaluation return every fixed number
of frames up to a frame budget, the training wall time, and a summary (mean over seeds at each
budget; frames to reach a return).

    python bench/minatar.py --systems impala --games breakout --seeds 0 --frames 1000000 --eval-every 100000
    python bench/minatar.py --systems muzero dreamer --games breakout --seeds 0 --frames 20000 --eval-every 5000
    python bench/minatar.py --systems rllib --games breakout --seeds 0 --frames 1000000 --eval-every 100000
    python bench/minatar.py --report bench/minatar_runs.jsonl --target 10

Systems: ``impala``, ``muzero``, ``dreamer``, ``dyna`` train ``configs/impala/minatar.yaml``,
``configs/muzero/minatar.yaml``, ``configs/dreamer/minatar.yaml``, ``configs/impala/minatar_dyna.yaml``
(``--set KEY VALUE`` overrides any option, e.g. ``--set model.init_args.optim.lr 0.0005``) through
the CLI's classes, one process per run (seed ``s``: ``seed_everything s`` and env seed ``s``; the
game: ``data.init_args.env.id``). ``rllib`` is the peer: RLlib's IMPALA
(``IMPALAConfig()``, 1 env runner x 16 envs, no separate learner process, lr 0.0005, train batch
500, a CNN of one 3x3 conv of 16 filters, stride 1, and 128-unit heads: the MinAtar paper's
network in RLlib's ``DefaultModelConfig``; every other option RLlib's default) in its own venv
(``--rllib-python``, default ``/work/venvs/rllib/bin/python``; create it with ``python -m venv
/work/venvs/rllib && /work/venvs/rllib/bin/pip install torch==2.13.0 "ray[rllib]" minatar``). It
plays the same env factory (``lightning_wm.envs.make_env``, gymnasium and numpy only), its
frames scaled to float 0/1.

Measurement rule: frames are training env steps (MinAtar has no frame skip: one agent step is
one frame; evaluation episodes not counted). Whenever the frames cross a multiple of
``--eval-every`` (and at the budget) the current weights play ``--eval-episodes`` greedy episodes
(``explore=False``: argmax of the policy; MuZero: its search's most visited action) in fresh envs,
the same episodes' seeds at every evaluation of a run; the clock stops meanwhile. Ours evaluate
through ``lightning_wm.data.collector.run_evaluation`` (recurrent state reset per episode, as
validation does); RLlib's module through ``benchlib.greedy_episodes``. RLlib evaluates after each
training iteration (at least ``min_time_s_per_iteration``, its default 10 s): its evaluation points
are the first iteration ends past each multiple. A run stops at ``--frames`` or ``--minutes`` of
training wall time, whichever comes first. ``--out`` appends every record as one JSON line;
``--report FILE ...`` prints the tables from such files (several runs together).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

from benchlib import (
    RLLIB_PYTHON,
    ROOT,
    build_cli,
    exit_on_signal,
    greedy_episodes,
    load_average,
    ours_env,
    peer_env,
    print_result,
    quiet_fit_overrides,
    run_worker,
)

CONFIGS = {
    "impala": "configs/impala/minatar.yaml",
    "muzero": "configs/muzero/minatar.yaml",
    "dreamer": "configs/dreamer/minatar.yaml",
    "dyna": "configs/impala/minatar_dyna.yaml",
}
SYSTEMS = [*CONFIGS, "rllib"]
GAMES = {
    "breakout": "MinAtar/Breakout-v1",
    "asterix": "MinAtar/Asterix-v1",
    "space_invaders": "MinAtar/SpaceInvaders-v1",
    "freeway": "MinAtar/Freeway-v1",
    "seaquest": "MinAtar/Seaquest-v1",
}
EVAL_SEED_OFFSET = 10_000  # evaluation episodes of seed s: seeds derived from EVAL_SEED_OFFSET + s


class EvalSchedule:
    """When to evaluate: each time the frames cross a multiple of ``every``, and once at the end
    (``frames`` reached or ``seconds`` of training spent)."""

    def __init__(self, every: int, frames: int, seconds: float) -> None:
        if every < 1 or frames < 1:
            raise ValueError(f"--eval-every and --frames must be >= 1, got {every} and {frames}")
        self.every, self.frames, self.seconds, self.next = every, frames, seconds, every

    def over(self, frames: int, seconds: float) -> bool:
        return frames >= self.frames or seconds >= self.seconds

    def due(self, frames: int, seconds: float) -> bool:
        """Whether to evaluate now; moves the next point past ``frames`` when it is."""
        if frames < self.next and not self.over(frames, seconds):
            return False
        self.next = (frames // self.every + 1) * self.every
        return True


def _row(frames: int, seconds: float, returns: list[float]) -> dict[str, float]:
    return {
        "frames": int(frames),
        "seconds": float(seconds),
        "eval_return": float(statistics.fmean(returns)),
        "eval_std": float(statistics.pstdev(returns)),
    }


def _log(system: str, row: dict[str, float]) -> None:
    print(
        f"[eval] {system} frames {row['frames']:9d}  {row['seconds']:7.1f} s  return {row['eval_return']:7.2f} "
        f"(sd {row['eval_std']:.2f})",
        file=sys.stderr,
        flush=True,
    )


def _record(args: argparse.Namespace, history: list[dict[str, float]], eval_seconds: float) -> dict[str, Any]:
    last = history[-1] if history else {"frames": 0, "seconds": 0.0, "eval_return": math.nan}
    return {
        "system": args.system,
        "game": args.game,
        "seed": args.seed,
        "frames_budget": args.frames,
        "eval_every": args.eval_every,
        "eval_episodes": args.eval_episodes,
        "history": history,
        "frames": last["frames"],
        "train_seconds": last["seconds"],
        "eval_seconds": eval_seconds,
        "frames_per_s": last["frames"] / max(last["seconds"], 1e-9),
        "sets": args.set or [],
        "load_average": load_average(),
    }


# -- ours ------------------------------------------------------------------------------------
def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    """Train ``CONFIGS[args.system]`` on ``args.game`` to the frame budget, evaluating on the way."""
    import pytorch_lightning as pl
    import torch

    from lightning_wm.data.collector import run_evaluation
    from lightning_wm.envs import EnvConfig

    overrides = [*quiet_fit_overrides(args.seed), "--trainer.max_steps", "-1"]
    overrides += ["--data.init_args.env.id", GAMES[args.game]]
    for key, value in args.set or []:
        overrides += [f"--{key}", value]
    cli = build_cli(os.path.join(ROOT, CONFIGS[args.system]), overrides)
    module, trainer = cli.model, cli.trainer
    schedule = EvalSchedule(args.eval_every, args.frames, args.minutes * 60)
    eval_env = EnvConfig(id=GAMES[args.game])

    class Evaluate(pl.Callback):
        def __init__(self) -> None:
            self.history: list[dict[str, float]] = []
            self.eval_time = 0.0
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            frames, seconds = int(pl_module.env_steps), time.perf_counter() - self.start - self.eval_time
            if not schedule.due(frames, seconds):
                return
            start = time.perf_counter()
            modes = [(m, m.training) for m in pl_module.modules()]
            pl_module.eval()
            with torch.no_grad():
                episodes = run_evaluation(
                    eval_env, pl_module, args.eval_episodes, args.eval_episodes, EVAL_SEED_OFFSET + args.seed
                )
            for m, training in modes:
                m.train(training)
            self.eval_time += time.perf_counter() - start
            self.history.append(_row(frames, seconds, [e["return"] for e in episodes]))
            _log(args.system, self.history[-1])
            if schedule.over(frames, seconds):
                trainer.should_stop = True

    evaluate = Evaluate()
    trainer.callbacks.append(evaluate)
    evaluate.start = time.perf_counter()
    trainer.fit(module, cli.datamodule)
    return _record(args, evaluate.history, evaluate.eval_time)


# -- RLlib (runs inside the RLlib venv) -------------------------------------------------------
def run_rllib(args: argparse.Namespace) -> dict[str, Any]:
    """Train RLlib's IMPALA on ``args.game`` to the frame budget, evaluating after the training
    iterations that cross each multiple of ``--eval-every``. Imports Ray here: this function runs
    only under the RLlib venv's interpreter, never in ours."""
    sys.path.insert(0, ROOT)  # lightning_wm.envs needs only gymnasium and numpy
    import gymnasium as gym
    import numpy as np
    import ray
    import torch
    from ray.rllib.algorithms.impala import IMPALAConfig
    from ray.rllib.core import DEFAULT_MODULE_ID
    from ray.rllib.core.columns import Columns
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
    from ray.tune.registry import register_env

    env_id = GAMES[args.game]

    def make(_config: Any = None) -> gym.Env:
        from lightning_wm.envs import EnvConfig, make_env

        env = make_env(EnvConfig(id=env_id))
        space = gym.spaces.Box(0.0, 1.0, env.observation_space.shape, np.float32)
        return gym.wrappers.TransformObservation(env, lambda o: o.astype(np.float32) / 255.0, space)

    torch.set_num_threads(1)
    # address="local": a fresh instance of our own, so that ray.shutdown() ends every process of it;
    # its workers find lightning_wm.envs through PYTHONPATH
    ray.init(
        address="local",
        num_cpus=args.num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": ROOT}},
    )
    signal.signal(signal.SIGTERM, exit_on_signal)  # after ray.init, which replaces handlers
    try:
        register_env("lightning_wm_minatar", make)
        config = (
            IMPALAConfig()
            .environment("lightning_wm_minatar")
            .env_runners(num_env_runners=1, num_envs_per_env_runner=16)
            .learners(num_learners=0)
            .training(lr=0.0005, train_batch_size_per_learner=500)
            .rl_module(model_config=DefaultModelConfig(conv_filters=[[16, 3, 1]], head_fcnet_hiddens=[128]))
            .debugging(seed=args.seed)
        )
        algo = config.build_algo()
        try:
            module = algo.learner_group._learner.module[DEFAULT_MODULE_ID]  # num_learners=0: in this process

            def policy(obs: Any) -> Any:
                with torch.no_grad():
                    out = module.forward_inference({Columns.OBS: torch.from_numpy(obs)})
                return out[Columns.ACTION_DIST_INPUTS].argmax(-1).numpy()

            schedule = EvalSchedule(args.eval_every, args.frames, args.minutes * 60)
            history: list[dict[str, float]] = []
            train_time = eval_time = 0.0
            while True:
                start = time.perf_counter()
                result = algo.train()
                train_time += time.perf_counter() - start
                runners = result.get("env_runners", {})
                frames = int(runners.get("num_env_steps_sampled_lifetime", 0))
                if not schedule.due(frames, train_time):
                    continue
                start = time.perf_counter()
                returns = greedy_episodes(policy, args.eval_episodes, EVAL_SEED_OFFSET + args.seed, make=make)
                eval_time += time.perf_counter() - start
                history.append(_row(frames, train_time, returns))
                _log("rllib", history[-1])
                if schedule.over(frames, train_time):
                    return _record(args, history, eval_time)
        finally:
            algo.stop()
    finally:
        ray.shutdown()


# -- summary ---------------------------------------------------------------------------------
def frames_to_reach(history: list[dict[str, float]], target: float) -> int | None:
    """Frames of the first evaluation whose mean return is at least ``target`` (None: never)."""
    return next((int(row["frames"]) for row in history if row["eval_return"] >= target), None)


def value_at(history: list[dict[str, float]], frames: int, every: int, key: str = "eval_return") -> float | None:
    """``key`` of the run's evaluation at ``frames``: the first one at or past it and before the
    next point (``frames + every``); None where the run has none there."""
    rows = [row for row in history if frames <= row["frames"] < frames + every]
    return float(rows[0][key]) if rows else None


def variant(record: dict[str, Any]) -> str:
    """The system and the ``--set`` overrides a run was made with: ``dyna (imagination.real_ratio
    0.125)`` (``init_args.`` left out of the keys); runs of one variant are the seeds of one row."""
    sets = [f"{key.replace('init_args.', '').removeprefix('model.')} {value}" for key, value in record.get("sets", [])]
    return f"{record['system']} ({'; '.join(sets)})" if sets else record["system"]


def summary(records: list[dict[str, Any]], every: int, targets: list[float]) -> str:
    """Markdown: per system variant (:func:`variant`) and game, the mean (over seeds) evaluation
    return and training wall time at each multiple of the runs' evaluation spacing (their
    ``eval_every``, else ``every``) where every seed has an evaluation (:func:`value_at`); then
    frames to reach each target per seed."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in sorted(records, key=lambda r: r["seed"]):  # per-seed values in seed order
        groups[(variant(r), r["game"])].append(r)
    lines = [
        "| system | game | seeds | frames | mean eval return (per seed) | mean wall time | frames/s |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: |",
    ]
    for (system, game), runs in sorted(groups.items()):
        reached = min(r["frames"] for r in runs)
        spacing = max(r.get("eval_every", every) for r in runs)
        for point in range(spacing, reached + 1, spacing):
            values = [value_at(r["history"], point, spacing) for r in runs]
            seconds = [value_at(r["history"], point, spacing, "seconds") for r in runs]
            if any(v is None for v in values):
                continue
            per_seed = ", ".join(f"{v:.2f}" for v in values)
            lines.append(
                f"| {system} | {game} | {len(runs)} | {point:,} | {statistics.fmean(values):.2f} ({per_seed}) | "
                f"{statistics.fmean(seconds):.0f} s | {statistics.fmean(r['frames_per_s'] for r in runs):,.0f} |"
            )
    if targets:
        lines += ["", "| system | game | target return | frames to reach it, per seed |", "| --- | --- | ---: | --- |"]
        for (system, game), runs in sorted(groups.items()):
            for target in targets:
                reach = [frames_to_reach(r["history"], target) for r in runs]
                cells = ", ".join(f"{f:,}" if f is not None else f"not in {r['frames']:,}" for f, r in zip(reach, runs))
                lines.append(f"| {system} | {game} | {target:g} | {cells} |")
    return "\n".join(lines)


# -- driver ------------------------------------------------------------------------------------
def run_one(args: argparse.Namespace, system: str, game: str, seed: int) -> dict[str, Any]:
    """One run in its own process (the system's interpreter); its JSON record."""
    cmd = [os.path.abspath(__file__), "--worker", "--system", system, "--game", game, "--seed", str(seed)]
    cmd += ["--frames", str(args.frames), "--eval-every", str(args.eval_every), "--minutes", str(args.minutes)]
    cmd += ["--eval-episodes", str(args.eval_episodes), "--num-cpus", str(args.num_cpus)]
    for key, value in args.set or []:
        cmd += ["--set", key, value]
    if system != "rllib":
        return run_worker([sys.executable, *cmd], ours_env(), prefix="minatar_bench_")
    if not os.path.exists(args.rllib_python):
        raise SystemExit(f"error: no RLlib interpreter at {args.rllib_python}; create the venv as the docstring says")
    return run_worker([args.rllib_python, *cmd], peer_env(), prefix="minatar_bench_")


def unshadow_minatar() -> None:
    """Take this script's folder off ``sys.path``: Python put it first, and this file's name would
    shadow the ``minatar`` package (``benchlib`` is imported by then)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]


def main() -> None:
    unshadow_minatar()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=["impala"])
    parser.add_argument("--games", nargs="+", choices=sorted(GAMES), default=["breakout"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--frames", type=int, default=1_000_000, help="frame budget per run")
    parser.add_argument("--eval-every", type=int, default=100_000, help="frames between evaluations")
    parser.add_argument("--eval-episodes", type=int, default=20)
    parser.add_argument("--minutes", type=float, default=15.0, help="training wall-time cap per run")
    parser.add_argument("--target", type=float, nargs="*", default=[], help="returns for 'frames to reach'")
    parser.add_argument("--set", nargs=2, action="append", metavar=("KEY", "VALUE"), help="override a config option")
    parser.add_argument("--out", help="append every run's record to this JSON-lines file")
    parser.add_argument("--report", nargs="+", metavar="FILE", help="print the tables of saved records, run nothing")
    parser.add_argument("--rllib-python", default=RLLIB_PYTHON)
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs Ray may use")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=SYSTEMS, default="impala", help=argparse.SUPPRESS)
    parser.add_argument("--game", choices=sorted(GAMES), default="breakout", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, exit_on_signal)
    if args.worker:
        print_result(run_rllib(args) if args.system == "rllib" else run_ours(args))
        return
    if args.report:
        records = [json.loads(line) for path in args.report for line in open(path) if line.strip()]
    else:
        print(f"machine: {os.cpu_count()} CPUs, load average {load_average()} at start", flush=True)
        records = []
        for system in args.systems:
            for game in args.games:
                for seed in args.seeds:
                    record = run_one(args, system, game, seed)
                    records.append(record)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps(record) + "\n")
    print()
    print(summary(records, args.eval_every, args.target))
    print()
    print("load average:", load_average())


if __name__ == "__main__":
    main()
