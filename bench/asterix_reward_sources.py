"""Where MinAtar Asterix's rewards come from under uniformly random play: the share earned by the
player stepping onto gold that the frame shows in the cell it moves to (predictable from the frame
and the action, as far as sticky actions let the action happen), against gold that moves onto the
player (its move timer is not in the frame). The ceiling against which a learned reward head is
read (``bench/muzero_probe.py``, ``bench/dreamer_probe.py``).

    python bench/asterix_reward_sources.py --episodes 3000

The game's own ``Env`` (``minatar.environments.asterix``), without sticky actions: the player's move
is the action's.
"""

from __future__ import annotations

import argparse

import numpy as np
from benchlib import unshadow_minatar

MOVES = {"l": (-1, 0), "r": (1, 0), "u": (0, -1), "d": (0, 1)}


def reward_sources(episodes: int, seed: int) -> dict[str, float]:
    """Counts of rewarded steps by source over ``episodes`` random episodes, and the steps."""
    from minatar.environments.asterix import Env

    rng, env = np.random.default_rng(seed), Env()
    env.random = np.random.RandomState(seed + 1)
    by_step, by_gold, steps = 0, 0, 0
    for _ in range(episodes):
        env.reset()
        while not env.terminal:
            action = int(rng.integers(5))  # no-op and the four moves (fire does nothing here)
            dx, dy = MOVES.get(env.action_map[action], (0, 0))
            x, y = min(9, max(0, env.player_x + dx)), min(8, max(1, env.player_y + dy))
            gold_there = bool(env.state()[y, x, env.channels["gold"]])
            reward, _ = env.act(action)
            steps += 1
            if reward:
                by_step += gold_there
                by_gold += not gold_there
    return {"steps": steps, "by the player's step": by_step, "by gold moving": by_gold}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    unshadow_minatar(__file__)
    counts = reward_sources(args.episodes, args.seed)
    rewarded = counts["by the player's step"] + counts["by gold moving"]
    print(
        f"{args.episodes} random episodes, {counts['steps']:,} steps, {rewarded:,} rewarded "
        f"({rewarded / counts['steps']:.4f} a step)"
    )
    for source in ("by the player's step", "by gold moving"):
        print(f"  {source}: {counts[source]:,} ({counts[source] / max(rewarded, 1):.1%})")


if __name__ == "__main__":
    main()
