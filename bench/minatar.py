"""MinAtar learning bench: per system, game and seed, every fixed number of frames up to a frame
budget, the paper's metric (the mean return of the last 100 training episodes, explore as trained)
and a greedy evaluation, the trivial policies' greedy scores on the same episode seeds, the
training wall time, and a summary (means over seeds at each budget, the paper's reference values
beside them; frames to reach a return); ``--plot`` draws one PNG per game.

    python bench/minatar.py --systems impala --games all --seeds 0 1 2 --frames 5000000 --eval-every 500000
    python bench/minatar.py --systems muzero dreamer --games breakout --seeds 0 --frames 20000 --eval-every 5000
    python bench/minatar.py --systems rllib --games breakout --seeds 0 --frames 1000000 --eval-every 100000
    python bench/minatar.py --report bench/minatar_runs.jsonl --target 10 --plot bench

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

Env settings: the run's own (``data.init_args.env``: minatar's gymnasium ids ``MinAtar/<Game>-v1``,
minimal action sets, sticky actions 0.1 and the games' defaults, as the paper; minatar 1.0.15
here, whose Seaquest has the 1.0.11 oxygen fix the paper's predates). The evaluation env is the
run's ``eval.env`` (default: its ``env``) with a time limit: its ``max_episode_steps``, else
:data:`EVAL_MAX_STEPS` (Seaquest has none: a submarine that stays at the surface never ends).

Measurement rule: frames are training env steps (MinAtar has no frame skip: one agent step is
one frame; evaluation episodes not counted). Whenever the frames cross a multiple of
``--eval-every`` (and at the end) the bench records the mean return of the last 100 training
episodes finished so far (the paper's metric; the episodes the datamodule reports, acted with
``explore=True`` as trained; RLlib: its ``episode_return_mean``, also over 100 episodes) and the
current weights play ``--eval-episodes`` greedy episodes (``explore=False``: argmax of the policy;
MuZero: its search's most visited action) in fresh envs, the same episodes' seeds at every
evaluation of a run; the clock stops meanwhile. Ours evaluate through
``lightning_wm.data.collector.run_evaluation``; RLlib's module through ``benchlib.greedy_episodes``.
The trivial policies (uniform random, each constant action) play the same episodes the same way
once per game, seed and env settings (kept in the records: ``trivial``; a later run with the same
key reuses them). RLlib evaluates after each training iteration (at least
``min_time_s_per_iteration``, its default 10 s). A run stops at ``--frames``, at ``--minutes`` of
training wall time, or at ``--wall-minutes`` of wall time in all (evaluations included), whichever
comes first; a worker still running ``--wall-minutes`` + 3 minutes after its start is killed (no
record). ``--out`` appends every record as one JSON line; ``--report FILE ...`` prints the tables
from such files (several runs together), one row per variant: the record's ``sets`` are the
overrides that change the config file (one that repeats its value goes to ``sets_same_as_config``).

Runs longer than a session: ``--run-dir DIR`` (ours, not RLlib) keeps a checkpoint of each run in
``DIR/<system>-<game>-seed<seed>/`` after every evaluation and when a stop request (SIGTERM, SIGUSR1,
Ctrl-C) ends it (weights, optimizer, replay buffer, loop state and the bench's own rows and clocks);
a stopped run's record so far (``"finished": false``, its last evaluation's frames; the summary
marks it ‡) is appended to ``--out`` as the bench stops; the same command run again resumes a cut
run from that checkpoint, ``--minutes`` and ``--wall-minutes`` counting over all its sessions (give
caps that cover the whole run: one resumed past them is refused with a line saying so, not recorded
as finished), and skips a finished one (``record.json`` there; its record was appended to ``--out``
when it finished).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from benchlib import (
    RLLIB_PYTHON,
    ROOT,
    build_cli,
    cpu_model,
    exit_on_signal,
    greedy_episodes,
    load_average,
    ours_env,
    peer_env,
    print_result,
    quiet_fit_overrides,
    read_json_lines,
    run_worker,
    unshadow_minatar,
)
from minatar_report import frames_ratio_table, plot_games, split_sets, summary
from minatar_trivial import cached_trivial, trivial_key, trivial_scores

CONFIGS = {
    "impala": "configs/impala/minatar.yaml",
    "muzero": "configs/muzero/minatar.yaml",
    "dreamer": "configs/dreamer/minatar.yaml",
    "dyna": "configs/impala/minatar_dyna.yaml",
}
SYSTEMS = [*CONFIGS, "rllib"]
GAMES = {
    "breakout": "MinAtar/Breakout-v1",
    "space_invaders": "MinAtar/SpaceInvaders-v1",
    "asterix": "MinAtar/Asterix-v1",
    "freeway": "MinAtar/Freeway-v1",
    "seaquest": "MinAtar/Seaquest-v1",
}
# what a run with --run-dir adds for its checkpoints to hold everything: the replay's rows (Dyna:
# its world model's)
RESUMABLE_SETS = {
    "muzero": ["--data.init_args.replay.save", "true"],
    "dreamer": ["--data.init_args.replay.save", "true"],
    "dyna": ["--data.init_args.model_replay.save", "true"],
}
EVAL_SEED_OFFSET = 10_000  # evaluation episodes of seed s: seeds derived from EVAL_SEED_OFFSET + s
EVAL_MAX_STEPS = 10_000  # evaluation episodes end here when the run's env sets no limit
TRAINING_WINDOW = 100  # the paper's metric: the mean of the last 100 training episodes
KILL_GRACE_S = 180.0  # a worker past its wall cap by this long is killed


class EvalSchedule:
    """When to evaluate: each time the frames cross a multiple of ``every``, and once at the end
    (``frames`` reached, ``seconds`` of training spent, or ``wall_seconds`` spent in all)."""

    def __init__(self, every: int, frames: int, seconds: float, wall_seconds: float = math.inf) -> None:
        if every < 1 or frames < 1:
            raise ValueError(f"--eval-every and --frames must be >= 1, got {every} and {frames}")
        self.every, self.frames, self.seconds, self.next = every, frames, seconds, every
        self.wall_seconds = wall_seconds

    def over(self, frames: int, seconds: float, wall: float = 0.0) -> bool:
        return frames >= self.frames or seconds >= self.seconds or wall >= self.wall_seconds

    def due(self, frames: int, seconds: float, wall: float = 0.0) -> bool:
        """Whether to evaluate now; moves the next point past ``frames`` when it is."""
        if frames < self.next and not self.over(frames, seconds, wall):
            return False
        self.resume_after(frames)
        return True

    def resume_after(self, frames: int) -> None:
        """The next point is the first multiple of ``every`` past ``frames`` (an evaluation there)."""
        self.next = (frames // self.every + 1) * self.every


class TrainingReturns:
    """The returns of the training episodes as they finish (acted as trained): the paper's metric
    is the mean of the last ``window``. :meth:`tee` reads them from a datamodule's
    ``pop_env_stats`` (whoever calls it: the CLI's env-stats callback or the bench)."""

    def __init__(self, window: int = TRAINING_WINDOW) -> None:
        self.recent: deque[float] = deque(maxlen=window)
        self.count = 0

    def add(self, episodes: list[dict[str, float]]) -> None:
        for episode in episodes:
            self.recent.append(float(episode["return"]))
            self.count += 1

    def mean(self) -> float:
        """The mean of the last ``window`` returns (NaN before the first episode ends)."""
        return statistics.fmean(self.recent) if self.recent else math.nan

    def tee(self, datamodule: Any) -> None:
        """Wrap ``datamodule.pop_env_stats`` so that every episode it hands out is added here."""
        pop = datamodule.pop_env_stats

        def pop_and_keep() -> Any:
            stats = pop()
            self.add(stats.episodes)
            return stats

        datamodule.pop_env_stats = pop_and_keep


def _row(frames: int, seconds: float, wall: float, returns: list[float], training: TrainingReturns) -> dict[str, Any]:
    return {
        "frames": int(frames),
        "seconds": float(seconds),
        "wall_seconds": float(wall),
        "eval_return": float(statistics.fmean(returns)),
        "eval_std": float(statistics.pstdev(returns)),
        "train_return": None if math.isnan(training.mean()) else training.mean(),
        "train_episodes": training.count,
    }


def learner_metrics(trainer: Any) -> dict[str, float]:
    """The learner's last logged ``train/*`` values (losses, mean policy entropy as
    ``entropy_loss``, learning rate; logged every ``log_every_n_steps`` even without a logger),
    kept with each evaluation so a record shows e.g. a policy that went deterministic."""
    return {
        k.removeprefix("train/"): round(float(v), 5)
        for k, v in trainer.callback_metrics.items()
        if k.startswith("train/") and getattr(v, "numel", lambda: 1)() == 1
    }


def _log(system: str, row: dict[str, Any], trivial: dict[str, Any] | None = None) -> None:
    trained = "–" if row["train_return"] is None else f"{row['train_return']:7.2f}"
    best = max(trivial["scores"].items(), key=lambda kv: kv[1]) if trivial else None
    print(
        f"[eval] {system} frames {row['frames']:9d}  {row['seconds']:7.1f} s  last 100 training {trained} "
        f"({row['train_episodes']} episodes)  greedy {row['eval_return']:7.2f} (sd {row['eval_std']:.2f})"
        + (f"  best trivial: {best[0]} {best[1]:.2f}" if best else "")
        + (f"  entropy {row['learner']['entropy_loss']:.3f}" if "entropy_loss" in row.get("learner", {}) else ""),
        file=sys.stderr,
        flush=True,
    )


def _record(
    args: argparse.Namespace,
    history: list[dict[str, Any]],
    eval_seconds: float,
    extra: dict[str, Any],
    sets: tuple[list[list[str]], list[list[str]]] | None = None,
) -> dict[str, Any]:
    """The run's JSON record; ``sets``: the ``--set`` pairs split against the config the run
    trained on (:func:`split_sets`; default: all of them count as changes)."""
    last = history[-1] if history else {"frames": 0, "seconds": 0.0, "eval_return": math.nan}
    changed, same = sets if sets is not None else (args.set or [], [])
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
        "sets": changed,
        "sets_same_as_config": same,
        "load_average": load_average(),
        "cpu": cpu_model(),
        **extra,
    }


