"""Central acting (``acting.policy: central``): batched inference (one call for every group, the
deadline, pytree splitting), env groups acting through it (recurrent state resets,
the same rows as a Collector, errors, stop requests), clean-up (threads, worker processes, after
``kill -9`` of the learner too), and tiny CLI fits of IMPALA, MuZero and Dreamer."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_wm.cli import main
from lightning_wm.data.acting import ActorError
from lightning_wm.data.acting.central import SWITCH_INTERVAL_S, ChunkPermits
from lightning_wm.data.acting.inference import InferenceClient, Rounds, acting_view, make_slots
from lightning_wm.data.collector import Collector
from lightning_wm.data.settings import ActingSettings
from lightning_wm.envs import EnvConfig, make_vector_env
from lightning_wm.seeding import env_seeds
from lightning_wm.signals import RunStopped, clear_stop, request_stop

from support.actor_agents import FaultyPolicy, StepCounter
from support.central import central_acting, take_chunks
from support.presets import (
    IMPALA_TINY,
    MUZERO_DATA_TINY,
    MUZERO_TINY,
    REPLAY_DATA_TINY,
    UNROLL_DATA_TINY,
    data_overrides,
    model_overrides,
)
from support.processes import alive, shm_left_behind, wait_gone, wait_until

ROOT = Path(__file__).resolve().parents[1]
CENTRAL = ["--data.init_args.acting.num_actors", "2", "--data.init_args.acting.policy", "central"]
# where the groups run in the CLI fits: threads of the learner, or processes exchanging through shared memory
# (with the policy in a process of its own)
GROUPS = pytest.mark.parametrize("groups", ["threads", "processes"])
# the same for tests of the fast lane: groups in processes spawn (seconds each), so that variant is slow
BOTH_GROUPS = pytest.mark.parametrize("groups", ["threads", pytest.param("processes", marks=pytest.mark.slow)])


def _where(groups: str) -> list[str]:
    """The acting option that puts the groups where ``groups`` says."""
    return ["--data.init_args.acting.central_groups", groups]


SPACE = gym.spaces.Box(-10.0, 10.0, (3,), np.float32)
# who drives the rounds: the groups themselves (groups as threads) or a serving loop (the inference process's body)
DRIVERS = pytest.mark.parametrize("driver", ["groups", "served"])


def _exchange(agent, groups: int, envs: int, deadline_s: float, driver: str, version=lambda: 0):
    """Slots, clients and rounds for ``groups`` groups (threads here) of ``envs`` envs; ``stop`` ends a serving loop."""
    slots = make_slots(agent, SPACE, groups, envs, threading.Semaphore)
    rounds, stop = Rounds(agent, slots, deadline_s, version), threading.Event()
    drive = rounds if driver == "groups" else None
    clients = [InferenceClient(slots, g, stop, rounds=drive) for g in range(groups)]
    if driver == "served":
        threading.Thread(target=rounds.serve, args=(stop,), daemon=True).start()
    return slots, clients, stop


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


@DRIVERS
def test_one_call_answers_every_group_and_each_group_keeps_its_own_recurrent_state(driver):
    agent = StepCounter()
    slots, clients, stop = _exchange(agent, 3, 2, 30.0, driver, version=lambda: 7)
    versions = []
    for client in clients:
        client.on_act = versions.append
    try:
        obs = {g: torch.full((2, 3), float(g)) for g in range(3)}
        first = _ask_all(clients, obs, {g: clients[g].initial_state(2) for g in range(3)})
        assert slots.served.tolist() == [1, 3], "the three groups in one call"
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
        assert slots.served.tolist() == [3, 7]
    finally:
        stop.set()


@DRIVERS
def test_a_group_that_does_not_ask_delays_the_others_by_the_deadline_only(driver):
    slots, clients, stop = _exchange(StepCounter(), 2, 1, 0.3, driver)
    try:
        obs = {g: torch.zeros(1, 3) for g in range(2)}
        _ask_all(clients, obs, {g: clients[g].initial_state(1) for g in range(2)})
        start = time.monotonic()
        clients[0].act(obs[0], torch.zeros(1, dtype=torch.bool), True)  # group 1 is active but silent
        assert 0.3 <= time.monotonic() - start < 10.0
        assert int(slots.served[1]) == 3
    finally:
        stop.set()


def test_a_stop_releases_a_waiting_client_and_an_agent_error_reaches_the_group_that_called():
    slots = make_slots(StepCounter(), SPACE, 1, 1, threading.Semaphore)
    stop = threading.Event()
    client = InferenceClient(slots, 0, stop)  # nothing answers
    outcome = []

    def ask(client):
        try:
            client.act(torch.zeros(1, 3), client.initial_state(1), True)
        except Exception as error:  # noqa: BLE001 - the test reads it
            outcome.append(error)

    thread = threading.Thread(target=ask, args=(client,))
    thread.start()
    wait_until(lambda: int(slots.asked[0]) == 1, 30, what="the request")
    stop.set()
    thread.join(timeout=30)
    assert type(outcome[0]).__name__ == "InferenceStopped"

    class Broken(StepCounter):
        def act(self, obs, state, explore):
            if obs.abs().sum() > 0:  # not the probe call on zeros
                raise ValueError("bad act")
            return super().act(obs, state, explore)

    _, (client,), _ = _exchange(Broken(), 1, 1, 0.0, "groups")
    with pytest.raises(ValueError, match="bad act"):
        client.act(torch.ones(1, 3), client.initial_state(1), True)


def test_acting_view_shares_the_tensors_not_the_mode():
    module = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 1)))
    view = acting_view(module).eval()
    assert module.training and module[1].training and not view.training and not view[1][0].training
    with torch.no_grad():
        module[1][0].weight.add_(1.0)  # an optimizer step, in place
    assert view[1][0].weight is module[1][0].weight
    torch.testing.assert_close(view(torch.ones(1, 2)), module(torch.ones(1, 2)))
    learner = pl.LightningModule()
    learner._trainer = SimpleNamespace(global_step=5)  # what a fit attaches
    assert acting_view(learner).global_step == 5, "schedules read the live step"


def test_settings_refuse_ray_and_unknown_policies():
    with pytest.raises(ValueError, match="policy: central runs with backend local"):
        ActingSettings(num_actors=2, policy="central", backend="ray")
    with pytest.raises(ValueError, match=r"acting\.policy must be one of \['copies', 'central'\]"):
        ActingSettings(num_actors=2, policy="shared")
    with pytest.raises(ValueError, match="deadline_ms must be >= 0"):
        ActingSettings(policy="central", deadline_ms=-1)
    with pytest.raises(ValueError, match=r"acting\.central_groups must be one of \['threads', 'processes'\]"):
        ActingSettings(policy="central", central_groups="fibers")
    with pytest.raises(ValueError, match="central_inference: thread beside central_groups: processes was removed"):
        ActingSettings(num_actors=2, policy="central", central_groups="processes", central_inference="thread")


def test_recurrent_state_restarts_with_each_episode_in_every_group():
    acting = central_acting(EnvConfig("CartPole-v1", max_episode_steps=5), groups=2, envs=3, chunk=8)
    switch_interval = sys.getswitchinterval()
    try:
        acting.attach_agent(StepCounter(), version=4)
        chunks = take_chunks(acting, 6)
        assert 1.0 <= acting.metrics()["actors/groups_per_act"] <= 2.0
        assert sys.getswitchinterval() <= SWITCH_INTERVAL_S
    finally:
        acting.close()
    assert sys.getswitchinterval() == switch_interval, "restored when acting stops"
    assert {c.actor for c in chunks} == {0, 1}
    for chunk in chunks:
        rows = chunk.rows
        assert (rows["policy_version"] == 4).all() and chunk.version == 4
        steps, first = rows["steps"], rows["is_first"]
        acted = ~rows["is_last"]  # last rows take no action (their extras are zeroed)
        assert (steps[first & acted] == 0).all()
        for t in range(1, steps.shape[0]):  # one more step since the episode began, row after row
            going = ~first[t] & acted[t] & acted[t - 1]
            assert (steps[t][going] == steps[t - 1][going] + 1).all()
        assert first[1:].any(), "episodes of 5 steps began within the chunks"


def test_each_group_runs_at_most_one_chunk_ahead_of_the_learner():
    acting = central_acting(EnvConfig("CartPole-v1"), groups=2, envs=3, chunk=4)
    made = lambda: sum(w.collector.stats.env_steps for w in acting.pool.groups.workers)  # noqa: E731
    try:
        acting.attach_agent(StepCounter(), version=0)
        wait_until(lambda: acting.pool.qsize() == 2, 30, what="a chunk of each group")
        assert made() == 2 * 4 * 3, "no third chunk starts before the learner takes one"
        take_chunks(acting, 1)
        wait_until(lambda: acting.pool.qsize() == 2, 30, what="the next chunk")
        assert made() == 3 * 4 * 3
    finally:
        acting.close()


def test_permits_go_round_the_groups_and_one_per_group_keeps_each_group_one_chunk_ahead():
    permits = ChunkPermits(3, 1, threading.Semaphore)
    free = lambda: [p.acquire(blocking=False) for p in permits.semaphores]  # noqa: E731 - takes what is there
    assert free() == [True, False, False]
    for taken, turn in [(0, 1), (1, 2), (2, 0)]:
        permits.taken(taken)
        assert free() == [g == turn for g in range(3)], "the next group in turn, one permit out"
    permits = ChunkPermits(2, 5, threading.Semaphore)  # more permits than groups: one per group
    assert free() == [True, True]
    permits.taken(1)
    assert free() == [False, True], "a group's permit comes back to it"


@BOTH_GROUPS
def test_one_permit_makes_the_groups_take_turns_with_one_chunk_ahead(groups):
    acting = central_acting(EnvConfig("CartPole-v1"), groups=2, envs=2, chunk=4, queue_size=1, central_groups=groups)
    try:
        acting.attach_agent(StepCounter(), version=0)
        chunks = []
        for count in range(1, 5):
            wait_until(lambda: acting.pool.qsize() == 1, 60, what="the chunk in turn")  # noqa: B023
            assert int(acting.pool.slots.served[1]) == count * 4, "one chunk ahead, all groups together"
            chunks += take_chunks(acting, 1)
    finally:
        acting.close()
    assert [c.actor for c in chunks] == [0, 1, 0, 1]


@BOTH_GROUPS
def test_one_sync_group_makes_the_rows_of_a_collector_with_its_seeds(groups):
    env = EnvConfig("CartPole-v1", seed=3, max_episode_steps=7)
    acting = central_acting(env, groups=1, envs=4, chunk=10, central_groups=groups)
    try:
        acting.attach_agent(StepCounter(), version=0)
        central = take_chunks(acting, 3)
    finally:
        acting.close()
    vec = make_vector_env(EnvConfig(**{**vars(env), "num_envs": 4}))
    try:
        collector = Collector(vec, StepCounter(), seeds=env_seeds(3, 4, "train", 0, 0))
        collector.policy_version = 0
        reference = [collector.collect_chunk(10) for _ in range(3)]
    finally:
        vec.close()
    for mine, theirs in zip(central, reference):
        assert mine.rows.keys() == theirs.keys()
        for key in theirs:
            np.testing.assert_array_equal(mine.rows[key], theirs[key], err_msg=key)


@BOTH_GROUPS
def test_random_prefill_comes_first_with_its_version(groups):
    acting = central_acting(EnvConfig("CartPole-v1"), groups=2, envs=2, chunk=4, central_groups=groups)
    try:
        acting.attach_agent(StepCounter(), version=0, random_rows=16)  # 4 vector steps per group
        chunks = []
        while len({c.actor for c in chunks if c.version == 0}) < 2:  # a policy chunk of each group
            chunks += take_chunks(acting, 1)
            assert len(chunks) < 200
    finally:
        acting.close()
    for group in (0, 1):
        versions = [c.version for c in chunks if c.actor == group]
        assert versions[0] == -1 and set(versions[1:]) == {0}, versions


def test_an_agent_error_becomes_one_error_naming_the_group():
    acting = central_acting(EnvConfig("CartPole-v1"), groups=2, envs=2, chunk=2)
    try:
        acting.attach_agent(FaultyPolicy("raise", at=4), version=0)
        with pytest.raises(ActorError, match=r"env group \d \(central acting\) raised:(.|\n)*policy exploded"):
            take_chunks(acting, 50)
    finally:
        acting.close()


def test_a_stop_request_ends_the_wait_and_the_groups(monkeypatch):
    acting = central_acting(EnvConfig("CartPole-v1"), groups=2, envs=2, chunk=4)
    acting.attach_agent(StepCounter(), version=0)
    try:
        take_chunks(acting, 1)
        request_stop(signal.SIGTERM)
        with pytest.raises(RunStopped):
            acting.next_chunk(timeout=30)
        threads = acting.pool.groups.threads
        wait_until(lambda: not any(t.is_alive() for t in threads), 30, what="the group threads' end")
    finally:
        clear_stop()
        acting.close()
    assert not any(t.name.startswith("lightning_wm-") for t in threading.enumerate())


@pytest.mark.slow
def test_close_leaves_no_thread_and_no_worker_process():
    acting = central_acting(EnvConfig("CartPole-v1", vectorization="async"), groups=2, envs=2, chunk=4)
    acting.attach_agent(StepCounter(), version=0)
    take_chunks(acting, 4)
    pids = acting.pool.pids()
    assert len(pids) == 4 and all(alive(p) for p in pids)
    acting.close()
    assert acting.pool is None
    assert wait_gone(pids, 30) == []
    assert not any(t.name.startswith("lightning_wm-") for t in threading.enumerate())


@pytest.mark.slow
def test_a_killed_env_worker_becomes_one_error_naming_the_group():
    acting = central_acting(EnvConfig("CartPole-v1", vectorization="async"), groups=2, envs=2, chunk=4)
    acting.attach_agent(StepCounter(), version=0)
    try:
        take_chunks(acting, 2)
        victim = acting.pool.groups.workers[1].collector.env.processes[0]
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(ActorError, match=r"env group 1 \(central acting\) raised"):
            take_chunks(acting, 1000)
        pids = [p for p in acting.pool.pids() if p != victim.pid] if acting.pool else []
    finally:
        acting.close()
    assert wait_gone(pids, 30) == []


LEARNER = textwrap.dedent(
    """
    import os, sys
    sys.path[:0] = [{root!r}, {tests!r}]
    from lightning_wm.data.acting import PoolActing
    from lightning_wm.data.settings import ActingSettings
    from lightning_wm.envs import EnvConfig
    from support.actor_agents import StepCounter

    if __name__ == "__main__":
        acting = PoolActing(
            EnvConfig("CartPole-v1", vectorization={vectorization!r}),
            ActingSettings(
                num_actors=2, envs_per_actor=2, policy="central", central_groups={groups!r}, central_inference={inference!r}
            ),
            4,
        )
        acting.setup(0)
        acting.attach_agent(StepCounter(), 0)
        seen = set()
        while len(seen) < 2:  # both groups acting
            seen.add(acting.next_chunk(timeout=120).actor)
        with open({pids!r} + ".tmp", "w") as f:
            f.write(" ".join(str(p) for p in acting.pool.pids()))
        os.replace({pids!r} + ".tmp", {pids!r})
        while True:
            acting.next_chunk(timeout=1.0)
    """
)


def test_shm_left_behind_counts_an_unmapped_new_entry_but_not_one_a_live_process_maps():
    import mmap

    before = set(os.listdir("/dev/shm"))
    held, dropped = Path(f"/dev/shm/lwm_test_held_{os.getpid()}"), Path(f"/dev/shm/lwm_test_dropped_{os.getpid()}")
    try:
        for path in (held, dropped):
            path.write_bytes(b"\0" * 4096)
        with held.open("r+b") as f, mmap.mmap(f.fileno(), 4096):
            assert shm_left_behind(before) == {dropped.name}
        assert shm_left_behind(before) == {held.name, dropped.name}
    finally:
        held.unlink(missing_ok=True)
        dropped.unlink(missing_ok=True)
    assert shm_left_behind(before) == set()


@pytest.mark.slow
@pytest.mark.parametrize(
    "groups, vectorization, inference, processes",
    [("threads", "async", None, 4), ("processes", "sync", None, 3)],
    ids=["env-workers-of-threads", "group-and-inference-processes"],
)
def test_kill_9_of_the_learner_leaves_no_process_and_nothing_in_dev_shm(
    tmp_path, groups, vectorization, inference, processes
):
    pids_file = tmp_path / "pids.txt"
    script = tmp_path / "learner.py"
    script.write_text(
        LEARNER.format(
            root=str(ROOT),
            tests=str(ROOT / "tests"),
            pids=str(pids_file),
            groups=groups,
            vectorization=vectorization,
            inference=inference,
        )
    )
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([sys.executable, str(script)], stderr=(tmp_path / "stderr.txt").open("w"))
    try:
        wait_until(lambda: pids_file.exists() or proc.poll() is not None, 120, what="the learner acting")
        assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()
        workers = [int(p) for p in pids_file.read_text().split()]
        assert len(workers) == processes and all(alive(p) for p in workers)
        proc.kill()  # SIGKILL: nothing of the learner runs any more
        proc.wait(timeout=30)
        assert wait_gone(workers, 30) == [], "processes outlived the learner"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # gymnasium unlinks its shared memory at creation; multiprocessing's resource tracker unlinks the
    # semaphores' names once the learner is gone (entries a parallel test's live processes map are not ours)
    wait_until(lambda: not shm_left_behind(shm_before), 30, what="nothing left behind in /dev/shm")


# -- tiny CLI fits ---------------------------------------------------------------------------------
def _logged(cli) -> dict:
    return {k: float(v) for k, v in cli.trainer.logged_metrics.items()}


@pytest.mark.slow
@GROUPS
def test_cli_fit_impala_cartpole_with_central_acting(groups):
    vectorization = "async" if groups == "threads" else "sync"  # threads: their envs in worker processes
    args = [
        "fit",
        "--config",
        str(ROOT / "configs/impala/cartpole.yaml"),
        *"--trainer.max_steps 4 --trainer.val_check_interval 4 --trainer.enable_progress_bar false".split(),
        *"--trainer.log_every_n_steps 1 --trainer.run_name run".split(),
        *data_overrides(UNROLL_DATA_TINY),
        *model_overrides(IMPALA_TINY),
        *CENTRAL,
        *f"--data.init_args.env.vectorization {vectorization}".split(),
        *_where(groups),
    ]
    cli = main(args=args)
    logged = _logged(cli)
    assert cli.trainer.global_step == 4
    for key in ("actors/frames_per_s", "actors/policy_lag", "actors/groups_per_act", "train/rho_mean", "val/return"):
        assert key in logged, key
    assert cli.datamodule.acting.pool is None, "the groups were stopped"


@pytest.mark.slow
@GROUPS
def test_cli_fit_muzero_cartpole_with_central_acting(groups):
    args = [
        "fit",
        "--config",
        str(ROOT / "configs/muzero/cartpole.yaml"),
        *"--trainer.max_steps 40 --trainer.val_check_interval 40 --trainer.enable_progress_bar false".split(),
        *"--trainer.log_every_n_steps 1 --trainer.run_name run".split(),
        *model_overrides(MUZERO_TINY),
        *data_overrides(MUZERO_DATA_TINY),
        *CENTRAL,
        *"--data.init_args.acting.chunk_length 8".split(),
        *_where(groups),
    ]
    cli = main(args=args)
    # at replay ratio 0.5, 40 steps take 80 rows: the learner waits for searched rows past the 40 of the prefill
    assert cli.trainer.global_step == 40
    buffer = cli.datamodule.buffer
    probs, version = buffer.column("visit_probs"), buffer.column("policy_version")
    stored = buffer.generation(np.arange(buffer.num_streams)[:, None], np.arange(buffer.cap_per_stream)[None]) >= 0
    searched = stored & (probs.sum(-1) > 0)  # rows the search acted (not the prefill, not last rows)
    assert searched.sum() > 0
    np.testing.assert_allclose(probs[searched].sum(-1), 1.0, rtol=1e-5)
    assert (version[searched] >= 0).all()
    assert "actors/policy_lag" in _logged(cli)
    assert cli.model.training, "acting's eval mode stayed in its view"


@pytest.mark.slow
@GROUPS
def test_cli_fit_dreamer_cartpole_with_central_acting(groups):
    args = [
        "fit",
        "--config",
        str(ROOT / "configs/dreamer/cartpole.yaml"),
        "--config",
        str(ROOT / "configs/dreamer/presets/debug.yaml"),
        *"--trainer.max_steps 4 --trainer.val_check_interval 4 --trainer.enable_progress_bar false".split(),
        *"--trainer.log_every_n_steps 1 --trainer.run_name run".split(),
        *data_overrides(REPLAY_DATA_TINY),
        *CENTRAL,
        *"--data.init_args.acting.chunk_length 8".split(),
        *_where(groups),
    ]
    cli = main(args=args)
    assert cli.trainer.global_step == 4
    logged = _logged(cli)
    for key in ("actors/frames_per_s", "train/loss_model", "val/return"):
        assert key in logged, key
    versions = cli.datamodule.buffer.column("policy_version")
    assert (versions >= 0).any() and (versions == -1).any(), "rows of the prefill and of the live module"
