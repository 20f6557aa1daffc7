"""The fault probe of issue 55, one test per case: what a scheduler (Slurm, Kubernetes, Ray) does to a
job, run as a real subprocess with real signals. Each waits on events (a file a probe callback
writes, a checkpoint, a worker's pid), never on fixed sleeps, and checks the exit status, that
there is no traceback, no child process left and nothing of ours left in /dev/shm."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support.processes import alive, descendants, wait_gone, wait_until

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow

DREAMER = [
    "--config", str(ROOT / "configs/dreamer/cartpole.yaml"),
    "--config", str(ROOT / "configs/dreamer/presets/debug.yaml"),
    "--data.init_args.prefill", "64", "--data.init_args.eval.episodes", "1", "--data.init_args.eval.envs", "1",
    "--data.init_args.batch_size", "4", "--data.init_args.sampler", "lightning_wm.data.samplers.SequenceSampler",
    "--data.init_args.sampler.init_args.length", "8",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
]  # fmt: skip
IMPALA = [
    "--config", str(ROOT / "configs/impala/cartpole.yaml"),
    "--trainer.val_check_interval", "1000", "--trainer.checkpoint_every_n_steps", "0",
    "--data.init_args.env.num_envs", "2", "--data.init_args.unroll_length", "4", "--data.init_args.batch_size", "2",
    "--data.init_args.acting.num_actors", "2",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
]  # fmt: skip
CONTROLLER = """
trainer:
  max_steps: 100000
  val_check_interval: 100000
  limit_val_batches: 1
  checkpoint_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
model:
  class_path: lightning_wm.agents.worldmodels.Controller
  init_args:
    es: {popsize: 8, episodes_per_member: 2, sigma0: 0.1, seed: 0, env_workers: 2}
data:
  class_path: lightning_wm.data.generations.GenerationDataModule
  init_args:
    env: {id: CartPole-v1, seed: 100}
    eval: {episodes: 1, envs: 1}
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}", "OMP_NUM_THREADS": "1", **extra}


def _mark(path: Path, step: int = 1) -> list[str]:
    """Options that make the fit write ``path`` once ``step`` steps are done (an event to wait on)."""
    return [
        "--trainer.callbacks+=support.fit_probes.MarkAt",
        f"--trainer.callbacks.init_args.path={path}",
        f"--trainer.callbacks.init_args.step={step}",
    ]


