"""The learner's side of actors, without processes: the replay-ratio throttle, unroll batching
(overlap by one, max_use) and the actor gauges."""

import numpy as np
import pytest
import torch

from lightning_wm.data.acting import ActorMetrics, Chunk
from lightning_wm.data.acting.base import Acting
from lightning_wm.data.batches import ReplayFeed, UnrollBatcher
from lightning_wm.data.batches.unroll import UnrollBatches
from lightning_wm.data.collector import Collector
from lightning_wm.data.settings import ModelReplaySettings, UnrollReplaySettings

from support.countdown import CountingAgent, countdown_envs


class FakeActors(Acting):
    """Chunks of ``T x N`` rows from ``num_actors`` actors, ``available()`` of them at a time; counts
    and gauges as :class:`~lightning_wm.data.acting.PoolActing` keeps them."""

    def __init__(self, num_actors=2, chunk_length=4, envs_per_actor=2, available=lambda: True):
        super().__init__(chunk_length, overlap=False)
        self.num_actors, self.envs_per_actor = num_actors, envs_per_actor
        self.available, self.sent, self.version = available, 0, 0
        self.metrics_ = ActorMetrics()
        self.rows = 0

    num_streams = property(lambda self: self.num_actors * self.envs_per_actor)
    concurrent_sources = property(lambda self: self.num_actors)
    env_steps = property(lambda self: self.rows)

    def setup(self, rank, rows=None):
        pass

    def attach_agent(self, agent, version, random_rows=0):
        pass

    def streams(self, chunk):
        return np.arange(chunk.actor * self.envs_per_actor, (chunk.actor + 1) * self.envs_per_actor)

    def received(self, chunk):
        self.rows += chunk.env_steps
        self.metrics_.chunk(chunk, 0)

    def batch_done(self, waited_s, held=0):
        self.metrics_.queue_depth = 1 + held
        self.metrics_.waited(waited_s)

    def pop_episodes(self):
        return self.metrics_.pop_episodes()

    def close(self):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass

    def next_chunk(self, timeout=0.0):
        if not self.available():
            return None
        self.sent += 1
        rows = {"obs": np.zeros((self.chunk_length, self.envs_per_actor, 1), np.float32)}
        return Chunk(
            self.sent % self.num_actors,
            self.version,
            rows,
            [{"return": 1.0, "length": 2.0}],
            self.chunk_length * self.envs_per_actor,
        )


class FakeBuffer:
    def __init__(self):
        self.rows = 0
        self.streams = []

    def add_many(self, chunk, streams=None, priority=None):
        self.rows += chunk["obs"].shape[0] * chunk["obs"].shape[1]
        self.streams.append(tuple(streams))

    def __len__(self):
        return self.rows


def test_replay_feed_keeps_the_ratio_when_actors_are_fast():
    actors, buffer = FakeActors(), FakeBuffer()
    feed = ReplayFeed(actors, buffer, replay_ratio=0.25, prefill=40)
    assert feed.slack == 16
    for b in range(1, 200):
        assert feed.before_batch() == 0.0
        assert abs(feed.rows - (40 + b * 4)) <= feed.slack + 8, "rows drifted from the replay ratio"
    assert buffer.rows == feed.rows == actors.env_steps and set(buffer.streams) == {(0, 1), (2, 3)}
    assert len(actors.pop_episodes()) == feed.rows // 8 and actors.pop_episodes() == []


def test_replay_feed_learner_waits_for_slow_actors():
    """Actors that deliver only every other call: the learner waits, and never runs ahead by more
    than the slack."""
    calls = {"n": 0}

    def every_other():
        calls["n"] += 1
        return calls["n"] % 2 == 0

    actors, buffer = FakeActors(available=every_other), FakeBuffer()
    feed = ReplayFeed(actors, buffer, replay_ratio=1.0, prefill=8, slack=8)
    for b in range(1, 50):
        feed.before_batch()
        assert feed.rows >= 8 + b - 8, "the learner ran ahead of the replay ratio"
    gauges = actors.metrics_.gauges()
    assert gauges["actors/wait_fraction"] > 0 and gauges["actors/batch_wait_ms"] > 0
    with pytest.raises(ValueError, match=r"at least one chunk \(4 steps x 2 envs = 8 rows\)"):
        ReplayFeed(actors, buffer, replay_ratio=1.0, prefill=8, slack=7)


