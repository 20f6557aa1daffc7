"""Dreamer's actor: its action distribution, one acting step (filter the observation with the
RSSM's posterior, act on the features) and :class:`DreamerPolicy`, the acting copy that actor
processes receive.

Shapes: ``B`` batch, ``A`` action size (one-hot for discrete actions, in ``[-1, 1]`` for
continuous ones: the model's action format, :class:`~lightning_wm.actions.ActionCodec`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_wm.actions import ActionCodec
from lightning_wm.agents.dreamer.world_model import DreamerWorldModel, State
from lightning_wm.nn import dists
from lightning_wm.nn.codec import Obs
from lightning_wm.tree import first_leaf

__all__ = ["ActorDistribution", "DreamerPolicy", "filter_and_act", "initial_acting_state"]


@dataclass(frozen=True)
class ActorDistribution:
    """Dreamer's action distribution over the actor's raw output: ``[..., A]`` logits (discrete:
    one-hot categorical with ``unimix``) or ``[..., 2A]`` mean/std parameters (continuous:
    ``bounded_normal`` or ``tanh_normal`` with std in ``[min_std, max_std]``, actions in ``[-1, 1]``)."""

    discrete: bool
    unimix: float = 0.01
    kind: str = "bounded_normal"
    min_std: float = 0.1
    max_std: float = 1.0

    def continuous(self, raw: Tensor) -> tuple[Tensor, Tensor]:
        """``(mean, std) [..., A]`` of a continuous actor."""
        if self.kind == "bounded_normal":
            return dists.bounded_normal(raw, self.min_std, self.max_std)
        return dists.tanh_normal(raw, self.min_std, self.max_std)

    def action(self, raw: Tensor, explore: bool) -> Tensor:
        """A sample (``explore``; continuous samples reparameterised) or the mode: ``[..., A]``
        one-hot, or in ``[-1, 1]``. ``raw`` float32."""
        if explore:
            return self.sample(raw)[0]
        if self.discrete:
            return dists.onehot_argmax(raw)
        mean, _ = self.continuous(raw)
        return mean if self.kind == "bounded_normal" else torch.tanh(mean)

    def sample(self, raw: Tensor) -> tuple[Tensor, Tensor]:
        """``(action, draw)``, both ``[..., A]``: the action taken (one-hot, or in ``[-1, 1]``,
        reparameterised) and the draw of the distribution it comes from, whose log-probability
        :meth:`entropy_and_log_prob` takes: the one-hot itself (discrete), the Gaussian draw
        ``x`` before the clip (``bounded_normal``: the action is ``clip(x, -1, 1)``, a function
        of ``x``) or ``u`` before the tanh (``tanh_normal``: the action is ``tanh(u)``)."""
        if self.discrete:
            action = dists.sample_onehot(dists.unimix_probs(raw, self.unimix).detach())
            return action, action
        mean, std = self.continuous(raw)
        if self.kind == "bounded_normal":
            return dists.bounded_normal_sample(mean, std)
        u = mean + std * torch.randn_like(mean)
        return torch.tanh(u), u

    def entropy_and_log_prob(self, raw: Tensor, draw: Tensor, log_prob: bool) -> tuple[Tensor, Tensor | None]:
        """``(entropy [...], log π(draw) [...] or None)`` of the distribution of ``raw [..., *]``
        at ``draw [..., A]``, a draw of :meth:`sample` (the log-probability only when
        ``log_prob``; no gradient into the draw). ``bounded_normal``: the Gaussian's density at
        the draw before the clip, so the score ``∇ log π(x)`` is that of the action's own
        distribution (the clipped action's density under the unclipped Gaussian is not).
        ``tanh_normal``: the density of ``tanh(u)`` (its entropy is the pre-tanh Gaussian's: no
        closed form after the tanh)."""
        if self.discrete:
            logits = dists.unimix_logits(raw, self.unimix)
            return -(logits.exp() * logits).sum(-1), (logits * draw).sum(-1)
        mean, std = self.continuous(raw)
        entropy = dists.normal_entropy(std)
        if not log_prob:
            return entropy, None
        x = draw.detach()
        if self.kind == "tanh_normal":
            return entropy, dists.tanh_normal_log_prob(x, mean, std)
        return entropy, dists.normal_log_prob(x, mean, std)


def initial_acting_state(wm: DreamerWorldModel, actions: ActionCodec, batch_size: int, device: torch.device) -> State:
    """The state before an episode's first observation: zeros ``{"h", "z", "action"}``."""
    state = wm.zero_state(batch_size, device)
    state["action"] = actions.zeros(batch_size, device)
    return state


def filter_and_act(
    wm: DreamerWorldModel,
    actor: nn.Module,
    distribution: ActorDistribution,
    actions: ActionCodec,
    obs: Obs,
    state: State,
    explore: bool,
) -> tuple[Tensor, State, dict[str, Tensor]]:
    """One acting step: filter ``obs [B, ...]`` into the posterior after ``state`` (whose
    ``"action"`` is the previous action), act on its features, return ``(env action, state, {})``."""
    post = wm.obs_step(state, state["action"], wm.encode(obs))
    action = distribution.action(actor(wm.features(post)).float(), explore)
    return actions.decode(action), {"h": post["h"], "z": post["z"], "action": action}, {}


class DreamerPolicy(nn.Module):
    """Dreamer's acting copy (:meth:`Dreamer.acting_copy`): the world model's encoders and RSSM
    posterior path, the actor and the action codec; acts exactly like :meth:`Dreamer.act`."""

    def __init__(
        self,
        wm: DreamerWorldModel,
        actor: nn.Module,
        actions: ActionCodec,
        distribution: ActorDistribution,
        eval_policy: str = "mode",
    ) -> None:
        super().__init__()
        self.wm, self.actor, self.actions, self.distribution = wm, actor, actions, distribution
        self.eval_policy = eval_policy

    def initial_state(self, batch_size: int) -> State:
        return initial_acting_state(self.wm, self.actions, batch_size, self.wm.bins.device)

    @torch.no_grad()
    def act(self, obs: Obs, state: State | None, explore: bool) -> tuple[Tensor, State, dict[str, Tensor]]:
        if state is None:
            state = self.initial_state(first_leaf(obs).shape[0])
        explore = explore or self.eval_policy == "sample"
        return filter_and_act(self.wm, self.actor, self.distribution, self.actions, obs, state, explore)
