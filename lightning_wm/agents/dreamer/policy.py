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
        if self.discrete:
            probs = dists.unimix_probs(raw, self.unimix)
            return dists.sample_onehot(probs.detach()) if explore else dists.onehot_argmax(raw)
        mean, std = self.continuous(raw)
        if not explore:
            return mean if self.kind == "bounded_normal" else torch.tanh(mean)
        sample = dists.bounded_normal_sample if self.kind == "bounded_normal" else dists.tanh_normal_sample
        return sample(mean, std)[0]

    def entropy_and_log_prob(self, raw: Tensor, actions: Tensor, log_prob: bool) -> tuple[Tensor, Tensor | None]:
        """``(entropy [...], log π(actions) [...] or None)`` of the distribution of ``raw [..., *]``
        at ``actions [..., A]`` (the log-probability only when ``log_prob``; with no gradient
        into the actions for continuous ones). For ``tanh_normal`` the entropy is the pre-tanh
        Gaussian's (no closed form after the tanh)."""
        if self.discrete:
            logits = dists.unimix_logits(raw, self.unimix)
            return -(logits.exp() * logits).sum(-1), (logits * actions).sum(-1)
        mean, std = self.continuous(raw)
        entropy = dists.normal_entropy(std)
        if not log_prob:
            return entropy, None
        a = actions.detach()
        if self.kind == "tanh_normal":
            u = torch.atanh(a.clamp(-0.999999, 0.999999))
            return entropy, dists.normal_log_prob(u, mean, std) - torch.log1p(-a.square() + 1e-6).sum(-1)
        return entropy, dists.normal_log_prob(a, mean, std)


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
