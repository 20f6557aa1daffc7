"""acting.splits: the envs in parts stepped in turn (SplitCollector) make a single Collector's rows,
with each part's env step in flight while the policy acts for the next part."""

import importlib.util

import gymnasium as gym
import numpy as np
import pytest

from lightning_wm.data.acting import make_acting
from lightning_wm.data.collector import Collector
from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.data.settings import ActingSettings
from lightning_wm.data.split_collector import SplitCollector, check_splits, make_collector
from lightning_wm.envs import EnvConfig, env_spec

from support.countdown import CountdownEnv, CountingAgent, countdown_envs

needs_envpool = pytest.mark.skipif(
    importlib.util.find_spec("envpool") is None,
    reason='EnvPool is not installed (pip install -e ".[envpool]")',
)
LENGTHS = [3, 4, 5, 6]


class InFlightEnv(gym.vector.SyncVectorEnv):
    """Countdown envs whose step is sent (``step_async``) and taken later (``step_wait``), logging both."""

    def __init__(self, lengths, log, name):
        super().__init__(
            [lambda n=n: CountdownEnv(n) for n in lengths], autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP
        )
        self.log, self.name, self.sent = log, name, None

    def step_async(self, actions):
        assert self.sent is None, "a second step sent before the first was taken"
        self.log.append(("send", self.name))
        self.sent = actions

    def step_wait(self, **kwargs):
        self.log.append(("wait", self.name))
        actions, self.sent = self.sent, None
        return self.step(actions)


class LoggingAgent(CountingAgent):
    def __init__(self, log):
        self.log = log

    def act(self, obs, state, explore):
        self.log.append(("act", int(obs[0, 1])))
        return super().act(obs, state, explore)


