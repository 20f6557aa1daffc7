"""IMPALA learning bench on CartPole-v1: env steps and wall time until the evaluation return
(mean of 10 episodes, deterministic policy) reaches 475, per seed, and the medians.

    python bench/impala_cartpole.py --system rllib --seeds 0 1 2
    python bench/impala_cartpole.py --system rllib --seeds 0 --minutes 10 --keep-going

``--system rllib`` is the peer: RLlib's IMPALA run as a new user would on this machine
(``IMPALAConfig().environment("CartPole-v1")``, 1 env runner x 8 envs, no separate learner
process (``num_learners=0``), lr 0.0005, train batch 500, every other option at RLlib's
default). RLlib pins gymnasium 1.2.2, so it lives in its own venv (``--rllib-python``,
default ``/work/venvs/rllib/bin/python``; create it with ``python -m venv /work/venvs/rllib &&
/work/venvs/rllib/bin/pip install torch==2.13.0 "ray[rllib]"``): this script re-runs itself
under that interpreter, one process per seed, and reads one JSON line back.

Measurement rule (the same for every system): after each training iteration the current
learner weights play ``--eval-episodes`` episodes in fresh envs (seeded ``seed * 1000 + i``),
greedy actions (argmax of the logits), all episodes stepped together in one batch. The
evaluation's own time is left out of the wall time; env steps are training env steps
(agent steps over all envs, evaluation episodes not counted). RLlib's training iterations
last at least ``min_time_s_per_iteration`` (its default, 10 s), which is the granularity of
its figures. ``frames/s`` is training env steps / training wall time. With ``--keep-going``
training continues to the budget after the target and the last evaluation says whether the
policy stays solved. Every Ray process is shut down before a seed's process exits, also when
the bench is terminated (SIGTERM) or interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

DEFAULT_RLLIB_PYTHON = "/work/venvs/rllib/bin/python"
RESULT_PREFIX = "RESULT "


def _exit_on_signal(signum: int, frame: Any) -> None:
    """SIGTERM handler: leave through ``finally`` blocks (Ray shut down, worker processes ended)."""
    raise SystemExit(128 + signum)


# -- evaluation shared by the systems ------------------------------------------------------
def greedy_episodes(policy: Any, episodes: int, seed: int, env_id: str = "CartPole-v1") -> list[float]:
    """Returns of ``episodes`` episodes of ``policy`` (a function ``obs [N, D] float32 numpy
    -> actions [N] int``) in ``episodes`` envs seeded ``seed * 1000 + i``, stepped together
    until each has finished exactly one episode."""
    import gymnasium as gym
    import numpy as np

    envs = [gym.make(env_id) for _ in range(episodes)]
    try:
        obs = np.stack([env.reset(seed=seed * 1000 + i)[0] for i, env in enumerate(envs)]).astype(np.float32)
        returns = np.zeros(episodes)
        running = np.ones(episodes, bool)
        while running.any():
            actions = policy(obs)
            for i in np.flatnonzero(running):
                o, r, terminated, truncated, _ = envs[i].step(int(actions[i]))
                obs[i] = o
                returns[i] += r
                running[i] = not (terminated or truncated)
        return returns.tolist()
    finally:
        for env in envs:
            env.close()


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
    signal.signal(signal.SIGTERM, _exit_on_signal)
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
        env_steps = int(result.get("env_runners", {}).get("num_env_steps_sampled_lifetime",
                                                          result.get("num_env_steps_sampled_lifetime", 0)))
        start = time.perf_counter()
        returns = greedy_episodes(policy, args.eval_episodes, args.seed)
        eval_time += time.perf_counter() - start
        row = {"env_steps": env_steps, "seconds": train_time, "eval_return": float(np.mean(returns)),
               "train_return": float(result.get("env_runners", {}).get("episode_return_mean", float("nan")))}
        history.append(row)
        print(f"[eval] env steps {env_steps:8d}  {train_time:7.1f} s  eval {row['eval_return']:6.1f}  "
              f"train {row['train_return']:6.1f}", file=sys.stderr, flush=True)
        if solved is None and row["eval_return"] >= args.target:
            solved = row
            if not args.keep_going:
                break
        if env_steps >= args.max_env_steps or train_time >= args.minutes * 60:
            break
    return {"system": "rllib", "seed": args.seed, "solved": solved, "history": history,
            "env_steps": env_steps, "train_seconds": train_time, "eval_seconds": eval_time,
            "frames_per_s": env_steps / max(train_time, 1e-9),
            "final_eval_return": history[-1]["eval_return"] if history else float("nan")}


# -- driver ------------------------------------------------------------------------------------
def run_seed(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One seed in its own process (the system's interpreter); returns its JSON record."""
    if not os.path.exists(args.rllib_python):
        raise SystemExit(f"error: no RLlib interpreter at {args.rllib_python}; create the venv as the docstring says "
                         "or pass --rllib-python")
    cmd = [args.rllib_python, os.path.abspath(__file__), "--worker", "--seed", str(seed)]
    for key in ("target", "max_env_steps", "minutes", "eval_episodes", "num_cpus"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if args.keep_going:
        cmd.append("--keep-going")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # RLlib's venv, not our packages
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        stdout, _ = proc.communicate()
    finally:  # interrupted or terminated: the worker shuts its Ray instance down before we go
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"error: seed {seed} failed (exit {proc.returncode}); its log is above")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def report(args: argparse.Namespace, records: list[dict[str, Any]]) -> None:
    print()
    print(f"IMPALA ({args.system}) on CartPole-v1, target eval return >= {args.target:g} "
          f"({args.eval_episodes} greedy episodes), budget {args.max_env_steps} env steps / {args.minutes:g} min")
    print()
    print("| seed | env steps to target | wall time to target | frames/s | final eval return |")
    print("| --- | --- | --- | --- | --- |")
    for r in records:
        s = r["solved"]
        steps = f"{s['env_steps']:,}" if s else f"not within {r['env_steps']:,}"
        wall = f"{s['seconds']:.0f} s" if s else f"> {r['train_seconds']:.0f} s"
        print(f"| {r['seed']} | {steps} | {wall} | {r['frames_per_s']:,.0f} | {r['final_eval_return']:.1f} |")
    solved = [r["solved"] for r in records if r["solved"]]
    if len(solved) == len(records):
        print(f"| median | {statistics.median(s['env_steps'] for s in solved):,.0f} | "
              f"{statistics.median(s['seconds'] for s in solved):.0f} s | "
              f"{statistics.median(r['frames_per_s'] for r in records):,.0f} | "
              f"{statistics.median(r['final_eval_return'] for r in records):.1f} |")
    print()
    print("load average:", " ".join(f"{x:.2f}" for x in os.getloadavg()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", choices=["rllib"], default="rllib")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--target", type=float, default=475.0)
    parser.add_argument("--max-env-steps", type=int, default=3_000_000)
    parser.add_argument("--minutes", type=float, default=15.0, help="training wall-time budget per seed")
    parser.add_argument("--eval-episodes", type=int, default=10)
    parser.add_argument("--keep-going", action="store_true",
                        help="train on to the budget after reaching the target (does the policy stay solved?)")
    parser.add_argument("--rllib-python", default=DEFAULT_RLLIB_PYTHON)
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs Ray may use")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if args.worker:
        print(RESULT_PREFIX + json.dumps(run_rllib(args)), flush=True)
        return
    records = [run_seed(args, seed) for seed in args.seeds]
    report(args, records)


if __name__ == "__main__":
    main()
