"""bench/minatar.py's pure parts: when it evaluates, and the summary it prints from run records."""

import pytest

from support.bench_scripts import load_bench_script

bench = load_bench_script("minatar.py")


def _run(system, seed, points):
    history = [{"frames": f, "seconds": s, "eval_return": r, "eval_std": 0.0} for f, s, r in points]
    return {"system": system, "game": "breakout", "seed": seed, "history": history, "frames": history[-1]["frames"],
            "frames_per_s": 1000.0}  # fmt: skip


def test_eval_schedule_evaluates_past_each_multiple_and_at_the_end():
    schedule = bench.EvalSchedule(every=100, frames=350, seconds=60.0)
    due = [f for f in (40, 99, 120, 130, 260, 290, 330) if schedule.due(f, 1.0)]
    assert due == [120, 260, 330]  # the first step past each multiple of 100 (past 200: 260)
    assert not schedule.over(340, 59.0) and schedule.due(352, 2.0) and schedule.over(352, 2.0)
    assert schedule.due(10, 61.0), "the time budget ends the run with an evaluation"
    with pytest.raises(ValueError, match="--eval-every"):
        bench.EvalSchedule(0, 10, 1.0)


def test_summary_means_over_seeds_at_each_point_and_frames_to_reach():
    runs = [
        _run("impala", 1, [(150, 12.0, 2.0), (240, 22.0, 6.0), (390, 40.0, 8.0)]),  # RLlib-like: late points
        _run("impala", 0, [(101, 10.0, 1.0), (205, 20.0, 3.0), (301, 30.0, 5.0)]),
    ]
    assert bench.value_at(runs[0]["history"], 200, 100) == 6.0
    assert bench.value_at(runs[1]["history"], 400, 100) is None
    assert bench.frames_to_reach(runs[1]["history"], 3.0) == 205
    assert bench.frames_to_reach(runs[1]["history"], 9.0) is None
    table = bench.summary(runs, every=100, targets=[4.0])  # per-seed values in seed order
    assert "| impala | breakout | 2 | 100 | 1.50 (1.00, 2.00) | 11 s |" in table
    assert "| impala | breakout | 2 | 200 | 4.50 (3.00, 6.00) | 21 s |" in table
    assert "| impala | breakout | 2 | 300 | 6.50 (5.00, 8.00) | 35 s |" in table
    assert "| impala | breakout | 4 | 301, 240 |" in table


def test_runs_with_other_settings_are_summarised_apart():
    shipped = _run("dyna", 0, [(101, 10.0, 1.0)])
    constant_lr = {
        **_run("dyna", 0, [(101, 10.0, 3.0)]),
        "sets": [["model.init_args.policy.init_args.optim.lr", "0.002"]],
    }
    table = bench.summary([shipped, constant_lr], every=100, targets=[])
    assert "| dyna | breakout | 1 | 100 | 1.00 (1.00) |" in table
    assert "| dyna (policy.optim.lr 0.002) | breakout | 1 | 100 | 3.00 (3.00) |" in table
