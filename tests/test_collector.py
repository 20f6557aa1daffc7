"""The Collector against a hand-stepped env: rows follow the row convention across auto-resets."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from lightning_wm.data.collector import Collector
from lightning_wm.data.episodes import EpisodeStore
from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.data.samplers import SequenceSampler
from lightning_wm.envs import EnvConfig, EnvSpec, env_spec, make_vector_env
from lightning_wm.policies import RandomAgent

from support.countdown import CountingAgent, countdown_envs


def expected_rows(length, total, truncate=False):
    """Rows of one env, built by hand from the env's rules."""
    rows, episode, t = [], 0, 0
    while len(rows) < total:
        first = t == 0
        last = t == length
        reward = 0.0 if first else 10 * t + (t - 1) % 3
        action = 0 if last else t % 3
        # no action is taken on a last row: the action and the agent's extras there are zeros
        rows.append(
            dict(
                obs=(episode, t),
                reward=reward,
                is_first=first,
                is_last=last,
                is_terminal=last and not truncate,
                action=action,
                calls=0 if last else t,
            )
        )
        if last:
            episode, t = episode + 1, 0
        else:
            t += 1
    return rows


def test_rows_match_hand_stepped_env():
    lengths, steps = [2, 3], 11
    buffer = ReplayBuffer(100, num_streams=2)
    collector = Collector(countdown_envs(lengths), CountingAgent(), buffer=buffer)
    finished = collector.collect(steps)
    # each stream holds exactly `steps` rows, so a full-length window is the whole stream;
    # the streams differ by episode length (the largest step index in obs)
    data = SequenceSampler(steps).sample(buffer, 64)
    for length in lengths:
        picks = [b for b in range(64) if int(data["obs"][b, :, 1].max()) == length]
        assert picks, f"no sequence of the env with episodes of {length} steps was sampled"
        got = {k: v[picks[0]].numpy() for k, v in data.items()}
        for t, row in enumerate(expected_rows(length, steps)):
            assert tuple(got["obs"][t]) == row["obs"], (length, t)
            assert got["reward"][t] == row["reward"], (length, t)
            assert bool(got["is_first"][t]) == row["is_first"], (length, t)
            assert bool(got["is_last"][t]) == row["is_last"], (length, t)
            assert bool(got["is_terminal"][t]) == row["is_terminal"], (length, t)
            assert int(got["action"][t]) == row["action"], (length, t)
            assert got["calls"][t] == row["calls"], (
                "agent state was not reset at is_first (or an extra kept on is_last)"
            )
    # env0 (length 2) ends at rows 2, 5, 8; env1 (length 3) at rows 3, 7
    assert sorted(e["length"] for e in finished) == [2, 2, 2, 3, 3]
    assert collector.stats.env_steps == 2 * steps


def test_truncation_is_not_termination():
    buffer = ReplayBuffer(50, num_streams=1)
    Collector(countdown_envs([3], truncate=True), CountingAgent(), buffer=buffer).collect(8)
    data = SequenceSampler(8).sample(buffer, 1)
    assert data["is_last"][0].any()
    assert not data["is_terminal"][0].any()


def test_episodes_written_to_store(tmp_path):
    store = EpisodeStore(tmp_path / "eps")
    collector = Collector(countdown_envs([4, 2]), CountingAgent(), store=store)
    collector.collect(9)
    episodes = list(store.episodes())
    assert len(episodes) == len(collector.stats.recent)
    for ep in episodes:
        assert ep["is_first"][0] and ep["is_last"][-1]
        assert not ep["is_first"][1:].any() and not ep["is_last"][:-1].any()
        assert (ep["obs"][:, 0] == ep["obs"][0, 0]).all(), "an episode mixes two resets"
        np.testing.assert_array_equal(ep["obs"][:, 1], np.arange(len(ep["obs"])))
    assert store.total_steps() == sum(len(e["obs"]) for e in episodes)


def test_random_agent_respects_bounds_and_correlation():
    spec = env_spec(EnvConfig("CarRacing-v3"))
    agent = RandomAgent(spec, correlation=0.9, seed=0)
    state = agent.initial_state(64)
    actions = []
    for _ in range(50):
        a, state, _ = agent.act(torch.zeros(64, 1), state, True)
        actions.append(a)
    actions = torch.stack(actions)
    low, high = torch.tensor(spec.action_low), torch.tensor(spec.action_high)
    assert (actions >= low).all() and (actions <= high).all()
    steering = actions[..., 0]
    lag1 = torch.corrcoef(torch.stack([steering[:-1].flatten(), steering[1:].flatten()]))[0, 1]
    assert lag1 > 0.7, "smoothed random actions should be strongly autocorrelated"


