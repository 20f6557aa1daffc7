"""Actor processes: weights flow with versions, seeds differ across actors and ranks, failures
reach the learner as one clear error, and no actor outlives its learner."""

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from lightning_wm.data.acting import ActingJob, ActorError, WeightStore, actor_pool
from lightning_wm.data.settings import ActingSettings
from lightning_wm.envs import EnvConfig
from lightning_wm.seeding import derive_seed, env_seeds

from support.actor_agents import FaultyPolicy, MarkedPolicy
from support.processes import descendants, wait_gone

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def _pool(env, module, chunk_length=64, rank=0, **settings):
    """An actor pool of ``module`` copies over ``env``; ``settings``: the acting group's fields."""
    return actor_pool(ActingJob(env, ActingSettings(**settings), chunk_length, rank=rank), module)


def _set(module: MarkedPolicy, value: float) -> MarkedPolicy:
    with torch.no_grad():
        module.w.fill_(value)
    return module


def test_weight_store_publish_pull_and_layout_check():
    store = WeightStore(_set(MarkedPolicy(), 1.0), version=3)
    reader = MarkedPolicy()
    assert store.version == 3 and store.pull_into(reader) == 3 and reader.w.item() == 1.0
    store.publish(_set(MarkedPolicy(), 5.0), version=4)
    _set(reader, 0.0)
    assert store.pull_into(reader, known_version=4) == 4 and reader.w.item() == 0.0, "known version: no copy"
    assert store.pull_into(reader, known_version=3) == 4 and reader.w.item() == 5.0
    with pytest.raises(ValueError, match="changed keys"):
        store.publish(torch.nn.Linear(2, 2), version=5)
    store._seq.value += 1  # a writer that never finishes: readers give up instead of reading torn weights
    with pytest.raises(TimeoutError):
        store.pull_into(reader, timeout_s=0.05)


@pytest.mark.slow
def test_pool_weights_versions_and_seeds():
    """Rows carry the version of the weights that made them, the learner's newest version reaches
    the actors within a bounded lag, and every env of every actor and rank has its own seed."""
    seed, rank, envs = 3, 1, 2
    module = _set(MarkedPolicy(), 0.0)
    with _pool(
        EnvConfig("CartPole-v1", seed=seed),
        module,
        num_actors=2,
        envs_per_actor=envs,
        chunk_length=4,
        rank=rank,
        timeout_s=60,
        queue_size=2,
    ) as pool:
        firsts: dict[int, np.ndarray] = {}
        version, published_5, lag_checked = 0, None, False
        deadline = time.monotonic() + 300  # one actor may start long after the other on a busy machine
        for n in itertools.count():
            assert time.monotonic() < deadline, f"version 5 came back: {lag_checked}; actors seen: {sorted(firsts)}"
            chunk = pool.get(timeout=120)
            assert chunk is not None, "no chunk within 120 s"
            rows = chunk.rows
            assert rows["obs"].shape == (4, envs, 4) and rows["is_first"].shape == (4, envs)
            assert (rows["policy_version"] == chunk.version).all()
            assert (rows["mark"][~rows["is_last"]] == chunk.version).all(), "rows made by other weights"
            assert chunk.version <= version and chunk.env_steps == 4 * envs
            firsts.setdefault(chunk.actor, rows["obs"][0])
            if version < 5 and n % 3 == 0:
                version += 1
                pool.publish(_set(module, float(version)), version)
                published_5 = n if version == 5 else None
            if published_5 is not None and not lag_checked and chunk.version == 5:
                # queued chunks (queue_size 2) and one chunk in progress per actor were made earlier
                assert n - published_5 <= 2 + 2 + 1, "the newest weights did not reach the actors"
                lag_checked = True
            if lag_checked and len(firsts) == 2:
                break
    seeds = [s for a in (0, 1) for s in env_seeds(seed, envs, "train", rank, a)]
    rank0 = env_seeds(seed, envs, "train", 0, 0) + env_seeds(seed, envs, "train", 0, 1)
    assert len(set(seeds)) == 4 and not set(seeds) & set(rank0)
    for actor, obs in firsts.items():
        for j, s in enumerate(env_seeds(seed, envs, "train", rank, actor)):
            np.testing.assert_array_equal(obs[j], gym.make("CartPole-v1").reset(seed=s)[0])


def _first_chunks(seed: int, num_actors: int = 2, envs: int = 2, steps: int = 6) -> dict[int, np.ndarray]:
    """Each actor's first chunk of actions (``[T, B]``) from a fresh pool of MarkedPolicy copies."""
    firsts: dict[int, np.ndarray] = {}
    with _pool(
        EnvConfig("CartPole-v1", seed=seed), MarkedPolicy(), steps, num_actors=num_actors, envs_per_actor=envs
    ) as pool:
        while len(firsts) < num_actors:
            chunk = pool.get(timeout=120)
            assert chunk is not None, "no chunk within 120 s"
            firsts.setdefault(chunk.actor, np.asarray(chunk.rows["action"]))
    return firsts


@pytest.mark.slow
def test_actor_action_draws_derive_from_the_run_seed():
    """An actor process samples from torch's generator seeded with ``derive_seed(seed, "policy",
    rank, actor)``: the same run seed gives the same draws, each actor its own stream."""
    first, again = _first_chunks(3), _first_chunks(3)
    for actor in (0, 1):
        generator = torch.Generator().manual_seed(derive_seed(3, "policy", 0, actor))
        expected = torch.stack([torch.randint(2, (2,), generator=generator) for _ in range(6)]).numpy()
        np.testing.assert_array_equal(first[actor], expected)
        np.testing.assert_array_equal(again[actor], expected)
    assert not np.array_equal(first[0], first[1])