class RunFolder:
    """``<run-dir>/<system>-<game>-seed<seed>/``: ``bench.ckpt`` (the checkpoint written after every
    evaluation and on a stop), ``record.json`` (the finished run's record; such a run is not run
    again) and ``partial.json`` (a stopped run's record so far, ``"finished": false``, until the
    bench that started the run appends it to its ``--out``)."""

    def __init__(self, run_dir: str | os.PathLike, system: str, game: str, seed: int) -> None:
        self.path = Path(run_dir) / f"{system}-{game}-seed{seed}"
        self.checkpoint = self.path / "bench.ckpt"
        self.record = self.path / "record.json"
        self.partial = self.path / "partial.json"

    def finished(self) -> dict[str, Any] | None:
        """The record of a run that finished here earlier, else None."""
        return json.loads(self.record.read_text()) if self.record.exists() else None

    def resume_from(self) -> str | None:
        """The checkpoint to resume from (None: a new run)."""
        return str(self.checkpoint) if self.checkpoint.exists() else None

    def keep_record(self, record: dict[str, Any]) -> None:
        self._write(self.record, record)
        self.partial.unlink(missing_ok=True)

    def keep_partial(self, record: dict[str, Any]) -> None:
        self._write(self.partial, record)

    def take_partial(self) -> dict[str, Any] | None:
        """A stopped run's record so far (removed here: it is appended once), else None."""
        if not self.partial.exists():
            return None
        record = json.loads(self.partial.read_text())
        self.partial.unlink()
        return record

    def _write(self, path: Path, record: dict[str, Any]) -> None:
        from lightning_wm.io import atomic_write

        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(json.dumps(record)), binary=False)


