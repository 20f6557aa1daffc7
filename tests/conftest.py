"""Test setup: tiny networks run fastest on one thread on this 2-core machine; denormals are
flushed as the CLI flushes them (so a test behaves the same whether a CLI test ran before it)."""

import os

import pytest
import torch

from lightning_wm import runtime

runtime.flush_denormals()
torch.set_num_threads(1)
os.environ.setdefault("SDL_VIDEODRIVER", "dummy")


@pytest.fixture(autouse=True)
def _in_tmp_cwd(tmp_path, monkeypatch):
    """Every test runs in its own temporary working directory (lightning_logs/ lands there)."""
    monkeypatch.chdir(tmp_path)
    yield
