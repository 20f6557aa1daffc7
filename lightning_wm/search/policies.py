"""The search as policy functions in mctx's manner: :func:`muzero_policy` (PUCT, Dirichlet noise at
the root) and :func:`gumbel_muzero_policy` (Gumbel-top-k and sequential halving at the root) from
``B`` roots (:class:`Root`) over any ``recurrent_fn`` and one :class:`SearchSettings`, each
returning a :class:`PolicyOutput` (the conventions are in :mod:`lightning_wm.search`).

A policy prepares the roots (legal mask, prior, root noise), makes its selection rule
(:mod:`~lightning_wm.search.rules`), runs the simulations over a
:class:`~lightning_wm.search.forest.Forest` (:func:`~lightning_wm.search.forest.run_simulations`:
selection, expansion, backup), on CUDA as one captured graph where it can
(:mod:`~lightning_wm.search.captured`), and reads the action and the policy target off the root.
The discount is an argument of the policy and stored once, in the forest (the backup and ``Q``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_wm.search.captured import capturable, simulation_graph
from lightning_wm.search.draws import dirichlet_noise, sample_gumbel, select_action
from lightning_wm.search.forest import Forest, run_simulations
from lightning_wm.search.rules import GumbelRule, PuctRule
from lightning_wm.search.settings import SearchSettings

__all__ = ["RecurrentFn", "Root", "PolicyOutput", "muzero_policy", "gumbel_muzero_policy"]

#: ``(state [B, ...], action [B] int64) -> (next_state [B, ...], reward [B], logits [B, A],
#: value [B])``: the model's dynamics and prediction (no grad needed); ``state`` may be any
#: pytree of tensors with the batch first (mctx's ``recurrent_fn`` without its discount).
RecurrentFn = Callable[[Any, Tensor], tuple[Any, Tensor, Tensor, Tensor]]


class Root(NamedTuple):
    """The ``B`` roots of a search (mctx's ``RootFnOutput``).

    Attributes:
        state: the roots' latent states (pytree, batch first; mctx's ``embedding``).
        logits: ``[B, A]`` prior logits.
        value: ``[B]`` predicted values (their dtype is the search's dtype).
    """

    state: Any
    logits: Tensor
    value: Tensor


@dataclass
class PolicyOutput:
    """What a search policy returns (``B`` roots, ``A`` actions).

    Attributes:
        action: ``[B]`` int64, the action to take.
        visit_probs: ``[B, A]`` policy target, sums to 1 (mctx's ``action_weights``): root visit
            counts normalised (:func:`muzero_policy`) or the improved policy
            ``softmax(logits + sigma(completed q))`` (:func:`gumbel_muzero_policy`).
        root_value: ``[B]`` the root's search value (mean over its visits).
        visit_counts: ``[B, A]`` root children's visit counts.
        q_values: ``[B, A]`` root ``r + discount * V(child)`` (0 for unvisited actions).
        root_prior: ``[B, A]`` the prior used at the root (after the mask and the noise).
        max_depth: ``[B]`` int64, depth of the deepest leaf expanded (1 = a root child).
    """

    action: Tensor
    visit_probs: Tensor
    root_value: Tensor
    visit_counts: Tensor
    q_values: Tensor
    root_prior: Tensor
    max_depth: Tensor


def _plain_output(policy: Callable[..., PolicyOutput]) -> Callable[..., PolicyOutput]:
    """Run ``policy`` under ``torch.inference_mode`` (no autograd bookkeeping: less overhead per
    tiny op) and hand back plain tensors (inference tensors cannot be saved for backward)."""

    @functools.wraps(policy)
    def run(*args: Any, **kwargs: Any) -> PolicyOutput:
        with torch.inference_mode():
            out = policy(*args, **kwargs)
        return PolicyOutput(*(getattr(out, f.name).clone() for f in fields(PolicyOutput)))

    return run


def _root_logits(root: Root, legal_actions_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(legal [B, A] bool, logits [B, A])``: the checked mask (all legal by default) and the
    root logits in the search's dtype, ``-inf`` on illegal actions."""
    if root.logits.dim() != 2:
        raise ValueError(f"root logits must be [B, A], got {tuple(root.logits.shape)}")
    batch, num_actions = root.logits.shape
    if root.value.shape != (batch,):
        raise ValueError(f"root_value must be [B] = [{batch}], got {tuple(root.value.shape)}")
    dtype, device = root.value.dtype, root.value.device
    if legal_actions_mask is None:
        legal = torch.ones(batch, num_actions, dtype=torch.bool, device=device)
    else:
        legal = legal_actions_mask.to(device=device, dtype=torch.bool)
        if legal.shape != (batch, num_actions):
            raise ValueError(f"legal_actions_mask must be [B, A] = [{batch}, {num_actions}], got {tuple(legal.shape)}")
        if not bool(legal.any(-1).all()):
            raise ValueError("legal_actions_mask has a root without any legal action")
    neg_inf = torch.tensor(float("-inf"), dtype=dtype, device=device)
    return legal, torch.where(legal, root.logits.to(dtype), neg_inf)


@_plain_output
def muzero_policy(
    recurrent_fn: RecurrentFn,
    root: Root,
    settings: SearchSettings,
    *,
    discount: float,
    explore: bool = True,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    legal_actions_mask: Tensor | None = None,
) -> PolicyOutput:
    """MuZero's search: PUCT inside the tree, Dirichlet noise at the root when exploring.

    Args:
        recurrent_fn: the model's step (:data:`RecurrentFn`).
        root: the ``B`` roots.
        settings: ``num_simulations``, ``pb_c_init``, ``pb_c_base``, ``dirichlet_alpha``,
            ``exploration_fraction``, ``unvisited_q``, ``compile`` and ``cuda_graphs`` (the
            others are Gumbel's or the schedule's).
        discount: per-step discount inside the tree.
        explore: root noise ``(1 - f) P + f Dir(alpha)`` and an action sampled from the visit
            counts at ``temperature``; ``False``: no noise, the most visited action.
        temperature: the visit-count temperature of the sampled action.
        generator: makes the noise and the sampled action reproducible.
        legal_actions_mask: ``[B, A]`` bool, actions allowed at the root (default: all).

    With ``settings.cuda_graphs`` on CUDA and every action legal, the simulations replay as one
    captured CUDA graph per search shape (the same kernels in the same order: the same search;
    a failed capture runs eagerly). With ``settings.compile`` each simulation past its descent
    runs as one ``torch.compile`` graph (the same search up to float rounding, after a one-time
    compilation per network class and search shape; needs a C++ compiler on CPU).
    """
    legal, logits = _root_logits(root, legal_actions_mask)
    prior = torch.softmax(logits, -1)
    if explore and settings.exploration_fraction > 0:
        noise = dirichlet_noise(settings.dirichlet_alpha, legal, generator).to(prior.dtype)
        prior = (1 - settings.exploration_fraction) * prior + settings.exploration_fraction * noise
    value = root.value.to(prior.dtype)
    rule_args = (
        settings.pb_c_init,
        settings.pb_c_base,
        settings.num_simulations,
        legal,
        settings.unvisited_q == "mean",
    )
    graph = None
    if settings.cuda_graphs and capturable(value.device, legal_actions_mask):
        rule_key = ("puct", *rule_args[:3], rule_args[4])
        graph = simulation_graph(
            recurrent_fn, root.state, prior, value, settings.num_simulations, discount,
            lambda: PuctRule(*rule_args), rule_key, settings.compile,
        )  # fmt: skip
    if graph is not None:
        visits, q, root_value, max_depth = graph(root.state, prior, value)
    else:
        tree = Forest(root.state, prior, value, settings.num_simulations, discount)
        run_simulations(recurrent_fn, tree, PuctRule(*rule_args), settings.compile)
        (visits, q), root_value, max_depth = tree.root_children(), tree.root_value(), tree.max_depth()
    action = select_action(visits, explore, temperature, generator)
    probs = visits / visits.sum(-1, keepdim=True)
    return PolicyOutput(action, probs, root_value, visits, q, prior, max_depth)


@_plain_output
def gumbel_muzero_policy(
    recurrent_fn: RecurrentFn,
    root: Root,
    settings: SearchSettings,
    *,
    discount: float,
    explore: bool = True,
    generator: torch.Generator | None = None,
    legal_actions_mask: Tensor | None = None,
    gumbel_scale: float = 1.0,
    c_visit: float = 50.0,
    c_scale: float = 0.1,
) -> PolicyOutput:
    """Gumbel MuZero's search (Danihelka et al., 2022): Gumbel-top-k over ``g + logits`` with
    sequential halving at the root, the deterministic rule inside the tree; the action is the
    best of the last considered actions, the policy target the improved policy.

    Args:
        recurrent_fn, root, discount, generator, legal_actions_mask: as :func:`muzero_policy`.
        settings: ``num_simulations``, ``max_num_considered_actions`` and ``compile`` (eager on
            CUDA: never captured).
        explore: Gumbel noise at the root (``False``: none, a deterministic search).
        gumbel_scale: the noise's scale when exploring (mctx's ``gumbel_scale``).
        c_visit, c_scale: ``sigma(q) = (c_visit + max N) * c_scale * q`` (mctx's
            ``maxvisit_init`` and ``value_scale``).
    """
    legal, logits = _root_logits(root, legal_actions_mask)
    prior = torch.softmax(logits, -1)
    value = root.value.to(prior.dtype)
    scale = gumbel_scale if explore else 0.0
    noise = sample_gumbel(logits.shape, generator, value.device, value.dtype) * scale
    num_simulations = settings.num_simulations
    rule = GumbelRule(logits, noise, legal, num_simulations, settings.max_num_considered_actions, c_visit, c_scale)
    tree = Forest(root.state, prior, value, num_simulations, discount)
    run_simulations(recurrent_fn, tree, rule, settings.compile)
    visits, q = tree.root_children()
    return PolicyOutput(
        action=rule.final_action(tree),
        visit_probs=rule.improved_policy(tree),
        root_value=tree.root_value(),
        visit_counts=visits,
        q_values=q,
        root_prior=prior,
        max_depth=tree.max_depth(),
    )
