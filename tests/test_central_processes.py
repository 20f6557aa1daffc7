"""Central acting with env groups in their own processes (``acting.central_groups: processes``):
the shared-memory exchange and the inference loop (one call for every group, the deadline, the
recurrent state kept per group and restarted per episode), the groups (at most one chunk ahead,
errors naming the group or the policy, hangs) and ``kill -9`` of a group. ``test_central.py`` runs
what both group modes share for each: the rows of a Collector, random prefill, permits in turn,
``kill -9`` of the learner and the tiny CLI fits."""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from lightning_wm.data.acting import ActorError, CentralActing
from lightning_wm.data.acting.inference import SWITCH_INTERVAL_S
from lightning_wm.data.acting.shared_inference import InferenceLoop, SharedMemoryClient, make_slots
from lightning_wm.envs import EnvConfig
from lightning_wm.signals import RunStopped, clear_stop, request_stop

from support.actor_agents import FaultyPolicy, StepCounter
from support.central import central_acting, take_chunks
from support.processes import alive, wait_gone, wait_until

ROOT = Path(__file__).resolve().parents[1]
SPACE = gym.spaces.Box(-10.0, 10.0, (3,), np.float32)


# -- the exchange and the loop, with threads as the groups -----------------------------------------
def _ask_all(clients, obs, starts, explore=True):
    """Every client asks at once (one thread each); returns their answers by group."""
    answers, threads = {}, []

    def ask(client):
        answers[client.group] = client.act(obs[client.group], starts[client.group], explore)

    for client in clients:
        threads.append(threading.Thread(target=ask, args=(client,)))
        threads[-1].start()
    for thread in threads:
        thread.join(timeout=30)
    return answers


def test_one_call_answers_every_group_and_each_group_keeps_its_own_recurrent_state():
    agent = StepCounter()
    slots = make_slots(agent, SPACE, groups=3, envs=2, explore=True)
    versions = []
    clients = [SharedMemoryClient(slots, g, threading.Event(), on_act=versions.append) for g in range(3)]
    loop = InferenceLoop(agent, slots, deadline_s=30.0, version=lambda: 7)
    try:
        obs = {g: torch.full((2, 3), float(g)) for g in range(3)}
        fresh = {g: clients[g].initial_state(2) for g in range(3)}
        first = _ask_all(clients, obs, fresh)
        assert loop.calls == 1 and loop.requests == 3, "the three groups in one call"
        assert versions == [7, 7, 7]
        for g, (action, flags, extras) in first.items():
            assert action.tolist() == [0, 0] and extras["steps"].tolist() == [0, 0]
            torch.testing.assert_close(extras["obs_sum"], torch.full((2,), 3.0 * g))
            assert flags.tolist() == [False, False], "no env starts an episode on the next step"
        clients[2].pause()  # group 2 waits for the learner: the next rounds do not wait for it
        starts = {0: torch.tensor([False, True]), 1: torch.tensor([False, False])}  # group 0's env 1 restarts
        for _ in range(2):
            second = _ask_all(clients[:2], obs, starts)
        assert second[0][2]["steps"].tolist() == [2, 0], "env 1 of group 0 restarted its count"
        assert second[1][2]["steps"].tolist() == [2, 2], "group 1 kept its own state"
        assert loop.calls == 3 and loop.requests == 7
    finally:
        loop.close()


def test_a_group_that_does_not_ask_delays_the_others_by_the_deadline_only():
    agent = StepCounter()
    slots = make_slots(agent, SPACE, groups=2, envs=1, explore=True)
    clients = [SharedMemoryClient(slots, g, threading.Event()) for g in range(2)]
    loop = InferenceLoop(agent, slots, deadline_s=0.3, version=lambda: 0)
    try:
        obs = {g: torch.zeros(1, 3) for g in range(2)}
        _ask_all(clients, obs, {g: clients[g].initial_state(1) for g in range(2)})
        start = time.monotonic()
        clients[0].act(obs[0], torch.zeros(1, dtype=torch.bool), True)  # group 1 is active but silent
        assert 0.3 <= time.monotonic() - start < 10.0
        assert loop.requests == 3
    finally:
        loop.close()


