"""lightning_wm.runtime: the process-level CPU settings."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_wm import runtime

ROOT = Path(__file__).resolve().parents[1]
SMALLEST_NORMAL = torch.finfo(torch.float32).tiny


def test_flush_denormals_makes_denormal_results_zero():
    if not runtime.flush_denormals():
        pytest.skip("this CPU has no flush-to-zero flags")
    x = torch.full((4,), SMALLEST_NORMAL)
    assert torch.all(x / 4 == 0)  # a denormal result is flushed
    assert torch.all(x * 1.0 == x)  # normal numbers are untouched


def test_threads_started_after_the_flush_inherit_it():
    script = (
        "import torch\n"
        "from lightning_wm import runtime\n"
        "if not runtime.flush_denormals(): raise SystemExit(3)\n"
        "torch.set_num_threads(2)\n"
        "x = torch.full((1 << 20,), 1e-39)\n"  # big enough for both intra-op threads
        "print(int((x * 1.0 != 0).sum()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if out.returncode == 3:
        pytest.skip("this CPU has no flush-to-zero flags")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"
