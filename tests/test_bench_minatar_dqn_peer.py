"""bench/minatar_dqn_peer.py: parsing the peer child's output into a record, on a canned
sample written by hand (the peer's venv and their dqn.py are not needed)."""

import json

import pytest

from support.bench_scripts import load_bench_script

peer = load_bench_script("minatar_dqn_peer.py")

CONFIG = {
    "game": "breakout",
    "seed": 0,
    "num_frames": 1000000,
    "sticky_action_prob": 0.1,
    "minatar": "1.0.15",
    "torch": "2.13.0+cpu",
    "torch_threads": 1,
    "device": "cpu",
}

# What the child prints, their own logging lines mixed in, the last line cut by a kill.
CANNED = f"""peer_config {json.dumps(CONFIG)}
Cuda available?: False
peer_episode 100000 1.0
peer_progress 100000 400.0
INFO:root:Episode 1000 | Return: 1.0 | Avg return: 0.6 | Frame: 100000 | Time per frame: 0.004
peer_episode 200000 3.0
peer_progress 200000 900.0
peer_episode 260000 5.0
peer_progress 260000 1300.0
peer_episode 2600
""".splitlines(keepends=True)


def test_parse_output_reads_config_episodes_and_progress_and_skips_the_rest():
    config, episodes, progress = peer.parse_output(CANNED)
    assert config == CONFIG
    assert episodes == [(100000, 1.0), (200000, 3.0), (260000, 5.0)]
    assert progress == [(100000, 400.0), (200000, 900.0), (260000, 1300.0)]


def test_summarize_gives_checkpoints_reached_and_none_beyond():
    record = peer.summarize(CANNED, "breakout", 0, 1_000_000)
    at = record["mean_last100_return_at"]
    assert at["250000"] == pytest.approx(2.0)  # episodes ending by 250k: returns 1 and 3
    assert at["500000"] is None and at["750000"] is None and at["1000000"] is None
    curve = record["mean_last100_return_every_50k"]
    assert list(curve) == ["50000", "100000", "150000", "200000", "250000"]
    assert curve["50000"] is None and curve["150000"] == pytest.approx(1.0)
    assert curve["200000"] == pytest.approx(2.0)
    assert record["frames_reached"] == 260000 and record["episodes"] == 3
    assert record["final_mean_last100_return"] == pytest.approx(3.0)
    assert record["frames_per_second"] == pytest.approx(200.0)  # 260000 frames / 1300 s
    assert record["sticky_action_prob"] == 0.1 and record["minatar"] == "1.0.15"


def test_mean_last_returns_keeps_only_the_last_hundred_ended_by_the_frame():
    episodes = [(1000 * (i + 1), float(i)) for i in range(120)]  # return i ends at frame 1000(i+1)
    assert peer.mean_last_returns(episodes, 120_000) == pytest.approx(69.5)  # returns 20..119
    assert peer.mean_last_returns(episodes, 50_500) == pytest.approx(24.5)  # returns 0..49
    assert peer.mean_last_returns(episodes, 999) is None
    assert peer.mean_last_returns(episodes, 3000, window=2) == pytest.approx(1.5)  # returns 1, 2


def test_child_script_compiles_and_prints_the_tags_the_parser_reads():
    compile(peer.CHILD, "minatar_dqn_peer_child", "exec")
    for tag in (peer.CONFIG_TAG, peer.EPISODE_TAG, peer.PROGRESS_TAG):
        assert tag in peer.CHILD
    assert "__EPISODE__" not in peer.CHILD
