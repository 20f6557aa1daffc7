"""Stop requests from signals (the scheduler's SIGTERM, Slurm's SIGUSR1, Ctrl-C)."""

import os
import signal

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
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    signals.clear_stop()
