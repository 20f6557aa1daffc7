"""``bench/gpu_check.py --device cpu --quick``: the GPU machine's one command, shrunk on the CPU, runs
every part (the family tests on the CPU, gradient steps, search, actors) and writes its report."""

import os
import subprocess
import sys
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
