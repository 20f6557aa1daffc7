"""What a device call does around its children: a time limit on each, the signals that stop the
caller passed on to them (a fit saves), and the job folders packed to travel to the next call.
Used by ``bench/gpu_learn.py`` (and, through it, ``gpu_check``'s children in its speed part).
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PART_BYTES = 15 * 2**20  # a returned file is at most 16 MiB
COMPRESS_LEVEL = 6  # gzip: replay rows of frames and 0/1 planes shrink many times


class Children:
    """The running children (``timeout`` processes, each leading its own process group; several with
    ``gpu_learn.py --side-by-side``) and the signal that stops the caller (:meth:`handle`, installed
    by it): the first SIGTERM/SIGINT/SIGHUP is passed to every child's group (a fit saves and exits),
    a second one kills the groups."""

    procs: set[subprocess.Popen] = set()
    stopped: int = 0
    lock = threading.Lock()

    @classmethod
    def handle(cls, signum: int, frame: Any) -> None:
        again = cls.stopped != 0
        cls.stopped = cls.stopped or signum
        for proc in list(cls.procs):
            cls.signal_group(proc, signal.SIGKILL if again else signal.SIGTERM)

    @staticmethod
    def signal_group(proc: subprocess.Popen, signum: int) -> None:
        """``signum`` to the process group ``proc`` leads, while it runs."""
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signum)
            except ProcessLookupError:
                pass


def run_limited(
    cmd: list[str], limit: float, env: dict[str, str] | None = None, cwd: str | None = None, grace: int = 5
) -> tuple[int, str, float]:
    """``timeout -k grace limit cmd``, its output captured: exit status, the output, wall seconds.
    (The same signature as ``gpu_check.run``, which the speed part's children go through too.)
    Safe to call from several threads at once (``--side-by-side``)."""
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        with Children.lock:  # (the check below after it: a signal at any point reaches this child)
            if Children.stopped:
                return 143, "not started: this script was stopped", 0.0
            proc = subprocess.Popen(
                ["timeout", "-k", str(grace), str(max(1, int(limit))), *cmd], stdout=log, stderr=subprocess.STDOUT,
                env=env, cwd=cwd, text=True,
            )  # fmt: skip
            Children.procs.add(proc)
        if Children.stopped:
            Children.signal_group(proc, signal.SIGTERM)
        status = proc.wait()
        Children.procs.discard(proc)
        log.seek(0)
        return status, log.read(), time.monotonic() - start


def unpack(name: str, resume_from: Path, folder: Path) -> bool:
    """Unpack ``<name>.tar`` (or its parts ``<name>.tar.0``, ``.1``, ...) from ``resume_from`` into
    ``folder`` (emptied first); False when there is none."""
    parts = sorted(resume_from.glob(f"{name}.tar.*"), key=lambda p: int(p.suffix[1:]) if p.suffix[1:].isdigit() else -1)
    parts = [p for p in parts if p.suffix[1:].isdigit()] or [p for p in [resume_from / f"{name}.tar"] if p.exists()]
    if not parts:
        return False
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    data = b"".join(p.read_bytes() for p in parts)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(folder, filter="data")
    return True


def replay_of(checkpoint: Path) -> list[Path]:
    """The replay files saved with ``checkpoint`` (rank 0's, found as a resumed fit finds them:
    ``BufferCheckpoint.saved_file``); none when it saved no buffer or the files are gone."""
    import torch

    from lightning_wm.callbacks import BufferCheckpoint

    if not checkpoint.is_file():
        return []
    record = torch.load(checkpoint, map_location="cpu", weights_only=True).get("replay_buffers")
    if not record:
        return []
    files = [BufferCheckpoint.saved_file(record, name, 0, checkpoint)[0] for name in record["names"]]
    return [f for f in files if f is not None]


def pack(name: str, folder: Path, out: Path, replay: Sequence[Path] = ()) -> list[str]:
    """:func:`packed` ``folder`` written as ``out/<name>.tar`` (:func:`write_parts`)."""
    return write_parts(name, packed(folder, replay), out)


def packed(folder: Path, replay: Sequence[Path] = ()) -> bytes:
    """The job folder (``last.ckpt``, the TensorBoard runs, ``learn.json``, the fit's log, the
    ``replay`` files given; no other checkpoints or replay files, no lock) as a gzip-compressed tar."""
    buffer = io.BytesIO()
    keep = {path.resolve() for path in replay}
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=COMPRESS_LEVEL) as tar:
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder)
            if path.is_dir() or path.name == "fit.lock" or (path.suffix == ".ckpt" and path.name != "last.ckpt"):
                continue
            if path.name.startswith("replay_") and path.resolve() not in keep:
                continue
            tar.add(path, arcname=str(rel))
    return buffer.getvalue()


def write_parts(name: str, data: bytes, out: Path) -> list[str]:
    """``data`` as ``out/<name>.tar``, or in :data:`PART_BYTES` parts ``<name>.tar.0``, ``.1``, ...
    when larger (earlier files of ``name`` removed); the names written."""
    for old in out.glob(f"{name}.tar*"):
        old.unlink()
    if len(data) <= PART_BYTES:
        (out / f"{name}.tar").write_bytes(data)
        return [f"{name}.tar"]
    names = []
    for i in range(0, len(data), PART_BYTES):
        names.append(f"{name}.tar.{i // PART_BYTES}")
        (out / names[-1]).write_bytes(data[i : i + PART_BYTES])
    return names
