"""MuZero's loss over a K-step unroll (Schrittwieser et al. 2020, eq. 1; ALF's switches):

    l = sum_k w_k [ value_weight * CE(z_k, v_k) + reward_weight * CE(u_k, r_k)
                    + policy_weight * CE(pi_k, p_k) + game_over_weight * BCE(d_k, o_k)
                    + repr_weight * (1 - cos(P(s_k), sg(P'(h(o_{t+k}))))) ]

per sample, each term only where its target exists (the masks of
:class:`~lightning_wm.agents.muzero.targets.UnrollTargets`), values and rewards as categorical
cross-entropies over two-hot targets in the h-transformed support, step weights ``w_k`` by
:func:`unroll_step_weight`, and the batch's mean weighted by the importance weights of
prioritized replay.

* :func:`unroll_model` — the network side: the model unrolled along the targets' actions
  (hidden-state gradient scaled at every step) with the heads the loss needs
  (:class:`UnrollOutput`);
* :func:`loss_terms` — the weighted per-sample terms ``{name: [B]}`` (pure);
* :func:`muzero_loss` — the terms and their importance-weighted batch mean ``(loss, parts)`` (pure);
* :func:`priority` — the new replay priority of each position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_wm.agents.muzero.model import MuZeroModel
from lightning_wm.agents.muzero.settings import MuZeroLossSettings
from lightning_wm.agents.muzero.targets import UnrollTargets
from lightning_wm.nn import dists
from lightning_wm.nn.blocks import scale_gradient

__all__ = ["Supports", "UnrollOutput", "unroll_step_weight", "unroll_model", "loss_terms", "muzero_loss", "priority"]


@dataclass(frozen=True)
class Supports:
    """The categorical supports of value and reward: bins ``[K_v]``, ``[K_r]`` in the h-transformed
    space and the transform's ``eps`` (a model's ``value_bins``, ``reward_bins``, ``value_eps``)."""

    value_bins: Tensor
    reward_bins: Tensor
    eps: float

    @classmethod
    def of(cls, model: MuZeroModel) -> Supports:
        return cls(model.value_bins, model.reward_bins, model.value_eps)


@dataclass
class UnrollOutput:
    """What the unrolled model predicts, per unroll step ``k`` (``B`` samples).

    Attributes:
        policy_logits: ``K + 1`` tensors ``[B, A]`` (step 0 from the representation).
        value_logits: ``K + 1`` tensors ``[B, K_v]``.
        reward_logits: ``K`` tensors ``[B, K_r]`` (steps ``1..K``).
        game_over_logits: ``[B, K + 1]`` (the game-over head), or None.
        consistency: ``(predicted, target)`` ``[B, K, D]`` each for steps ``1..K``: the unrolled
            states through projector and predictor, the reached observations' representations
            through the projector (no gradient), or None.
        value0: ``[B]`` the network's value at the position (no gradient; the priorities).
    """

    policy_logits: list[Tensor]
    value_logits: list[Tensor]
    reward_logits: list[Tensor]
    game_over_logits: Tensor | None
    consistency: tuple[Tensor, Tensor] | None
    value0: Tensor


def unroll_step_weight(num_unroll_steps: int, rule: str) -> Tensor:
    """Weights ``[K + 1]`` of the unroll's steps in the loss: ``pseudocode`` (the MuZero pseudocode,
    ALF): step 0 weighs 1 and every unrolled step ``1 / K``; ``equal`` (EfficientZero, LightZero):
    every step weighs ``1 / K``, so the K unrolled steps together weigh K times step 0."""
    K = num_unroll_steps
    if rule == "pseudocode":
        return torch.tensor([1.0] + [1.0 / K] * K)
    if rule == "equal":
        return torch.full((K + 1,), 1.0 / K)
    raise ValueError(f"unroll_step_weights must be 'pseudocode' or 'equal', got {rule!r}")


def unroll_model(
    model: MuZeroModel,
    obs: Tensor,
    actions: Tensor,
    settings: MuZeroLossSettings,
) -> UnrollOutput:
    """Unroll ``model`` ``K`` steps from ``obs [B, W, ...]`` (row 0 the position; rows ``1..K`` the
    observations reached, for latent consistency) along ``actions [B, K]``, scaling the hidden
    state's gradient by ``recurrent_gradient_scaling_factor`` after every step, and run the heads
    ``settings`` trains (game over, consistency)."""
    K = actions.shape[1]
    root = model.initial_inference(obs[:, 0])
    state = root["state"]
    policy_logits, value_logits = [root["policy_logits"]], [root["value_logits"]]
    reward_logits, states = [], [state]
    for k in range(K):
        r_logits, state = model.dynamics(state, actions[:, k])
        p_logits, v_logits = model.prediction(state)
        reward_logits.append(r_logits)
        policy_logits.append(p_logits)
        value_logits.append(v_logits)
        states.append(state)
        state = scale_gradient(state, settings.recurrent_gradient_scaling_factor)
    game_over = None
    if settings.train_game_over_function:
        game_over = torch.stack([model.game_over_logit(s) for s in states], 1).float()
    consistency = None
    if settings.train_repr_prediction:
        B = obs.shape[0]
        with torch.no_grad():
            target = model.project(model.representation(obs[:, 1 : K + 1].flatten(0, 1))).view(B, K, -1)
        predicted = model.predict_projection(torch.stack(states[1:], 1).flatten(0, 1)).view(B, K, -1)
        consistency = (predicted, target)
    value0 = model.value(root["value_logits"].detach()).float()
    return UnrollOutput(policy_logits, value_logits, reward_logits, game_over, consistency, value0)


def loss_terms(
    out: UnrollOutput,
    targets: UnrollTargets,
    valid: Tensor,
    settings: MuZeroLossSettings,
    supports: Supports,
) -> dict[str, Tensor]:
    """The weighted per-sample terms ``{name: [B]}`` of :func:`muzero_loss`: ``value``, and as
    ``settings`` trains them ``reward``, ``policy``, ``game_over``, ``repr``. ``valid [B, W]``:
    the window's mask (the consistency term counts the steps whose observation exists)."""
    K = targets.actions.shape[1]
    step_weight = unroll_step_weight(K, settings.unroll_step_weights).to(valid.device)  # [K + 1]

    def total(per_step: Tensor, mask: Tensor) -> Tensor:  # [B, K + 1] -> [B]
        return (per_step * mask.float() * step_weight).sum(1)

    values = torch.stack(out.value_logits, 1).float()  # [B, K + 1, K_v]
    terms = {
        "value": settings.value_weight
        * total(dists.h_twohot_loss(values, targets.value, supports.value_bins, supports.eps), targets.value_mask)
    }
    if settings.train_reward_function:
        rewards = torch.stack(out.reward_logits, 1).float()  # [B, K, K_r]
        per_step = dists.h_twohot_loss(rewards, targets.reward[:, 1:], supports.reward_bins, supports.eps)
        terms["reward"] = settings.reward_weight * total(F.pad(per_step, (1, 0)), targets.reward_mask)
    if settings.train_policy:
        logp = torch.log_softmax(torch.stack(out.policy_logits, 1).float(), -1)  # [B, K + 1, A]
        terms["policy"] = settings.policy_weight * total(-(targets.policy * logp).sum(-1), targets.policy_mask)
    if settings.train_game_over_function:
        if out.game_over_logits is None:
            raise ValueError("loss.train_game_over_function needs the game-over logits of the unroll")
        bce = F.binary_cross_entropy_with_logits(out.game_over_logits, targets.game_over.float(), reduction="none")
        terms["game_over"] = settings.game_over_weight * total(bce, targets.game_over_mask)
    if settings.train_repr_prediction:
        if out.consistency is None:
            raise ValueError("loss.train_repr_prediction needs the consistency pair of the unroll")
        predicted, target = out.consistency
        cosine = F.cosine_similarity(predicted.float(), target.float(), dim=-1)  # [B, K]
        terms["repr"] = settings.repr_weight * total(F.pad(1.0 - cosine, (1, 0)), F.pad(valid[:, 1 : K + 1], (1, 0)))
    return terms


def muzero_loss(
    out: UnrollOutput,
    targets: UnrollTargets,
    valid: Tensor,
    settings: MuZeroLossSettings,
    supports: Supports,
    importance_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """MuZero's loss: the batch mean of the per-sample sums of :func:`loss_terms`, each sample
    weighted by its ``importance_weight [B]`` (prioritized replay) when given. Returns ``(loss,
    parts)``, ``parts`` the per-sample terms ``{name: [B]}``."""
    parts = loss_terms(out, targets, valid, settings, supports)
    per_sample = sum(parts.values())  # [B]
    loss = (per_sample * importance_weight).mean() if importance_weight is not None else per_sample.mean()
    return loss, parts


def priority(out: UnrollOutput, targets: UnrollTargets) -> Tensor:
    """Prioritized replay's new priority of each position ``[B]``: ``|v(s_0) - z_0| + 1e-6``, the
    distance of the network's value at the position from its n-step target (the paper's)."""
    return (out.value0 - targets.value[:, 0]).abs() + 1e-6
