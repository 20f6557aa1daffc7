"""bench/actors.py: the settings it measures with and one short in-process measurement."""

import torch

from support.bench_scripts import load_bench_script

actors = load_bench_script("actors.py")


def test_envs_per_actor_replaces_the_default_in_process_too():
    assert actors.settings("cartpole")["envs_per_actor"] == 16
    chosen = actors.settings("cartpole", envs_per_actor=3)
    assert chosen["envs_per_actor"] == 3 and chosen["chunk_length"] == 64


def test_in_process_acts_a_chunk_per_gradient_step():
    torch.manual_seed(0)
    s = {**actors.settings("cartpole", envs_per_actor=3), "chunk_length": 4, "batch": 8}
    result = actors.in_process(s, seconds=0.05, prefill=12)
    assert result["fps"] > 0 and result["steps_per_s"] > 0
    # one chunk of 3 envs x 4 steps per gradient step: 12 rows for each step taken
    assert abs(result["fps"] / result["steps_per_s"] - 12) < 1e-6
