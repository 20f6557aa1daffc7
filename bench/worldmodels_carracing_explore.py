"""Does the CarRacing data agent get off the start? It against a uniform random agent.

A uniform random agent brakes half the time and jitters its steering, so it barely leaves the
start and V and M never see most of the track. ``configs/worldmodels/carracing/record.yaml``
records with a smoothed, brake-light random policy instead. This script plays the same random
tracks (same seeds) with both and reports, per agent, the mean over episodes of the tiles
visited (CarRacing's own ``tile_visited_count``) and of the return:

    python bench/worldmodels_carracing_explore.py --episodes 4 --steps 300

Each episode is cut at ``--steps`` agent steps (CarRacing's full episode is 1000).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_wm.envs import EnvConfig, env_spec, make_env  # noqa: E402
from lightning_wm.policies import RandomAgent  # noqa: E402

RECORD_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "worldmodels" / "carracing" / "record.yaml"


def data_agent_options(path: Path = RECORD_CONFIG) -> dict[str, Any]:
    """The RandomPolicy options of the CarRacing record config (``correlation``, ``action_mean``, ...)."""
    options = dict(yaml.safe_load(path.read_text())["model"]["init_args"])
    options.pop("seed", None)
    return options


def explore(options: dict[str, Any], episodes: int, steps: int, seed: int = 0) -> dict[str, float]:
    """Play ``episodes`` CarRacing-v3 episodes of at most ``steps`` steps with a
    :class:`RandomAgent` of ``options`` (``{}``: uniform random actions); episode ``i`` is the
    track of seed ``seed + i``. Returns the means over episodes of ``tiles`` (tiles visited),
    ``tile_fraction`` (of the track's tiles) and ``return``."""
    config = EnvConfig("CarRacing-v3", size=(16, 16), kwargs={"continuous": True})
    agent = RandomAgent(env_spec(config), seed=seed, **options)
    env = make_env(config)
    tiles, fractions, returns = [], [], []
    try:
        for i in range(episodes):
            env.reset(seed=seed + i)
            state, total = agent.initial_state(1), 0.0
            for _ in range(steps):
                action, state, _ = agent.act(None, state)
                _, reward, terminated, truncated, _ = env.step(action[0].numpy())
                total += float(reward)
                if terminated or truncated:
                    break
            race = env.unwrapped
            tiles.append(race.tile_visited_count)
            fractions.append(race.tile_visited_count / len(race.track))
            returns.append(total)
    finally:
        env.close()
    return {
        "tiles": float(np.mean(tiles)),
        "tile_fraction": float(np.mean(fractions)),
        "return": float(np.mean(returns)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"CarRacing-v3, {args.episodes} tracks (seeds {args.seed}..), {args.steps} steps each")
    print("| agent | tiles visited | of the track | return |")
    print("| --- | --- | --- | --- |")
    for name, options in (("uniform random", {}), ("record.yaml's data agent", data_agent_options())):
        r = explore(options, args.episodes, args.steps, args.seed)
        print(f"| {name} | {r['tiles']:.1f} | {100 * r['tile_fraction']:.1f}% | {r['return']:.1f} |")


if __name__ == "__main__":
    main()