def _start(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``command`` in its own session (its own process group, as a scheduler's job step is)."""
    return subprocess.Popen(
        command, cwd=cwd, env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def _main(subcommand: str, *args: str) -> list[str]:
    return [sys.executable, str(ROOT / "main.py"), subcommand, *args]


def _shm_of(pids: set[int]) -> list[str]:
    """Entries of /dev/shm that name one of ``pids`` (torch's and our shared memory carry the pid)."""
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return []
    return [n for n in names if any(f"_{p}_" in n or n.endswith(f"_{p}") for p in pids)]


class Job:
    """A started command with the processes seen below it, ended and checked by :meth:`finish`."""

    def __init__(self, command: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        self.proc = _start(command, cwd, env)
        self.family: set[int] = set()

    def watch(self) -> set[int]:
        self.family |= descendants(self.proc.pid)
        return self.family

    def finish(self, timeout: float = 60) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode, out, err

    def check_clean(self, err: str) -> None:
        assert "Traceback" not in err, err[-3000:]
        left = wait_gone(self.family, seconds=30)
        assert not left, f"processes left: {left}"
        assert not _shm_of({self.proc.pid, *self.family}), "shared memory left in /dev/shm"

    def kill(self, signum: int, group: bool = False) -> float:
        self.watch()
        (os.killpg if group else os.kill)(self.proc.pid, signum)
        return time.monotonic()


def _step_of(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


def _wait_file(path: Path, job: Job, timeout: float = 240) -> None:
    def ready() -> bool:
        job.watch()
        if job.proc.poll() is not None:
            raise AssertionError(f"the command ended early ({job.proc.returncode}): {job.proc.stderr.read()[-3000:]}")
        return path.exists()

    wait_until(ready, timeout, what=f"{path.name}")


def _unshare_works(*flags: str) -> bool:
    return shutil.which("unshare") is not None and subprocess.run(["unshare", *flags, "true"]).returncode == 0


# -- case 1 ----------------------------------------------------------------------------------------
def test_case1_controller_sigterm_with_env_workers_exits_and_a_kill_9_leaves_no_worker(tmp_path):
    config = tmp_path / "controller.yaml"
    config.write_text(CONTROLLER)
    job = Job(_main("fit", "--config", str(config), "--trainer.run_name", "c", *_mark(tmp_path / "m", 2)), tmp_path)
    _wait_file(tmp_path / "m", job)
    assert len(job.watch()) >= 2, "the env workers did not start"
    sent = job.kill(signal.SIGTERM)
    status, _, err = job.finish()
    assert time.monotonic() - sent <= 30 and status == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM at step" in err and "last.ckpt holds it" in err
    job.check_clean(err)
    last = tmp_path / "lightning_logs/c/checkpoints/last.ckpt"
    assert "cma_es" in torch.load(last, map_location="cpu", weights_only=True)
    # kill -9 of the learner: its env workers die with it (parent-death signal), none is left with parent 1
    job = Job(
        _main("fit", "--config", str(config), "--trainer.run_name", "c", "--resume_if_exists", "true",
              *_mark(tmp_path / "m2", _step_of(last) + 1)),
        tmp_path,
    )  # fmt: skip
    _wait_file(tmp_path / "m2", job)
    workers = job.watch()
    assert len(workers) >= 2
    job.kill(signal.SIGKILL)
    job.finish()
    assert not wait_gone(workers, seconds=30), "env workers outlived a kill -9 of the learner"


def test_case1_pixel_env_workers_keep_default_sigterm_after_rendering(tmp_path):
    """SDL (pygame) installs a SIGTERM handler when rendering starts unless told not to: a worker
    that caught SIGTERM could not be terminated. The workers' signal dispositions are read from
    /proc after they rendered."""
    code = (
        "import os, sys\nfrom lightning_wm.envs import EnvConfig\nfrom lightning_wm.population_envs import PopulationEnvs\n"
        "pool = PopulationEnvs(EnvConfig(id='CartPole-v1', pixels=True, size=[64, 64]), 2, workers=2)\n"
        "pool.reset([0, 1]); pool.step([0, 1], [0, 1])\n"
        "print(json.dumps([p.pid for p in pool._procs]), flush=True)\nsys.stdin.read()\n"
    ).replace("import os, sys", "import json, os, sys")
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        workers = json.loads(proc.stdout.readline())
        for pid in workers:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
            caught, ignored = int(status["SigCgt"], 16), int(status["SigIgn"], 16)
            assert not caught >> (signal.SIGTERM - 1) & 1, "a worker catches SIGTERM"
            assert ignored >> (signal.SIGINT - 1) & 1 and ignored >> (signal.SIGUSR1 - 1) & 1
        proc.kill()  # kill -9 of the parent
        proc.wait(timeout=30)
        assert not wait_gone(workers, seconds=30), "pixel env workers outlived their parent"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


# -- case 2 ----------------------------------------------------------------------------------------
@pytest.mark.xdist_group("ray")  # one local Ray instance at a time: under -n, on one worker
def test_case2_ray_actors_sigterm_saves_and_exits_143(tmp_path):
    pytest.importorskip("ray")
    job = Job(
        _main("fit", *IMPALA, "--data.init_args.acting.backend", "ray", "--trainer.max_steps", "100000",
              "--trainer.run_name", "r", *_mark(tmp_path / "m", 2)),
        tmp_path,
    )  # fmt: skip
    _wait_file(tmp_path / "m", job, timeout=300)
    sent = job.kill(signal.SIGTERM)
    status, _, err = job.finish(timeout=120)
    assert status == 128 + signal.SIGTERM and time.monotonic() - sent <= 30, err[-3000:]
    assert "stopped by SIGTERM at step" in err
    assert _step_of(tmp_path / "lightning_logs/r/checkpoints/last.ckpt") >= 2
    job.check_clean(err)


# -- case 3 ----------------------------------------------------------------------------------------
@pytest.mark.skipif(not _unshare_works("-p", "-f", "--mount-proc"), reason="needs PID namespaces (unshare)")
def test_case3_a_restart_in_a_new_pid_namespace_resumes(tmp_path):
    """Kubernetes restarts the container of a pod: the new fit is pid 1 again, as the killed one was."""
    pod = ["unshare", "-p", "-f", "--mount-proc", "--kill-child"]
    args = [*DREAMER, "--trainer.run_name", "k", "--trainer.checkpoint_every_n_steps", "2"]
    job = Job([*pod, *_main("fit", *args, "--trainer.max_steps", "100000")], tmp_path)
    _wait_file(tmp_path / "lightning_logs/k/checkpoints/last.ckpt", job)
    job.kill(signal.SIGKILL, group=True)
    job.finish()
    assert json.loads((tmp_path / "lightning_logs/k/fit.lock").read_text())["pid"] == 1, "the lock was left"
    step = _step_of(tmp_path / "lightning_logs/k/checkpoints/last.ckpt")
    again = Job(
        [*pod, *_main("fit", *args, "--trainer.max_steps", str(step + 2), "--resume_if_exists", "true")], tmp_path
    )
    status, _, err = again.finish(timeout=300)
    assert status == 0, err[-3000:]
    assert "taking over the run folder lock" in err and "no process holds it" in err
    assert _step_of(tmp_path / "lightning_logs/k/checkpoints/last.ckpt") == step + 2


# -- case 4 ----------------------------------------------------------------------------------------
def test_case4_resume_if_exists_after_a_preemption_before_the_first_last_ckpt(tmp_path):
    args = [*DREAMER, "--trainer.run_name", "p", "--trainer.checkpoint_every_n_steps", "1000",
            "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1"]  # fmt: skip
    job = Job(_main("fit", *args, "--trainer.max_steps", "100000"), tmp_path)
    best = tmp_path / "lightning_logs/p/checkpoints/best.ckpt"
    _wait_file(best, job)
    job.kill(signal.SIGKILL, group=True)
    job.finish()
    assert not (tmp_path / "lightning_logs/p/checkpoints/last.ckpt").exists()
    step = _step_of(best)
    again = Job(_main("fit", *args, "--trainer.max_steps", str(step + 2), "--resume_if_exists", "true"), tmp_path)
    status, out, err = again.finish(timeout=300)
    assert status == 0, err[-3000:]
    assert f"resuming from best.ckpt, the only checkpoint there (step {step})" in out
    assert _step_of(tmp_path / "lightning_logs/p/checkpoints/last.ckpt") == step + 2


# -- case 5 ----------------------------------------------------------------------------------------
def test_case5_record_stops_on_sigterm_keeping_the_finished_episodes(tmp_path):
    store = tmp_path / "frames"
    job = Job(
        _main("record", "--config", str(ROOT / "configs/worldmodels/cartpole_pixels/record.yaml"),
              "--episodes", "2000", "--data.init_args.directory", str(store)),
        tmp_path,
    )  # fmt: skip
    wait_until(lambda: job.watch() is not None and len(list(store.glob("*.npz"))) >= 3, 240, what="3 episodes")
    sent = job.kill(signal.SIGTERM)
    status, _, err = job.finish()
    assert status == 128 + signal.SIGTERM and time.monotonic() - sent <= 30, err[-3000:]
    kept = len(list(store.glob("*.npz")))
    assert f"stopped by SIGTERM after {kept} of 2000 episodes" in err
    job.check_clean(err)


def test_case5_evaluate_stops_on_sigterm_saying_it_wrote_nothing(tmp_path):
    """``evaluate`` follows the same rule; its progress lines (one per episode here) are the event."""
    import threading

    job = Job(_main("evaluate", *DREAMER, "--episodes", "100000"), tmp_path, env=_env(LIGHTNING_WM_PROGRESS_EVERY="0"))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(job.proc.stderr), daemon=True)
    reader.start()
    wait_until(lambda: job.watch() is not None and any("evaluate CartPole-v1: 2/" in x for x in lines), 240,
               what="two evaluation episodes")  # fmt: skip
    sent = job.kill(signal.SIGTERM)
    status = job.proc.wait(timeout=60)
    reader.join(timeout=30)
    err = "".join(lines)
    assert status == 128 + signal.SIGTERM and time.monotonic() - sent <= 30, err[-3000:]
    assert "stopped by SIGTERM during evaluate; it writes nothing, so nothing was lost" in err
    job.check_clean(err)


# -- case 7 ----------------------------------------------------------------------------------------
@pytest.mark.skipif(not _unshare_works("-m"), reason="needs mount namespaces (unshare)")
def test_case7_a_full_disk_at_start_is_one_line_and_leaves_no_lock(tmp_path):
    (tmp_path / "disk").mkdir()
    fit = " ".join(f"'{a}'" for a in _main("fit", *DREAMER, "--trainer.default_root_dir", "disk"))
    script = f"mount -t tmpfs -o size=128k tmpfs disk && (head -c 1M /dev/zero > disk/fill 2>/dev/null; true) && {fit}"
    script += "; status=$?; find disk -name fit.lock; exit $status"
    job = Job(["unshare", "-m", "sh", "-c", script], tmp_path)
    status, out, err = job.finish(timeout=240)
    assert status == 1, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no space left on the device" in errors[0], err[-3000:]
    assert "fit.lock" not in out
    job.check_clean(err)


# -- case 8 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("family", "signum"),
    [("dreamer", signal.SIGUSR1), ("impala", signal.SIGUSR1), ("impala", signal.SIGTERM)],
)
def test_case8_a_signal_to_the_whole_job_saves_and_leaves_nothing_behind(tmp_path, family, signum):
    """Slurm's ``--signal=USR1@120`` (without ``B:``) and ``scancel`` signal every process of the job."""
    args = DREAMER if family == "dreamer" else IMPALA
    job = Job(_main("fit", *args, "--trainer.max_steps", "100000", "--trainer.run_name", "g",
                    *_mark(tmp_path / "m", 2)), tmp_path)  # fmt: skip
    _wait_file(tmp_path / "m", job)
    sent = job.kill(signum, group=True)
    status, _, err = job.finish()
    assert status == 128 + signum and time.monotonic() - sent <= 30, err[-3000:]
    assert f"stopped by {signal.Signals(signum).name} at step" in err
    assert "resource_tracker" not in err and "leak" not in err and "KeyError" not in err, err[-3000:]
    assert _step_of(tmp_path / "lightning_logs/g/checkpoints/last.ckpt") >= 2
    job.check_clean(err)


# -- case 9 ----------------------------------------------------------------------------------------
@pytest.mark.skipif(not _unshare_works("-m"), reason="needs mount namespaces (unshare)")
def test_case9_validate_on_a_read_only_run_folder_is_one_line(tmp_path):
    args = [*DREAMER, "--trainer.run_name", "ro"]
    done = Job(_main("fit", *args, "--trainer.max_steps", "2"), tmp_path).finish(timeout=300)
    assert done[0] == 0, done[2][-3000:]
    run = "lightning_logs/ro"
    validate = " ".join(f"'{a}'" for a in _main("validate", *args, "--ckpt_path", "last"))
    script = f"mount --bind {run} {run} && mount -o remount,ro,bind {run} && {validate}"
    status, _, err = Job(["unshare", "-m", "sh", "-c", script], tmp_path).finish(timeout=240)
    assert status == 1, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not writable (Read-only file system)" in errors[0], err[-3000:]
    assert "--trainer.logger false" in errors[0] and "Traceback" not in err


# -- case 10 ---------------------------------------------------------------------------------------
def test_case10_a_requeue_to_another_host_takes_the_lock_over_unattended(tmp_path):
    args = [*DREAMER, "--trainer.run_name", "h"]
    done = Job(_main("fit", *args, "--trainer.max_steps", "2"), tmp_path).finish(timeout=300)
    assert done[0] == 0, done[2][-3000:]
    owner = {"host": "node-17", "pid": 4321, "boot_id": "another-kernel", "pid_ns": "pid:[1]", "job": "", "since": 0}
    (tmp_path / "lightning_logs/h/fit.lock").write_text(json.dumps(owner))  # the old node died holding it
    refused = Job(_main("fit", *args, "--trainer.max_steps", "4", "--ckpt_path", "last"), tmp_path).finish(timeout=300)
    assert refused[0] == 1 and "locked by a fit on another machine (pid 4321 on host node-17)" in refused[2]
    job = Job(
        _main("fit", *args, "--trainer.max_steps", "4", "--resume_if_exists", "true"),
        tmp_path,
        env=_env(LIGHTNING_WM_LOCK_LEASE_S="3"),
    )
    status, _, err = job.finish(timeout=300)
    assert status == 0, err[-3000:]
    assert "taking over the run folder lock" in err and "heartbeat stopped" in err
    assert _step_of(tmp_path / "lightning_logs/h/checkpoints/last.ckpt") == 4


# -- case 11 ---------------------------------------------------------------------------------------
def test_case11_a_double_ctrl_c_exits_130_saying_what_was_saved(tmp_path):
    """The first Ctrl-C asks for a stop; the stop hangs (a probe waits for ever in it); the second
    ends the fit at once, and the one line says which step last.ckpt holds."""
    stuck = [
        "--trainer.callbacks+=support.fit_probes.StuckStopping",
        f"--trainer.callbacks.init_args.path={tmp_path / 's'}",
    ]
    job = Job(_main("fit", *DREAMER, "--trainer.max_steps", "100000", "--trainer.run_name", "i",
                    "--trainer.checkpoint_every_n_steps", "1", *_mark(tmp_path / "m", 2), *stuck), tmp_path)  # fmt: skip
    _wait_file(tmp_path / "m", job)
    job.kill(signal.SIGINT)
    _wait_file(tmp_path / "s", job)
    sent = job.kill(signal.SIGINT)
    status, _, err = job.finish()
    assert status == 130 and time.monotonic() - sent <= 30, err[-3000:]
    line = [x for x in err.splitlines() if x.startswith("stopped")]
    assert len(line) == 1 and line[0].startswith("stopped at once by a second SIGINT at step"), err[-3000:]
    step = _step_of(tmp_path / "lightning_logs/i/checkpoints/last.ckpt")
    assert f"nothing more was saved: {tmp_path / 'lightning_logs/i/checkpoints/last.ckpt'} holds step {step}" in line[0]
    job.check_clean(err)


# -- also seen -------------------------------------------------------------------------------------
def test_killing_gpu_check_ends_its_running_part(tmp_path):
    job = Job([sys.executable, str(ROOT / "bench/gpu_check.py"), "--device", "cpu", "--quick", "--parts", "search",
               "--limits", "search=300"], tmp_path)  # fmt: skip
    wait_until(lambda: any("timeout" in _cmd(p) for p in job.watch()), 120, what="the part's start")
    part = job.watch()
    job.kill(signal.SIGTERM)
    job.finish()
    assert not wait_gone(part, seconds=30), "the running part outlived gpu_check.py"


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def test_an_actors_death_saves_last_ckpt_at_the_step_reached(tmp_path):
    job = Job(_main("fit", *IMPALA, "--trainer.max_steps", "100000", "--trainer.run_name", "a",
                    *_mark(tmp_path / "m", 2)), tmp_path)  # fmt: skip
    _wait_file(tmp_path / "m", job)
    actors = sorted(p for p in job.watch() if alive(p) and "spawn" in _cmd(p))
    assert actors, "no actor process found"
    os.kill(actors[-1], signal.SIGKILL)
    status, _, err = job.finish(timeout=120)
    assert status == 1 and "Traceback" not in err, err[-3000:]
    step = _step_of(tmp_path / "lightning_logs/a/checkpoints/last.ckpt")
    assert step >= 2 and f"at step {step}; " in err and "last.ckpt holds it" in err
    job.check_clean(err)
