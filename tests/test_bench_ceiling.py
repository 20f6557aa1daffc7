"""bench/ceiling.py's pure parts: the engines' env settings and the table; one short measurement."""

import pytest

from lightning_wm.envs import EnvConfig

from support.bench_scripts import load_bench_script

ceiling = load_bench_script("ceiling.py")


def test_each_engine_steps_the_env_its_way():
    env = EnvConfig("CartPole-v1")
    sync = ceiling.engine_config(env, "gymnasium sync", 64, cores=3)
    spread = ceiling.engine_config(env, "gymnasium async", 64, cores=3)
    pool = ceiling.engine_config(env, "EnvPool", 64, cores=3)
    assert (sync.num_envs, sync.vectorization, sync.backend) == (64, "sync", "gymnasium")
    assert (spread.num_envs, spread.vectorization, spread.backend) == (3, "async", "gymnasium")
    assert (pool.num_envs, pool.backend) == (64, "envpool")
    assert ceiling.engine_config(env, "EnvPool", 2, cores=3).num_envs == 6  # at least two envs per thread
    assert ceiling.engine_config(env, "EnvPool async", 64, cores=3) == pool  # the same envs, half a batch each recv


def test_table_gives_each_row_its_share_of_its_envs_best_engine():
    rows = [
        {"env": "a", "engine": "gymnasium sync", "envs": 4, "workers": "1 process", "steps_per_s": 50.0},
        {"env": "a", "engine": "EnvPool", "envs": 4, "workers": "2 threads", "steps_per_s": 200.0},
        {"env": "b", "engine": "gymnasium sync", "envs": 4, "workers": "1 process", "steps_per_s": 30.0},
    ]
    for row in rows:
        row["frames_per_s"] = 4 * row["steps_per_s"]
    assert ceiling.ceiling(rows[:2]) == 200.0
    lines = ceiling.table(rows).splitlines()
    assert lines[2] == "| a | gymnasium sync | 4 | 1 process | 50 | 200 | 25% |"
    assert lines[3] == "| a | **EnvPool** | 4 | 2 threads | 200 | 800 | 100% |"
    assert lines[4] == "| b | **gymnasium sync** | 4 | 1 process | 30 | 120 | 100% |"


def test_minatar_is_measured_without_envpool_and_beside_the_wrapped_sync_vector_env():
    pytest.importorskip("minatar.gym", reason='MinAtar is the optional extra: pip install -e ".[minatar]"')
    rows = ceiling.measure("minatar_breakout", seconds=0.05, cores=2)
    assert [r["engine"] for r in rows] == ["gymnasium sync", "gymnasium async", "SyncVectorEnv"]
    assert rows[0]["envs"] == rows[2]["envs"] == 16 and all(r["steps_per_s"] > 0 for r in rows)


def test_a_short_measurement_counts_agent_steps():
    rate = ceiling.steps_per_second(EnvConfig("CartPole-v1", num_envs=2), seconds=0.05, warmup=1)
    assert rate > 0
