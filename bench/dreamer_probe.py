"""What a Dreamer run's networks make of its own replay: whether the reward head sees the real
rewards (from the posterior, and from the prior that imagination steps with), how sure the actor
is, how often imagination dreams a reward against the replay's real rate, and the critic's values
against the real discounted returns. For a run that does not learn, it says which part is blind.

    python bench/dreamer_probe.py /work/runs/dr/dreamer-asterix-seed0 --windows 256 --length 64

``RUN`` is a ``bench/minatar.py --run-dir`` run folder (``config.yaml``, ``bench.ckpt`` and the
replay file the checkpoint names) or any folder holding a Dreamer checkpoint (``--checkpoint``),
its ``config.yaml`` and the replay file saved with that checkpoint. Windows of ``--length`` rows are drawn
uniformly from the replay (seeded); a reward counts as seen where the prediction is at least half
of it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from probelib import action_shares, discounted_returns, print_figures, probe_parser, run_windows, seen

from lightning_wm.agents.dreamer import Dreamer


@torch.no_grad()
def probe(module: Dreamer, batch: dict[str, torch.Tensor]) -> dict[str, float | str]:
    """The probe's figures over the windows ``batch [N, L, ...]``."""
    wm, dist = module.wm, module.actor_distribution
    _, _, post = module.world_model_loss(batch)
    feat = torch.cat([post["h"], post["z"]], -1)  # [N, L, F]
    reward = batch["reward"].float()
    rewarded = reward != 0
    from_post = wm.head_mean(wm.reward_head(feat))
    prior = wm._sample(wm.prior_stats(post["h"]), None, mode=True)  # what imagination steps with
    from_prior = wm.head_mean(wm.first_layer(wm.reward_head, {"h": post["h"], **prior}))
    raw = module.actor_output(feat)
    entropy = dist.entropy_and_log_prob(raw, raw, False)[0]  # the draw is unused without log_prob
    value = wm.head_mean(module.critic(feat))
    figures = {
        "rows": float(reward.numel()),
        "real reward a row": float(reward.mean()),
        "rewarded rows": float(rewarded.float().mean()),
        **seen("posterior", from_post, reward, rewarded),
        **seen("prior", from_prior, reward, rewarded),
        "actor entropy (nats)": float(entropy.mean()),
        "actor entropy, of uniform": float(entropy.mean()) / math.log(raw.shape[-1]) if module.discrete else math.nan,
        **(action_shares(raw, batch["action"]) if module.discrete else {}),
        **_real_returns(value, reward, batch, module.behavior.discount),
    }
    figures.update(_imagined(module, post))
    return figures


def _real_returns(value: torch.Tensor, reward: torch.Tensor, batch: dict, discount: float) -> dict[str, float]:
    """The critic's value ``[N, L]`` on the first half of each window against the real discounted
    return from there: ``G_t = r_{t+1} + γ (1 - terminal_{t+1}) G_{t+1}``, to the window's end
    (bootstrapped with the critic there) or the episode's last row (0 if terminal, else the
    critic's value)."""
    returns = discounted_returns(value, reward, batch["is_terminal"].bool(), batch["is_last"].bool(), discount)
    half = reward.shape[1] // 2
    return {
        "critic value (first half)": float(value[:, :half].mean()),
        "real discounted return (first half)": float(returns[:, :half].mean()),
    }


def _imagined(module: Dreamer, post: dict[str, Any]) -> dict[str, float]:
    """Imagine the run's horizon from every replayed posterior state with the actor."""
    start = {k: v.reshape(-1, *v.shape[2:]) for k, v in post.items() if k in ("h", "z", "idx")}
    traj = module.imagine(start, torch.ones(start["h"].shape[0]))
    rewards = traj["rewards"]
    return {
        "imagined reward a step": float(rewards.mean()),
        "imagined steps with a reward >= 0.5": float((rewards >= 0.5).float().mean()),
        "imagined λ-return": float(traj["returns"].mean()),
    }


def main() -> None:
    parser = probe_parser(__doc__)
    args = parser.parse_args()
    module, _, batch = run_windows(Dreamer, args, __file__)
    print_figures(args.run.name, probe(module, batch))


if __name__ == "__main__":
    main()
