"""IMPALA learning and speed bench: env steps and wall time until the evaluation return (mean of
10 episodes, deterministic policy) reaches the target, per seed, and the medians; ours against
RLlib's IMPALA; and env frames/s with 1, 2, 4 actor processes while the learner trains.

    python bench/impala_cartpole.py --system ours --seeds 0 1 2 --keep-going
    python bench/impala_cartpole.py --system rllib --seeds 0 1 2 --keep-going
    python bench/impala_cartpole.py --system ours --config configs/impala/pendulum.yaml --target -200
    python bench/impala_cartpole.py --seeds 0 1 2 --keep-going --max-env-steps 384000 \
        --set data.init_args.acting.policy central           # central acting (acting.policy)
    python bench/impala_cartpole.py --seeds 0 1 2 3 4 5 6 7 --keep-going --max-env-steps 384000 \
        --eval-every 5 --set data.init_args.acting.num_actors 0 --jobs 2  # 8 seeds in process, 2 at a time
    python bench/impala_cartpole.py --speed --speed-envs cartpole pong --actors 1 2 4

``--jobs N`` runs N seeds at a time, each in its own process: a run in process repeats bit for
bit, so its env steps and returns do not change, but wall times and frames/s are then measured on
shared cores, and with actors the acting's timing (hence the learning) changes too.

``--system ours`` trains ``--config`` (default ``configs/impala/cartpole.yaml``; ``--set KEY VALUE``
overrides any option of it, e.g. ``--set model.init_args.loss.entropy_weight 0.005``) through the
CLI's classes, one process per seed (seed ``s``: ``seed_everything s`` and env seed ``s``).
After every ``--eval-every`` gradient steps the learner's current weights play the evaluation
episodes; the clock stops meanwhile (the actors go on acting until the chunk queue is full,
2 chunks per actor, which the learner then consumes).

``--system rllib`` is the peer: RLlib's IMPALA run as a new user would on this machine
(``IMPALAConfig().environment("CartPole-v1")``, 1 env runner x 8 envs, no separate learner
process (``num_learners=0``), lr 0.0005, train batch 500, every other option at RLlib's
default). RLlib pins gymnasium 1.2.2, so it lives in its own venv (``--rllib-python``,
default ``/work/venvs/rllib/bin/python``; create it with ``python -m venv /work/venvs/rllib &&
/work/venvs/rllib/bin/pip install torch==2.13.0 "ray[rllib]"``): this script re-runs itself
under that interpreter, one process per seed, and reads one JSON line back.

Measurement rule (the same for every system): the current learner weights play
``--eval-episodes`` episodes in fresh envs (seeded ``seed * 1000 + i``), greedy actions (argmax
of the logits; the mean for continuous actions), all episodes stepped together in one batch.
The evaluation's own time is left out of the wall time; env steps are training env steps
(agent steps over all envs, evaluation episodes not counted). RLlib evaluates after each
training iteration, which lasts at least ``min_time_s_per_iteration`` (its default, 10 s): the
granularity of its figures. ``frames/s`` is training env steps / training wall time. With
``--keep-going`` training continues to the budget after the target and the last evaluation
says whether the policy stays solved. Every process (actors, Ray) is shut down before a seed's
process exits, also when the bench is terminated (SIGTERM) or interrupted.

``--speed``: for each env (CartPole-v1 from the cartpole config, ALE/Pong-v5 from
``configs/impala/pong.yaml``, which needs opencv: ``pip install -e ".[atari]"``) and actor count,
fit with that many actors for ``--speed-seconds`` after a warm-up and report env frames/s that
reached the learner, gradient steps/s, the learner's share of time waiting for unrolls and the
seconds from the start of fit (where acting starts) to the first training step. ``--set
data.init_args.acting.policy central`` measures central acting.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import sys
import time
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
    run_seeds,
    run_worker,
)


# -- RLlib (runs inside the RLlib venv) -------------------------------------------------------
def run_rllib(args: argparse.Namespace) -> dict[str, Any]:
    """Train RLlib's IMPALA on CartPole-v1 until the evaluation return reaches the target (or
    the budget runs out); returns the record of the run. Imports Ray here: this function runs
    only under the RLlib venv's interpreter (gymnasium 1.2.2), never in ours."""
    import numpy as np
    import ray
    import torch
    from ray.rllib.algorithms.impala import IMPALAConfig
    from ray.rllib.core import DEFAULT_MODULE_ID
    from ray.rllib.core.columns import Columns

    torch.set_num_threads(1)
    # address="local": always a fresh instance of our own (never one somebody started with `ray start`),
    # so that ray.shutdown() below ends every process of it
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    # Ray's own SIGTERM handler aborts the process and leaves agents behind: exit through the
    # finally blocks below instead (installed after ray.init, which replaces handlers)
    signal.signal(signal.SIGTERM, exit_on_signal)
    try:
        config = (
            IMPALAConfig()
            .environment("CartPole-v1")
            .env_runners(num_env_runners=1, num_envs_per_env_runner=8)
            .learners(num_learners=0)
            .training(lr=0.0005, train_batch_size_per_learner=500)
            .debugging(seed=args.seed)
        )
        algo = config.build_algo()
        try:
            return _rllib_loop(args, algo, DEFAULT_MODULE_ID, Columns, np, torch)
        finally:
            algo.stop()
    finally:
        ray.shutdown()


