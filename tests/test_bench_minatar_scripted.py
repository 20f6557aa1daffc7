"""bench/minatar_breakout_scripted.py: the scripted paddles play MinAtar Breakout by its own rules."""

import pytest

from support.bench_scripts import load_bench_script

scripted = load_bench_script("minatar_breakout_scripted.py")


@pytest.fixture(autouse=True)
def _needs_minatar():
    pytest.importorskip("minatar.gym", reason='MinAtar is the optional extra: pip install -e ".[minatar]"')


def test_without_sticky_actions_tracking_never_misses_and_bricks_end_the_blind_paddles():
    track = scripted.episode_returns(scripted.PADDLES["track"], 2, sticky=0.0, max_steps=1000)
    assert (track > 50).all()  # alive at the cut: the ball is always caught
    for name, score in (("land", 3.0), ("land_above", 7.0)):  # a brick's bounce they never foresee
        returns = scripted.episode_returns(scripted.PADDLES[name], 3, sticky=0.0, max_steps=1000)
        assert (returns == score).all(), (name, returns)


def test_seeded_runs_repeat_and_the_script_prints_one_line_per_paddle(capsys):
    paddle = scripted.PADDLES["track"]
    first = scripted.episode_returns(paddle, 3, sticky=0.1, max_steps=300, seed=4)
    assert (scripted.episode_returns(paddle, 3, sticky=0.1, max_steps=300, seed=4) == first).all()
    scripted.main(["--episodes", "2", "--max-steps", "200"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == list(scripted.PADDLES)