@pytest.mark.slow
def test_actor_exception_reaches_learner_with_traceback():
    pool = _pool(EnvConfig("CartPole-v1"), FaultyPolicy("raise", at=6), num_actors=1, chunk_length=2)
    pid = pool.pids()[0]
    with pytest.raises(ActorError) as info:
        for _ in range(100):
            pool.get(timeout=60)
    message = str(info.value)
    assert message.startswith(f"actor 0 (pid {pid}) raised:")
    assert "Traceback" in message and "ValueError: policy exploded on call 6" in message
    assert "actor_agents.py" in message, "the actor's own traceback is carried"
    assert not wait_gone([pid])


@pytest.mark.slow
def test_hung_and_killed_actors_are_reported():
    pool = _pool(EnvConfig("CartPole-v1"), FaultyPolicy("hang", at=4), num_actors=2, chunk_length=1, timeout_s=2.0)
    pids = pool.pids()
    with pytest.raises(
        ActorError, match=r"actor \d \(pid \d+\) hung: no heartbeat for [\d.]+ s \(acting.timeout_s=2\)"
    ):
        for _ in range(100):
            pool.get(timeout=60)
    assert not wait_gone(pids), "a hung actor was left running"

    pool = _pool(EnvConfig("CartPole-v1"), MarkedPolicy(), num_actors=2, chunk_length=1, timeout_s=60)
    assert pool.get(timeout=120) is not None
    pids = pool.pids()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(ActorError, match=rf"actor 1 \(pid {pids[1]}\) was killed by signal SIGKILL"):
        deadline = time.monotonic() + 60  # by time, not by count: actor 0 alone can deliver 1,000 chunks
        while time.monotonic() < deadline:  # before the pool's next health check (every 0.5 s)
            pool.get(timeout=1)
    assert not wait_gone(pids)


LEARNER = textwrap.dedent("""
    import json, signal, sys
    # Ctrl-C as in a terminal: a background job of a non-interactive shell (nohup pytest &)
    # starts with SIGINT ignored, and the learner would inherit that and never see it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {tests!r})
    from support.actor_agents import MarkedPolicy
    from lightning_wm.data.acting import ActingJob, actor_pool
    from lightning_wm.data.settings import ActingSettings
    from lightning_wm.envs import EnvConfig

    if __name__ == "__main__":
        pool = actor_pool(ActingJob(EnvConfig("CartPole-v1"), ActingSettings(num_actors=2), 4), MarkedPolicy())
        try:
            pool.get(timeout=120)
            print(json.dumps(pool.pids()), flush=True)
            while True:  # the learner stops reading (actors block on the full queue) until a signal ends it
                signal.pause()
        finally:
            pool.close()
""")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill -9", "Ctrl-C"])
def test_no_orphans_when_the_learner_dies(how, tmp_path):
    script = tmp_path / "learner.py"
    script.write_text(LEARNER.format(tests=str(TESTS)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, env=env, text=True, start_new_session=True
    )
    try:
        line = proc.stdout.readline()
        assert line, f"the learner script printed nothing (exit code {proc.poll()})"
        family = descendants(proc.pid)  # actors, and whatever they or multiprocessing started
        assert set(eval(line)) <= family
        if how == "kill -9":
            proc.kill()
        else:  # a terminal's Ctrl-C: SIGINT to the whole foreground process group
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
        assert not wait_gone(family, seconds=10), f"orphans after {how}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.xdist_group("ray")  # one local Ray instance at a time: under -n, on one worker
@pytest.mark.slow
def test_ray_backend_on_a_local_instance(monkeypatch):
    """The same pool as Ray actors: chunks, versions through the object store, errors with tracebacks."""
    ray = pytest.importorskip("ray")
    # Ray's workers import the test policies from tests/ (a local instance inherits the environment)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]))
    ray.init(num_cpus=3, include_dashboard=False, configure_logging=False)
    try:
        module = _set(MarkedPolicy(), 0.0)
        with _pool(
            EnvConfig("CartPole-v1", seed=3),
            module,
            num_actors=2,
            envs_per_actor=2,
            chunk_length=4,
            backend="ray",
            timeout_s=120,
        ) as pool:
            pids = pool.pids()
            assert len(set(pids)) == 2 and os.getpid() not in pids
            firsts, newest = {}, None
            pool.publish(_set(module, 1.0), 1)
            for _ in range(50):
                chunk = pool.get(timeout=120)
                assert chunk is not None
                assert chunk.rows["obs"].shape == (4, 2, 4) and (chunk.rows["policy_version"] == chunk.version).all()
                assert (chunk.rows["mark"][~chunk.rows["is_last"]] == chunk.version).all()
                firsts.setdefault(chunk.actor, chunk.rows["obs"][0])
                newest = chunk.version
                if newest == 1 and len(firsts) == 2:
                    break
            assert newest == 1 and sorted(firsts) == [0, 1]
            for actor, obs in firsts.items():
                for j, s in enumerate(env_seeds(3, 2, "train", 0, actor)):
                    np.testing.assert_array_equal(obs[j], gym.make("CartPole-v1").reset(seed=s)[0])
        assert not wait_gone(pids) and ray.is_initialized(), "a pool leaves a Ray instance it did not start running"
        crashing = _pool(
            EnvConfig("CartPole-v1"), FaultyPolicy("raise", at=3), num_actors=1, chunk_length=1, backend="ray"
        )
        with pytest.raises(ActorError, match=r"(?s)ray actor 0 raised:.*ValueError: policy exploded on call 3"):
            for _ in range(100):
                crashing.get(timeout=120)
    finally:
        ray.shutdown()