def test_collector_on_real_pixel_env():
    cfg = EnvConfig("CartPole-v1", num_envs=2, pixels=True)
    env = make_vector_env(cfg)
    spec: EnvSpec = env_spec(cfg)
    buffer = ReplayBuffer(200, num_streams=2)
    Collector(env, RandomAgent(spec, seed=0), buffer=buffer, seeds=0).collect(30)
    batch = SequenceSampler(10).sample(buffer, 3)
    assert batch["obs"].shape == (3, 10, 64, 64, 3) and batch["obs"].dtype == torch.uint8
    assert batch["action"].dtype == torch.int64


def test_random_agent_biased_scheme_drives_carracing():
    """``action_mean``/``action_std``: smooth steering, gas mostly on, braking rare and light."""
    spec = env_spec(EnvConfig("CarRacing-v3"))
    agent = RandomAgent(spec, correlation=0.95, seed=0, action_mean=[0.0, 0.15, -0.3], action_std=[0.3, 0.1, 0.2])
    state = agent.initial_state(64)
    actions = []
    for _ in range(200):
        a, state, _ = agent.act(torch.zeros(64, 1), state, True)
        actions.append(a)
    actions = torch.stack(actions)  # [T, B, 3]
    low, high = torch.tensor(spec.action_low), torch.tensor(spec.action_high)
    assert (actions >= low).all() and (actions <= high).all()
    steer, gas, brake = actions.unbind(-1)
    assert abs(steer.mean()) < 0.1 and 0.2 < steer.std() < 0.4
    lag1 = torch.corrcoef(torch.stack([steer[:-1].flatten(), steer[1:].flatten()]))[0, 1]
    assert lag1 > 0.9, "steering should be smooth"
    assert (gas > 0).float().mean() > 0.85 and 0.1 < gas.mean() < 0.2
    assert (brake > 0).float().mean() < 0.12 and brake.mean() < 0.02
    # the default uniform mapping brakes about half the time (what the scheme above avoids)
    uniform = RandomAgent(spec, correlation=0.95, seed=0)
    state, brakes = uniform.initial_state(64), []
    for _ in range(200):
        a, state, _ = uniform.act(torch.zeros(64, 1), state, True)
        brakes.append(a[:, 2])
    assert (torch.stack(brakes) > 0).float().mean() > 0.4


def test_random_agent_biased_scheme_checks_its_arguments():
    import pytest

    spec = env_spec(EnvConfig("CarRacing-v3"))
    with pytest.raises(ValueError, match="one value per action dimension"):
        RandomAgent(spec, action_mean=[0.0, 0.5])
    with pytest.raises(ValueError, match=">= 0"):
        RandomAgent(spec, action_std=[1.0, -1.0, 1.0])
    with pytest.raises(ValueError, match="discrete"):
        RandomAgent(env_spec(EnvConfig("CartPole-v1")), action_mean=[0.0])


def test_random_agent_default_is_unchanged():
    """Without ``action_mean``/``action_std`` the sampler draws exactly the uniform AR(1) mapping."""
    spec = env_spec(EnvConfig("CarRacing-v3"))
    agent, g = RandomAgent(spec, correlation=0.5, seed=3), torch.Generator().manual_seed(3)
    state = agent.initial_state(4)
    u = torch.rand(4, 3, generator=g) * 2 - 1
    low, high = torch.tensor(spec.action_low), torch.tensor(spec.action_high)
    for _ in range(5):
        a, state, _ = agent.act(torch.zeros(4, 1), state, True)
        u = (0.5 * u + 0.75**0.5 * torch.randn(4, 3, generator=g)).clamp(-1, 1)
        torch.testing.assert_close(a, low + (u + 1) / 2 * (high - low))


@pytest.mark.slow  # CarRacing episodes: over a second
def test_carracing_record_config_drives(capsys):
    """``record`` with configs/worldmodels/carracing/record.yaml: gas mostly on, braking rare."""
    from pathlib import Path

    from lightning_wm.cli import main

    cfg = Path(__file__).resolve().parents[1] / "configs" / "worldmodels" / "carracing" / "record.yaml"
    main(
        [
            "record",
            "--config",
            str(cfg),
            "--episodes",
            "1",
            "--data.init_args.env.num_envs",
            "1",
            "--data.init_args.env.max_episode_steps",
            "60",
            "--data.init_args.directory",
            "frames",
        ]
    )
    store = EpisodeStore("frames")
    (path,) = store.paths()
    action = store.load(path)["action"][:-1]  # the last row's action is zero by convention
    assert action.shape == (60, 3)
    assert (action[:, 1] > 0).mean() > 0.8 and action[:, 2].mean() < 0.05
    assert "recorded 1 episodes" in capsys.readouterr().out


