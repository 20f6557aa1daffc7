"""Stop requests from signals (the scheduler's SIGTERM, Slurm's SIGUSR1, Ctrl-C)."""

import os
import signal
import subprocess
import sys

import pytest

from lightning_wm import signals


def test_a_signal_becomes_a_stop_request_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with signals.stop_on_signals():
        assert signals.stop_requested() is None
        signals.check_stop()  # nothing pending: no exception
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.stop_requested() == signal.SIGTERM
        with pytest.raises(signals.RunStopped) as info:
            signals.check_stop()
        assert info.value.code == 128 + signal.SIGTERM and "SIGTERM" in str(info.value)
    assert signal.getsignal(signal.SIGTERM) is before
    signals.clear_stop()


def test_the_first_request_wins_and_a_second_ctrl_c_interrupts_at_once():
    with signals.stop_on_signals():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals.stop_requested() == signal.SIGINT  # the first request is the one reported
        with pytest.raises(signals.RunAborted) as info:
            os.kill(os.getpid(), signal.SIGINT)
        assert info.value.code == 130 and "second SIGINT" in str(info.value)
    signals.clear_stop()


def test_handlers_a_library_replaced_are_reclaimed_and_lightnings_wrapper_is_kept():
    """``ray.init()`` makes SIGTERM ``sys.exit(15)``; Lightning's composed handler calls ours."""
    assert signals.reclaim_signals() == []  # outside the block: nothing is ours to reclaim
    with signals.stop_on_signals():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
        assert signals.reclaim_signals() == ["SIGTERM"]
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.stop_requested() == signal.SIGTERM

        class _HandlersCompose:  # the name Lightning's wrapper has
            def __call__(self, signum, frame):
                pass

        signal.signal(signal.SIGUSR1, _HandlersCompose())
        assert signals.reclaim_signals() == []
    signals.clear_stop()


def test_nested_blocks_keep_a_pending_request():
    """``main`` installs the handlers for the whole command; a fit inside must not clear a stop
    that arrived while the model was being built."""
    with signals.stop_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        with signals.stop_on_signals():
            assert signals.stop_requested() == signal.SIGTERM
    signals.clear_stop()


def test_the_resource_tracker_survives_a_sigusr1_to_the_whole_group():
    """Slurm's ``--signal=USR1@120`` signals every process of the job: the tracker (started here as
    shared memory would start it) ignores SIGUSR1, and shared memory made after the signal needs no
    new tracker ("process died unexpectedly ... resources might leak")."""
    code = (
        "import os, signal, sys, time\n"
        "from multiprocessing import resource_tracker as rt, shared_memory\n"
        "from lightning_wm import signals\n"
        "with signals.stop_on_signals():\n"
        "    rt.ensure_running()\n"
        "    tracker = rt._resource_tracker._pid\n"
        "    status = open(f'/proc/{tracker}/status').read()\n"
        "    ignored = int(status.split('SigIgn:')[1].split()[0], 16)\n"
        "    print('ignores SIGUSR1', bool(ignored >> (signal.SIGUSR1 - 1) & 1), flush=True)\n"
        "    os.killpg(0, signal.SIGUSR1)\n"
        "    while signals.stop_requested() is None: time.sleep(0.01)\n"
        "    block = shared_memory.SharedMemory(create=True, size=16); block.close(); block.unlink()\n"
        "    print('tracker', rt._resource_tracker._pid == tracker)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, start_new_session=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["ignores SIGUSR1 True", "tracker True"], out.stdout
    assert "died unexpectedly" not in out.stderr and "leak" not in out.stderr


@pytest.mark.parametrize("command", ["validate", "test"])
def test_a_stop_during_validate_or_test_says_that_it_writes_nothing(command, tmp_path, monkeypatch):
    """``validate`` and ``test`` are Lightning's loops behind one checked runner: a stop inside
    either is the one line that names the command."""
    import pytorch_lightning as pl

    from lightning_wm.cli import Trainer

    def stopped(*args, **kwargs):
        raise signals.RunStopped(signal.SIGTERM)

    monkeypatch.setattr(pl.Trainer, command, stopped)
    trainer = Trainer(logger=False, default_root_dir=str(tmp_path), enable_progress_bar=False)
    with pytest.raises(signals.RunStopped) as stop:
        getattr(trainer, command)(None, ckpt_path=None)
    assert str(stop.value) == f"stopped by SIGTERM during {command}; it writes nothing, so nothing was lost"