def test_a_stop_releases_a_waiting_client_and_an_agent_error_stops_the_loop():
    slots = make_slots(StepCounter(), SPACE, groups=1, envs=1, explore=True)
    stop = threading.Event()
    client = SharedMemoryClient(slots, 0, stop)
    outcome = []

    def ask():
        try:
            client.act(torch.zeros(1, 3), client.initial_state(1), True)
        except Exception as error:  # noqa: BLE001 - the test reads it
            outcome.append(error)

    thread = threading.Thread(target=ask)
    thread.start()  # no loop answers
    wait_until(lambda: int(slots.asked[0]) == 1, 30, what="the request")
    stop.set()
    thread.join(timeout=30)
    assert type(outcome[0]).__name__ == "InferenceStopped"

    class Broken(StepCounter):
        def act(self, obs, state, explore):
            raise ValueError("bad act")

    loop = InferenceLoop(Broken(), slots, deadline_s=0.0, version=lambda: 0)
    try:
        threading.Thread(target=ask, daemon=True).start()
        wait_until(lambda: loop.error is not None, 30, what="the loop's error")
        assert "ValueError: bad act" in loop.traceback
    finally:
        stop.set()
        loop.close()


# -- groups in processes ------------------------------------------------------------------------------
def _central(env: EnvConfig, groups: int, envs: int, chunk: int, **settings) -> CentralActing:
    return central_acting(env, groups, envs, chunk, central_groups="processes", **settings)


@pytest.mark.slow
def test_groups_restart_the_state_per_episode_and_run_one_chunk_ahead_at_most():
    acting = _central(EnvConfig("CartPole-v1", max_episode_steps=5), groups=2, envs=3, chunk=8)
    switch_interval = sys.getswitchinterval()
    try:
        acting.attach_agent(StepCounter(), version=4)
        server = acting.pool.server
        wait_until(lambda: acting.pool.qsize() == 2, 60, what="a chunk of each group")
        assert server.requests == 2 * 8, "no group starts a second chunk before the learner takes its first"
        assert sys.getswitchinterval() <= SWITCH_INTERVAL_S
        chunks = take_chunks(acting, 1)
        wait_until(lambda: acting.pool.qsize() == 2, 60, what="that group's next chunk")
        assert server.requests == 3 * 8
        chunks += take_chunks(acting, 7)
    finally:
        acting.close()
    assert sys.getswitchinterval() == switch_interval, "restored when acting stops"
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
def test_an_agent_error_or_hang_becomes_one_error_naming_the_central_inference():
    acting = _central(EnvConfig("CartPole-v1"), groups=2, envs=2, chunk=2)
    try:
        acting.attach_agent(FaultyPolicy("raise", at=6), version=0)  # the probe call was the first
        with pytest.raises(ActorError, match=r"central inference \(.*\) raised:(.|\n)*policy exploded"):
            take_chunks(acting, 50)
        assert acting.pool._closed
    finally:
        acting.close()
    acting = _central(EnvConfig("CartPole-v1"), groups=1, envs=2, chunk=2, timeout_s=1.0)
    try:
        acting.attach_agent(FaultyPolicy("hang", at=3), version=0)
        loop = acting.pool.server
        with pytest.raises(ActorError, match=r"central inference hung: one policy call has run for"):
            take_chunks(acting, 50)
    finally:
        acting.close()
        FaultyPolicy.hangs_released.set()  # the hung call returns and the loop's thread ends
    try:
        wait_until(lambda: not loop.running, 30, what="the inference thread's end after the hang")
    finally:
        FaultyPolicy.hangs_released.clear()


@pytest.mark.slow
def test_a_killed_group_becomes_one_error_naming_it_and_close_leaves_no_process():
    acting = _central(EnvConfig("CartPole-v1"), groups=2, envs=2, chunk=4)
    acting.attach_agent(StepCounter(), version=0)
    try:
        take_chunks(acting, 4)
        pids, loop = acting.pool.pids(), acting.pool.server
        assert len(pids) == 2 and all(alive(p) for p in pids)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(
            ActorError, match=r"env group 1 \(central acting\) \(pid \d+\) was killed by signal SIGKILL"
        ):
            take_chunks(acting, 1000)
    finally:
        acting.close()
    assert wait_gone(pids, 30) == []
    assert not loop.running


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
