"""Run a CLI fit that is killed with SIGKILL halfway through writing its N-th checkpoint.

``python kill_during_save.py N fit ...args``: the N-th ``torch.save`` into a file writes half of
the bytes, flushes them, and the process kills itself (no cleanup, like ``kill -9`` or a power
cut), with ``TMPDIR`` on another folder than the logs.
"""

import io
import os
import signal
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS.parent)]  # support.* and this repository's lightning_wm, installed or not

from lightning_wm.cli import main  # noqa: E402

target = int(sys.argv[1])
calls = 0
real_save = torch.save


def save_then_die(obj, f, *args, **kwargs):
    global calls
    if isinstance(f, (str, os.PathLike)) or not hasattr(f, "write"):
        return real_save(obj, f, *args, **kwargs)
    calls += 1
    if calls < target:
        return real_save(obj, f, *args, **kwargs)
    buffer = io.BytesIO()
    real_save(obj, buffer, *args, **kwargs)
    data = buffer.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)


torch.save = save_then_die
main(args=sys.argv[2:])