def _rllib_loop(args: argparse.Namespace, algo: Any, module_id: str, columns: Any, np: Any, torch: Any) -> dict:
    learner = algo.learner_group._learner  # num_learners=0: the learner lives in this process
    module = learner.module[module_id]

    def policy(obs: Any) -> Any:
        with torch.no_grad():
            out = module.forward_inference({columns.OBS: torch.from_numpy(obs)})
        return out[columns.ACTION_DIST_INPUTS].argmax(-1).numpy()

    history: list[dict[str, float]] = []
    solved: dict[str, float] | None = None
    train_time = eval_time = 0.0
    env_steps = 0
    while True:
        start = time.perf_counter()
        result = algo.train()
        train_time += time.perf_counter() - start
        # the first iterations may report no env-runner metrics yet (their samples are in flight)
        env_steps = int(
            result.get("env_runners", {}).get(
                "num_env_steps_sampled_lifetime", result.get("num_env_steps_sampled_lifetime", 0)
            )
        )
        start = time.perf_counter()
        returns = greedy_episodes(policy, args.eval_episodes, args.seed)
        eval_time += time.perf_counter() - start
        row = {
            "env_steps": env_steps,
            "seconds": train_time,
            "eval_return": float(np.mean(returns)),
            "train_return": float(result.get("env_runners", {}).get("episode_return_mean", float("nan"))),
        }
        history.append(row)
        print(
            f"[eval] env steps {env_steps:8d}  {train_time:7.1f} s  eval {row['eval_return']:6.1f}  "
            f"train {row['train_return']:6.1f}",
            file=sys.stderr,
            flush=True,
        )
        if solved is None and row["eval_return"] >= args.target:
            solved = row
            if not args.keep_going:
                break
        if env_steps >= args.max_env_steps or train_time >= args.minutes * 60:
            break
    return {
        "system": "rllib",
        "seed": args.seed,
        "solved": solved,
        "history": history,
        "env_steps": env_steps,
        "train_seconds": train_time,
        "eval_seconds": eval_time,
        "frames_per_s": env_steps / max(train_time, 1e-9),
        "final_eval_return": history[-1]["eval_return"] if history else float("nan"),
    }


# -- ours ------------------------------------------------------------------------------------
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "impala", "cartpole.yaml")