def test_actor_metrics_window():
    now = {"t": 0.0}
    metrics = ActorMetrics(window_s=10.0, clock=lambda: now["t"])
    for t in range(20):
        now["t"] = float(t + 1)
        metrics.chunk(Chunk(0, t, {}, [], env_steps=100), learner_version=t + 3)
    metrics.chunk(Chunk(0, -1, {}, [], env_steps=100), learner_version=50)  # random prefill rows: no lag
    metrics.waited(2.0)
    gauges = metrics.gauges()
    assert gauges["actors/frames_per_s"] == pytest.approx(12 * 100 / 10.0)  # 11 chunks at t = 10..20 + the prefill one
    assert gauges["actors/policy_lag"] == pytest.approx(3.0)
    assert gauges["actors/wait_fraction"] == pytest.approx(0.2) and gauges["actors/batch_wait_ms"] == 2000.0


def test_actor_metrics_running_sums_equal_a_pass_over_the_window():
    """Gauges read every step keep running sums; they equal the sums over the events still in the window."""
    rng = np.random.default_rng(0)
    now = {"t": 0.0}
    metrics = ActorMetrics(window_s=2.0, clock=lambda: now["t"])
    events: list[tuple[float, str, float]] = []
    for step in range(400):
        now["t"] += float(rng.uniform(0.0, 0.05))
        steps, lag, wait = int(rng.integers(1, 200)), int(rng.integers(0, 5)), float(rng.uniform(0, 0.01))
        metrics.chunk(Chunk(0, 7, {}, [], env_steps=steps), learner_version=7 + lag)
        metrics.waited(wait)
        events += [(now["t"], "frames", steps), (now["t"], "lags", lag), (now["t"], "waits", wait)]
        if step % 7 == 0:
            gauges = metrics.gauges()
            inside = [(kind, v) for t, kind, v in events if t >= now["t"] - 2.0]
            span = min(2.0, now["t"])
            lags = [v for kind, v in inside if kind == "lags"]
            waits = [v for kind, v in inside if kind == "waits"]
            assert gauges["actors/frames_per_s"] == pytest.approx(sum(v for k, v in inside if k == "frames") / span)
            assert gauges["actors/policy_lag"] == pytest.approx(np.mean(lags))
            assert gauges["actors/batch_wait_ms"] == pytest.approx(1000.0 * np.mean(waits))
    now["t"] += 10.0  # everything left the window
    assert metrics.gauges() == {"actors/frames_per_s": 0.0, "actors/queue_depth": 0.0}


def test_unrolls_overlap_by_one_and_keep_order():
    """Chunk k of an env holds rows kT..kT+T: the last row of one unroll is the first of the next."""
    collector = Collector(countdown_envs([3, 5]), CountingAgent())
    batcher = UnrollBatcher(batch_size=2)
    batches = []
    for _ in range(4):
        batcher.add(collector.collect_chunk(4, overlap=True))
        batches.append(batcher.batch())
    assert batches[0]["obs"].shape == (2, 5, 2) and batches[0]["action"].dtype == torch.int64
    for env in range(2):
        for k in range(3):
            now, nxt = batches[k], batches[k + 1]
            for key in ("obs", "reward", "is_first", "is_last", "action", "calls"):
                torch.testing.assert_close(now[key][env, -1], nxt[key][env, 0])
        steps = torch.cat([batches[0]["obs"][env, :, 1]] + [b["obs"][env, 1:, 1] for b in batches[1:]])
        length = [3, 5][env]
        assert steps.tolist() == [t % (length + 1) for t in range(17)], "rows out of order or missing"
    assert len(batcher) == 0


def test_unroll_replay_max_use():
    batcher = UnrollBatcher(batch_size=4, capacity=8, max_use=2, seed=0)
    uses: dict[int, int] = {}
    next_id = 0
    for _ in range(30):
        while not batcher.ready():
            ids = np.arange(next_id, next_id + 2)
            next_id += 2
            batcher.add({"id": np.broadcast_to(ids, (3, 2)).copy()})  # 2 unrolls of 3 rows
        batch = batcher.batch()
        assert batch["id"].shape == (4, 3) and len(set(batch["id"][:, 0].tolist())) == 4, "an unroll twice in a batch"
        for i in batch["id"][:, 0].tolist():
            uses[i] = uses.get(i, 0) + 1
    assert max(uses.values()) == 2 and len(batcher) <= 8
    assert sum(uses.values()) == 30 * 4 and next_id < 30 * 4, "replay reused unrolls"
    with pytest.raises(ValueError, match="at least batch_size"):
        UnrollBatcher(batch_size=4, capacity=2)


