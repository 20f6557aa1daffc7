"""What the learning benches share: the CLI's objects without a run, one seed per worker process
(its record read back as one JSON line), the greedy evaluation of a peer's policy, SIGTERM
handling and the machine's load. Imports only the standard library at module level: the peers'
venvs (RLlib's) import it too."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RLLIB_PYTHON = "/work/venvs/rllib/bin/python"  # the RLlib venv (its own gymnasium pin): ../shared/NOTES.md
RESULT_PREFIX = "RESULT "


def read_json_lines(path: str) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (``--out`` of the benches, ``evaluate --out``), in file order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def exit_on_signal(signum: int, frame: Any) -> None:
    """SIGTERM handler: leave through ``finally`` blocks (Ray shut down, worker processes ended)."""
    raise SystemExit(128 + signum)


def unshadow_minatar(script: str) -> None:
    """Move the folder of ``script`` (a bench script's ``__file__``) from the front of ``sys.path``
    to its end: first, this folder's ``minatar.py`` would shadow the ``minatar`` package; kept, a
    spawned actor process (which re-runs the script) still finds ``benchlib``."""
    here = os.path.dirname(os.path.abspath(script))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here] + [here]


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere): runs repeat
    bit for bit on one machine only, so a record says which it ran on."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0]} x {len(names)}" if names else platform.processor() or "unknown"


def build_cli(config: str, overrides: list[str]) -> Any:
    """The CLI's model, datamodule and trainer for ``fit --config config`` plus ``overrides``
    (``--key value`` pairs), without running anything (:func:`lightning_wm.cli.build_cli`)."""
    sys.path.insert(0, ROOT)
    from lightning_wm import cli

    argv, sys.argv = sys.argv, sys.argv[:1]  # the bench's own flags are not the CLI's (LightningCLI warns)
    try:
        return cli.build_cli(["--config", config, *overrides], run=False)
    finally:
        sys.argv = argv


def quiet_fit_overrides(seed: int) -> list[str]:
    """Seed the weights and the envs with ``seed``; no progress bar, validation, checkpoints or
    logger (the bench measures by itself)."""
    return [
        "--seed_everything",
        str(seed),
        "--data.init_args.env.seed",
        str(seed),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.limit_val_batches",
        "0",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.logger",
        "false",
    ]


def ours_env() -> dict[str, str]:
    """The environment of a worker running our package: this checkout first on ``PYTHONPATH``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


def peer_env() -> dict[str, str]:
    """The environment of a worker running a peer's venv: none of our packages on ``PYTHONPATH``."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


_WORKERS: set[subprocess.Popen] = set()  # the workers running now, for end_workers
_WORKERS_LOCK = threading.Lock()
_STOPPING = threading.Event()  # set by end_workers: no new worker starts


def run_worker(
    cmd: list[str], env: dict[str, str], prefix: str = "bench_", timeout: float | None = None
) -> dict[str, Any]:
    """Run ``cmd`` (a bench script with ``--worker``) in a scratch folder (what Lightning writes into
    the working directory goes there and is removed), return the JSON record it prints after
    :data:`RESULT_PREFIX`. Interrupted, terminated or still running after ``timeout`` seconds, the
    worker is terminated and waited for (past ``timeout``: an error naming the limit)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        with _WORKERS_LOCK:  # started under the lock, so end_workers sees it or it never starts
            if _STOPPING.is_set():
                raise SystemExit("error: the bench is stopping; no new worker")
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=scratch)
            _WORKERS.add(proc)
        try:
            stdout, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"error: {' '.join(cmd[2:6])} still ran after {timeout:.0f} s; terminated") from None
        finally:  # interrupted or terminated: the worker shuts its actors / Ray down before we go
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
            with _WORKERS_LOCK:
                _WORKERS.discard(proc)
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"error: {' '.join(cmd[2:])} failed (exit {proc.returncode}); its log is above")
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def end_workers() -> None:
    """Terminate the workers still running and wait for them (each shuts its actors / Ray down on
    SIGTERM): what a bench's ``finally`` calls when seeds run in threads (:func:`run_seeds`),
    whose own ``finally`` blocks do not run when the main thread leaves."""
    with _WORKERS_LOCK:
        _STOPPING.set()
        procs = list(_WORKERS)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        proc.wait()


