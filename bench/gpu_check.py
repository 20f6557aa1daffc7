"""One command for a GPU machine: the GPU tests and a short speed table, as one markdown report.

    python bench/gpu_check.py                        # CUDA: tests, capture, search, actors, sizes (<= 9.5 min)
    python bench/gpu_check.py --parts search,sizes --limits search=100,sizes=220     # what is still open,
    python bench/gpu_check.py --parts capture,actors,steps --limits capture=150,actors=150,steps=100  # two calls
    python bench/gpu_check.py --parts steps          # eager fp32/bf16 gradient steps of the shipped configs
    python bench/gpu_check.py --parts sizes --sizes-seconds 300   # Dreamer XS..L, eager and recorded
    python bench/gpu_check.py --device cpu --quick   # the same checks shrunk, on the CPU (<= 6 min here)
    python bench/gpu_check.py --out report.md        # also write the report to a file

Parts, each under its own time limit (``timeout -k 5``, so a part that ignores SIGTERM is killed):

1. **tests**: ``tests/test_gpu.py`` — every config family fits a few steps on the device, then
   validates and evaluates from its checkpoint there; ``bf16-mixed``; the compile options; DDP on
   one device (``LIGHTNING_WM_TEST_DEVICE`` selects the device; ``--quick`` leaves out compiling);
   **capture**: on CUDA, ``tests/test_compiling.py``'s, ``tests/test_dists.py``'s and
   ``tests/test_graph_capture.py``'s CUDA tests (the compiled and the recorded steps and the
   captured search against eager) and a fit with Dreamer's step recorded;
2. **gradient steps** (``--parts steps``; not in the default CUDA run, whose eager figures are in
   ``bench/RESULTS.md``): seconds per optimizer step of each family at its shipped size (the
   shipped config, acting in process, the data fetch not counted), fp32 and ``bf16-mixed``; then
   Dreamer's gradient step at sizes XS, S, M and L (``bench/learner_speed.py``'s step, batch
   16x64, horizon 15), fp32 and bf16 autocast, eager and, on CUDA, recorded as one CUDA graph
   (``compile.mode: graph``: no compile; fused Adam), with the peak GPU memory;
3. **search**: simulations per second of one 50-simulation MCTS at batch 16, 64, 256 and 1024
   on the device, MuZero's CartPole-sized network, eager, with the simulation loop captured
   as one CUDA graph (``search.cuda_graphs``), and captured with compiled simulations (both
   switches: fewer, fused kernels in the graph);
4. **actors**: IMPALA Pong frames per second on the machine's cores (``bench/actors.py``): the env
   ceiling, then with EnvPool in process and 4 policy-copy actors of 32 envs, each with
   ``acting.splits`` 1 and 2 (without EnvPool: policy copies and central groups).

The report names the machine (torch, device, cores) so that figures from different machines are
never mixed up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import RESULT_PREFIX, print_result  # noqa: E402  (the child's record line, read back by run_child)

# (family, config, overrides that keep its shipped size but make it start fast)
STEP_RUNS = [
    ("Dreamer", "dreamer/cartpole.yaml", ["--data.init_args.prefill", "1100"]),
    (
        "Dreamer, `compile.mode: graph`",
        "dreamer/cartpole.yaml",
        ["--data.init_args.prefill", "1100", "--model.init_args.compile.mode", "graph"],
    ),
    ("MuZero", "muzero/cartpole.yaml", []),
    (
        "MuZero (Pong conv)",
        "muzero/pong.yaml",
        ["--data.init_args.prefill", "2000", "--data.init_args.env.num_envs", "4"],
    ),
    ("IMPALA", "impala/cartpole.yaml", ["--data.init_args.acting.num_actors", "0"]),
    (
        "IMPALA (Pong conv)",
        "impala/pong.yaml",
        ["--data.init_args.acting.num_actors", "0", "--data.init_args.env.num_envs", "8"],
    ),
]
QUICK_STEP_RUNS = [
    ("Dreamer (debug size)", "dreamer/cartpole.yaml", ["--config", str(ROOT / "configs/dreamer/presets/debug.yaml"), "--data.init_args.prefill", "64"]),
    ("MuZero", "muzero/cartpole.yaml", ["--model.init_args.search.num_simulations", "4"]),
    ("IMPALA", "impala/cartpole.yaml", ["--data.init_args.acting.num_actors", "0"]),
]  # fmt: skip


def _term_with_parent() -> None:
    """In the forked child before exec: SIGTERM when the parent dies (Linux ``PR_SET_PDEATHSIG``)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)