def _overrides(args: argparse.Namespace, seed: int, *extra: str) -> list[str]:
    out = [*quiet_fit_overrides(seed), *extra]
    for key, value in args.set or []:
        out += [f"--{key}", value]
    return out


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    """Train our IMPALA (``args.config``) until the evaluation return reaches the target (or the
    budget runs out); returns the record of the run."""
    import numpy as np
    import pytorch_lightning as pl
    import torch

    cli = build_cli(args.config, _overrides(args, args.seed, "--trainer.max_steps", "-1"))
    # evaluation in the datamodule's eval.env where it has one (a policy trained in a dream plays the real env)
    env_id = (cli.datamodule.eval.env or cli.datamodule.env).id
    module, trainer = cli.model, cli.trainer

    def policy(obs: Any) -> Any:
        with torch.no_grad():
            action, _, _ = module.act(torch.from_numpy(obs).to(module.device), None, explore=False)
        return action.cpu().numpy()

    class Evaluate(pl.Callback):
        def __init__(self) -> None:
            self.history: list[dict[str, float]] = []
            self.solved: dict[str, float] | None = None
            self.eval_time = 0.0
            self.start = time.perf_counter()

        def train_seconds(self) -> float:
            return time.perf_counter() - self.start - self.eval_time

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            step = trainer.global_step
            seconds = self.train_seconds()
            over = pl_module.env_steps >= args.max_env_steps or seconds >= args.minutes * 60
            if step % args.eval_every and not over:
                return
            start = time.perf_counter()
            returns = greedy_episodes(policy, args.eval_episodes, args.seed, env_id)
            self.eval_time += time.perf_counter() - start
            logged = trainer.callback_metrics  # the learner's latest train/* values
            row = {
                "env_steps": int(pl_module.env_steps),
                "seconds": seconds,
                "step": step,
                "eval_return": float(np.mean(returns)),
                "policy_lag": float(logged.get("train/policy_lag", float("nan"))),
                "rho_clipped": float(logged.get("train/rho_clipped_fraction", float("nan"))),
            }
            self.history.append(row)
            print(
                f"[eval] env steps {row['env_steps']:8d}  {seconds:7.1f} s  step {step:6d}  "
                f"eval {row['eval_return']:8.1f}",
                file=sys.stderr,
                flush=True,
            )
            if self.solved is None and row["eval_return"] >= args.target:
                self.solved = row
                over = over or not args.keep_going
            if over:
                trainer.should_stop = True

    evaluate = Evaluate()
    trainer.callbacks.append(evaluate)
    evaluate.start = time.perf_counter()
    trainer.fit(module, cli.datamodule)
    history = evaluate.history
    env_steps = history[-1]["env_steps"] if history else 0
    seconds = history[-1]["seconds"] if history else evaluate.train_seconds()
    return {
        "system": "ours",
        "seed": args.seed,
        "env_id": env_id,
        "solved": evaluate.solved,
        "history": history,
        "env_steps": env_steps,
        "train_seconds": seconds,
        "eval_seconds": evaluate.eval_time,
        "frames_per_s": env_steps / max(seconds, 1e-9),
        "final_eval_return": history[-1]["eval_return"] if history else float("nan"),
    }


SPEED_CONFIGS = {
    "cartpole": os.path.join(ROOT, "configs", "impala", "cartpole.yaml"),
    "pong": os.path.join(ROOT, "configs", "impala", "pong.yaml"),
}


def run_speed(args: argparse.Namespace) -> dict[str, Any]:
    """Fit ``args.speed_env``'s config with ``args.num_actors`` actors: frames/s reaching the
    learner, gradient steps/s and the learner's wait share over ``args.speed_seconds`` after
    ``args.warmup_seconds``."""
    import pytorch_lightning as pl

    cli = build_cli(
        SPEED_CONFIGS[args.speed_env],
        _overrides(
            args,
            0,
            "--trainer.max_steps",
            "-1",
            "--data.init_args.acting.num_actors",
            str(args.num_actors),
            "--trainer.val_check_interval",
            "100000000",
        ),
    )

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.start = time.perf_counter()
            self.fit_start = self.start
            self.first_step_s = float("nan")
            self.mark: tuple[float, int, int] | None = None
            self.result: dict[str, float] = {}

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.fit_start = time.perf_counter()  # before acting starts (the AgentPublisher attaches at fit start)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            now = time.perf_counter()
            if math.isnan(self.first_step_s):
                self.first_step_s = now - self.fit_start
            if self.mark is None:
                if now - self.start >= args.warmup_seconds:
                    self.mark = (now, pl_module.env_steps, trainer.global_step)
                return
            span = now - self.mark[0]
            if span >= args.speed_seconds:
                wait = trainer.logged_metrics.get("actors/wait_fraction")  # the last 10 s, as the learner saw them
                self.result = {
                    "first_step_s": self.first_step_s,
                    "frames_per_s": (pl_module.env_steps - self.mark[1]) / span,
                    "steps_per_s": (trainer.global_step - self.mark[2]) / span,
                    "seconds": span,
                    "wait_fraction": float(wait) if wait is not None else float("nan"),
                }
                trainer.should_stop = True

    clock = Clock()
    cli.trainer.callbacks.append(clock)
    cli.trainer.fit(cli.model, cli.datamodule)
    data = cli.datamodule
    return {
        "env": args.speed_env,
        "actors": args.num_actors,
        "envs_per_actor": data.env.num_envs,
        "unroll_length": data.unroll_length,
        "batch_size": data.batch_size,
        **clock.result,
    }


