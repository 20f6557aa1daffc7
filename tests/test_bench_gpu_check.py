"""``bench/gpu_check.py --device cpu --quick``: the GPU machine's one command, shrunk on the CPU, runs
every part (the family tests on the CPU, gradient steps, search, actors) and writes its report."""

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from support.bench_scripts import load_bench_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_runs_every_part_on_the_cpu(tmp_path):
    pytest.importorskip("cv2", reason="the actors part plays Pong, whose preprocessing needs opencv (.[atari])")
    report = tmp_path / "report.md"
    # the parts' own limits add up to 425 s (--quick): past them a part reports TIMED OUT, which fails below
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench/gpu_check.py"), "--device", "cpu", "--quick", "--out", str(report)],
        capture_output=True, text=True, timeout=500, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = report.read_text()
    for heading in ("## Tests", "## Gradient steps", "## Search", "## Actors", "Machine: torch"):
        assert heading in text, heading
    assert "passed" in text.split("## Tests")[1].split("##")[0]
    assert "failed" not in text and "TIMED OUT" not in text


def test_sizes_part_times_every_size_eagerly_first_and_keeps_fp32_when_bf16_is_cut(monkeypatch):
    gpu_check = load_bench_script("gpu_check.py")
    fp32, bf16 = {"median": 0.1, "min": 0.09, "first": 12.0}, {"median": 0.2, "min": 0.19, "first": 3.0}
    asked = []

    def child(flag, payload, limit):  # recorded runs: cut during bf16's, fp32's figures printed
        asked.append((payload["size"], payload["mode"]))
        if payload["mode"].startswith("graph"):
            return 124, {"32-true": {**fp32, "calls": {"eager": 2, "recorded": 1, "replayed": 9}}}, "recording"
        return 0, {"32-true": fp32, "bf16-mixed": bf16}, ""

    monkeypatch.setattr(gpu_check, "run_child", child)
    rows = [line for line in gpu_check.sizes_part("cuda", quick=False, limit=1000) if line.startswith("| ")][2:]
    assert asked == [(s, m) for m in ("none", "graph", "graph+tf32") for s in ("XS", "L", "S", "M")]
    assert rows[0] == "| XS | none | 0.1000 (0.0900) | 0.2000 (0.1900) | 0.50× | 12.0, 3.0 | 0.00 |  |"
    assert rows[4] == (
        "| XS | graph | 0.1000 (0.0900) | timed out | | 12.0, - | 0.00 | 32-true: {'eager': 2, 'recorded': 1, 'replayed': 9} |"
    )


# -- bench/gpu_learn.py: the learning proofs ------------------------------------------------------------
def _gpu_learn(tmp_path: Path, *args: str) -> list[str]:
    out, work = tmp_path / "out", tmp_path / "work"
    return [sys.executable, str(ROOT / "bench/gpu_learn.py"), "--device", "cpu", "--quick", "--out", str(out),
            "--work", str(work), *args]  # fmt: skip


def _step_of(checkpoint: Path) -> int:
    import torch

    return int(torch.load(checkpoint, map_location="cpu", weights_only=True)["global_step"])


def test_pack_splits_the_job_folder_in_parts_and_unpack_restores_it(tmp_path, monkeypatch):
    device_call = load_bench_script("device_call.py")
    monkeypatch.setattr(device_call, "PART_BYTES", 4000)
    folder = tmp_path / "job"
    checkpoints = folder / "lightning_logs/job/checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "last.ckpt").write_bytes(os.urandom(9000))
    for left_behind in ("step=4.ckpt", "best.ckpt", "replay_rank0_step4.pt", "fit.lock"):
        (checkpoints / left_behind).write_bytes(b"x")
    (folder / "lightning_logs/job/version_0").mkdir()
    (folder / "lightning_logs/job/version_0/events.out").write_bytes(b"events")
    (folder / "learn.json").write_text('{"segments": []}')
    out = tmp_path / "out"
    out.mkdir()
    names = device_call.pack("job", folder, out, replay=[checkpoints / "replay_rank0_step4.pt"])
    assert len(names) >= 3 and names == [f"job.tar.{i}" for i in range(len(names))]  # 9000 random bytes, gzip
    assert all((out / n).stat().st_size <= 4000 for n in names)
    restored = tmp_path / "restored"
    assert device_call.unpack("job", out, restored)
    files = sorted(str(p.relative_to(restored)) for p in restored.rglob("*") if p.is_file())
    assert files == [
        "learn.json",
        "lightning_logs/job/checkpoints/last.ckpt",
        "lightning_logs/job/checkpoints/replay_rank0_step4.pt",  # the replay named, no other
        "lightning_logs/job/version_0/events.out",
    ]
    assert (restored / "lightning_logs/job/checkpoints/last.ckpt").read_bytes() == (
        checkpoints / "last.ckpt"
    ).read_bytes()
    assert not device_call.unpack("other", out, tmp_path / "other")


