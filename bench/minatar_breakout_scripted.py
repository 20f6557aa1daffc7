"""Scripted paddles on MinAtar Breakout: what a policy that ignores the bricks scores.

Why our IMPALA sits at ~6 on Breakout with a near-deterministic policy (bench/minatar_log.md):
three hand-written paddles read the game's own state (ball position and direction, paddle) and
play through ``minatar.Environment`` with and without sticky actions:

* ``track``: move toward the ball's column;
* ``land``: move toward the column where the ball will reach the paddle's row, bricks ignored
  (the game's wall rule: a ball that would leave the field stays at the edge for a step);
* ``land_above``: move toward the column the ball is in one row above the paddle's (the game
  bounces a ball that arrives straight above the paddle), bricks ignored.

    python bench/minatar_breakout_scripted.py --episodes 100

Prints one line per paddle: mean ± std of the episode return at sticky-action probability 0.1
(the benchmark's) and 0 (the game without noise). Needs the ``minatar`` extra.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import unshadow_minatar

LEFT, NOOP, RIGHT = 1, 0, 3  # MinAtar's full action indices ('l', 'n', 'r')
Paddle = Callable[[Any], int]


def toward(game: Any, column: int) -> int:
    """The action that moves the paddle one column toward ``column``."""
    return LEFT if column < game.pos else RIGHT if column > game.pos else NOOP


def landing(game: Any) -> tuple[int, int]:
    """(the column where the ball reaches row 9, its column one row above), bricks ignored."""
    x, y, d = game.ball_x, game.ball_y, game.ball_dir
    for _ in range(60):
        nx, ny = x + (-1 if d in (0, 3) else 1), y + (-1 if d in (0, 1) else 1)
        if nx < 0 or nx > 9:
            nx, d = min(max(nx, 0), 9), [1, 0, 3, 2][d]
        if ny < 0:
            ny, d = 0, [3, 2, 1, 0][d]
        elif ny == 9:
            return nx, x
        x, y = nx, ny
    return game.ball_x, game.ball_x


PADDLES: dict[str, Paddle] = {
    "track": lambda g: toward(g, g.ball_x),
    "land": lambda g: toward(g, landing(g)[0]),
    "land_above": lambda g: toward(g, landing(g)[1]),
}


def episode_returns(paddle: Paddle, episodes: int, sticky: float, max_steps: int, seed: int = 0) -> np.ndarray:
    """Returns of ``episodes`` episodes of ``paddle`` (each cut at ``max_steps`` steps), the game's
    random draws (ball start, sticky actions) seeded with ``seed``."""
    from minatar import Environment  # the package, once main() or the tests put bench/ last

    env = Environment("breakout", sticky_action_prob=sticky)
    env.seed(seed)
    returns = np.zeros(episodes)
    for i in range(episodes):
        env.reset()
        done, steps = False, 0
        while not done and steps < max_steps:
            reward, done = env.act(paddle(env.env))
            returns[i] += reward
            steps += 1
    return returns


def main(argv: list[str] | None = None) -> None:
    unshadow_minatar(__file__)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--max-steps", type=int, default=20000, help="steps per episode at most")
    parser.add_argument("--seed", type=int, default=0, help="seed of the game's random draws")
    args = parser.parse_args(argv)
    print(f"{Path(__file__).name}: {args.episodes} episodes each, cut at {args.max_steps} steps")
    for name, paddle in PADDLES.items():
        cells = []
        for sticky in (0.1, 0.0):
            r = episode_returns(paddle, args.episodes, sticky, args.max_steps, args.seed)
            cells.append(f"sticky {sticky}: {r.mean():8.2f} ± {r.std():7.2f}")
        print(f"{name:>10}  " + "   ".join(cells))


if __name__ == "__main__":
    main()