# -- ours ------------------------------------------------------------------------------------
def evaluation_env(datamodule: Any) -> Any:
    """The run's evaluation env settings: ``eval.env`` (default ``env``) with a time limit (its own
    ``max_episode_steps``, else :data:`EVAL_MAX_STEPS`)."""
    eval_settings = getattr(datamodule, "eval", None)
    config = getattr(eval_settings, "env", None) or datamodule.env
    return dataclasses.replace(config, max_episode_steps=config.max_episode_steps or EVAL_MAX_STEPS)


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    """Train ``CONFIGS[args.system]`` on ``args.game`` to the frame budget, evaluating on the way
    (with ``--run-dir``: a checkpoint after every evaluation, and a cut run resumed from it)."""
    from minatar_evaluation import BenchEvaluation

    from lightning_wm.data.collector import run_evaluation
    from lightning_wm.envs import make_env
    from lightning_wm.signals import RunStopped, signal_name

    wall_start = time.perf_counter()
    folder = RunFolder(args.run_dir, args.system, args.game, args.seed) if args.run_dir else None
    overrides = [*quiet_fit_overrides(args.seed), "--trainer.max_steps", "-1"]
    overrides += ["--data.init_args.env.id", GAMES[args.game]]
    if folder is not None:
        overrides += ["--trainer.default_root_dir", str(folder.path), *RESUMABLE_SETS.get(args.system, [])]
    for key, value in args.set or []:
        overrides += [f"--{key}", value]
    config = os.path.join(ROOT, CONFIGS[args.system])
    sets = split_sets(config, args.set or [])  # against the file as this run reads it
    cli = build_cli(config, overrides)
    module, trainer, datamodule = cli.model, cli.trainer, cli.datamodule
    eval_env = evaluation_env(datamodule)
    eval_seed = EVAL_SEED_OFFSET + args.seed

    def play(agent: Any) -> list[float]:
        episodes = run_evaluation(eval_env, agent, args.eval_episodes, args.eval_episodes, eval_seed)
        return [e["return"] for e in episodes]

    env_settings = dataclasses.asdict(eval_env)
    key = trivial_key("ours", {k: v for k, v in env_settings.items() if k not in ("num_envs", "seed")},
                      args.eval_episodes, eval_seed)  # fmt: skip
    trivial = cached_trivial(args, key, lambda: trivial_scores(play, lambda: make_env(eval_env), eval_seed))
    training = TrainingReturns()
    training.tee(datamodule)

    def make_row(trainer: Any, frames: int, seconds: float, wall: float, returns: list[float]) -> dict[str, Any]:
        return {**_row(frames, seconds, wall, returns, training), "learner": learner_metrics(trainer)}

    identity = {"system": args.system, "game": args.game, "seed": args.seed, "sets": args.set or [],
                "frames": args.frames, "eval_every": args.eval_every, "eval_episodes": args.eval_episodes}  # fmt: skip
    evaluate = BenchEvaluation(
        EvalSchedule(args.eval_every, args.frames, args.minutes * 60, args.wall_minutes * 60),
        play, training, make_row, lambda row: _log(args.system, row, trivial), identity,
        folder.checkpoint if folder else None, wall_start,
    )  # fmt: skip
    trainer.callbacks.append(evaluate)

    def record(finished: bool) -> dict[str, Any]:
        extra = {"trivial": trivial, "eval_env": env_settings, "wall_seconds": evaluate.wall(), "finished": finished}
        return _record(args, evaluate.history, evaluate.eval_time, extra, sets)

    try:
        trainer.fit(module, datamodule, ckpt_path=folder.resume_from() if folder else None)
    except RunStopped as stop:
        if folder is not None and evaluate.saved_on_stop:
            folder.keep_partial({**record(finished=False), "stopped_at_frames": evaluate.frames})
            print(f"[stopped] {args.system} {args.game} seed {args.seed} by {signal_name(stop.signum)} at "
                  f"{evaluate.frames} frames: {folder.checkpoint} holds the run, the same command resumes it",
                  file=sys.stderr, flush=True)  # fmt: skip
        raise
    final = record(finished=True)
    if folder is not None:
        folder.keep_record(final)
    return final


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

    from lightning_wm.envs import EnvConfig, make_env

    wall_start = time.perf_counter()
    env_config = EnvConfig(id=GAMES[args.game])
    eval_config = dataclasses.replace(env_config, max_episode_steps=EVAL_MAX_STEPS)

    def make(_config: Any = None, config: EnvConfig = env_config) -> gym.Env:
        env = make_env(config)
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

            eval_seed = EVAL_SEED_OFFSET + args.seed

            def play(act: Any) -> list[float]:
                return greedy_episodes(act, args.eval_episodes, eval_seed, make=lambda: make(config=eval_config))

            env_settings = dataclasses.asdict(eval_config)
            key = trivial_key("rllib", env_settings, args.eval_episodes, eval_seed)
            trivial = cached_trivial(
                args, key, lambda: trivial_scores(play, lambda: make(config=eval_config), eval_seed)
            )
            extra = {"trivial": trivial, "eval_env": env_settings}
            return _rllib_train_and_evaluate(algo, args, lambda: play(policy), trivial, extra, wall_start)
        finally:
            algo.stop()
    finally:
        ray.shutdown()