def unroll_uses(replay: UnrollReplaySettings, batches: int) -> tuple[dict[int, int], FakeActors]:
    """Uses of each unroll id over ``batches`` batches of 4 from two always-ready fake actors."""
    actors = FakeActors(num_actors=2, envs_per_actor=2)
    side = UnrollBatches(4, 4, replay, ModelReplaySettings(), seed=0)
    side.setup(actors, rank=0, seed=0)
    uses: dict[int, int] = {}
    for _ in range(batches):
        for i in side.next_batch()["index"].tolist():
            uses[i] = uses.get(i, 0) + 1
    return uses, actors


def test_unroll_replay_use_all_uses_each_unroll_max_use_times():
    """Actors always ready: eagerly each batch takes a chunk of both (4 new unrolls for 4 uses), so
    max_use 2 is not reached; with use_all every unroll is used twice (chunks taken only when needed)."""
    uses, actors = unroll_uses(UnrollReplaySettings(capacity=8, max_use=2, use_all=True), 40)
    done = [n for i, n in uses.items() if i < 2 * actors.sent - 8]  # ids of unrolls no longer in the replay
    assert len(done) > 60 and set(done) == {2} and actors.sent == 40
    eager, actors = unroll_uses(UnrollReplaySettings(capacity=8, max_use=2), 40)
    assert sum(n == 1 for n in eager.values()) > 20 and actors.sent == 2 * 40
    with pytest.raises(ValueError, match=r"use_all paces a replay: set replay.capacity > 0"):
        UnrollReplaySettings(use_all=True)
    with pytest.raises(ValueError, match=r"must hold batch_size - 1 leftovers and a chunk's 2 unrolls: .* at least 5"):
        unroll_uses(UnrollReplaySettings(capacity=4, max_use=2, use_all=True), 1)


def test_prioritized_unroll_replay_draws_by_priority_and_weights():
    batcher = UnrollBatcher(batch_size=2, capacity=4, max_use=1000, seed=0, prioritized=True, alpha=1.0, beta=1.0)
    batcher.add({"id": np.broadcast_to(np.arange(4), (3, 4)).copy()})  # unrolls 0..3, all at priority 1
    first = batcher.batch()
    assert first["index"].tolist() == first["id"][:, 0].tolist() and torch.equal(first["index"], first["generation"])
    torch.testing.assert_close(first["weight"], torch.ones(2))  # equal priorities: equal weights
    assert batcher.update_priorities([0, 1, 2, 3], [9.0, 1.0, 1.0, 1.0]) == {"applied": 4, "stale": 0}
    counts = np.zeros(4)
    for _ in range(400):
        batch = batcher.batch()
        counts[batch["index"].numpy()] += 1
        if 0 in batch["index"].tolist():  # P(0) = 9/12 = 0.75, the others 1/12: weights (4P)^-1 / max
            other = batch["weight"][batch["index"] != 0]
            torch.testing.assert_close(batch["weight"][batch["index"] == 0], other / 9.0)
    assert counts[0] > 340 and counts[0] > 2 * counts[1:].max(), "the high-priority unroll is drawn most"
    assert counts[1:].min() > 50, "the others stay drawable"


def test_prioritized_unroll_feedback_skips_unrolls_that_left():
    batcher = UnrollBatcher(batch_size=2, capacity=2, max_use=1, seed=0, prioritized=True)
    batcher.add({"id": np.zeros((3, 2))})
    batch = batcher.batch()  # both used up (max_use 1): they leave the replay
    batcher.add({"id": np.zeros((3, 2))})
    assert batcher.update_priorities(batch["index"], [5.0, 5.0]) == {"applied": 0, "stale": 2}
    assert batcher.update_priorities([2, 7], [5.0, 5.0]) == {"applied": 1, "stale": 1}
    with pytest.raises(ValueError, match=r"replay.capacity > 0"):
        UnrollBatcher(batch_size=2, prioritized=True)
    with pytest.raises(ValueError, match="finite"):
        batcher.update_priorities([2], [float("nan")])


def test_replay_feed_ingests_until_the_buffer_holds_the_prefill():
    """Rows counted but not held (one actor's rings wrapped): the feed keeps ingesting past the
    ratio's upper bound until the buffer really holds ``prefill`` rows, instead of waiting forever."""

    class SmallRings(FakeBuffer):
        def __len__(self):
            return min(self.rows, 40)  # what the rings keep

    actors, buffer = FakeActors(), SmallRings()
    feed = ReplayFeed(actors, buffer, replay_ratio=0.25, prefill=40, slack=16)
    actors.rows = 200  # e.g. restored counts, or streams that wrapped
    assert feed.before_batch() == 0.0 and len(buffer) >= 40