def same_rows(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("overlap", [False, True])
def test_split_rows_are_one_collectors_rows(overlap):
    single_buffer, split_buffer = ReplayBuffer(100, 4, seed=0), ReplayBuffer(100, 4, seed=0)
    single = Collector(countdown_envs(LENGTHS), CountingAgent(), buffer=single_buffer)
    log = []
    parts = [InFlightEnv(LENGTHS[:2], log, "a"), InFlightEnv(LENGTHS[2:], log, "b")]
    split = SplitCollector(parts, CountingAgent(), buffer=split_buffer)
    for _ in range(3):  # across chunk ends: the overlap row and the steps left in flight
        same_rows(single.collect_chunk(7, overlap=overlap), split.collect_chunk(7, overlap=overlap))
    single.collect(2)
    split.collect(2)
    assert single.stats.env_steps == split.stats.env_steps == 4 * (3 * 7 + overlap + 2)
    assert [e["return"] for e in single.stats.recent] == [e["return"] for e in split.stats.recent]
    assert single_buffer.revision == split_buffer.revision
    for key in ("obs", "reward", "is_last", "action", "calls"):
        np.testing.assert_array_equal(single_buffer._data[key], split_buffer._data[key], err_msg=key)
    split.close()
    single.close()


def test_each_parts_step_runs_while_the_policy_acts_for_the_next():
    log = []
    split = SplitCollector([InFlightEnv(LENGTHS[:2], log, "a"), InFlightEnv(LENGTHS[2:], log, "b")], LoggingAgent(log))
    split.collect_chunk(4)
    events = [e for e in log if e[0] != "act"]
    # after the first round: a's results are taken only once b's step was sent (and the other way round)
    assert events[:2] == [("send", "a"), ("send", "b")]
    assert events[2:] == [("wait", "a"), ("send", "a"), ("wait", "b"), ("send", "b")] * 3
    acts = [i for i, e in enumerate(log) if e[0] == "act"]
    assert len(acts) == 8 and all(log[i + 1][0] == "send" for i in acts)  # every call's actions go out at once
    # the chunk is returned with both parts' steps in flight: the envs step while the learner trains
    assert [part.env.sent is not None for part in split.parts] == [True, True]
    split.close()


def test_episode_env_index_counts_across_parts():
    split = SplitCollector([countdown_envs([2, 2]), countdown_envs([2, 9])], CountingAgent())
    finished = split.collect(5)
    assert sorted({e["env"] for e in finished}) == [0, 1, 2]


@pytest.mark.parametrize(
    ("config", "splits", "words"),
    [
        (EnvConfig("CartPole-v1", num_envs=6, vectorization="async"), 4, "must divide env.num_envs=6"),
        (EnvConfig("CartPole-v1", num_envs=4), 2, "set env.vectorization: async or env.backend: envpool"),
        (EnvConfig("CartPole-v1", num_envs=4), 0, "must be >= 1"),
    ],
)
def test_splits_that_cannot_apply_are_one_clear_line(config, splits, words):
    with pytest.raises(ValueError, match=words):
        check_splits(config, splits)


def test_splits_with_central_acting_is_refused_and_with_copies_checked_per_actor():
    with pytest.raises(ValueError, match="applies in process and to actors with policy: copies"):
        ActingSettings(num_actors=2, policy="central", splits=2)
    assert ActingSettings(num_actors=2, splits=2).splits == 2
    from lightning_wm.data.acting import ActingJob, actor_pool

    config = EnvConfig("CartPole-v1", num_envs=8, vectorization="async")
    with pytest.raises(ValueError, match="must divide env.num_envs=3"):
        actor_pool(ActingJob(config, ActingSettings(num_actors=1, envs_per_actor=3, splits=2), 64), Balance())


class Balance:
    """CartPole by the pole's angle: deterministic, so both collectors take the same actions."""

    def initial_state(self, batch_size):
        return None

    def act(self, obs, state, explore):
        return (obs[:, 2] > 0).long(), state, {"angle": obs[:, 2]}


@needs_envpool
def test_envpool_parts_step_as_one_pool():
    config = EnvConfig("CartPole-v1", num_envs=4, max_episode_steps=30, backend="envpool")
    spec = env_spec(config)
    seeds = [11, 12, 13, 14]
    single = make_collector(config, Balance(), None, seeds, spec)
    split = make_collector(config, Balance(), None, seeds, spec, splits=2)
    assert isinstance(split, SplitCollector) and len(split.parts) == 2
    try:
        for _ in range(3):
            same_rows(single.collect_chunk(25, overlap=True), split.collect_chunk(25, overlap=True))
        assert split.stats.episodes == single.stats.episodes > 0
    finally:
        single.close()
        split.close()


@needs_envpool
def test_in_process_acting_with_splits_makes_whole_chunks():
    config = EnvConfig("CartPole-v1", num_envs=4, backend="envpool")
    acting = make_acting(config, env_spec(config), ActingSettings(splits=2), chunk_length=5, overlap=True)
    acting.setup(rank=0)
    try:
        acting.attach_agent(Balance(), version=3)
        first, second = acting.next_chunk(), acting.next_chunk()
        assert first.rows["obs"].shape == second.rows["obs"].shape == (6, 4, 4)
        np.testing.assert_array_equal(first.rows["obs"][-1], second.rows["obs"][0])  # unrolls share a row
        assert (second.rows["policy_version"] == 3).all() and acting.env_steps == 4 * 11
    finally:
        acting.close()


def test_an_actor_with_splits_makes_the_rows_of_one_collector():
    """A policy-copy actor's worker (``ActorWorker``) over its envs in two parts: the chunks of a
    worker over one vector env, with the same deterministic policy."""
    from lightning_wm.data.acting.worker import ActingJob, ActorWorker

    env = EnvConfig("CartPole-v1", num_envs=4, max_episode_steps=30, vectorization="async", seed=3)
    jobs = [ActingJob(env, ActingSettings(num_actors=1, splits=k), 10) for k in (1, 2)]
    workers = [ActorWorker(0, job, Balance()) for job in jobs]
    assert isinstance(workers[1].collector, SplitCollector)
    try:
        for version in (1, 2, 3):
            single, split = (w.chunk(version) for w in workers)
            assert split.rows["obs"].shape == (10, 4, 4) and split.env_steps == single.env_steps == 40
            same_rows(single.rows, split.rows)
    finally:
        for worker in workers:
            worker.close()


@pytest.mark.slow  # an actor process and its EnvPool
@needs_envpool
def test_a_fit_with_a_split_actor_process():
    from pathlib import Path

    from lightning_wm.cli import main

    config = Path(__file__).resolve().parents[1] / "configs/impala/cartpole.yaml"
    acting = ["--data.init_args.acting.num_actors", "1", "--data.init_args.acting.splits", "2"]
    quiet = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    cli = main(
        ["fit", "--config", str(config), *acting, "--data.init_args.env.backend", "envpool", *quiet]
        + ["--trainer.max_steps", "10", "--trainer.val_check_interval", "10"]
    )
    assert cli.trainer.global_step == 10