def run_seeds(run_seed: Callable[[int], dict[str, Any]], seeds: Iterable[int], jobs: int = 1) -> list[dict[str, Any]]:
    """``run_seed(seed)`` for every seed, ``jobs`` worker processes at a time; the records in the
    order of ``seeds``. With ``jobs > 1`` the workers share the cores: env steps and returns are
    the seeds' own (a run in process repeats bit for bit), wall times and frames/s are not."""
    seeds = list(seeds)
    if jobs < 1:
        raise SystemExit(f"error: --jobs must be >= 1, got {jobs}")
    _STOPPING.clear()  # an earlier run_seeds ended its workers; this one starts its own
    if jobs == 1:
        return [run_seed(seed) for seed in seeds]
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        return list(pool.map(run_seed, seeds))
    finally:
        end_workers()  # interrupted or terminated: no worker outlives the bench
        pool.shutdown(wait=True, cancel_futures=True)


def print_result(record: dict[str, Any]) -> None:
    """A worker's last line: its record for :func:`run_worker`."""
    print(RESULT_PREFIX + json.dumps(record), flush=True)


def greedy_episodes(
    policy: Callable[[Any], Any],
    episodes: int,
    seed: int,
    env_id: str = "CartPole-v1",
    make: Callable[[], Any] | None = None,
) -> list[float]:
    """Returns of ``episodes`` episodes of ``policy`` (a function ``obs [N, ...] numpy -> actions
    [N] int`` or ``[N, A]`` float) in ``episodes`` envs (``make()``, default ``gym.make(env_id)``)
    seeded ``seed * 1000 + i``, stepped together until each has finished exactly one episode.
    Float observations reach the policy as float32, others (uint8 frames) in their own dtype."""
    import gymnasium as gym
    import numpy as np

    envs = [make() if make is not None else gym.make(env_id) for _ in range(episodes)]
    discrete = isinstance(envs[0].action_space, gym.spaces.Discrete)
    dtype = envs[0].observation_space.dtype
    dtype = np.float32 if np.issubdtype(dtype, np.floating) else dtype
    try:
        obs = np.stack([env.reset(seed=seed * 1000 + i)[0] for i, env in enumerate(envs)]).astype(dtype)
        returns = np.zeros(episodes)
        running = np.ones(episodes, bool)
        while running.any():
            actions = policy(obs)
            for i in np.flatnonzero(running):
                o, r, terminated, truncated, _ = envs[i].step(int(actions[i]) if discrete else actions[i])
                obs[i] = o
                returns[i] += r
                running[i] = not (terminated or truncated)
        return returns.tolist()
    finally:
        for env in envs:
            env.close()


def version_folders(run_dir: Path) -> list[Path]:
    """A run folder's ``version_*`` folders (one per fit, a resumed run adds one), in order."""
    return sorted(Path(run_dir).glob("version_*"), key=lambda p: int(p.name.split("_")[-1]))


def read_version_scalars(version: Path, tags: Iterable[str]) -> dict[str, list[tuple[float, int, float]]]:
    """``(wall_time, step, value)`` of each of ``tags`` that one ``version_*`` folder logged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(version), size_guidance={"scalars": 0})
    acc.Reload()
    logged = set(acc.Tags()["scalars"])
    return {tag: [(e.wall_time, e.step, e.value) for e in acc.Scalars(tag)] if tag in logged else [] for tag in tags}


def read_scalars(run_dir: Path, tags: tuple[str, ...]) -> dict[str, list[tuple[float, int, float]]]:
    """``(wall_time, step, value)`` of each tag over the run's ``version_*`` folders, in order."""
    out: dict[str, list[tuple[float, int, float]]] = {tag: [] for tag in tags}
    for version in version_folders(run_dir):
        for tag, events in read_version_scalars(version, tags).items():
            out[tag] += events
    return out


def env_steps_at(env_steps: list[tuple[float, int, float]], step: int) -> float:
    """The env steps a run had logged (``env/steps`` events ``(wall_time, step, value)``) by global
    ``step``: the largest value logged at or before it, 0 before the first."""
    return max((value for _, at, value in env_steps if at <= step), default=0.0)