def test_run_episodes_takes_a_fixed_share_from_each_env(tmp_path):
    """Env 0's episodes last 2 steps, env 1's 9: 'the first 6 to finish' would be five short
    ones; fixed shares give 3 + 3, and the store holds exactly those 6."""
    env = countdown_envs([2, 9])
    spec = EnvSpec(env.single_observation_space, env.single_action_space, "countdown")
    store = EpisodeStore(tmp_path / "eps")
    collector = Collector(env, CountingAgent(), store=store, spec=spec)
    episodes = collector.run_episodes(6)
    assert sorted(e["length"] for e in episodes) == [2, 2, 2, 9, 9, 9]
    assert sorted(e["env"] for e in episodes) == [0, 0, 0, 1, 1, 1]
    assert len(store) == 6 and collector.stats.episodes == 6
    # 5 episodes over 2 envs: shares 3 and 2
    assert sorted(
        e["length"] for e in Collector(countdown_envs([2, 9]), CountingAgent(), spec=spec).run_episodes(5)
    ) == [
        2,
        2,
        2,
        9,
        9,
    ]


def test_collect_chunk_is_time_major_and_matches_collect():
    """``collect_chunk(T)`` gives the rows ``collect`` would add, stacked ``[T, N, ...]``."""
    lengths = [2, 3]
    chunks = Collector(countdown_envs(lengths), CountingAgent())
    rows = [chunks.collect_chunk(4), chunks.collect_chunk(7)]
    for chunk, steps in zip(rows, (4, 7)):
        assert chunk["obs"].shape == (steps, 2, 2) and chunk["is_first"].shape == (steps, 2)
        assert chunk["action"].dtype == np.int64 and chunk["calls"].shape == (steps, 2)
    for env, length in enumerate(lengths):
        expected = expected_rows(length, 11)
        for t, row in enumerate(expected):
            chunk, s = (rows[0], t) if t < 4 else (rows[1], t - 4)
            assert tuple(chunk["obs"][s, env]) == row["obs"], (env, t)
            assert chunk["reward"][s, env] == row["reward"] and chunk["action"][s, env] == row["action"]
            assert bool(chunk["is_last"][s, env]) == row["is_last"] and chunk["calls"][s, env] == row["calls"]
    assert chunks.stats.env_steps == 22 and len(chunks.stats.pop_finished()) == 5
    assert "policy_version" not in rows[0]


def test_collect_chunk_overlap_and_policy_version():
    """With ``overlap`` chunk k holds rows kT..kT+T: its first row is the previous chunk's last."""
    collector = Collector(countdown_envs([3, 5]), CountingAgent())
    collector.policy_version = 7
    first = collector.collect_chunk(4, overlap=True)
    collector.policy_version = 8
    second = collector.collect_chunk(4, overlap=True)
    assert first["obs"].shape[0] == 5 and second["obs"].shape[0] == 5
    for key in ("obs", "reward", "is_first", "is_last", "action", "calls", "policy_version"):
        np.testing.assert_array_equal(second[key][0], first[key][-1])
    assert (first["policy_version"] == 7).all() and (second["policy_version"][1:] == 8).all()
    assert second["policy_version"].dtype == np.int64
    assert collector.stats.env_steps == 2 * 9  # the shared row is stepped once
    for env, length in enumerate([3, 5]):
        expected = expected_rows(length, 9)
        for t in range(9):
            chunk, s = (first, t) if t < 5 else (second, t - 4)
            assert tuple(chunk["obs"][s, env]) == expected[t]["obs"]


def test_seeds_per_env():
    """A list of seeds seeds env i's first reset with seeds[i]; an int with seeds + i."""
    cfg = EnvConfig("CartPole-v1", num_envs=3)
    spec = env_spec(cfg)
    first = Collector(make_vector_env(cfg), RandomAgent(spec, seed=0), seeds=[11, 5, 42]).collect_chunk(1)["obs"][0]
    for i, seed in enumerate([11, 5, 42]):
        single = gym.make("CartPole-v1")
        np.testing.assert_array_equal(first[i], single.reset(seed=seed)[0])
    as_int = Collector(make_vector_env(cfg), RandomAgent(spec, seed=0), seeds=5).collect_chunk(1)["obs"][0]
    np.testing.assert_array_equal(as_int[0], gym.make("CartPole-v1").reset(seed=5)[0])
    np.testing.assert_array_equal(as_int[2], gym.make("CartPole-v1").reset(seed=7)[0])
    import pytest

    with pytest.raises(ValueError, match="one per env"):
        Collector(make_vector_env(cfg), RandomAgent(spec, seed=0), seeds=[1, 2])
