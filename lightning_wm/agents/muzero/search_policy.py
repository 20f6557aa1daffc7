"""MuZero's search policy: :func:`search`, one batched search from observations (the policy
function ``search.gumbel`` picks, :func:`~lightning_wm.search.muzero_policy` or
:func:`~lightning_wm.search.gumbel_muzero_policy`), which acting and reanalyse's targets both run;
and acting with it: :func:`act_with_search` (frame-stacked when ``frame_stack > 1``; the action by
visit counts and the rows' extras ``root_value [B]`` and ``visit_probs [B, A]``), which
:class:`~lightning_wm.agents.muzero.MuZero` and :class:`MuZeroPolicy`, the acting copy actor
processes run, both call."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_wm.agents.muzero.model import MuZeroModel
from lightning_wm.agents.muzero.windows import push_frame
from lightning_wm.search import PolicyOutput, Root, SearchSettings, gumbel_muzero_policy, muzero_policy

__all__ = ["search", "SearchStats", "MuZeroPolicy", "initial_frames", "act_with_search"]


def search(
    model: MuZeroModel,
    settings: SearchSettings,
    discount: float,
    obs: Tensor,
    explore: bool,
    temperature: float = 1.0,
    legal_actions_mask: Tensor | None = None,
) -> PolicyOutput:
    """One batched search from observations ``obs [B, *obs_shape]`` with ``model`` in eval mode
    (BatchNorm statistics), no gradients: Gumbel MuZero's with ``settings.gumbel``, else MuZero's
    (``temperature``: its visit-count temperature of an exploring action)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model.initial_inference(obs)
            root = Root(out["state"], out["policy_logits"], out["value"])
            options = {"discount": discount, "explore": explore, "legal_actions_mask": legal_actions_mask}
            if settings.gumbel:
                return gumbel_muzero_policy(model.recurrent_fn, root, settings, **options)
            return muzero_policy(model.recurrent_fn, root, settings, temperature=temperature, **options)
    finally:
        model.train(was_training)


class SearchStats:
    """Running means of what the acting searches saw (logged as ``search/*``)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.count, self.root_value, self.entropy, self.depth, self.max_depth = 0, 0.0, 0.0, 0.0, 0

    def add(self, out: PolicyOutput) -> None:
        probs = out.visit_probs.float()
        entropy = -(probs * torch.log(probs.clamp(min=1e-12))).sum(-1)
        n = int(out.root_value.numel())
        self.count += n
        self.root_value += float(out.root_value.float().sum())
        self.entropy += float(entropy.sum())
        self.depth += float(out.max_depth.float().sum())
        self.max_depth = max(self.max_depth, int(out.max_depth.max()))

    def means(self) -> dict[str, float]:
        n = max(1, self.count)
        return {
            "search/root_value": self.root_value / n,
            "search/visit_entropy": self.entropy / n,
            "search/depth": self.depth / n,
            "search/max_depth": float(self.max_depth),
        }


def initial_frames(model: MuZeroModel, batch_size: int, device: torch.device) -> Tensor | None:
    """The acting state before an episode: ``None``, or a zero frame stack ``[B, K, H, W, C]``."""
    if model.frame_stack == 1:
        return None
    return torch.zeros(batch_size, *model.obs_shape, dtype=torch.uint8, device=device)


def act_with_search(
    model: MuZeroModel,
    settings: SearchSettings,
    discount: float,
    temperature: float,
    obs: Tensor,
    state: Tensor | None,
    explore: bool,
    stats: SearchStats | None = None,
) -> tuple[Tensor, Any, dict[str, Tensor]]:
    """The one acting step of :class:`~lightning_wm.agents.muzero.MuZero` and
    :class:`MuZeroPolicy`: ``(action [B], state, {"root_value": [B], "visit_probs": [B, A]})``;
    search statistics of exploring steps go to ``stats``."""
    if model.frame_stack > 1:
        if state is None:
            state = initial_frames(model, obs.shape[0], obs.device)
        state = push_frame(state, obs)
        obs = state
    out = search(model, settings, discount, obs, explore, temperature)
    if explore and stats is not None:
        stats.add(out)
    return out.action, state, {"root_value": out.root_value.float(), "visit_probs": out.visit_probs.float()}


class MuZeroPolicy(nn.Module):
    """MuZero's acting copy: a model, the search settings and discount, and the current
    visit-count ``temperature`` as a buffer (so it travels with the published weights).

    ``act`` returns extras ``root_value [B]`` and ``visit_probs [B, A]``: the rows' search value
    and policy target.
    """

    def __init__(self, model: MuZeroModel, settings: SearchSettings, discount: float, temperature: float = 1.0) -> None:
        super().__init__()
        self.model, self.settings, self.discount = model, settings, float(discount)
        self.register_buffer("temperature", torch.tensor(float(temperature)))
        self.stats = SearchStats()

    @property
    def device(self) -> torch.device:
        return self.temperature.device

    def initial_state(self, batch_size: int) -> Tensor | None:
        return initial_frames(self.model, batch_size, self.device)

    @torch.no_grad()
    def act(self, obs: Tensor, state: Tensor | None, explore: bool) -> tuple[Tensor, Any, dict[str, Tensor]]:
        return act_with_search(
            self.model, self.settings, self.discount, float(self.temperature), obs, state, explore, self.stats
        )
