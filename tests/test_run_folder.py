"""Run folders: one live owner, and no silent overwrite of another run's checkpoints."""

import os
import socket
import subprocess
import sys

import pytest

from lightning_wm.run_folder import RunFolderError, RunFolderLock, check_new_run, is_rank_zero


def test_a_second_lock_on_a_live_folder_is_refused_naming_the_owner(tmp_path):
    with RunFolderLock(tmp_path):
        with pytest.raises(RunFolderError, match=f"pid {os.getpid()}"):
            RunFolderLock(tmp_path).acquire()
    assert not (tmp_path / "fit.lock").exists(), "released at the end of the block"


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "fit.lock").write_text(f"{socket.gethostname()} {int(dead.stdout)}\n")
    with pytest.warns(RuntimeWarning, match="stale lock"):
        lock = RunFolderLock(tmp_path)
        lock.acquire()
    assert (tmp_path / "fit.lock").read_text().split()[1] == str(os.getpid())
    lock.release()


def test_a_lock_from_another_host_is_refused(tmp_path):
    (tmp_path / "fit.lock").write_text("some-other-host 12345\n")
    with pytest.raises(RunFolderError, match="host some-other-host"):
        RunFolderLock(tmp_path).acquire()


def test_a_new_run_over_old_checkpoints_is_refused_unless_overwrite(tmp_path):
    check_new_run(tmp_path / "missing", overwrite=False)  # no folder: nothing to protect
    (tmp_path / "last.ckpt").write_bytes(b"x")
    (tmp_path / "replay_rank0_step10.pt").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("kept")
    with pytest.raises(RunFolderError, match="--ckpt_path last.*--trainer.run_name.*--trainer.overwrite true"):
        check_new_run(tmp_path, overwrite=False)
    check_new_run(tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_rank_zero_from_the_launchers_environment(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert is_rank_zero()
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert is_rank_zero()
    monkeypatch.setenv("RANK", "1")
    assert not is_rank_zero()


def test_a_full_disk_is_one_line_naming_the_file_and_the_free_bytes(tmp_path):
    """torch's writer reports ENOSPC as a RuntimeError raised while handling the OSError."""
    import errno

    from lightning_wm.io import DiskFullError, atomic_write

    target = tmp_path / "last.ckpt"
    target.write_bytes(b"the previous checkpoint")

    def write(f):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0") from None

    with pytest.raises(DiskFullError) as info:
        atomic_write(target, write)
    message = str(info.value)
    assert "no space left" in message and str(target) in message and "bytes free in" in message
    assert "\n" not in message and "enforce fail" not in message
    assert target.read_bytes() == b"the previous checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"], "the temp file was removed"
