"""Central acting with env groups in their own processes (``acting.central_groups: processes``): the
groups (the recurrent state restarted per episode, at most one chunk ahead), ``kill -9`` of a group
and a stop request. ``test_central.py`` runs the rounds (both drivers) and what both group modes
share: the rows of a Collector, random prefill, permits in turn, ``kill -9`` of the learner and the
tiny CLI fits; ``test_inference_process.py`` the inference process."""

import os
import signal
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from lightning_wm.data.acting import ActorError, PoolActing
from lightning_wm.envs import EnvConfig
from lightning_wm.signals import RunStopped, clear_stop, request_stop

from support.actor_agents import StepCounter
from support.central import central_acting, take_chunks
from support.processes import alive, wait_gone, wait_until

ROOT = Path(__file__).resolve().parents[1]
SPACE = gym.spaces.Box(-10.0, 10.0, (3,), np.float32)


# -- groups in processes ------------------------------------------------------------------------------
def _central(env: EnvConfig, groups: int, envs: int, chunk: int, **settings) -> PoolActing:
    return central_acting(env, groups, envs, chunk, central_groups="processes", **settings)


@pytest.mark.slow
def test_groups_restart_the_state_per_episode_and_run_one_chunk_ahead_at_most():
    acting = _central(EnvConfig("CartPole-v1", max_episode_steps=5), groups=2, envs=3, chunk=8)
    try:
        acting.attach_agent(StepCounter(), version=4)
        served = acting.pool.slots.served
        wait_until(lambda: acting.pool.qsize() == 2, 60, what="a chunk of each group")
        assert int(served[1]) == 2 * 8, "no group starts a second chunk before the learner takes its first"
        chunks = take_chunks(acting, 1)
        wait_until(lambda: acting.pool.qsize() == 2, 60, what="that group's next chunk")
        assert int(served[1]) == 3 * 8
        chunks += take_chunks(acting, 7)
    finally:
        acting.close()
    assert {c.actor for c in chunks} == {0, 1}
    for chunk in chunks:
        rows = chunk.rows
        assert (rows["policy_version"] == 4).all() and chunk.version == 4
        steps, first, acted = rows["steps"], rows["is_first"], ~rows["is_last"]
        assert (steps[first & acted] == 0).all()
        for t in range(1, steps.shape[0]):  # one more step since the episode began, row after row
            going = ~first[t] & acted[t] & acted[t - 1]
            assert (steps[t][going] == steps[t - 1][going] + 1).all()
        assert first[1:].any(), "episodes of 5 steps began within the chunks"


@pytest.mark.slow
def test_a_killed_group_becomes_one_error_naming_it_and_close_leaves_no_process():
    acting = _central(EnvConfig("CartPole-v1"), groups=2, envs=2, chunk=4)
    acting.attach_agent(StepCounter(), version=0)
    try:
        take_chunks(acting, 4)
        pids = acting.pool.pids()  # the groups, then the inference process
        assert len(pids) == 3 and all(alive(p) for p in pids)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(
            ActorError, match=r"env group 1 \(central acting\) \(pid \d+\) was killed by signal SIGKILL"
        ):
            take_chunks(acting, 1000)
    finally:
        acting.close()
    assert wait_gone(pids, 30) == []


@pytest.mark.slow
def test_a_stop_request_ends_the_wait_and_close_ends_the_groups():
    acting = _central(EnvConfig("CartPole-v1"), groups=2, envs=2, chunk=4)
    acting.attach_agent(StepCounter(), version=0)
    try:
        take_chunks(acting, 1)
        pids = acting.pool.pids()
        request_stop(signal.SIGTERM)
        with pytest.raises(RunStopped):
            acting.next_chunk(timeout=30)
    finally:
        clear_stop()
        acting.close()
    assert wait_gone(pids, 30) == []
