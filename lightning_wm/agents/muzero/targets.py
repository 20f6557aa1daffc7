"""MuZero's training targets for a ``K``-step unroll from replayed windows (pure functions).

A window is ``W = K + td_steps + 1`` consecutive rows (row convention) starting at a sampled
position ``t`` (never a last row), batch-major ``[B, W, ...]``, with ``mask [B, W]`` true for the
rows that exist and belong to ``t``'s episode up to and including its last row
(:class:`~lightning_wm.data.samplers.WindowSampler`). Unroll step ``k = 0..K`` sits at row ``k``:

* value: the n-step target of :func:`lightning_wm.returns.window_nstep_values` (game over =
  discount 0, truncation bootstraps, 0 past a termination, masked past a truncation or the
  write head);
* reward (``k >= 1``): ``reward[k]``, the reward on arriving at row ``k``; 0 past a termination;
  masked past a truncation;
* policy: the stored search policy ``visit_probs[k]`` where an action was taken at row ``k`` after
  a search (a row whose ``visit_probs`` are all zero, e.g. of the random prefill, has no policy
  target); at and past a termination uniform (``policy_after_end="uniform"``) or masked
  (``"mask"``); masked at and past a truncation;
* game over (``train_game_over_function``): the state at step ``k`` is the terminal one or past it;
* actions to unroll with: ``action[k]`` for ``k < K`` where one was taken; afterwards the last
  real action again, or uniformly random actions with ``random_action_after_episode_end`` (ALF).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_wm.returns import window_nstep_values


@dataclass
class UnrollTargets:
    """Targets of a ``K``-step unroll, batch-major; masks say which entries the loss counts."""

    actions: Tensor  # [B, K] int64: the action of unroll step k + 1
    value: Tensor  # [B, K + 1]
    value_mask: Tensor  # [B, K + 1] bool
    reward: Tensor  # [B, K + 1] (step 0 has none: 0, masked)
    reward_mask: Tensor  # [B, K + 1] bool
    policy: Tensor  # [B, K + 1, A]
    policy_mask: Tensor  # [B, K + 1] bool
    game_over: Tensor  # [B, K + 1] bool
    game_over_mask: Tensor  # [B, K + 1] bool


def bootstrap_rows(valid: Tensor, td_steps: Tensor, num_positions: int) -> Tensor:
    """The rows n-step value targets bootstrap from: ``valid [B, W]`` (a prefix per window),
    ``td_steps [B]`` (``-1``: the end of the window) -> bool ``[B, W]``, true at
    ``min(p + n, e)`` for the positions ``p < num_positions`` with ``p <= e`` (``e`` the last valid
    row), the rows whose values :func:`~lightning_wm.returns.window_nstep_values` reads."""
    batch, width = valid.shape
    last = valid.long().sum(1, keepdim=True) - 1  # [B, 1]
    n = torch.where(td_steps == -1, torch.full_like(td_steps, width), td_steps).view(-1, 1)
    p = torch.arange(num_positions, device=valid.device).unsqueeze(0)  # [1, P]
    rows = torch.minimum(p + n, last)  # [B, P]
    hits = torch.zeros(batch, width, dtype=torch.long, device=valid.device)
    hits.scatter_add_(1, rows.clamp(min=0), ((p <= last) & (last >= 0)).long())
    return hits > 0


def muzero_targets(
    window: dict[str, Tensor],
    *,
    num_unroll_steps: int,
    td_steps: int | Tensor,
    discount: float,
    value: Tensor | None = None,
    policy_after_end: str = "uniform",
    random_action_after_episode_end: bool = False,
    generator: torch.Generator | None = None,
) -> UnrollTargets:
    """Targets for ``K = num_unroll_steps`` from a window batch.

    Args:
        window: ``reward [B, W]``, ``is_last [B, W]``, ``is_terminal [B, W]``, ``action [B, W]``
            int64, ``visit_probs [B, W, A]``, ``root_value [B, W]``, ``mask [B, W]`` with
            ``W >= K + 1`` (``K + td_steps + 1`` for n-step targets within the window).
        td_steps: n of the n-step value targets (``-1``: Monte Carlo to the end of the window),
            one for all windows or one per window (int64 ``[B]``).
        value: ``[B, W]`` values to bootstrap from instead of the stored ``root_value`` (e.g. a
            target network's or reanalysed values; on the last row of a truncated episode the
            stored one is 0, since no search ran there).
        policy_after_end: ``"uniform"`` or ``"mask"`` — the policy target at and past a termination.
        random_action_after_episode_end: unroll past the episode end with random actions instead
            of repeating the last one (ALF's option of the same name).
        generator: for the random actions.
    """
    if policy_after_end not in ("uniform", "mask"):
        raise ValueError(f"policy_after_end must be 'uniform' or 'mask', got {policy_after_end!r}")
    k1 = num_unroll_steps + 1
    valid = window["mask"].bool()
    batch, width = valid.shape
    if width < k1:
        raise ValueError(f"a window of {width} rows is too short for {num_unroll_steps} unroll steps")
    is_last = window["is_last"].bool() & valid
    is_terminal = window["is_terminal"].bool() & valid
    reward = window["reward"].float()
    values = window["root_value"] if value is None else value
    target, value_mask = window_nstep_values(
        reward.t(), values.float().t(), is_terminal.t(), valid.t(), discount, td_steps, k1
    )
    last = valid.long().sum(1, keepdim=True) - 1  # [B, 1]: the episode's last row in the window
    terminated = is_terminal.gather(1, last)  # [B, 1]
    steps = torch.arange(k1, device=valid.device).unsqueeze(0)  # [1, K + 1]
    inside = steps <= last
    # reward of arriving at row k: real inside, 0 past a termination, unknown past a truncation
    reward_target = torch.where(inside, reward[:, :k1], torch.zeros_like(reward[:, :k1]))
    reward_mask = (inside | terminated) & (steps > 0)
    # policy: where an action was taken; uniform (or masked) at and past a termination
    probs = window["visit_probs"][:, :k1].float()
    acted = valid[:, :k1] & ~is_last[:, :k1] & (probs.sum(-1) > 0)
    num_actions = probs.shape[-1]
    after_termination = terminated & (steps >= last)
    policy = torch.where(acted.unsqueeze(-1), probs, torch.full_like(probs, 1.0 / num_actions))
    policy_mask = acted | (after_termination if policy_after_end == "uniform" else torch.zeros_like(acted))
    # actions to unroll with: real ones, then the last real one again (or random ones)
    action = window["action"][:, :num_unroll_steps].long()
    real = (valid & ~is_last)[:, :num_unroll_steps]
    last_real = (valid & ~is_last).long().sum(1, keepdim=True).clamp(min=1) - 1
    if random_action_after_episode_end:
        filler = torch.randint(0, num_actions, action.shape, generator=generator, device=action.device)
    else:
        filler = window["action"].long().gather(1, last_real).expand_as(action)
    actions = torch.where(real, action, filler)
    return UnrollTargets(
        actions=actions,
        value=target.t(),
        value_mask=value_mask.t(),
        reward=reward_target,
        reward_mask=reward_mask,
        policy=policy,
        policy_mask=policy_mask,
        game_over=after_termination,
        game_over_mask=inside | terminated,
    )
