"""Learning proofs on a lent GPU: named jobs trained under a wall limit, resumable across device calls,
and the open GPU speed goals measured in the same call; one markdown report.

    python bench/gpu_learn.py --jobs impala_pong --budget 540 --out $OUT    # speed (<= 240 s), then the job
    python bench/gpu_learn.py --parts learn --jobs impala_pong --resume-from .gpu/resume --out $OUT
    python bench/gpu_learn.py --parts learn --jobs dreamer_pixels,muzero_minatar --side-by-side --out $OUT
    python bench/gpu_learn.py --device cpu --quick --out /tmp/gl --work /tmp/gl_work   # every job shrunk, CPU

On the device the packages it lacks come as wheels (``bench/gpu_wheels.py``; README, "Learning on a
GPU machine", has the whole call).

Jobs (:data:`JOBS`; each a config in ``configs/``): ``impala_pong`` (greedy return >= 18 over 10
episodes), ``dreamer_pixels`` (evaluation >= 475, held to the end), ``dreamer_minatar`` and
``muzero_minatar`` (100k frames with at least the CPU runs' 3-seed return, 7.07 and 5.57): each
within 10 minutes of fit wall time, all segments together (:data:`GOAL_SECONDS`; ``--job-seconds``, the
fit wall a job may spend, is 600 s too by default: a longer one, a CPU run at full length, is judged at
600 s all the same).

**learn**: each job runs ``main.py fit`` (as ``--fit-run``, a child of this script) in
``<work>/<job>`` (``--trainer.default_root_dir``, run name = job, ``--resume_if_exists true``)
under ``timeout -k 30``: at its limit the fit gets SIGTERM, saves ``last.ckpt`` and exits. Then the
job folder is packed for the next call. What a call writes under ``--out`` (flat: a device call
returns at most 8 files, 16 MiB each):

* ``report.md``: the speed table and per job one row per segment (env steps, frames, fit wall,
  returns, env steps/s, learner wait) and the goal's verdict;
* ``<job>.png``: the returns against frames and against fit wall time;
* ``<job>.tar`` (or ``<job>.tar.0``, ``.1``, ... in 15 MiB parts): the job folder — the run's
  ``checkpoints/last.ckpt``, its TensorBoard ``version_*`` folders, ``learn.json`` (the segments:
  wall, exit, steps) and the fit's log.

**Side by side** (``--side-by-side``): the jobs' fits run at once, one device and the cores shared
out among them (``OMP_NUM_THREADS``), each with the call's time left: more jobs a call, each slower
than alone; every job's note in the report says what ran beside it, and its goal is judged the same.

**Resume across calls**: copy the returned ``<job>.tar*`` into an ignored folder of the checkout
(``.gpu/resume``), carry it with the next call, and pass ``--resume-from .gpu/resume``: the job
folder is unpacked from it and the fit resumes from ``last.ckpt`` and, for the replay jobs, the
buffer saved with it (``replay.save``; the tar is gzip-compressed; a buffer that would take the
job's file past one part stays behind, and that resumed fit prefills anew). A job whose fit ended
(``max_steps``) or whose wall budget is spent is reported, not run again.

**speed** (``gpu_check.py``'s children): Dreamer L's recorded step (``compile.mode: graph``) with
TF32 matrix multiplies, fp32 and bf16 (goal <= 0.06 s); a batch-64 50-simulation captured search,
then also compiled (goal <= 10 ms); IMPALA Pong acting against EnvPool's async ceiling
(``gpu_check.actors_part``: 4 copies x 32 envs, splits 1 and 2; goal >= 70% with the learner waiting
<= 10%). SIGTERM or Ctrl-C to this script is passed to the running part (a fit saves), the report
is written with what was done, and the script exits 128 + the signal.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

START = time.monotonic()  # --budget counts from here, before Lightning's import

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
# bench/ holds minatar.py, which must not shadow the minatar package: bench/ goes last on the path
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != BENCH] + [str(BENCH)]

import pytorch_lightning as pl  # noqa: E402
from benchlib import env_steps_at, read_scalars  # noqa: E402
from device_call import PART_BYTES, Children, packed, replay_of, run_limited, unpack, write_parts  # noqa: E402

FIT_GRACE_S = 30  # SIGTERM to SIGKILL: a fit saves its checkpoint and stops its actors in this time
PACK_MARGIN_S = 20  # per job: reading the logs, the curve, the tar
GOAL_SECONDS = 600  # every goal: within 10 minutes of fit wall, all segments together
PLOT_LOCK = threading.Lock()


class Job(NamedTuple):
    """A learning proof: its config, its goal (``metric`` reaching ``target``) and its CPU shrink.

    ``frames_per_step``: emulator frames per env step (Atari's frame skip); ``until_frames``: the
    goal is the return at this many frames (MinAtar), else the first time the target is reached;
    ``replay``: the job learns from a replay buffer, saved with its checkpoints (``replay.save``) and
    packed with ``last.ckpt`` while the job's file stays within one part, so that a resumed fit goes
    on with its rows instead of prefilling anew.
    """

    config: str
    goal: str
    target: float
    metric: str = "val/return"
    frames_per_step: int = 1
    until_frames: int = 0
    hold: bool = False
    replay: bool = False
    quick: tuple[str, ...] = ()


def _flags(**groups: Any) -> tuple[str, ...]:
    """``_flags(model={"net.deter": 16})`` -> ``("--model.init_args.net.deter", "16")``; ``trainer``
    keys take no ``init_args``; lists are written as JSON."""
    out: list[str] = []
    for group, values in groups.items():
        prefix = f"--{group}" if group == "trainer" else f"--{group}.init_args"
        for key, value in values.items():
            out += [f"{prefix}.{key}", json.dumps(value) if isinstance(value, list) else str(value)]
    return tuple(out)


QUICK_TRAINER = {"max_steps": 4, "val_check_interval": 4, "checkpoint_every_n_steps": 4, "log_every_n_steps": 1}
DREAMER_QUICK = {"net.deter": 16, "net.stoch": 4, "net.classes": 4, "net.hidden": 16, "net.bins": 31}
DREAMER_QUICK_DATA = {"prefill": 64, "batch_size": 4, "sampler.init_args.length": 8, "eval.episodes": 1}
JOBS: dict[str, Job] = {
    "impala_pong": Job(
        "configs/impala/pong_gpu.yaml",
        "greedy return >= 18 (10 episodes) within 10 min",
        18.0,
        frames_per_step=4,
        quick=_flags(
            trainer=QUICK_TRAINER,
            model={"net.fc_size": 16},
            data={"env.num_envs": 2, "env.max_episode_steps": 50, "unroll_length": 4, "batch_size": 2}
            | {"acting.num_actors": 1, "eval.episodes": 1, "eval.envs": 1},  # one actor process
        ),
    ),
    "dreamer_pixels": Job(
        "configs/dreamer/cartpole_pixels_gpu.yaml",
        "evaluation >= 475 within 10 min, held to the end",
        475.0,
        frames_per_step=2,  # action repeat 2
        hold=True,
        replay=True,
        quick=_flags(
            trainer=QUICK_TRAINER,
            model={**DREAMER_QUICK, "net.cnn_depth": 4, "behavior.horizon": 4, "openloop_sequences": 1},
            data=DREAMER_QUICK_DATA,
        ),
    ),
    "dreamer_minatar": Job(
        "configs/dreamer/minatar_gpu.yaml",
        "100k frames within 10 min, greedy return >= 7.07 (the CPU runs' 3-seed mean)",
        7.07,
        until_frames=100_000,
        replay=True,
        quick=_flags(
            trainer=QUICK_TRAINER,
            model={**DREAMER_QUICK, "net.cnn_depth": 4, "behavior.horizon": 4},
            data={**DREAMER_QUICK_DATA, "env.num_envs": 2, "eval.envs": 1},
        ),
    ),
    "muzero_minatar": Job(
        "configs/muzero/minatar_gpu.yaml",
        "100k frames within 10 min, greedy return >= 5.57 (the CPU runs' 3-seed mean)",
        5.57,
        until_frames=100_000,
        replay=True,
        quick=_flags(
            trainer=QUICK_TRAINER,
            model={"net.channels": 4, "net.latent_dim": 16, "net.hidden": 16, "net.head_hidden": 8}
            | {"net.support_size": 10, "net.projection": [16, 16, 8], "search.num_simulations": 4},
            data={"batch_size": 8, "prefill": 40, "env.num_envs": 2, "eval.episodes": 1, "eval.envs": 1},
        ),
    ),
}


# -- the learn part ------------------------------------------------------------------------------------
class LearnClock(pl.Callback):
    """Logs ``learn/fetch_share``: the share of the fit's host time between optimizer steps, less
    validation (the batch fetch: acting in process, waiting for actors' rows; checkpoint writes),
    since the first step of this process."""

    def __init__(self) -> None:
        self.fetch = self.validating = self.validated = 0.0
        self._end: float | None = None
        self._first: float | None = None
        self._val_start = 0.0

    def on_validation_start(self, trainer, pl_module):
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        if self._first is not None:  # (a sanity check before the first step is outside the span)
            self.validating += time.perf_counter() - self._val_start

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.perf_counter()
        if self._end is not None:
            self.fetch += now - self._end - self.validating
        self.validated, self.validating = self.validated + self.validating, 0.0
        self._first = self._first or now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._end = time.perf_counter()
        busy = self._end - (self._first or self._end) - self.validated
        if busy > 0:
            pl_module.log("learn/fetch_share", self.fetch / busy, on_step=True, on_epoch=False)


def fit_args(name: str, job: Job, folder: Path, device: str, quick: bool, sets: list[str]) -> list[str]:
    """The ``main.py fit`` arguments of ``job`` in ``folder`` (resumed when it holds ``last.ckpt``)."""
    args = ["fit", "--config", str(ROOT / job.config), "--trainer.default_root_dir", str(folder)]
    args += ["--trainer.run_name", name, "--resume_if_exists", "true", "--trainer.enable_progress_bar", "false"]
    args += ["--trainer.accelerator", "gpu" if device == "cuda" else "cpu", "--trainer.devices", "1"]
    args += ["--trainer.callbacks+=gpu_learn.LearnClock"]
    if "envpool" in (ROOT / job.config).read_text() and importlib.util.find_spec("envpool") is None:
        args += ["--data.init_args.env.backend", "gymnasium"]  # (said in the report)
    if job.replay:
        args += ["--data.init_args.replay.save", "true"]
    if quick:
        args += list(job.quick)
    for item in sets:
        key, _, value = item.partition("=")
        args += [f"--{key}", value]
    return args


TAGS = ("env/steps", "env/episode_return", "val/return", "actors/frames_per_s", "actors/wait_fraction")
TAGS += ("learn/fetch_share",)


def fit_wall(segments: list[dict[str, Any]], wall_time: float) -> float:
    """The fit wall seconds (all segments before it together) at an event's ``wall_time``."""
    before = 0.0
    for seg in segments:
        if seg["start"] <= wall_time <= seg["start"] + seg["wall_s"] + 1:
            return before + wall_time - seg["start"]
        before += seg["wall_s"]
    return before


def curve_points(
    scalars: dict[str, list], segments: list[dict[str, Any]], tag: str
) -> list[tuple[float, float, float]]:
    """``(env steps, fit wall s, value)`` of ``tag``, env steps read at the event's global step."""
    return [
        (env_steps_at(scalars["env/steps"], step), fit_wall(segments, wall_time), value)
        for wall_time, step, value in scalars[tag]
    ]


def verdict(job: Job, val: list[tuple[float, float, float]], limit_s: float) -> str:
    """The goal's verdict from the evaluations ``(env steps, fit wall s, return)``."""
    if not val:
        return "no evaluation yet"
    if job.until_frames:
        at = [p for p in val if p[0] * job.frames_per_step >= job.until_frames]
        if not at:
            return f"not at {job.until_frames:,} frames yet (last evaluation {val[-1][2]:.2f} at {val[-1][0]:,.0f})"
        env, wall, value = at[0]
        met = value >= job.target and wall <= limit_s
        return f"{'MET' if met else 'NOT MET'}: {value:.2f} at {env * job.frames_per_step:,.0f} frames, {wall:.0f} s"
    first = next((p for p in val if p[2] >= job.target), None)
    if first is None:
        return f"target {job.target:g} not reached (best {max(p[2] for p in val):.2f})"
    later = [p[2] for p in val if p[0] >= first[0]]
    held = (
        ""
        if not job.hold
        else f"; lowest after: {min(later):.1f} ({'held' if min(later) >= job.target else 'NOT held'})"
    )
    met = first[1] <= limit_s and (not job.hold or min(later) >= job.target)
    return f"{'MET' if met else 'NOT MET'}: {first[2]:.1f} at {first[0]:,.0f} env steps, {first[1]:.0f} s of fit{held}"


def evaluation_list(val: list[tuple[float, float, float]]) -> str:
    """Every evaluation ``(env steps, fit wall s, return)`` as ``1,000: 35.6 (9.1 min)``, comma-separated."""
    return ", ".join(f"{env:,.0f}: {value:.1f} ({wall / 60:.1f} min)" for env, wall, value in val)


def plot(name: str, job: Job, scalars: dict[str, list], segments: list[dict[str, Any]], path: Path) -> None:
    """The returns (training episodes, evaluations) against frames and against fit wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for tag, style in (("env/episode_return", "-"), ("val/return", "o-")):
        points = curve_points(scalars, segments, tag)
        for ax, index, scale in ((axes[0], 0, job.frames_per_step), (axes[1], 1, 1 / 60)):
            ax.plot([p[index] * scale for p in points], [p[2] for p in points], style, label=tag, markersize=3)
    for ax in axes:
        ax.axhline(job.target, color="gray", linestyle="--", label=f"target {job.target:g}")
        ax.set_ylabel("return")
        ax.grid(alpha=0.3)
    axes[1].axvline(10, color="red", linestyle=":", label="10 min")
    axes[0].set_xlabel("frames")
    axes[1].set_xlabel("fit wall time (min, all segments)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"{name}: {job.goal} ({len(segments)} segment(s))")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _mean_in(points: list[tuple[float, int, float]], start: float, end: float) -> float | None:
    inside = [v for t, _, v in points if start <= t <= end + 1]
    return sum(inside) / len(inside) if inside else None


def _num(values: list[float]) -> str:
    return f"{values[0]:.2f}" if values else "-"


def segment_rows(name: str, job: Job, scalars: dict[str, list], segments: list[dict[str, Any]]) -> list[str]:
    """One markdown row per segment: env steps and frames at its end, fit wall, returns, rates, wait."""
    rows, before_env, before_wall = [], 0.0, 0.0
    for i, seg in enumerate(segments, 1):
        end = seg["start"] + seg["wall_s"]
        env = max((v for t, _, v in scalars["env/steps"] if t <= end + 1), default=before_env)
        train = [v for t, _, v in scalars["env/episode_return"] if t <= end + 1][-1:]
        val = [v for t, _, v in scalars["val/return"] if t <= end + 1]
        wait = _mean_in(scalars["actors/wait_fraction"], seg["start"], end)
        fetch = _mean_in(scalars["learn/fetch_share"], seg["start"], end)
        wait_text = (
            f"{wait:.0%} (actors)" if wait is not None else (f"{fetch:.0%} (fetch)" if fetch is not None else "-")
        )
        rate = (env - before_env) / max(seg["wall_s"], 1e-9)
        before_wall += seg["wall_s"]
        rows.append(
            f"| {name} | {i} | {seg['status']} | {env:,.0f} | {env * job.frames_per_step:,.0f} | {seg['wall_s']:.0f} "
            f"({before_wall:.0f}) | {_num(train[-1:])} | {_num(val[-1:])} ({_num([max(val)] if val else [])}) | "
            f"{rate:,.0f} | {wait_text} |"
        )
        before_env = env
    return rows


def run_job(name: str, args: argparse.Namespace, limit: float, beside: tuple[str, ...] = ()) -> list[str]:
    """One segment of job ``name`` within ``limit`` seconds (resumed from ``--resume-from`` or the
    work folder), then its report rows, curve and packed folder under ``--out``. ``beside``: the jobs
    running at the same time (``--side-by-side``), said in the report; the machine's cores are
    shared out among them (``OMP_NUM_THREADS``, unless set)."""
    job, out, folder = JOBS[name], Path(args.out), Path(args.work) / name
    if args.resume_from and unpack(name, Path(args.resume_from), folder):
        note = f"resumed from `{args.resume_from}`"
    else:
        note = "resumed from the work folder" if (folder / "learn.json").exists() else "a new run"
    folder.mkdir(parents=True, exist_ok=True)
    state_path = folder / "learn.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {"job": name, "segments": []}
    segments = state["segments"]
    spent, ran = sum(s["wall_s"] for s in segments), False
    left = min(limit, args.job_seconds - spent)
    if segments and segments[-1]["status"] == "finished":
        note = "finished before this call: not run"
    elif Children.stopped:
        note = "not run: this script was stopped"
    elif left < 30:
        note = f"not run: {'its wall budget is spent' if args.job_seconds - spent < 30 else 'too little time left'}"
    else:
        fit = fit_args(name, job, folder, args.device, args.quick, args.set)
        if "--data.init_args.env.backend" in fit:
            note += "; EnvPool is not installed: its envs ran on gymnasium"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if beside:
            note += f"; side by side with {', '.join(f'`{b}`' for b in beside)}, sharing the device and the cores"
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (1 + len(beside)))))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--fit-run", json.dumps(fit)]
        start, ran = time.time(), True
        print(f"[gpu_learn] {name}: fit for up to {left:.0f} s ({note})", flush=True)
        status, output, wall = run_limited(cmd, left, env=env, grace=FIT_GRACE_S)
        (folder / "fit.log").write_text(output[-200_000:])
        what = {0: "finished", 124: "cut at its limit", 143: "stopped (SIGTERM)", 137: "KILLED (no save)"}
        segments.append({"start": start, "wall_s": wall, "status": what.get(status, f"FAILED (exit {status})")})
        state_path.write_text(json.dumps(state, indent=1))
        if status not in what:
            note += "; the fit's last lines: " + " / ".join(output.strip().splitlines()[-3:])[-400:]
    scalars = read_scalars(folder / "lightning_logs" / name, TAGS)
    lines = [f"### `{name}` (`{job.config}`): {job.goal}", "", note, ""]
    lines += [
        "| job | segment | exit | env steps | frames | fit wall s (total) | train return | eval return (best) | env steps/s | learner wait |"
    ]
    lines += ["| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += segment_rows(name, job, scalars, segments)
    val = curve_points(scalars, segments, job.metric)
    lines += ["", f"Goal: {verdict(job, val, GOAL_SECONDS)}"]
    if val:
        lines += ["", "Evaluations (env steps: return, fit minutes): " + evaluation_list(val)]
    if ran:  # (a device call returns at most 8 files: a job not run keeps the files it came with)
        with PLOT_LOCK:  # (pyplot's state is global: one figure at a time across threads)
            plot(name, job, scalars, segments, out / f"{name}.png")
        lines.append(pack_job(name, job, folder, out))
    return lines


def pack_job(name: str, job: Job, folder: Path, out: Path) -> str:
    """:func:`device_call.pack` of the job folder, with the replay files of ``last.ckpt``
    (``job.replay``) where the packed job stays one file, else without them (a resumed fit then
    prefills anew); the report's line naming the files."""
    replay = replay_of(folder / "lightning_logs" / name / "checkpoints" / "last.ckpt") if job.replay else []
    data, said = packed(folder, replay), " (with its replay buffer)" if replay else ""
    if replay and len(data) > PART_BYTES:
        data, said = packed(folder), " (its replay buffer stays behind: with it, over one file)"
    return f"Files: `{name}.png`, " + ", ".join(f"`{n}`" for n in write_parts(name, data, out)) + said


def learn_in_turn(
    jobs: list[str], args: argparse.Namespace, left: Callable[[], float], save: Callable[[list[str]], Any]
) -> list[str]:
    """The jobs one after the other, each with the call's time ``left()`` less the later jobs'
    margins; the report's sections, ``save``d after each job."""
    lines: list[str] = []
    pending = deque(jobs)
    while pending:
        name = pending.popleft()
        lines += [*run_job(name, args, left() - FIT_GRACE_S - PACK_MARGIN_S * (1 + len(pending))), ""]
        save(lines)
    return lines


def learn_side_by_side(
    jobs: list[str], args: argparse.Namespace, left: Callable[[], float], save: Callable[[list[str]], Any]
) -> list[str]:
    """The jobs at once (``--side-by-side``: one thread each, sharing the device and the cores), each
    with the call's time ``left()`` less every job's margin; the report's sections in ``jobs``' order,
    ``save``d as each job ends."""
    limit = left() - FIT_GRACE_S - PACK_MARGIN_S * len(jobs)
    sections: dict[str, list[str]] = {}
    lock = threading.Lock()

    def one(name: str) -> None:
        try:
            lines = run_job(name, args, limit, beside=tuple(j for j in jobs if j != name))
        except Exception as error:  # (a thread's exception would only be printed: the report says it)
            lines = [f"### `{name}`: FAILED in this script: {error!r}"]
        with lock:
            sections[name] = [*lines, ""]
            save([line for job in jobs for line in sections.get(job, [])])

    threads = [threading.Thread(target=one, args=(name,), name=name) for name in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()  # (a signal's handler still runs in this thread meanwhile)
    return [line for job in jobs for line in sections[job]]


# -- the speed part -----------------------------------------------------------------------------------
def speed_part(device: str, quick: bool, limit: float) -> list[str]:
    """The open speed goals, each a ``gpu_check.py`` child under its share of ``limit``: Dreamer L
    (0.2), the captured search (0.17), acting (0.45), then the captured and compiled search (the rest)."""
    import gpu_check

    gpu_check.run = run_limited  # its children under this script's signal handling
    deadline = time.monotonic() + limit
    share = lambda part: min(part * limit, deadline - time.monotonic())  # noqa: E731
    lines = ["## Speed goals", ""]
    size, mode = ("XS", "none") if quick else ("L", "graph+tf32")
    payload = {"device": device, "size": size, "mode": mode, "steps": 2 if quick else 8, "quick": quick}
    status, result, out = gpu_check.run_child("size-run", payload, share(0.2))
    if result:
        cells = ", ".join(f"{p} {r['median']:.4f} s (min {r['min']:.4f})" for p, r in result.items())
        lines.append(
            f"* Dreamer {size} gradient step, `compile.mode` {mode} (fp32: TF32 matmuls on CUDA): {cells}; goal L <= 0.06 s"
        )
    else:
        lines.append(f"* Dreamer {size} step FAILED (exit {status}): {out.strip().splitlines()[-1:]}")
    lines.append(search_line(device, quick, compiled=False, limit=share(0.17)))
    acting = gpu_check.actors_part(device, quick, max(10.0, share(0.45)))
    if device == "cuda":
        lines.append(search_line(device, quick, compiled=True, limit=deadline - time.monotonic()))
    goal = "Acting goal: a copies row's `of ceiling` >= 70% with its `learner wait (keep up)` <= 10%."
    return [*lines, "", *acting, "", goal]


def search_line(device: str, quick: bool, compiled: bool, limit: float) -> str:
    """One batched MCTS (batch 64, 50 simulations; quick: 16, 10) timed in a ``gpu_check`` child:
    captured as a CUDA graph (``compiled``: of the compiled simulations); eager on the CPU."""
    import gpu_check

    batch, sims = (16, 10) if quick else (64, 50)
    label = ("captured, compiled" if compiled else "captured") if device == "cuda" else "eager (CPU)"
    if limit < 10:
        return f"* search {label}: not run, out of time"
    payload = {"device": device, "batches": [batch], "simulations": sims, "repeats": 5}
    payload |= {"cuda_graphs": device == "cuda", "compile": compiled}
    status, result, out = gpu_check.run_child("search-run", payload, limit)
    if not result:
        return f"* search {label} FAILED (exit {status}): {out.strip().splitlines()[-1:]}"
    r = result[0]
    return f"* search, batch {batch}, {sims} simulations, {label}: {1e3 * r['seconds']:.1f} ms (first {r['first']:.2f} s); goal <= 10 ms"


def fit_child(args_json: str) -> None:
    """``main.py fit`` with ``args`` in this process (``--fit-run``): the path set above, so that
    ``gpu_learn.LearnClock`` is found and ``bench/minatar.py`` shadows nothing."""
    from lightning_wm.cli import main as cli_main

    sys.argv = ["main.py", *json.loads(args_json)]
    cli_main()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="every job and measure shrunk (the CPU dry run)")
    parser.add_argument("--parts", default="speed,learn", help="comma-separated, in order: speed, learn")
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, run in order: {', '.join(JOBS)}")
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="run the jobs at once, sharing the device and the cores (the report says so beside each job)",
    )
    parser.add_argument("--budget", type=float, default=540, help="seconds for the whole call (default 540)")
    parser.add_argument("--speed-seconds", type=float, default=240, help="limit of the speed part (default 240)")
    parser.add_argument("--job-seconds", type=float, default=600, help="fit wall a job may spend (600)")
    parser.add_argument("--out", required=False, default=os.environ.get("OUT", "gpu_learn_out"))
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "gpu_learn"), help="the job folders")
    parser.add_argument("--resume-from", help="a folder holding <job>.tar files returned by an earlier call")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE: --KEY VALUE for every job's fit")
    parser.add_argument("--fit-run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fit_run:
        return fit_child(args.fit_run)
    parts, jobs = args.parts.split(","), args.jobs.split(",")
    unknown = sorted(set(parts) - {"speed", "learn"}) + sorted(set(jobs) - set(JOBS))
    if unknown:
        raise SystemExit(f"error: unknown part or job {unknown}; parts: speed, learn; jobs: {', '.join(JOBS)}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("error: --device cuda but torch sees no CUDA device; use --device cpu")
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, Children.handle)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    write_report(args, parts, jobs, out)
    if Children.stopped:
        raise SystemExit(128 + Children.stopped)


def write_report(args: argparse.Namespace, parts: list[str], jobs: list[str], out: Path) -> None:
    """Run the parts in order within ``--budget``, writing ``report.md`` after each."""
    import gpu_check

    start = START
    report = [f"# lightning_wm GPU learning proofs ({args.device}{', quick' if args.quick else ''})", ""]
    report += [f"Machine: {gpu_check.machine(args.device)}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", ""]
    left = lambda: args.budget - (time.monotonic() - start)  # noqa: E731
    for part in parts:
        print(f"[gpu_learn] {part} ({time.monotonic() - start:.0f} s since the start)", flush=True)
        if part == "speed":
            report += [*speed_part(args.device, args.quick, min(args.speed_seconds, left() - 10)), ""]
        else:
            report += ["## Learning", ""]
            learn = learn_side_by_side if args.side_by_side else learn_in_turn
            report += learn(jobs, args, left, lambda done: (out / "report.md").write_text("\n".join(report + done)))
        (out / "report.md").write_text("\n".join(report) + "\n")
    report.append(f"({time.monotonic() - start:.0f} s in all; `python bench/gpu_learn.py {' '.join(sys.argv[1:])}`)")
    (out / "report.md").write_text("\n".join(report) + "\n")
    print("\n".join(report))


if __name__ == "__main__":
    main()
