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

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_wm.cli import main
from lightning_wm.data.acting import ActorError
from lightning_wm.data.acting.central import SWITCH_INTERVAL_S
from lightning_wm.data.acting.inference import BatchedInference, InferenceStopped, acting_view
from lightning_wm.data.acting.permits import ChunkPermits
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
from support.processes import alive, wait_gone, wait_until

ROOT = Path(__file__).resolve().parents[1]
CENTRAL = ["--data.init_args.acting.num_actors", "2", "--data.init_args.acting.policy", "central"]
# where the groups run in the CLI fits: threads of the learner, or processes exchanging through shared memory
# (``inference-process``: groups in processes and the policy in a process of its own, central_inference: process)
GROUPS = pytest.mark.parametrize("groups", ["threads", "processes", "inference-process"])
# the same for tests of the fast lane: groups in processes spawn (seconds each), so that variant is slow
BOTH_GROUPS = pytest.mark.parametrize("groups", ["threads", pytest.param("processes", marks=pytest.mark.slow)])


def _where(groups: str) -> list[str]:
    """The acting options that put the groups (and the policy) where ``groups`` says."""
    if groups == "inference-process":
        return (
            "--data.init_args.acting.central_groups processes --data.init_args.acting.central_inference process".split()
        )
    return ["--data.init_args.acting.central_groups", groups]


class Recording:
    """A fake agent: records the batch size of every call; action ``obs[:, 0]``, state ``{"h": h + 1,
    "pair": (h, -h)}``, extras ``{"double": 2 * obs}``."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def act(self, obs, state, explore):
        self.batches.append(obs.shape[0])
        h = state["h"] + 1
        return obs[:, 0].long(), {"h": h, "pair": (h, -h)}, {"double": 2 * obs}


def _ask(server, group, size, results):
    obs = torch.full((size, 3), float(group))
    state = {"h": torch.full((size, 2), 10.0 * group), "pair": (torch.zeros(size, 2), torch.zeros(size, 2))}
    answer = server.act(group, obs, state, True)
    results[group] = (time.monotonic(), answer)


def _round(server, sizes):
    results, threads = {}, []
    for group, size in sizes.items():
        threads.append(threading.Thread(target=_ask, args=(server, group, size, results)))
        threads[-1].start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def test_one_agent_call_answers_every_group_and_splits_pytrees_back():
    agent = Recording()
    server = BatchedInference(agent, deadline_s=30.0, version=lambda: 7, groups=range(3))
    try:
        results = _round(server, {0: 2, 1: 3, 2: 1})
    finally:
        server.close()
    assert agent.batches == [6], "the three groups' requests in one call"
    for group, size in {0: 2, 1: 3, 2: 1}.items():
        action, state, extras, version = results[group][1]
        assert version == 7
        assert action.tolist() == [group] * size
        torch.testing.assert_close(state["h"], torch.full((size, 2), 10.0 * group + 1))
        torch.testing.assert_close(state["pair"][1], -state["pair"][0])
        assert isinstance(state["pair"], tuple)
        torch.testing.assert_close(extras["double"], torch.full((size, 3), 2.0 * group))
    assert server.calls == 1 and server.requests == 3


def test_a_withheld_group_delays_the_others_by_the_deadline_only():
    agent = Recording()
    server = BatchedInference(agent, deadline_s=0.3, groups=range(3))  # group 2 never asks
    try:
        start = time.monotonic()
        results = _round(server, {0: 1, 1: 2})
    finally:
        server.close()
    assert agent.batches == [3], "the two groups that asked, in one call"
    waited = max(t for t, _ in results.values()) - start
    assert 0.3 <= waited < 10.0
    assert results[1][1][0].tolist() == [1, 1]


def test_an_agent_error_reaches_the_caller_and_close_releases_a_waiting_group():
    class Broken:
        def act(self, obs, state, explore):
            raise ValueError("bad act")

    server = BatchedInference(Broken(), deadline_s=0.0)
    with pytest.raises(ValueError, match="bad act"):
        server.act(0, torch.zeros(1, 3), None, True)
    server = BatchedInference(Recording(), deadline_s=60.0, groups=range(2))  # group 1 never asks
    outcome = []

    def ask():
        try:
            server.act(0, torch.zeros(1, 3), {"h": torch.zeros(1, 2), "pair": None}, True)
        except InferenceStopped as error:
            outcome.append(error)

    thread = threading.Thread(target=ask)
    thread.start()
    wait_until(lambda: server.waiting == 1, 30, what="group 0's request")
    server.close()
    thread.join(timeout=30)
    assert len(outcome) == 1 and not thread.is_alive()


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
    with pytest.raises(ValueError, match="acting.policy must be 'copies' or 'central'"):
        ActingSettings(num_actors=2, policy="shared")
    with pytest.raises(ValueError, match="deadline_ms must be >= 0"):
        ActingSettings(policy="central", deadline_ms=-1)
    with pytest.raises(ValueError, match="acting.central_groups must be 'threads' or 'processes'"):
        ActingSettings(policy="central", central_groups="fibers")


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
    made = lambda: sum(w.collector.stats.env_steps for w in acting.pool.workers)  # noqa: E731
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
            assert acting.pool.server.requests == count * 4, "one chunk ahead, all groups together"
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
        threads = acting.pool.threads
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
        victim = acting.pool.workers[1].collector.env.processes[0]
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
    from lightning_wm.data.acting import CentralActing
    from lightning_wm.data.settings import ActingSettings
    from lightning_wm.envs import EnvConfig
    from support.actor_agents import StepCounter

    if __name__ == "__main__":
        acting = CentralActing(
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


@pytest.mark.slow
@pytest.mark.parametrize(
    "groups, vectorization, inference, processes",
    [("threads", "async", "thread", 4), ("processes", "sync", "thread", 2), ("processes", "sync", "process", 3)],
    ids=["env-workers-of-threads", "group-processes", "inference-process"],
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
    # semaphores' names once the learner is gone
    wait_until(lambda: set(os.listdir("/dev/shm")) <= shm_before, 30, what="nothing new in /dev/shm")


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
