"""The stability rule of bench/impala_cartpole.py on hand-made evaluation curves (the lowest
evaluation after the first three in a row at the target), and its seeds run side by side
(``--jobs``, bench/benchlib.py's ``run_seeds``)."""

import math
import os
import sys
import threading
import time

import pytest

from support.bench_scripts import load_bench_script


def _history(returns):
    return [{"eval_return": r} for r in returns]


def test_lowest_evaluation_after_holding_the_target_three_times():
    lowest = load_bench_script("impala_cartpole.py").lowest_after_holding
    # 480 at index 1 is not held (a dip follows); 476, 500, 490 hold; afterwards 410 is the lowest
    assert lowest(_history([100, 480, 300, 476, 500, 490, 470, 410, 500]), 475) == 410
    assert lowest(_history([100, 480, 490]), 475) is None  # never three in a row
    assert math.isinf(lowest(_history([480, 490, 500]), 475))  # held at the very end: nothing after


def test_seeds_run_side_by_side_in_order_and_no_worker_outlives_a_failure(tmp_path):
    """``--jobs``: the records come back in the order of the seeds; when one seed fails the others'
    workers are terminated (or never started) before ``run_seeds`` returns."""
    benchlib = load_bench_script("benchlib.py")
    started = threading.Barrier(2, timeout=60)

    def both_at_once(seed):
        started.wait()  # returns only when the two seeds run at the same time
        return {"seed": seed}

    assert benchlib.run_seeds(both_at_once, [1, 0], jobs=2) == [{"seed": 1}, {"seed": 0}]
    pid_file = tmp_path / "pid"
    sleeper = [
        sys.executable,
        "-c",
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)",
    ]

    def seed_run(seed):
        if seed == 0:  # fails once seed 1's worker runs
            deadline = time.monotonic() + 60
            while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
                time.sleep(0.01)
            raise SystemExit("error: seed 0 failed")
        return benchlib.run_worker(sleeper, dict(os.environ))

    start = time.monotonic()
    with pytest.raises(SystemExit, match="seed 0 failed"):
        benchlib.run_seeds(seed_run, [0, 1], jobs=2)
    assert time.monotonic() - start < 60, "the sleeping worker was not terminated"
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)  # ended and reaped
    with pytest.raises(SystemExit, match="the bench is stopping"):
        benchlib.run_worker(sleeper, dict(os.environ))  # after end_workers nothing new starts
    record = [sys.executable, "-c", f"print({benchlib.RESULT_PREFIX!r} + '{{\"seed\": 2}}')"]
    assert benchlib.run_seeds(lambda seed: benchlib.run_worker(record, dict(os.environ)), [2]) == [{"seed": 2}]