def run(
    cmd: list[str], limit: float, env: dict[str, str] | None = None, cwd: str | None = None
) -> tuple[int, str, float]:
    """``timeout -k 5 limit cmd``: exit status, the combined output, wall seconds. The part ends with
    this script: ``timeout`` gets SIGTERM when this process dies (even by ``kill -9``) and passes it
    to the part's whole process group (then SIGKILL 5 s later)."""
    start = time.monotonic()
    done = subprocess.run(
        ["timeout", "-k", "5", str(int(limit)), *cmd],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        preexec_fn=_term_with_parent,
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


def run_child(flag: str, payload: dict[str, Any], limit: float) -> tuple[int, Any, str]:
    """This script re-run as ``--<flag> payload`` (one measurement in a fresh process) within
    ``limit`` seconds: exit status, the JSON its ``RESULT`` line printed (``None`` if none), and
    its combined output."""
    status, out, _ = run([sys.executable, __file__, f"--{flag}", json.dumps(payload)], limit)
    lines = [line for line in out.splitlines() if line.startswith(RESULT_PREFIX)]
    result = json.loads(lines[-1][len(RESULT_PREFIX) :]) if lines else None
    return status, result, out


def machine(device: str) -> str:
    cores = os.cpu_count()
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        what = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    else:
        what = "CPU only"
    return f"torch {torch.__version__}, {what}, {cores} CPU cores, Python {sys.version.split()[0]}"


# -- part 1: the tests ---------------------------------------------------------------------------------
def tests_part(device: str, quick: bool, limit: float) -> list[str]:
    env = {**os.environ, "LIGHTNING_WM_TEST_DEVICE": device, "LIGHTNING_WM_TEST_QUICK": "1" if quick else "0"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests/test_gpu.py")]
    workers = min(4, max(1, (os.cpu_count() or 2) // 4))
    if workers > 1 and _has("xdist"):
        cmd += ["-n", str(workers)]
    status, out, wall = run(cmd, limit, env=env, cwd=str(ROOT))
    summary = next((line for line in reversed(out.splitlines()) if " passed" in line or " failed" in line), "")
    lines = ["## Tests (`tests/test_gpu.py`)", ""]
    verdict = "passed" if status == 0 else ("TIMED OUT" if status in (124, 137) else f"FAILED (exit {status})")
    lines.append(f"{verdict}: {summary.strip('= ') or 'no summary'} ({wall:.0f} s)")
    failed = [line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))]
    if failed:
        lines += ["", "```", *failed[:20], "```"]
    if status != 0 and not failed:
        lines += ["", "```", *out.splitlines()[-30:], "```"]
    return lines


def capture_tests_part(device: str, limit: float) -> list[str]:
    """``tests/test_compiling.py``'s CUDA tests: the captured step (Dreamer, MuZero, IMPALA) and the
    captured search against eager (each compiles a tiny step: about a minute apiece)."""
    lines = ["## Capture tests (`tests/test_compiling.py`'s and `tests/test_dists.py`'s CUDA tests)", ""]
    if device != "cuda":
        return [*lines, "not run: they need CUDA"]
    names = [
        "test_compiling.py::test_captured_search_gives_the_eager_search_on_cuda",
        "test_compiling.py::test_cuda_graph_steps_repeat_without_recompiling",
        "test_compiling.py::test_cuda_graph_step_gives_the_eager_losses_and_gradients",
        "test_compiling.py::test_compiled_dreamer_step_without_graphs_gives_the_eager_losses_on_cuda",
        "test_dists.py::test_uniform_logits_decode_to_zero_in_compiled_cuda_kernels",
        "test_graph_capture.py",
        "test_gpu.py::test_dreamer_fits_with_its_step_recorded_as_a_graph_and_resumes_eagerly",
    ]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += [str(ROOT / "tests" / name) for name in names]
    if _has("xdist"):  # each test compiles on its own: side by side they share the machine's cores
        cmd += ["-n", str(len(names))]
    status, out, wall = run(cmd, limit, cwd=str(ROOT))
    summary = next((line for line in reversed(out.splitlines()) if " passed" in line or " failed" in line), "")
    verdict = "passed" if status == 0 else ("TIMED OUT" if status in (124, 137) else f"FAILED (exit {status})")
    lines.append(f"{verdict}: {summary.strip('= ') or 'no summary'} ({wall:.0f} s)")
    failed = [line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))]
    details = [line for line in out.splitlines() if line.startswith("E ")][:40]  # the assertions' messages
    return [*lines, *(["", "```", *failed[:20], *details, "```"] if failed else [])]


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# -- part 2: gradient steps -----------------------------------------------------------------------------
class StepTimer(pl.Callback):
    """A Lightning callback (``--trainer.callbacks+=gpu_check.StepTimer``): the wall seconds of each
    optimizer step, from batch start to batch end (the data fetch, where in-process acting happens,
    is outside), with the device synchronised at both ends."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    @staticmethod
    def _sync(pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._sync(pl_module)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._sync(pl_module)
        self.times.append(time.perf_counter() - self._start)


def step_times(config: str, extra: list[str], device: str, steps: int) -> dict[str, dict[str, float]]:
    """Run in a child process: for fp32 and ``bf16-mixed``, fit ``steps`` optimizer steps of
    ``config`` and time each (median and min after two warm-up steps)."""
    sys.path.append(str(Path(__file__).resolve().parent))  # gpu_check.StepTimer by class path
    from lightning_wm.cli import main

    accelerator = "gpu" if device == "cuda" else "cpu"
    out = {}
    for precision in ("32-true", "bf16-mixed"):
        with tempfile.TemporaryDirectory() as folder:
            os.chdir(folder)
            args = ["fit", "--config", str(ROOT / "configs" / config), *extra, "--trainer.accelerator", accelerator]
            args += ["--trainer.devices", "1", "--trainer.precision", precision, "--trainer.max_steps", str(steps)]
            args += ["--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false"]
            args += ["--trainer.enable_model_summary", "false", "--trainer.enable_checkpointing", "false"]
            args += ["--trainer.logger", "false", "--trainer.torch_threads", str(min(8, os.cpu_count() or 1))]
            args += ["--trainer.callbacks+=gpu_check.StepTimer"]
            cli = main(args=args)
        timer = next(c for c in cli.trainer.callbacks if hasattr(c, "times"))
        measured = timer.times[min(2, len(timer.times) - 1) :]  # the first steps warm up (allocation, autotuning)
        out[precision] = {"median": statistics.median(measured), "min": min(measured), "steps": len(measured)}
    return out


def steps_part(device: str, quick: bool, limit: float) -> list[str]:
    runs = QUICK_STEP_RUNS if quick else STEP_RUNS
    steps = 4 if quick else 12  # timed from the third
    lines = [
        "## Gradient steps (seconds per optimizer step, shipped size, data fetch excluded)",
        "",
        "| family | config | fp32 median (min) | bf16-mixed median (min) | bf16 speed-up |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    deadline = time.monotonic() + limit
    for family, config, extra in runs:
        left = deadline - time.monotonic()
        if left < 10:
            lines.append(f"| {family} | `{config}` | not run: out of time | | |")
            continue
        payload = {"config": config, "extra": extra, "device": device, "steps": steps}
        status, result, out = run_child("step-run", payload, left)
        if status != 0 or not result:
            last = out.strip().splitlines()[-1:] or [""]
            lines.append(f"| {family} | `{config}` | failed (exit {status}): {last[0][:120]} | | |")
            continue
        fp32, bf16 = result["32-true"], result["bf16-mixed"]
        lines.append(
            f"| {family} | `{config}` | {fp32['median']:.4f} ({fp32['min']:.4f}) | {bf16['median']:.4f} "
            f"({bf16['min']:.4f}) | {fp32['median'] / bf16['median']:.2f}× |"
        )
    return lines


#: how the Dreamer sizes run steps on CUDA: eager, and the eager kernels recorded as one CUDA graph
#: (``compile.mode: graph``); Inductor's compiled step (``step``, on the CPU) was still compiling
#: the XS step after 230 s on an H100; ``graph+tf32`` records with fp32 matrix multiplies on TF32
#: tensor cores (``trainer.float32_matmul_precision: high``)
SIZE_MODES = ("none", "graph", "graph+tf32")


def dreamer_size_times(device: str, size: str, mode: str, steps: int, quick: bool) -> dict[str, dict[str, float]]:
    """Run in a child process: Dreamer's gradient step at ``size`` (``bench/learner_speed.py``'s),
    fp32 then bf16 autocast, in ``mode`` (:data:`SIZE_MODES`; fused Adam where it records or
    compiles); median and min seconds after the warm-up steps (three: ``graph`` records at the
    third), and the first step's (a compilation's)."""
    import argparse as _argparse

    sys.path.append(str(Path(__file__).resolve().parent))
    import learner_speed

    from lightning_wm.compiling import CompileSettings

    length, batch = (16, 4) if quick else (64, 16)
    optim = "auto" if mode == "none" else "fused"  # the fused optimizers CUDA graphs want
    if mode.endswith("+tf32"):
        torch.set_float32_matmul_precision("high")
        mode = mode.removesuffix("+tf32")
    args = _argparse.Namespace(size=size, horizon=15, batch=batch, length=length, device=device, optim=optim)
    step, _, model = learner_speed.dreamer_step(args, CompileSettings(mode=mode, max_shapes=2))
    out = {}
    warmup = 3
    for precision, bf16 in (("32-true", False), ("bf16-mixed", True)):
        times = []
        for _ in range(steps + warmup):
            learner_speed.synchronize(device)
            start = time.perf_counter()
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
                step()
            learner_speed.synchronize(device)
            times.append(time.perf_counter() - start)
        out[precision] = {"median": statistics.median(times[warmup:]), "min": min(times[warmup:]), "first": times[0]}
        if mode == "graph" and model._captured is not None:
            out[precision]["calls"] = dict(model._captured.calls)
            out[precision]["failed"] = model._captured.failed
        if device == "cuda":
            out[precision]["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        print_result(out)  # fp32's figures survive a time limit that cuts bf16's compile
    return out


def sizes_part(device: str, quick: bool, limit: float) -> list[str]:
    """Dreamer XS..L: eager, then recorded (``graph``) on CUDA or compiled (``step``) on the CPU; one
    child process per (size, mode), every size eager first (seconds each)."""
    order = ["XS"] if quick else ["XS", "L", "S", "M"]
    modes = ("none",) if quick else SIZE_MODES if device == "cuda" else ("none", "step")
    runs = [(size, mode) for mode in modes for size in order]
    steps = 2 if quick else 8
    lines = [
        "## Dreamer gradient step by size (seconds; batch 16x64, horizon 15; `bench/learner_speed.py`'s step)",
        "",
        "| size | compile.mode | fp32 median (min) | bf16 median (min) | bf16 speed-up | first step s (fp32, bf16) | peak GiB | notes |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    if quick:
        lines[0] = "## Dreamer gradient step by size (quick: XS at batch 4x16, eager only)"
    deadline = time.monotonic() + limit
    for size, mode in runs:
        left = deadline - time.monotonic()
        if left < 10:
            lines.append(f"| {size} | {mode} | not run: out of time | | | | | |")
            continue
        payload = {"device": device, "size": size, "mode": mode, "steps": steps, "quick": quick}
        status, result, out = run_child("size-run", payload, left)
        verdict = "timed out" if status in (124, 137) else f"failed (exit {status})"
        if not result:
            last = out.strip().splitlines()[-1:] or [""]
            lines.append(f"| {size} | {mode} | {verdict}: {last[0][:200]} | | | | | |")
            continue
        fp32, bf16 = result["32-true"], result.get("bf16-mixed")
        notes = "; ".join(
            f"{p}: {r['calls']}" + (f" FAILED TO RECORD: {r['failed']}" if r.get("failed") else "")
            for p, r in result.items()
            if "calls" in r
        )
        peak = f"{max(r.get('peak_gib', 0.0) for r in result.values()):.2f}"
        if bf16 is None:  # cut during bf16's compile: fp32's figures stand
            lines.append(
                f"| {size} | {mode} | {fp32['median']:.4f} ({fp32['min']:.4f}) | {verdict} | | {fp32['first']:.1f}, - "
                f"| {peak} | {notes} |"
            )
            continue
        lines.append(
            f"| {size} | {mode} | {fp32['median']:.4f} ({fp32['min']:.4f}) | {bf16['median']:.4f} "
            f"({bf16['min']:.4f}) | {fp32['median'] / bf16['median']:.2f}× | {fp32['first']:.1f}, {bf16['first']:.1f} "
            f"| {peak} | {notes} |"
        )
    return lines


# -- part 3: search -------------------------------------------------------------------------------------
def search_times(
    device: str, batches: list[int], simulations: int, repeats: int, cuda_graphs: bool = False, compile: bool = False
) -> list[dict[str, float]]:
    """Run in a child process: one batched MCTS of ``simulations`` simulations per batch size on the
    device with MuZero's CartPole-sized network (the configs' sizes), eager or with the simulation
    loop captured as a CUDA graph (with ``compile``: of the compiled simulations)."""
    from lightning_wm.agents.muzero import MuZeroModel, MuZeroNet
    from lightning_wm.envs import EnvConfig, env_spec
    from lightning_wm.search import Root, SearchSettings, muzero_policy

    spec = env_spec(EnvConfig("CartPole-v1"))
    net = MuZeroNet(latent_dim=64, hidden=64, layers=2, head_hidden=32, support_size=25)
    model = MuZeroModel(spec.observation_space, spec.action_dim, net).to(device).eval()
    out = []
    with torch.no_grad():
        for batch in batches:
            root = model.initial_inference(torch.randn(batch, 4, device=device) * 0.5)
            generator = torch.Generator(device=device).manual_seed(batch)
            settings = SearchSettings(
                num_simulations=simulations, dirichlet_alpha=0.3, unvisited_q="zero", cuda_graphs=cuda_graphs,
                compile=compile,
            )  # fmt: skip

            def once() -> float:
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                muzero_policy(model.recurrent_fn, Root(root["state"], root["policy_logits"], root["value"]),
                              settings, discount=0.997, generator=generator)  # fmt: skip
                if device == "cuda":
                    torch.cuda.synchronize()
                return time.perf_counter() - start

            first = once()  # warm-up (with cuda_graphs: the capture)
            seconds = statistics.median(once() for _ in range(repeats))
            out.append(
                {"batch": batch, "seconds": seconds, "sims_per_s": batch * simulations / seconds, "first": first}
            )
    return out


#: the search part's variants on CUDA: (name, cuda_graphs, compile)
SEARCH_VARIANTS = (("eager", False, False), ("captured", True, False), ("captured, compiled", True, True))


def search_part(device: str, quick: bool, limit: float) -> list[str]:
    batches, simulations, repeats = ([16, 64], 10, 2) if quick else ([16, 64, 256, 1024], 50, 5)
    variants = SEARCH_VARIANTS if device == "cuda" else SEARCH_VARIANTS[:1]
    lines = [f"## Search ({simulations} simulations, CartPole-sized MuZero network)", ""]
    header = " | ".join(f"{name}: ms per search | {name}: simulations/s | {name}: first s" for name, _, _ in variants)
    lines += [f"| batch | {header} |", "| ---: |" + " ---: |" * (3 * len(variants))]
    results = {}
    deadline = time.monotonic() + limit
    for name, graphs, compile in variants:
        payload = {
            "device": device,
            "batches": batches,
            "simulations": simulations,
            "repeats": repeats,
            "cuda_graphs": graphs,
            "compile": compile,
        }
        status, result, out = run_child("search-run", payload, max(10, deadline - time.monotonic()))
        if status != 0 or not result:
            lines.insert(2, f"{name} failed (exit {status}): {out.strip().splitlines()[-3:]}")
            continue
        results[name] = {r["batch"]: r for r in result}
    for batch in batches:
        cells = []
        for name, _, _ in variants:
            r = results.get(name, {}).get(batch)
            cells += [f"{1e3 * r['seconds']:.1f}", f"{r['sims_per_s']:,.0f}", f"{r['first']:.2f}"] if r else ["—"] * 3
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    return lines


# -- part 4: actors -------------------------------------------------------------------------------------
def actors_part(device: str, quick: bool, limit: float) -> list[str]:
    # EnvPool steps the acting modes' envs where it is installed: H100 runs of policy copies reached 32% of
    # the ceiling with 4 actors x 16 envs and 45-48% with 4 x 32 or 8 x 16 (central acting: 27-33%), so the
    # part runs 4 x 32 copies with and without acting.splits 2 (each actor's env step overlapping its policy)
    envpool = not quick and _has("envpool")
    actors = 2 if quick else max(1, min(8, (os.cpu_count() or 2) // (4 if envpool else 2)))
    seconds = 2 if quick else 6
    cmd = [sys.executable, str(ROOT / "bench/actors.py"), "--envs", "pong", "--actors", f"0,{actors}"]
    cmd += ["--device", device]  # the learner and central acting on the device, policy copies on the CPU
    cmd += ["--seconds", str(seconds), "--prefill", "200" if quick else "1000"]
    if envpool:
        cmd += ["--backend", "envpool", "--envs-per-actor", "32", "--policies", "copies", "--splits", "1,2"]
    else:  # (--quick, the CPU test of this script: central threads alone, the plumbing)
        cmd += ["--policies", "central" if quick else "copies,central"]
        cmd += ["--vectorizations", "sync" if quick else "async"]
        cmd += ["--central-groups", "threads" if quick else "threads,processes"]
    status, out, _ = run(cmd, limit)
    lines = [
        f"## Actors (IMPALA-style acting on ALE/Pong-v5: the env ceiling, in process, {actors} actors; {'EnvPool' if envpool else 'gymnasium'} envs; learner on {device}; `bench/actors.py`)",
        "",
        f"`{' '.join(cmd[1:])}`",
        "",
    ]
    table = [line for line in out.splitlines() if line.startswith("|")]
    if status != 0 or not table:
        return [*lines, f"failed (exit {status}): {out.strip().splitlines()[-3:]}"]
    return [*lines, *table]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="the same checks, shrunk (minutes on a CPU)")
    parser.add_argument("--out", help="also write the report here")
    parser.add_argument(
        "--parts",
        help="comma-separated parts, run in this order (default: tests,capture,search,actors,sizes; with --quick "
        "every part: tests,capture,steps,sizes,search,actors)",
    )
    parser.add_argument(
        "--sizes-seconds",
        type=float,
        help="time limit of the Dreamer sizes part (default 135: every size eager, then recorded)",
    )
    parser.add_argument(
        "--limits", help="time limits in seconds per part, e.g. tests=90,sizes=200 (the others keep their defaults)"
    )
    parser.add_argument("--step-run", help=argparse.SUPPRESS)
    parser.add_argument("--search-run", help=argparse.SUPPRESS)
    parser.add_argument("--size-run", help=argparse.SUPPRESS)
    return parser.parse_args()


def child_run(args: argparse.Namespace) -> bool:
    """In a child process of a part (``--step-run``, ``--search-run``, ``--size-run``): measure and
    print its record; True if this was one."""
    if args.step_run:  # a child process of part 2
        p = json.loads(args.step_run)
        print_result(step_times(p["config"], p["extra"], p["device"], p["steps"]))
        return True
    if args.search_run:  # a child process of part 3
        p = json.loads(args.search_run)
        print_result(
            search_times(p["device"], p["batches"], p["simulations"], p["repeats"], p["cuda_graphs"], p["compile"])
        )
        return True
    if args.size_run:  # a child process of part 2's Dreamer sizes
        p = json.loads(args.size_run)
        # prints its record once per precision (fp32's survives a cut bf16 compile)
        dreamer_size_times(p["device"], p["size"], p["mode"], p["steps"], p["quick"])
        return True
    return False


def part_limits(args: argparse.Namespace) -> dict[str, float]:
    """Time limits (seconds) per part: the defaults, ``--sizes-seconds`` and ``--limits``."""
    # time limits (seconds) per part: the default parts fit one 10-minute device call (<= 9.5 min; the
    # timings of H100 runs: tests 76 s, capture 69 s for 6 tests and over 120 s for 7, search 35 s; the
    # Dreamer step's capture needs minutes of compiling), --device cpu --quick <= 6 min here
    limits = {"tests": 90, "capture": 150, "steps": 110, "sizes": 135, "search": 75, "actors": 120} if not args.quick else {
        "tests": 170, "capture": 5, "steps": 110, "sizes": 25, "search": 25, "actors": 90}  # fmt: skip
    if args.sizes_seconds:
        limits["sizes"] = args.sizes_seconds
    for item in filter(None, (args.limits or "").split(",")):
        part, _, seconds = item.partition("=")
        if part not in limits or not seconds.replace(".", "", 1).isdigit():
            raise SystemExit(f"error: --limits takes part=seconds pairs for parts {sorted(limits)}, got {item!r}")
        limits[part] = float(seconds)
    return limits


def select_parts(args: argparse.Namespace, limits: dict[str, float]) -> list[str]:
    """The parts to run, in order: ``--parts`` or the default for ``--quick`` or not."""
    default = "tests,capture,steps,sizes,search,actors" if args.quick else "tests,capture,search,actors,sizes"
    parts = (args.parts or default).split(",")
    unknown = sorted(set(parts) - set(limits))
    if unknown:
        raise SystemExit(f"error: unknown part(s) {unknown}; choose from {sorted(limits)}")
    return parts


def main() -> None:
    args = parse_args()
    if child_run(args):
        return
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("error: --device cuda but torch sees no CUDA device; use --device cpu")
    limits = part_limits(args)
    parts = select_parts(args, limits)
    start = time.monotonic()
    report = [
        f"# lightning_wm GPU check ({args.device}{', quick' if args.quick else ''})",
        "",
        f"Machine: {machine(args.device)}",
        "",
    ]
    run_part = {
        "tests": lambda limit: tests_part(args.device, args.quick, limit),
        "capture": lambda limit: capture_tests_part(args.device, limit),
        "steps": lambda limit: steps_part(args.device, args.quick, limit),
        "sizes": lambda limit: sizes_part(args.device, args.quick, limit),
        "search": lambda limit: search_part(args.device, args.quick, limit),
        "actors": lambda limit: actors_part(args.device, args.quick, limit),
    }
    for part in parts:  # in the order given; the report is written after each, so a cut run keeps what it had
        report += [*run_part[part](limits[part]), ""]
        if args.out:
            Path(args.out).write_text("\n".join(report) + "\n")
    report.append(f"({time.monotonic() - start:.0f} s in all; `python bench/gpu_check.py {' '.join(sys.argv[1:])}`)")
    text = "\n".join(report)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    failed = any(line.startswith(("FAILED", "TIMED OUT")) or "failed (exit" in line for line in report)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
