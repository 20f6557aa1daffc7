"""A scheduler's SIGTERM (``timeout``, Slurm, Kubernetes) and Ctrl-C stop a fit at the step it
reached: ``last.ckpt`` and the replay buffer are saved, actors are gone, the exit status is
128 + the signal, and ``--resume_if_exists true`` continues exactly."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support.processes import descendants, wait_gone, wait_until

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow

DREAMER = [
    "--config", str(ROOT / "configs/dreamer/cartpole.yaml"),
    "--config", str(ROOT / "configs/dreamer/presets/debug.yaml"),
    "--trainer.val_check_interval", "100", "--trainer.checkpoint_every_n_steps", "0",
    "--data.init_args.prefill", "64", "--data.init_args.batch_size", "4",
    "--data.init_args.sampler", "lightning_wm.data.samplers.SequenceSampler",
    "--data.init_args.sampler.init_args.length", "8", "--data.init_args.replay.save", "true",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    "--seed_everything", "3",
]  # fmt: skip
IMPALA_ACTORS = [
    "--config", str(ROOT / "configs/impala/cartpole.yaml"),
    "--trainer.val_check_interval", "100", "--trainer.checkpoint_every_n_steps", "0",
    "--data.init_args.env.num_envs", "2", "--data.init_args.unroll_length", "4", "--data.init_args.batch_size", "2",
    "--data.init_args.acting.num_actors", "2",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
]  # fmt: skip


def _run(args: list[str], cwd: Path, signal_at: int | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    extra = []
    if signal_at is not None:
        extra = [
            "--trainer.callbacks+=support.fit_probes.SignalAtStep",
            f"--trainer.callbacks.init_args.step={signal_at}",
        ]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}"}  # tests/: support.fit_probes
    return subprocess.run(
        [sys.executable, str(ROOT / "main.py"), "fit", *args, *extra],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _ckpt(cwd: Path, run: str) -> dict:
    return torch.load(cwd / f"lightning_logs/{run}/checkpoints/last.ckpt", map_location="cpu", weights_only=True)


def test_sigterm_mid_training_saves_the_step_it_reached_and_resumes(tmp_path):
    """The checkpoint a SIGTERM leaves at step 3 is the one a run that ended at step 3 writes:
    same weights, optimizer states, counters and replay buffer."""
    stopped = _run([*DREAMER, "--trainer.max_steps", "6", "--trainer.run_name", "r"], tmp_path, signal_at=3)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-2000:]
    assert "stopped by SIGTERM at step 3" in stopped.stderr and "resume with --ckpt_path last" in stopped.stderr
    ended = _run([*DREAMER, "--trainer.max_steps", "3", "--trainer.run_name", "e"], tmp_path)
    assert ended.returncode == 0, ended.stderr[-2000:]
    a, b = _ckpt(tmp_path, "r"), _ckpt(tmp_path, "e")
    assert a["global_step"] == b["global_step"] == 3
    assert a["ReplayDataModule"] == b["ReplayDataModule"]
    for key, value in b["state_dict"].items():
        assert torch.equal(a["state_dict"][key], value), key
    for saved, expected in zip(a["optimizer_states"], b["optimizer_states"]):
        for index, state in expected["state"].items():
            for name, value in state.items():
                assert torch.equal(saved["state"][index][name], value), (index, name)
    buffers = [tmp_path / f"lightning_logs/{run}/checkpoints/replay_rank0_step3.pt" for run in "re"]
    x, y = (torch.load(path, weights_only=True) for path in buffers)
    for key, value in y["data"].items():
        assert torch.equal(x["data"][key], value), key
    resumed = _run(
        [*DREAMER, "--trainer.max_steps", "6", "--trainer.run_name", "r", "--resume_if_exists", "true"], tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _ckpt(tmp_path, "r")["global_step"] == 6


def test_sigterm_from_outside_while_actors_start_stops_within_30_s_without_orphans(tmp_path):
    """``timeout``/Kubernetes signal only the learner; it is waiting for its actors' first rows."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "main.py"), "fit", *IMPALA_ACTORS, "--trainer.max_steps", "100000",
         "--trainer.run_name", "a"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        family = wait_until(lambda: len(descendants(proc.pid)) >= 2 and descendants(proc.pid), 120, what="actors")
        assert len(family) >= 2, "the actors never started"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - sent <= 30, "the fit took more than 30 s to stop"
        assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
        assert "stopped by SIGTERM" in err
        assert not wait_gone(family, seconds=10), "actors outlived the stopped learner"
        assert (tmp_path / "lightning_logs/a/checkpoints/last.ckpt").is_file()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    resumed = _run(
        [*IMPALA_ACTORS, "--trainer.max_steps", "2", "--trainer.run_name", "a", "--resume_if_exists", "true"], tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _ckpt(tmp_path, "a")["global_step"] == 2


def test_a_second_fit_in_a_run_folder_is_refused_and_overwrite_replaces_it(tmp_path):
    first = _run([*DREAMER, "--trainer.max_steps", "2", "--trainer.run_name", "x"], tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    again = _run([*DREAMER, "--trainer.max_steps", "2", "--trainer.run_name", "x"], tmp_path)
    assert again.returncode == 1 and "holds another run's checkpoints" in again.stderr
    assert again.stderr.count("\n") <= 3, "one line and the traceback hint"
    replaced = _run(
        [*DREAMER, "--trainer.max_steps", "2", "--trainer.run_name", "x", "--trainer.overwrite", "true"], tmp_path
    )
    assert replaced.returncode == 0, replaced.stderr[-2000:]
    assert "warning: --trainer.overwrite true: deleted last.ckpt" in replaced.stderr, "it says what it deletes"


def test_resuming_with_nothing_left_to_do_says_so(tmp_path):
    assert _run([*DREAMER, "--trainer.max_steps", "2", "--trainer.run_name", "n"], tmp_path).returncode == 0
    again = _run([*DREAMER, "--trainer.max_steps", "2", "--trainer.run_name", "n", "--ckpt_path", "last"], tmp_path)
    assert again.returncode == 0 and "nothing to do" in again.stderr and "at step 2" in again.stderr


def test_slurm_sigusr1_saves_stops_and_requeues_the_job(tmp_path):
    """Slurm's warning before the time limit (``--signal=USR1@120``): save, stop, and put the job
    back in the queue (``scontrol requeue``, as Lightning's Slurm support does); a fake scontrol
    on PATH records the call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "scontrol.args"}\n')
    scontrol.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{TESTS}"
    out = subprocess.run(
        [sys.executable, str(ROOT / "main.py"), "fit", *DREAMER, "--trainer.max_steps", "6", "--trainer.run_name", "s",
         "--trainer.callbacks+=support.fit_probes.SignalAtStep", "--trainer.callbacks.init_args.step=2",
         f"--trainer.callbacks.init_args.signum={int(signal.SIGUSR1)}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 128 + signal.SIGUSR1, out.stderr[-2000:]
    assert "stopped by SIGUSR1 at step 2" in out.stderr and "Slurm job 4242 requeued" in out.stderr
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "4242"]
    assert _ckpt(tmp_path, "s")["global_step"] == 2
