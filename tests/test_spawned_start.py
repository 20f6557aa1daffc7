"""A spawned worker that dies while starting is reported, not waited on forever: CPython's spawn
writes a child's start data through a pipe the parent also holds open, so a child that exits
before reading it (its re-import of the main module failed) would block ``start()`` for good once
the data pass the pipe's buffer. Each test runs a real script as ``__main__`` in a subprocess."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The main module of the subprocess. In a spawned child it is re-run as ``__mp_main__``; with
# FAIL_IN_CHILD it raises there, as a script whose imports only work from its own folder does.
SCRIPT = textwrap.dedent(
    """
    import os, sys
    if __name__ != "__main__" and os.environ.get("FAIL_IN_CHILD"):
        raise ImportError("this main module cannot be imported in a child")
    from lightning_wm.data.acting.spawned import SpawnedWorkers, worker_process

    def body(index, payload, link):
        with worker_process(index, link):
            link.chunks.put(len(payload))
            link.stop.wait(60)  # the queue does not flush at exit (cancel_join_thread): stay until closed

    if __name__ == "__main__":
        workers = SpawnedWorkers(body, (b"x" * 1_000_000,), 1, 1, "worker {}")  # 1 MB: past any pipe buffer
        try:
            print("got", workers.chunks.get(timeout=60), flush=True)
        finally:
            workers.close()
    """
)


def _run(tmp_path: Path, fail_in_child: bool) -> subprocess.CompletedProcess:
    script = tmp_path / "main_module.py"
    script.write_text(SCRIPT)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **({"FAIL_IN_CHILD": "1"} if fail_in_child else {})}
    return subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_a_child_that_dies_while_starting_is_reported(tmp_path):
    done = _run(tmp_path, fail_in_child=True)
    assert done.returncode != 0
    assert "this main module cannot be imported in a child" in done.stderr  # the child's own error
    assert "worker 0 (pid " in done.stderr and "exited while starting" in done.stderr


@pytest.mark.slow
def test_a_large_start_payload_still_starts(tmp_path):
    done = _run(tmp_path, fail_in_child=False)
    assert done.returncode == 0, done.stderr
    assert "got 1000000" in done.stdout