def test_replay_of_names_the_buffer_files_a_checkpoint_recorded(tmp_path):
    import torch

    device_call = load_bench_script("device_call.py")
    checkpoint = tmp_path / "last.ckpt"
    assert device_call.replay_of(checkpoint) == []  # no checkpoint
    torch.save({"global_step": 8}, checkpoint)
    assert device_call.replay_of(checkpoint) == []  # no buffer saved with it
    torch.save({"replay_buffers": {"step": 8, "dir": str(tmp_path), "names": ["replay"]}}, checkpoint)
    assert device_call.replay_of(checkpoint) == []  # its file is gone
    for step in (4, 8):
        (tmp_path / f"replay_rank0_step{step}.pt").write_bytes(b"rows")
    assert device_call.replay_of(checkpoint) == [tmp_path / "replay_rank0_step8.pt"]


def test_verdicts_read_the_goal_off_the_evaluations():
    gpu_learn = load_bench_script("gpu_learn.py")
    pong, pixels, minatar = (gpu_learn.JOBS[j] for j in ("impala_pong", "dreamer_pixels", "muzero_minatar"))
    # (env steps, fit wall s, return)
    assert gpu_learn.verdict(pong, [(1e6, 200, 3.0), (2e6, 400, 18.5)], 600).startswith("MET: 18.5 at 2,000,000")
    assert gpu_learn.verdict(pong, [(1e6, 200, 3.0), (2e6, 700, 19.0)], 600).startswith("NOT MET: 19.0")
    assert gpu_learn.verdict(pong, [(1e6, 200, 3.0)], 600) == "target 18 not reached (best 3.00)"
    held = gpu_learn.verdict(pixels, [(1e3, 60, 500.0), (2e3, 120, 480.0)], 600)
    assert held.startswith("MET") and "lowest after: 480.0 (held)" in held
    assert "NOT held" in gpu_learn.verdict(pixels, [(1e3, 60, 500.0), (2e3, 120, 300.0)], 600)
    # MinAtar: the return at the first evaluation at or past 100k frames
    assert (
        gpu_learn.verdict(minatar, [(50_000, 200, 6.0), (100_000, 500, 5.6)], 600)
        == "MET: 5.60 at 100,000 frames, 500 s"
    )
    assert gpu_learn.verdict(minatar, [(100_000, 500, 5.0)], 600).startswith("NOT MET: 5.00")
    assert gpu_learn.verdict(minatar, [(50_000, 200, 6.0)], 600).startswith("not at 100,000 frames yet")


def test_the_report_lists_every_evaluation_with_its_env_steps_and_fit_minutes():
    gpu_learn = load_bench_script("gpu_learn.py")
    listed = gpu_learn.evaluation_list([(1000.0, 546.0, 35.64), (5000.0, 2130.0, 500.0)])
    assert listed == "1,000: 35.6 (9.1 min), 5,000: 500.0 (35.5 min)"


def test_fit_wall_adds_up_the_segments_before_an_event():
    gpu_learn = load_bench_script("gpu_learn.py")
    segments = [{"start": 1000.0, "wall_s": 100.0}, {"start": 5000.0, "wall_s": 50.0}]
    assert gpu_learn.fit_wall(segments, 1040.0) == 40.0
    assert gpu_learn.fit_wall(segments, 5030.0) == 130.0  # 100 s of the first segment + 30 s


