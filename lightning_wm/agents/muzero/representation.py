"""MuZero's representation for another agent (ALF's ``MuzeroRepresentationLearner``).

:class:`MuZeroRepresentation` is an encoder module: ``forward(obs [N, ...]) -> features [N, D]``
is the MuZero model's representation ``h(o)`` (min-max scaled hidden state, flattened), which
another agent's networks sit on (e.g. IMPALA's ``model.init_args.encoder``). The model is
trained with the MuZero losses (value, reward, policy, latent consistency over a ``K``-step
unroll through its dynamics) on windows cut from every position of the host agent's unroll
batches ``[B, T+1, ...]``, on its own schedule (``interval``), while the host learns on the
features, detached (``detach: true``, ALF's setting: only the MuZero losses shape the
representation) or not. The host calls :meth:`MuZeroRepresentation.representation_loss` from its
training step and adds the loss to its own.

Targets (:func:`~lightning_wm.agents.muzero.targets.muzero_targets`): n-step values over the
unroll's rewards bootstrapping from the model's own value (no gradient; ALF's learner
bootstraps from the values its model computed when acting), rewards, and as policy target the
host's behaviour policy ``softmax(logits)`` stored in the rows (no search runs here). A window
from position ``p`` holds the rows ``p..p + K + td_steps`` of the unroll that belong to ``p``'s
episode; rows past the unroll's end are treated as cut by the write head (the value bootstraps
from the last row there, later rewards and policies are masked).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from lightning_wm.agents.muzero.losses import Supports, loss_terms, unroll_model
from lightning_wm.agents.muzero.model import MuZeroModel
from lightning_wm.agents.muzero.settings import MuZeroLossSettings, MuZeroNet, UnrollSettings
from lightning_wm.agents.muzero.targets import muzero_targets
from lightning_wm.envs import EnvSpec
from lightning_wm.settings import as_settings

__all__ = ["MuZeroRepresentation", "unroll_windows", "windows_of"]


def windows_of(x: Tensor, width: int) -> Tensor:
    """``x [B, L, ...]`` -> ``[B * (L - 1), width, ...]``: the ``width`` rows from each position
    ``p = 0..L-2`` of each unroll (sample ``b * (L - 1) + p``), zeros past the unroll's end."""
    if x.shape[1] < 2:
        raise ValueError(f"unrolls need at least 2 rows, got {x.shape[1]}")
    B, L = x.shape[:2]
    pad = x.new_zeros(B, width - 1, *x.shape[2:])
    return torch.cat([x, pad], 1).unfold(1, width, 1)[:, : L - 1].movedim(-1, 2).flatten(0, 1)


def unroll_windows(batch: dict[str, Tensor], width: int) -> tuple[dict[str, Tensor], Tensor]:
    """Windows of ``width`` rows from every position of an unroll batch.

    ``batch``: ``obs [B, L, ...]``, ``action``, ``reward``, ``is_first``, ``is_last``,
    ``is_terminal`` ``[B, L]`` (rows of one env each, row convention). Returns ``(windows,
    position_ok)``: every key ``[B * (L - 1), width, ...]`` for the positions ``p = 0..L-2`` of
    each unroll (sample ``b * (L - 1) + p``), rows past the unroll's end zero, plus ``mask``:
    the rows that exist and belong to ``p``'s episode up to and including its last row (an
    ``is_first`` row starts another episode); ``position_ok [B * (L - 1)]``: ``p`` is not a last
    row (an action was taken there).
    """
    is_first, is_last = batch["is_first"].bool(), batch["is_last"].bool()
    B, L = is_first.shape

    def cut(x: Tensor) -> Tensor:
        return windows_of(x, width)

    exists = cut(torch.ones(B, L, dtype=torch.bool, device=is_first.device))
    last, first = cut(is_last), cut(is_first)
    # row j of a window belongs to the position's episode unless a last row came before it or a
    # first row starts at or before it (after the position itself)
    ended = torch.cumsum(last.long(), 1) - last.long() > 0
    restarted = torch.cumsum(first[:, 1:].long(), 1) > 0
    mask = exists & ~ended & ~torch.nn.functional.pad(restarted, (1, 0))
    windows = {k: cut(batch[k]) for k in ("obs", "action", "reward", "is_last", "is_terminal")}
    windows["mask"] = mask
    return windows, ~last[:, 0]


