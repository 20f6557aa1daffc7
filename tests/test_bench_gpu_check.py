"""``bench/gpu_check.py --device cpu --quick``: the GPU machine's one command, shrunk on the CPU, runs
every part (the family tests on the CPU, gradient steps, search, actors) and writes its report."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
