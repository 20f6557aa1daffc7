"""The stability rule of bench/impala_cartpole.py on hand-made evaluation curves: the lowest
evaluation after the first three in a row at the target."""

import math

from support.bench_scripts import load_bench_script


def _history(returns):
    return [{"eval_return": r} for r in returns]


def test_lowest_evaluation_after_holding_the_target_three_times():
    lowest = load_bench_script("impala_cartpole.py").lowest_after_holding
    # 480 at index 1 is not held (a dip follows); 476, 500, 490 hold; afterwards 410 is the lowest
    assert lowest(_history([100, 480, 300, 476, 500, 490, 470, 410, 500]), 475) == 410
    assert lowest(_history([100, 480, 490]), 475) is None  # never three in a row
    assert math.isinf(lowest(_history([480, 490, 500]), 475))  # held at the very end: nothing after
