"""What a MuZero run's networks make of its own replay: whether the dynamics' reward head sees the
real rewards one and more steps into an unroll along the replay's actions (what the search plans
with), whether the value head sees a reward coming, how sure the policy prior and the stored search
policies are, and the values against the real discounted returns. For a run that does not learn,
it says which part is blind.

    python bench/muzero_probe.py /work/runs/rea/rd2/muzero-asterix-seed0 --windows 256 --length 64

``RUN`` is a ``bench/minatar.py --run-dir`` run folder (``config.yaml``, ``bench.ckpt`` and the
replay file the checkpoint names) or any folder holding a MuZero checkpoint (``--checkpoint``), its
``config.yaml`` and the replay file saved with that checkpoint. The online network is probed (the
one that acts). Windows of ``--length`` rows are drawn uniformly from the replay (seeded); a reward
counts as seen where the prediction is at least half of it. Frame stacks are not supported (MinAtar
configs use one frame).
"""

from __future__ import annotations

import math

import torch
from probelib import action_shares, auc, discounted_returns, print_figures, probe_parser, run_windows, seen

from lightning_wm.agents.muzero import MuZero


@torch.no_grad()
def probe(module: MuZero, batch: dict[str, torch.Tensor], horizon: int = 10) -> dict[str, float | str]:
    """The probe's figures over the windows ``batch [N, L, ...]`` (``L > num_unroll_steps``);
    ``horizon``: the rows ahead within which a reward counts as coming for the value head."""
    if module.net.frame_stack != 1:
        raise SystemExit("error: the probe reads one frame a row; this run stacks frames (net.frame_stack > 1)")
    model = module.model
    reward, action = batch["reward"].float(), batch["action"].long()
    last, terminal = batch["is_last"].bool(), batch["is_terminal"].bool()
    N, L = reward.shape
    root = model.initial_inference(batch["obs"].flatten(0, 1))
    logits = root["policy_logits"].view(N, L, -1)
    value = root["value"].view(N, L).float()
    rewarded = reward != 0
    figures: dict[str, float | str] = {
        "rows": float(reward.numel()),
        "real reward a row": float(reward.mean()),
        "rewarded rows": float(rewarded.float().mean()),
        **_unrolled_rewards(
            model,
            root["state"].view(N, L, *root["state"].shape[1:]),
            action,
            reward,
            last,
            module.unroll.num_unroll_steps,
        ),
        **_value_sees_rewards(value, reward, last, horizon),
    }
    entropy = -(logits.log_softmax(-1) * logits.softmax(-1)).sum(-1)
    figures["prior entropy, of uniform"] = float(entropy.mean()) / math.log(logits.shape[-1])
    figures.update(action_shares(logits, action))
    figures.update(_stored_search(batch, logits))
    returns = discounted_returns(value, reward, terminal, last, module.discount)
    half = L // 2
    figures["value (first half)"] = float(value[:, :half].mean())
    figures["real discounted return (first half)"] = float(returns[:, :half].mean())
    return figures


def _unrolled_rewards(
    model: torch.nn.Module,
    state: torch.Tensor,
    action: torch.Tensor,
    reward: torch.Tensor,
    last: torch.Tensor,
    K: int,
) -> dict[str, float]:
    """The dynamics' reward ``k`` steps into an unroll from every row ``s`` (``state [N, L, ...]``
    the representation of each row) along the replay's actions, against the real reward entering
    row ``s + k`` (``reward [N, L]``), for ``k`` = 1, the middle and ``K`` (the run's
    ``num_unroll_steps``); only unrolls that stay in one episode (no last row among
    ``s .. s + k - 1``) count."""
    N, L = reward.shape
    shown = {1, (K + 1) // 2, K}
    starts = L - K
    current = state[:, :starts].flatten(0, 1)
    ended = torch.zeros(N, starts, dtype=torch.bool)
    figures: dict[str, float] = {}
    for k in range(1, K + 1):
        ended |= last[:, k - 1 : starts + k - 1]
        step = model.recurrent_inference(current, action[:, k - 1 : starts + k - 1].flatten())
        current = step["state"]
        if k in shown:
            real = reward[:, k : starts + k]
            inside = ~ended
            predicted = step["reward"].view(N, starts).float()
            figures.update(seen(f"dynamics, {k} step(s) in", predicted[inside], real[inside], real[inside] != 0))
    return figures


def _value_sees_rewards(
    value: torch.Tensor, reward: torch.Tensor, last: torch.Tensor, horizon: int
) -> dict[str, float]:
    """The AUC of the value ``[N, L]`` for rows with a reward within the next ``horizon`` rows of
    their episode against rows without (rows whose ``horizon`` runs past the window are left out)."""
    N, L = reward.shape
    rows = L - horizon
    coming = torch.zeros(N, rows, dtype=torch.bool)
    ended = torch.zeros(N, rows, dtype=torch.bool)
    for j in range(1, horizon + 1):
        ended |= last[:, j - 1 : rows + j - 1]
        coming |= ~ended & (reward[:, j : rows + j] != 0)
    return {
        f"rows with a reward within {horizon}": float(coming.float().mean()),
        f"value: AUC, a reward within {horizon} above none": auc(value[:, :rows], coming),
    }


def _stored_search(batch: dict[str, torch.Tensor], logits: torch.Tensor) -> dict[str, float]:
    """The replay's search policies (rows where a search ran): their entropy, and how often their
    most visited action is the prior's argmax now."""
    if "visit_probs" not in batch:
        return {}
    visits = batch["visit_probs"].float()
    searched = visits.sum(-1) > 0
    if not searched.any():
        return {}
    probs = visits[searched]
    entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1)
    agree = probs.argmax(-1) == logits[searched].argmax(-1)
    return {
        "stored search policy entropy, of uniform": float(entropy.mean()) / math.log(probs.shape[-1]),
        "stored search's most visited = prior's argmax now": float(agree.float().mean()),
    }


def main() -> None:
    parser = probe_parser(__doc__)
    parser.add_argument("--horizon", type=int, default=10, help="rows ahead a reward counts as coming")
    args = parser.parse_args()
    module, _, batch = run_windows(MuZero, args, __file__)
    print_figures(args.run.name, probe(module, batch, args.horizon))


if __name__ == "__main__":
    main()