@pytest.mark.slow
def test_gpu_learn_runs_every_job_shrunk_on_the_cpu(tmp_path):
    """The device's one command, ``--quick`` on the CPU: each job's GPU config fits, is packed and
    plotted, and the report has a row and a verdict per job."""
    pytest.importorskip("cv2", reason="the Pong job's Atari preprocessing needs opencv (.[atari])")
    pytest.importorskip("minatar", reason="the MinAtar jobs need the minatar extra")
    done = subprocess.run(_gpu_learn(tmp_path, "--parts", "learn"), capture_output=True, text=True, timeout=400,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (tmp_path / "out/report.md").read_text()
    gpu_learn = load_bench_script("gpu_learn.py")
    for job in gpu_learn.JOBS:
        assert f"| {job} | 1 | finished |" in report, job
        assert (tmp_path / f"out/{job}.png").stat().st_size > 10_000
        checkpoint = tmp_path / f"work/{job}/lightning_logs/{job}/checkpoints/last.ckpt"
        assert _step_of(checkpoint) == 4  # --quick: 4 steps
        assert (tmp_path / f"out/{job}.tar").exists()
    assert report.count("Goal: ") == len(gpu_learn.JOBS)
    assert report.count("Evaluations (env steps: return, fit minutes): ") == len(gpu_learn.JOBS)


@pytest.mark.slow
def test_a_job_cut_at_its_limit_resumes_in_the_next_call_and_a_stopped_script_saves(tmp_path):
    """Call 1: the job's wall budget cuts the fit (SIGTERM: last.ckpt and its replay buffer saved,
    packed). Call 2, in a fresh work folder from call 1's files: the fit resumes from that checkpoint
    with those rows; SIGTERM to the script stops the fit, which saves again; the script reports and
    exits 143."""
    pytest.importorskip("minatar", reason="the MinAtar jobs need the minatar extra")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = [
        *_gpu_learn(tmp_path, "--parts", "learn", "--jobs", "dreamer_minatar"),
        "--set",
        "trainer.max_steps=100000",
    ]
    done = subprocess.run([*first, "--job-seconds", "35"], capture_output=True, text=True, timeout=150, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| dreamer_minatar | 1 | cut at its limit |" in (tmp_path / "out/report.md").read_text()
    carried = tmp_path / "carried"
    (tmp_path / "out").rename(carried)
    cut_at = _step_of(tmp_path / "work/dreamer_minatar/lightning_logs/dreamer_minatar/checkpoints/last.ckpt")
    assert cut_at > 0
    second = [*first, "--job-seconds", "300", "--resume-from", str(carried), "--work", str(tmp_path / "work2")]
    proc = subprocess.Popen(second, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    run_dir = tmp_path / "work2/dreamer_minatar/lightning_logs/dreamer_minatar"
    deadline = time.monotonic() + 120
    while not list(run_dir.glob("version_1/events.out*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)  # polling for the resumed fit's logger (its second version folder)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 143, output[-3000:]
    report = (tmp_path / "out/report.md").read_text()
    assert "resumed from" in report and "| dreamer_minatar | 2 | stopped (SIGTERM) |" in report, report
    assert _step_of(run_dir / "checkpoints/last.ckpt") >= cut_at
    log = (tmp_path / "work2/dreamer_minatar/fit.log").read_text()
    assert "Restored all states from the checkpoint" in log
    # the replay buffer travelled with last.ckpt and the resumed fit loaded it (no prefilling anew)
    assert "(with its replay buffer)" in report and "no replay file" not in log
    with tarfile.open(carried / "dreamer_minatar.tar") as tar:
        assert f"lightning_logs/dreamer_minatar/checkpoints/replay_rank0_step{cut_at}.pt" in tar.getnames()


@pytest.mark.slow
def test_jobs_side_by_side_run_at_once_and_a_stopped_script_saves_every_one(tmp_path):
    """``--side-by-side``: both jobs' fits train at the same time (each note names the other); SIGTERM
    to the script reaches both fits, each saves ``last.ckpt`` past its first checkpoint, the report
    has a stopped row per job, and the script exits 143."""
    pytest.importorskip("minatar", reason="the MinAtar jobs need the minatar extra")
    jobs = ("dreamer_minatar", "muzero_minatar")
    command = _gpu_learn(tmp_path, "--parts", "learn", "--jobs", ",".join(jobs), "--side-by-side")
    command += ["--set", "trainer.max_steps=100000", "--job-seconds", "300"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    checkpoints = {job: tmp_path / f"work/{job}/lightning_logs/{job}/checkpoints/last.ckpt" for job in jobs}
    deadline = time.monotonic() + 150
    while not all(c.exists() for c in checkpoints.values()) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)  # polling for both fits' first checkpoints (step 4): both are training
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, output[-3000:]
    report = (tmp_path / "out/report.md").read_text()
    for job, other in (jobs, jobs[::-1]):
        assert f"| {job} | 1 | stopped (SIGTERM) |" in report, report
        assert f"side by side with `{other}`" in report
        assert _step_of(checkpoints[job]) >= 4
        assert (tmp_path / f"out/{job}.tar").exists() and (tmp_path / f"out/{job}.png").exists()
    assert report.index("### `dreamer_minatar`") < report.index("### `muzero_minatar`")  # the --jobs order
    (a,), (b,) = (json.loads((tmp_path / f"work/{job}/learn.json").read_text())["segments"] for job in jobs)
    assert a["start"] < b["start"] + b["wall_s"] and b["start"] < a["start"] + a["wall_s"]  # at the same time


def test_a_replay_that_would_take_the_job_past_one_file_stays_behind(tmp_path, monkeypatch):
    import torch

    gpu_learn = load_bench_script("gpu_learn.py")
    checkpoints = tmp_path / "job/lightning_logs/dreamer_minatar/checkpoints"
    checkpoints.mkdir(parents=True)
    torch.save({"replay_buffers": {"step": 4, "dir": str(checkpoints), "names": ["replay"]}}, checkpoints / "last.ckpt")
    (checkpoints / "replay_rank0_step4.pt").write_bytes(os.urandom(6000))  # random bytes: gzip cannot shrink them
    out = tmp_path / "out"
    out.mkdir()
    job = gpu_learn.JOBS["dreamer_minatar"]
    line = gpu_learn.pack_job("dreamer_minatar", job, tmp_path / "job", out)
    assert line.endswith("`dreamer_minatar.tar` (with its replay buffer)")
    monkeypatch.setattr(gpu_learn, "PART_BYTES", 4000)
    line = gpu_learn.pack_job("dreamer_minatar", job, tmp_path / "job", out)
    assert line.endswith("`dreamer_minatar.tar` (its replay buffer stays behind: with it, over one file)")
    with tarfile.open(out / "dreamer_minatar.tar") as tar:
        assert tar.getnames() == ["lightning_logs/dreamer_minatar/checkpoints/last.ckpt"]