# -- driver ------------------------------------------------------------------------------------
def _worker(args: argparse.Namespace, cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run ``cmd`` (this script with ``--worker``) in a scratch folder; its JSON record."""
    return run_worker(cmd, env, prefix="impala_bench_")


def _common(args: argparse.Namespace) -> list[str]:
    cmd = []
    for key in (
        "target",
        "max_env_steps",
        "minutes",
        "eval_episodes",
        "num_cpus",
        "eval_every",
        "config",
        "speed_seconds",
        "warmup_seconds",
    ):
        value = getattr(args, key)
        cmd += [f"--{key.replace('_', '-')}", os.path.abspath(value) if key == "config" else str(value)]
    for key, value in args.set or []:
        cmd += ["--set", key, value]
    return cmd + (["--keep-going"] if args.keep_going else [])


def run_seed(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One seed in its own process (the system's interpreter); returns its JSON record."""
    if args.system == "ours":
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--system", "ours", "--seed", str(seed)]
        return _worker(args, cmd + _common(args), ours_env())
    if not os.path.exists(args.rllib_python):
        raise SystemExit(
            f"error: no RLlib interpreter at {args.rllib_python}; create the venv as the docstring says "
            "or pass --rllib-python"
        )
    cmd = [args.rllib_python, os.path.abspath(__file__), "--worker", "--system", "rllib", "--seed", str(seed)]
    return _worker(args, cmd + _common(args), peer_env())  # RLlib's venv, not our packages


def lowest_after_holding(history: list[dict[str, float]], target: float, times: int = 3) -> float | None:
    """The lowest evaluation after the first ``times`` evaluations in a row at or above ``target``
    (``None`` if it never held that long; ``inf`` if nothing came after)."""
    run = 0
    for i, row in enumerate(history):
        run = run + 1 if row["eval_return"] >= target else 0
        if run == times:
            return min((r["eval_return"] for r in history[i + 1 :]), default=math.inf)
    return None


def _mean(history: list[dict[str, float]], key: str) -> float:
    values = [r[key] for r in history if key in r and not math.isnan(r[key])]
    return statistics.mean(values) if values else float("nan")


def report(args: argparse.Namespace, records: list[dict[str, Any]]) -> None:
    env_id = records[0].get("env_id", "CartPole-v1") if records else "CartPole-v1"
    print()
    print(
        f"IMPALA ({args.system}) on {env_id}, target eval return >= {args.target:g} "
        f"({args.eval_episodes} greedy episodes), budget {args.max_env_steps} env steps / {args.minutes:g} min"
    )
    print()
    print(
        "| seed | env steps to target | wall time to target | frames/s | final eval return (env steps) "
        "| lowest eval after 3 in a row at target | mean policy lag | mean ρ clipped share |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in records:
        s = r["solved"]
        steps = f"{s['env_steps']:,}" if s else f"not within {r['env_steps']:,}"
        wall = f"{s['seconds']:.0f} s" if s else f"> {r['train_seconds']:.0f} s"
        lowest = lowest_after_holding(r["history"], args.target)
        held = "never held" if lowest is None else "-" if math.isinf(lowest) else f"{lowest:.1f}"
        print(
            f"| {r['seed']} | {steps} | {wall} | {r['frames_per_s']:,.0f} | {r['final_eval_return']:.1f} "
            f"({r['env_steps']:,}) | {held} | {_mean(r['history'], 'policy_lag'):.2f} "
            f"| {_mean(r['history'], 'rho_clipped'):.3f} |"
        )
    if records:  # an unsolved seed counts as "more than its budget" (the median may be one)
        steps = sorted(
            (r["solved"]["env_steps"], "") if r["solved"] else (math.inf, f"> {r['env_steps']:,}") for r in records
        )[(len(records) - 1) // 2]
        wall = sorted(
            (r["solved"]["seconds"], "") if r["solved"] else (math.inf, f"> {r['train_seconds']:.0f} s")
            for r in records
        )[(len(records) - 1) // 2]
        print(
            f"| median | {steps[1] or f'{steps[0]:,.0f}'} | {wall[1] or f'{wall[0]:.0f} s'} | "
            f"{statistics.median(r['frames_per_s'] for r in records):,.0f} | "
            f"{statistics.median(r['final_eval_return'] for r in records):.1f} | | | |"
        )
    print()
    print("load average:", load_average())


def speed_table(args: argparse.Namespace) -> None:
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start")
    print()
    print(
        "| env | actors | envs/actor | unroll x batch | frames/s | learner steps/s | learner wait "
        "| fit start to first step |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.speed_envs:
        for actors in args.actors:
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                "--speed",
                "--speed-env",
                name,
                "--num-actors",
                str(actors),
            ]
            r = _worker(args, cmd + _common(args), ours_env())
            wait = "–" if math.isnan(r["wait_fraction"]) else f"{100 * r['wait_fraction']:.0f}%"  # in process: none
            print(
                f"| {name} | {actors} | {r['envs_per_actor']} | {r['unroll_length']} x {r['batch_size']} | "
                f"{r['frames_per_s']:,.0f} | {r['steps_per_s']:.1f} | {wait} "
                f"| {r['first_step_s']:.1f} s |",
                flush=True,
            )
    print()
    print("load average:", load_average())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", choices=["ours", "rllib"], default="ours")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="our config (--system ours)")
    parser.add_argument(
        "--set",
        nargs=2,
        action="append",
        metavar=("KEY", "VALUE"),
        help="override an option of --config, e.g. --set model.init_args.optim.lr 0.001",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--jobs", type=int, default=1, help="seeds run at a time (each in its own process; wall times then shared)"
    )
    parser.add_argument("--target", type=float, default=475.0)
    parser.add_argument("--max-env-steps", type=int, default=3_000_000)
    parser.add_argument("--minutes", type=float, default=15.0, help="training wall-time budget per seed")
    parser.add_argument("--eval-episodes", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=10, help="gradient steps between evaluations (ours)")
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="train on to the budget after reaching the target (does the policy stay solved?)",
    )
    parser.add_argument("--rllib-python", default=RLLIB_PYTHON)
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs Ray may use")
    parser.add_argument("--speed", action="store_true", help="frames/s with --actors actor processes")
    parser.add_argument("--speed-envs", nargs="+", default=["cartpole", "pong"], choices=sorted(SPEED_CONFIGS))
    parser.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--speed-seconds", type=float, default=30.0, help="measured seconds per setting")
    parser.add_argument("--warmup-seconds", type=float, default=15.0, help="seconds before measuring")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--speed-env", default="cartpole", help=argparse.SUPPRESS)
    parser.add_argument("--num-actors", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, exit_on_signal)
    if args.worker:
        run = run_speed if args.speed else run_ours if args.system == "ours" else run_rllib
        print_result(run(args))
        return
    if args.speed:
        speed_table(args)
        return
    records = run_seeds(lambda seed: run_seed(args, seed), args.seeds, args.jobs)
    report(args, records)


if __name__ == "__main__":
    main()