class MuZeroRepresentation(nn.Module):
    """A MuZero model whose representation is another agent's encoder, trained with MuZero's
    losses on the host's batches (module docstring). Discrete actions; vector or frame
    observations (the :class:`MuZeroModel` networks; one frame per observation).

    Args:
        env_spec: the env's spaces (the host passes it as the encoder's first argument).
        net: the networks (``MuZeroNet``; ``latent_dim``: the feature size for
            vectors).
        unroll: the unroll and its n-step targets (``UnrollSettings``;
            ``td_steps >= 1``; values bootstrap from the model's own, so ``bootstrap_value`` must
            stay ``target_network``).
        loss: the losses (``MuZeroLossSettings``; ``train_policy`` needs ``logits``
            columns, the host's behaviour policy).
        discount: γ of the value targets.
        detach: the host's gradients do not reach the representation (ALF's learner).
        interval: train every this many host steps (ALF's ``interval``).
        loss_weight: scale of the MuZero loss added to the host's.
    """

    def __init__(
        self,
        env_spec: EnvSpec,
        *,
        net: MuZeroNet = MuZeroNet(),
        unroll: UnrollSettings = UnrollSettings(),
        loss: MuZeroLossSettings = MuZeroLossSettings(),
        discount: float = 0.997,
        detach: bool = True,
        interval: int = 1,
        loss_weight: float = 1.0,
    ) -> None:
        super().__init__()
        net = as_settings(MuZeroNet, net, "net")
        unroll = as_settings(UnrollSettings, unroll, "unroll")
        loss = as_settings(MuZeroLossSettings, loss, "loss")
        if not env_spec.discrete:
            raise ValueError("MuZeroRepresentation needs a discrete action space (its dynamics take action indices)")
        if unroll.td_steps < 1 or interval < 1:
            raise ValueError(
                f"MuZeroRepresentation's unroll.td_steps and interval must be >= 1, got {unroll.td_steps}, {interval}"
            )
        if net.frame_stack != 1:
            raise ValueError(
                f"MuZeroRepresentation encodes one observation at a time; net.frame_stack must be 1, got {net.frame_stack}"
            )
        if unroll.bootstrap_value != "target_network":
            raise ValueError(
                "MuZeroRepresentation's value targets bootstrap from its model's own values (it has no stored "
                f"search values); unroll.bootstrap_value must be 'target_network', got {unroll.bootstrap_value!r}"
            )
        if not 0.0 <= discount <= 1.0:
            raise ValueError(f"discount must be in [0, 1], got {discount}")
        self.model = MuZeroModel(
            env_spec.observation_space, env_spec.action_dim, net, game_over_head=loss.train_game_over_function
        )
        self.out_dim = math.prod(self.model.state_shape)
        self.net, self.unroll, self.loss, self.discount = net, unroll, loss, float(discount)
        self.detach, self.interval, self.loss_weight = detach, interval, loss_weight

    def forward(self, obs: Tensor) -> Tensor:
        """``obs [N, *obs_shape]`` -> features ``[N, out_dim]``."""
        features = self.model.representation(obs).flatten(1)
        return features.detach() if self.detach else features

    def representation_loss(self, batch: dict[str, Any], step: int) -> tuple[Tensor, dict[str, Tensor]] | None:
        """The MuZero loss on the host's unroll batch ``[B, T+1, ...]`` (mean over the positions
        where an action was taken) and what to log: its parts and ``repr/feature_std``, the spread
        of the features over the batch's rows (the std of each feature, averaged; it falls towards
        0 when the representation maps every observation alike). None on the steps ``interval``
        skips."""
        if step % self.interval != 0:
            return None
        K, td = self.unroll.num_unroll_steps, self.unroll.td_steps
        width = K + td + 1
        windows, ok = unroll_windows(batch, width)
        obs = windows["obs"][ok]
        valid = windows["mask"][ok]
        with torch.no_grad():  # bootstrap values: the model's own, as when acting (once per row)
            rows = batch["obs"]
            inference = self.model.initial_inference(rows.flatten(0, 1))
            value = inference["value"].float().view(rows.shape[:2])
            value = windows_of(value, width)[ok]
            spread = inference["state"].flatten(1).float().std(0).mean()
        if self.loss.train_policy:
            if "logits" not in batch:
                raise ValueError(
                    "MuZeroRepresentation's train_policy needs the host's behaviour policy (logits) "
                    "in the rows; set loss.train_policy: false"
                )
            probs = torch.softmax(windows_of(batch["logits"].float(), width)[ok], -1)
        else:
            probs = torch.zeros(*valid.shape, self.model.num_actions, device=valid.device)
        fwd = {k: windows[k][ok] for k in ("reward", "is_last", "is_terminal", "action")}
        targets = muzero_targets(
            {**fwd, "mask": valid, "visit_probs": probs, "root_value": value},
            num_unroll_steps=K,
            td_steps=td,
            discount=self.discount,
            policy_after_end=self.unroll.policy_after_end,
            random_action_after_episode_end=self.unroll.random_action_after_episode_end,
        )
        out = unroll_model(self.model, obs, targets.actions, self.loss)
        parts = loss_terms(out, targets, valid, self.loss, Supports.of(self.model))
        total = sum(part.mean() for part in parts.values())  # the sum of the parts' batch means
        logs = {f"repr/{name}_loss": part.detach().mean() for name, part in parts.items()}
        logs["repr/loss"] = total.detach()
        logs["repr/feature_std"] = spread  # across the batch, mean over features: near 0 = the features collapsed
        return self.loss_weight * total, logs