def _rllib_train_and_evaluate(
    algo: Any, args: argparse.Namespace, evaluate: Any, trivial: dict, extra: dict, wall_start: float
) -> dict[str, Any]:
    """RLlib's training iterations until the frame budget or a time cap, ``evaluate()`` (greedy
    returns) after each one that crosses a multiple of ``--eval-every``; the run's record."""
    training = TrainingReturns()
    schedule = EvalSchedule(args.eval_every, args.frames, args.minutes * 60, args.wall_minutes * 60)
    history: list[dict[str, float]] = []
    train_time = eval_time = 0.0
    while True:
        start = time.perf_counter()
        result = algo.train()
        train_time += time.perf_counter() - start
        runners = result.get("env_runners", {})
        frames = int(runners.get("num_env_steps_sampled_lifetime", 0))
        if not schedule.due(frames, train_time, time.perf_counter() - wall_start):
            continue
        training.recent.clear()  # RLlib's own mean over its last 100 episodes stands for ours
        mean = runners.get("episode_return_mean")
        if mean is not None and not math.isnan(float(mean)):
            training.recent.append(float(mean))
        training.count = int(runners.get("num_episodes_lifetime", 0))
        start = time.perf_counter()
        returns = evaluate()
        eval_time += time.perf_counter() - start
        history.append(_row(frames, train_time, time.perf_counter() - wall_start, returns, training))
        _log("rllib", history[-1], trivial)
        if schedule.over(frames, train_time, time.perf_counter() - wall_start):
            extra = {**extra, "wall_seconds": time.perf_counter() - wall_start}
            return _record(args, history, eval_time, extra)


