"""The summaries of bench/muzero_cartpole.py on hand-made evaluation curves."""

import math

import pytest

from support.bench_scripts import load_bench_script


@pytest.fixture(scope="module")
def bench():
    return load_bench_script("muzero_cartpole.py")


def curve(returns, every=1000):
    return [
        {"env_steps": every * (i + 1), "games": 10 * (i + 1), "wall_s": 5.0 * (i + 1), "return_mean": r}
        for i, r in enumerate(returns)
    ]


def test_a_lucky_evaluation_is_first_but_not_held(bench):
    s = bench.summarize(curve([9, 500, 200, 480, 490, 300, 500, 500, 500]))
    assert s["solved"] and s["env_steps"] == 2000 and s["games"] == 20 and s["wall_s"] == 10.0
    assert not s["stays"] and s["min_after"] == 200
    assert s["held_env_steps"] == 9000  # 480, 490 then 300 break the run; 500 x 3 ends at 9,000
    assert s["stays_after_held"]
    # the last 2,000 env steps of a 9,000-step run: the evaluations after 7,000
    assert s["tail_mean"] == pytest.approx(500.0)
    assert s["last_return"] == 500 and s["last_env_steps"] == 9000


def test_a_dip_after_three_in_a_row_is_not_staying(bench):
    s = bench.summarize(curve([500, 480, 476, 400, 500]))
    assert s["held_env_steps"] == 3000 and not s["stays_after_held"] and not s["stays"]
    assert bench.summarize(curve([9, 500, 480, 476, 500]))["stays_after_held"]


def test_an_unsolved_run(bench):
    s = bench.summarize(curve([9, 100, 474.9]), tail_env_steps=1500)
    assert not s["solved"] and s["held_env_steps"] is None and "env_steps" not in s
    assert s["tail_mean"] == pytest.approx((100 + 474.9) / 2)


def test_median_counts_a_run_that_never_got_there_as_the_slowest(bench):
    median = bench.median_counting_unsolved
    assert median([3000, None, 1000]) == 3000
    assert median([4000, 1000, None, 2000]) == 3000
    assert math.isinf(median([1000, None, None, 2000]))
    assert math.isinf(median([None]))
    with pytest.raises(ValueError):
        median([])
