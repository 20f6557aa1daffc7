"""The stability verdict of bench/dreamer_cartpole.py on hand-made evaluation curves."""

import math

import pytest

from support.bench_scripts import load_bench_script


@pytest.fixture(scope="module")
def bench():
    return load_bench_script("dreamer_cartpole.py")


@pytest.fixture(scope="module")
def verdict(bench):
    return bench.stability_verdict


def test_set_values_are_yaml_with_exponent_numbers(bench):
    # YAML 1.1 reads 3e-4 (no dot) as a string; Adam then fails long after the start
    assert bench._parse_value("3e-4") == 3e-4
    assert bench._parse_value("1.0") == 1.0 and bench._parse_value("true") is True
    assert bench._parse_value("categorical") == "categorical" and bench._parse_value("[1, 2]") == [1, 2]


def test_stable_run(verdict):
    # first at the target at index 2; later: 480, 470, 500, 490 -> median 485; final 490
    out = verdict([20.0, 300.0, 500.0, 480.0, 470.0, 500.0, 490.0], 475.0)
    assert out["stable"] and out["first"] == 2 and out["later"] == 4
    assert out["median_later"] == 485.0 and out["min_later"] == 470.0 and out["final"] == 490.0


def test_collapse_after_solving_is_not_stable(verdict):
    # the run: 500 once, then swings, ends at 285.5
    out = verdict([100.0, 500.0, 193.0, 470.0, 400.0, 285.5], 475.0)
    assert not out["stable"] and out["median_later"] == (285.5 + 400.0) / 2 and "median" in out["reason"]


def test_final_below_target_is_not_stable(verdict):
    out = verdict([500.0, 500.0, 500.0, 480.0, 200.0], 475.0)
    assert out["median_later"] == 490.0 and not out["stable"] and "final" in out["reason"]


def test_negative_target_and_unsolved_runs(verdict):
    assert verdict([-900.0, -190.0, -180.0, -195.0], -200.0)["stable"]  # Pendulum: higher is better
    never = verdict([10.0, 20.0], 475.0)
    assert not never["stable"] and never["first"] is None and math.isnan(never["median_later"])
    only_last = verdict([10.0, 480.0], 475.0)
    assert not only_last["stable"] and only_last["later"] == 0 and "keep-going" in only_last["reason"]


def test_set_overrides_reach_one_field_of_a_group_and_keep_the_others(bench):
    base = {"net": {"deter": 128, "hidden": 128}, "eval_policy": "mode"}
    out = bench._overrides(base, ["net.deter=16", "optim.actor.lr=3e-4", "eval_policy=sample"])
    assert out == {"net": {"deter": 16, "hidden": 128}, "optim": {"actor": {"lr": 3e-4}}, "eval_policy": "sample"}
    assert base["net"]["deter"] == 128, "the config's own dict is left alone"