# -- driver ------------------------------------------------------------------------------------
def run_one(args: argparse.Namespace, system: str, game: str, seed: int, trivial: dict[str, Any]) -> dict[str, Any]:
    """One run in its own process (the system's interpreter; killed :data:`KILL_GRACE_S` past
    ``--wall-minutes``); its JSON record. ``trivial``: the trivial scores known so far, by key."""
    cmd = [os.path.abspath(__file__), "--worker", "--system", system, "--game", game, "--seed", str(seed)]
    cmd += ["--frames", str(args.frames), "--eval-every", str(args.eval_every), "--minutes", str(args.minutes)]
    cmd += ["--eval-episodes", str(args.eval_episodes), "--num-cpus", str(args.num_cpus)]
    cmd += ["--wall-minutes", str(args.wall_minutes), "--trivial-cache", json.dumps(trivial)]
    if args.run_dir and system != "rllib":
        cmd += ["--run-dir", os.path.abspath(args.run_dir)]
    for key, value in args.set or []:
        cmd += ["--set", key, value]
    timeout = args.wall_minutes * 60 + KILL_GRACE_S
    if system != "rllib":
        return run_worker([sys.executable, *cmd], ours_env(), prefix="minatar_bench_", timeout=timeout)
    if not os.path.exists(args.rllib_python):
        raise SystemExit(f"error: no RLlib interpreter at {args.rllib_python}; create the venv as the docstring says")
    return run_worker([args.rllib_python, *cmd], peer_env(), prefix="minatar_bench_", timeout=timeout)


