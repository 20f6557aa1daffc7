"""Run folders: one live owner (an atomic lock that knows its host, kernel boot, PID namespace and
scheduler job), stale locks taken over by rule, and no silent overwrite of another run's
checkpoints."""

import fcntl
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_wm.run_folder import (
    LockOwner,
    RunFolderError,
    RunFolderLock,
    RunFolderWarning,
    check_new_run,
    derive_run_name,
    is_rank_zero,
    stale_reason,
)

from support.processes import wait_until

ROOT = Path(__file__).resolve().parents[1]


def _unshare_works(*flags: str) -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", *flags, "true"], capture_output=True).returncode == 0


def _flock_free(path: Path) -> bool:
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
    return True


def test_a_second_lock_on_a_live_folder_is_refused_naming_the_owner(tmp_path):
    with RunFolderLock(tmp_path):
        with pytest.raises(RunFolderError, match=f"pid {os.getpid()}"):
            RunFolderLock(tmp_path).acquire()
    assert not (tmp_path / "fit.lock").exists(), "released at the end of the block"
    assert not [p for p in tmp_path.iterdir()], "no temp file left"


def test_the_lock_is_written_whole_naming_where_its_owner_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    with RunFolderLock(tmp_path):
        owner = json.loads((tmp_path / "fit.lock").read_text())
    assert owner["host"] == socket.gethostname() and owner["pid"] == os.getpid() and owner["job"] == "slurm:77"
    assert owner["pid_ns"] == os.readlink("/proc/self/ns/pid")
    assert owner["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def test_a_stale_old_format_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "fit.lock").write_text(f"{socket.gethostname()} {int(dead.stdout)}\n")
    with pytest.warns(RunFolderWarning, match="its process is gone"):
        lock = RunFolderLock(tmp_path)
        lock.acquire()
    assert json.loads((tmp_path / "fit.lock").read_text())["pid"] == os.getpid()
    lock.release()


def _foreign_lock(path: Path, age_s: float = 0.0, job: str = "", host: str = "some-other-host") -> None:
    owner = LockOwner(host, 12345, boot_id="another-kernel", pid_ns="pid:[1]", job=job, since=0.0)
    path.write_text(owner.text())
    if age_s:
        stamp = path.stat().st_mtime - age_s
        os.utime(path, (stamp, stamp))


def test_a_lock_of_another_machine_is_refused_while_its_heartbeat_is_fresh(tmp_path):
    _foreign_lock(tmp_path / "fit.lock")
    with pytest.raises(RunFolderError, match="host some-other-host.*heartbeat is 0 s old.*--resume_if_exists true"):
        RunFolderLock(tmp_path).acquire()


def test_a_lock_of_another_machine_is_taken_over_after_its_lease_or_by_the_same_job(tmp_path, monkeypatch):
    """A requeue to another node: the old node stopped beating (lease), or Slurm kept the job id."""
    _foreign_lock(tmp_path / "fit.lock", age_s=500)
    with pytest.warns(RunFolderWarning, match="heartbeat stopped 500 s ago"), RunFolderLock(tmp_path):
        pass
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    _foreign_lock(tmp_path / "fit.lock", job="slurm:4242")
    with pytest.warns(RunFolderWarning, match="same scheduler job"), RunFolderLock(tmp_path):
        pass


def test_resume_if_exists_waits_for_a_foreign_lease_to_run_out(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_WM_LOCK_LEASE_S", "2")
    _foreign_lock(tmp_path / "fit.lock")
    with pytest.warns(RunFolderWarning, match="heartbeat stopped"), RunFolderLock(tmp_path, wait_s=10):
        pass


def test_the_heartbeat_keeps_the_lock_fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_WM_LOCK_LEASE_S", "2")  # a beat every 0.5 s
    with RunFolderLock(tmp_path):
        path = tmp_path / "fit.lock"
        os.utime(path, (0, 0))
        wait_until(lambda: path.stat().st_mtime > 0, 10, what="a heartbeat")


@pytest.mark.parametrize(
    ("owner", "unlocked", "age", "stale"),
    [
        (LockOwner("h", 5, "boot", "ns1"), True, 0.0, "no process holds it"),  # same kernel, no flock holder
        (LockOwner("h", 5, "boot", "ns2"), False, 999.0, None),  # same kernel, flock held: live
        (LockOwner("x", 5, "other", "ns", "slurm:9"), None, 0.0, "same scheduler job"),
        (LockOwner("h", 5, "other", "ns"), True, 0.0, "restarted"),  # same name, new boot
        (LockOwner("x", 5, "other", "ns"), True, 121.0, "heartbeat stopped 121 s ago"),
        (LockOwner("x", 5, "other", "ns"), True, 119.0, None),
        (None, True, 0.0, "unreadable"),
        (None, False, 0.0, None),
    ],
)
def test_when_a_lock_is_stale(owner, unlocked, age, stale):
    me = LockOwner("h", 1, "boot", "ns9", "slurm:9")
    reason = stale_reason(owner, me, unlocked, age, 120.0)
    assert (reason is None) if stale is None else (reason is not None and stale in reason)


def _racer(folder: str, barrier, held, done) -> None:
    lock = RunFolderLock(folder)
    barrier.wait()
    try:
        lock.acquire()
    except RunFolderError:
        held.put(0)
        return
    held.put(1)
    done.wait()
    lock.release()


@pytest.mark.parametrize("stale_first", [False, True])
def test_racers_never_get_two_holders(tmp_path, stale_first):
    """Slurm array tasks sharing a run_name start together: 4 racers, 25 trials, one holder each."""
    ctx = mp.get_context("fork")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    for trial in range(25):
        folder = tmp_path / str(trial)
        folder.mkdir()
        if stale_first:  # a lock left by a killed fit: the racers also race to take it over
            (folder / "fit.lock").write_text(f"{socket.gethostname()} {int(dead.stdout)}\n")
        barrier, held, done = ctx.Barrier(4), ctx.Queue(), ctx.Event()
        racers = [ctx.Process(target=_racer, args=(str(folder), barrier, held, done)) for _ in range(4)]
        for racer in racers:
            racer.start()
        results = [held.get(timeout=60) for _ in racers]
        done.set()
        for racer in racers:
            racer.join(timeout=60)
        assert sum(results) == 1, f"trial {trial}: {sum(results)} holders"


@pytest.mark.skipif(not _unshare_works("-p", "-f", "--mount-proc"), reason="needs PID namespaces (unshare)")
def test_a_lock_held_in_another_pid_namespace_is_live_and_stale_once_it_is_killed(tmp_path):
    """Kubernetes restarts a container in the same pod: the new fit is pid 1 again, as was the old."""
    code = (
        "import sys, time\nfrom lightning_wm.run_folder import RunFolderLock\n"
        f"lock = RunFolderLock({str(tmp_path)!r}); lock.acquire(); print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    holder = subprocess.Popen(
        ["unshare", "-p", "-f", "--mount-proc", "--kill-child", sys.executable, "-c", code],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        assert json.loads((tmp_path / "fit.lock").read_text())["pid"] == 1
        with pytest.raises(RunFolderError, match="in use by a running fit"):
            RunFolderLock(tmp_path).acquire()
    finally:
        holder.kill()  # unshare --kill-child: the holder (pid 1 there) dies with it, as by kill -9
        holder.wait(timeout=60)
    wait_until(lambda: _flock_free(tmp_path / "fit.lock"), 30, what="the killed holder's flock to go")
    with pytest.warns(RunFolderWarning, match="no process holds it"), RunFolderLock(tmp_path):
        pass


@pytest.mark.skipif(not _unshare_works("-m"), reason="needs mount namespaces (unshare)")
def test_a_full_disk_at_start_is_one_line_and_leaves_no_lock(tmp_path):
    """The write check writes real bytes (an empty file fits on a full disk); the lock is written
    whole or not at all."""
    code = (
        "from lightning_wm.io import check_writable\nfrom lightning_wm.run_folder import RunFolderLock\n"
        "import sys\n"
        "for step in (lambda: check_writable('disk/run'), lambda: RunFolderLock('disk/run').acquire()):\n"
        "    try:\n        step()\n    except OSError as err:\n        print(type(err).__name__, err)\n"
    )
    script = (
        "mount -t tmpfs -o size=128k tmpfs disk && mkdir disk/run && "
        f'(head -c 1M /dev/zero > disk/fill 2>/dev/null; true) && {sys.executable} -c "$0" && ls -A disk/run'
    )
    (tmp_path / "disk").mkdir()
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, out.stdout  # two one-line errors, and an empty run folder
    assert all(line.startswith("DiskFullError") and "no space left" in line for line in lines)
    assert "Traceback" not in out.stderr


def test_a_new_run_over_old_checkpoints_is_refused_unless_overwrite(tmp_path):
    check_new_run(tmp_path / "missing", overwrite=False)  # no folder: nothing to protect
    (tmp_path / "last.ckpt").write_bytes(b"x")
    (tmp_path / "replay_rank0_step10.pt").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("kept")
    with pytest.raises(RunFolderError, match="--ckpt_path last.*--trainer.run_name.*--trainer.overwrite true"):
        check_new_run(tmp_path, overwrite=False)
    with pytest.warns(RunFolderWarning, match=r"overwrite true: deleted last\.ckpt, replay_rank0_step10\.pt from"):
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


def test_the_run_name_is_the_config_path_after_configs_from_any_working_folder(tmp_path, monkeypatch):
    from jsonargparse import Namespace

    def name(path):
        return derive_run_name(Namespace(config=[path], model=None))

    config = ROOT / "configs/dreamer/cartpole.yaml"
    monkeypatch.chdir(ROOT)
    assert name("configs/dreamer/cartpole.yaml") == name(str(config)) == "dreamer-cartpole"
    assert name("configs/worldmodels/cartpole_dreamer/controller.yaml") == "worldmodels-cartpole_dreamer-controller"
    monkeypatch.chdir(tmp_path)  # run from elsewhere, the config given by its absolute path
    assert name(str(config)) == "dreamer-cartpole"
    (tmp_path / "my.yaml").write_text("{}")
    assert name("my.yaml") == "my"  # outside any configs folder: the file's name
    assert derive_run_name(Namespace(config=None, model=Namespace(class_path="a.b.Dreamer"))) == "dreamer"