def known_trivial(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The trivial scores the records hold, by key (what a new run with the same key reuses)."""
    return {r["trivial"]["key"]: r["trivial"]["scores"] for r in records if r.get("trivial")}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=["impala"])
    parser.add_argument("--games", nargs="+", choices=[*GAMES, "all"], default=["breakout"], help="or all")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--frames", type=int, default=1_000_000, help="frame budget per run")
    parser.add_argument("--eval-every", type=int, default=100_000, help="frames between evaluations")
    parser.add_argument("--eval-episodes", type=int, default=20)
    parser.add_argument("--minutes", type=float, default=15.0, help="training wall-time cap per run")
    parser.add_argument("--wall-minutes", type=float, default=20.0, help="wall-time cap per run, evaluations included")
    parser.add_argument("--target", type=float, nargs="*", default=[], help="returns for 'frames to reach'")
    parser.add_argument("--set", nargs=2, action="append", metavar=("KEY", "VALUE"), help="override a config option")
    parser.add_argument("--out", help="append every run's record to this JSON-lines file")
    parser.add_argument("--run-dir", help="keep each run's checkpoint here; a cut run resumes (ours, not rllib)")
    parser.add_argument("--report", nargs="+", metavar="FILE", help="print the tables of saved records, run nothing")
    parser.add_argument("--plot", metavar="DIR", help="write DIR/minatar_<game>.png for every game of the records")
    parser.add_argument("--plot-suffix", default="", help="_200k: the plots are minatar_<game>_200k.png")
    parser.add_argument("--rllib-python", default=RLLIB_PYTHON)
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs Ray may use")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=SYSTEMS, default="impala", help=argparse.SUPPRESS)
    parser.add_argument("--game", choices=sorted(GAMES), default="breakout", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--trivial-cache", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "all" in args.games:
        args.games = list(GAMES)
    return args


def _append(out: str | None, record: dict[str, Any]) -> None:
    if out:
        from lightning_wm.io import append_json_line

        append_json_line(out, record)


def _append_partial(out: str | None, folder: RunFolder | None) -> None:
    """A stopped run's record so far (``"finished": false``) from its run folder to ``out``: what a
    run longer than a session measured is kept with the others; the summary marks it."""
    partial = folder.take_partial() if folder is not None and out else None
    if partial is not None:
        _append(out, partial)
        print(f"stopped: its record so far ({len(partial['history'])} evaluations, the last at "
              f"{partial['frames']:,} frames; \"finished\": false) appended to {out}", file=sys.stderr, flush=True)  # fmt: skip


def main() -> None:
    unshadow_minatar(__file__)
    args = parse_args()
    signal.signal(signal.SIGTERM, exit_on_signal)
    if args.worker:
        print_result(run_rllib(args) if args.system == "rllib" else run_ours(args))
        return
    if args.report:
        records = [r for path in args.report for r in read_json_lines(path)]
    else:
        print(f"machine: {os.cpu_count()} CPUs, load average {load_average()} at start", flush=True)
        records = []
        earlier = read_json_lines(args.out) if args.out and os.path.exists(args.out) else []
        for system in args.systems:
            for game in args.games:
                for seed in args.seeds:
                    folder = RunFolder(args.run_dir, system, game, seed) if args.run_dir else None
                    finished = folder.finished() if folder is not None else None
                    if finished is not None:
                        print(f"finished earlier (its record was appended then): {folder.record}", flush=True)
                        records.append(finished)
                        continue
                    try:
                        record = run_one(args, system, game, seed, known_trivial(earlier + records))
                    except (SystemExit, KeyboardInterrupt):  # stopped: its worker kept the record so far
                        _append_partial(args.out, folder)
                        raise
                    records.append(record)
                    _append(args.out, record)
    print()
    print(summary(records, args.eval_every, args.target))
    ratios = frames_ratio_table(records)
    if ratios:
        print("\nFrames to the same return (the paper's metric, mean over seeds), each variant against the config:\n")
        print(ratios)
    if args.plot:
        for path in plot_games(records, args.plot, args.plot_suffix):
            print(f"wrote {path}")
    print()
    print("load average:", load_average())


if __name__ == "__main__":
    main()
