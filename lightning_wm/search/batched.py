"""The batched search: :func:`mcts` from ``B`` roots over any ``recurrent_fn`` (the conventions
are in :mod:`lightning_wm.search`) and what it returns, :class:`SearchOutput`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from lightning_wm.search.captured import capturable, simulation_graph
from lightning_wm.search.draws import dirichlet_noise, sample_gumbel, select_action
from lightning_wm.search.forest import Forest, Rule, compiled_simulate, simulate
from lightning_wm.search.rules import GumbelRule, PuctRule

__all__ = ["RecurrentFn", "SearchOutput", "mcts"]

RecurrentFn = Callable[[Any, Tensor], tuple[Any, Tensor, Tensor, Tensor]]


@dataclass
class SearchOutput:
    """What one batched search returns (``B`` roots, ``A`` actions).

    Attributes:
        action: ``[B]`` int64, the action to take.
        visit_probs: ``[B, A]`` policy target, sums to 1: root visit counts normalised (PUCT) or
            the improved policy ``softmax(logits + sigma(completed q))`` (Gumbel).
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


def _plain_output(search: Callable[..., SearchOutput]) -> Callable[..., SearchOutput]:
    """Run ``search`` under ``torch.inference_mode`` (no autograd bookkeeping: less overhead per
    tiny op) and hand back plain tensors (inference tensors cannot be saved for backward)."""

    @functools.wraps(search)
    def run(*args: Any, **kwargs: Any) -> SearchOutput:
        with torch.inference_mode():
            out = search(*args, **kwargs)
        return SearchOutput(*(getattr(out, f.name).clone() for f in fields(SearchOutput)))

    return run


@_plain_output
def mcts(
    recurrent_fn: RecurrentFn,
    root_state: Any,
    root_logits: Tensor,
    root_value: Tensor,
    *,
    num_simulations: int,
    discount: float,
    pb_c_init: float = 1.25,
    pb_c_base: float = 19652.0,
    dirichlet_alpha: float = 0.3,
    exploration_fraction: float = 0.25,
    explore: bool = True,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    legal_actions_mask: Tensor | None = None,
    gumbel: bool = False,
    max_num_considered_actions: int = 16,
    gumbel_scale: float = 1.0,
    c_visit: float = 50.0,
    c_scale: float = 0.1,
    unvisited_q: str = "zero",
    compile: bool = False,
    cuda_graphs: bool = False,
) -> SearchOutput:
    """Search ``num_simulations`` times from each of ``B`` roots.

    Args:
        recurrent_fn: ``(state [B, ...], action [B] int64) -> (next_state [B, ...], reward [B],
            logits [B, A], value [B])`` — the model's dynamics and prediction (no grad needed).
            ``state`` may be any pytree of tensors with the batch first.
        root_state: the roots' latent states (pytree, batch first).
        root_logits: ``[B, A]`` prior logits at the roots.
        root_value: ``[B]`` predicted values at the roots (its dtype is the search's dtype).
        num_simulations: expansions per root (>= 1).
        discount: per-step discount inside the tree.
        pb_c_init, pb_c_base: PUCT constants (MuZero: 1.25, 19652).
        dirichlet_alpha, exploration_fraction: root noise ``(1 - f) P + f Dir(alpha)`` (PUCT, only
            when ``explore``).
        explore: noise at the root and a sampled action; ``False``: no noise, the argmax action.
        temperature: visit-count temperature for the sampled action (PUCT; see
            :class:`TemperatureSchedule`).
        generator: makes the noise and the sampled action reproducible.
        legal_actions_mask: ``[B, A]`` bool, actions allowed at the root (default: all).
        gumbel: Gumbel MuZero root selection and interior rule instead of PUCT + Dirichlet.
        max_num_considered_actions: Gumbel's ``m`` (actions sampled without replacement).
        gumbel_scale: scale of the Gumbel noise when ``explore`` (0: deterministic).
        c_visit, c_scale: Gumbel's ``sigma(q) = (c_visit + max N) * c_scale * q``.
        unvisited_q: PUCT's value of an unvisited child, ``"zero"`` or ``"mean"`` (see the
            module docstring).
        compile: run each simulation past its descent (``recurrent_fn`` on the chosen leaves, the
            new nodes' backup, the next descent) through ``torch.compile`` as one graph: the same
            search up to float rounding with a fraction of the per-simulation overhead, after a
            one-time compilation per ``recurrent_fn`` (a module's method: per module class), batch
            size, number of simulations, action count, rule, dtype and device (cached on disk).
            Needs a C++ compiler on CPU; ``recurrent_fn`` must be traceable (tensor code).
        cuda_graphs: on CUDA, run the simulation loop (the network calls included) as one
            captured CUDA graph per search shape (:mod:`~lightning_wm.search.captured`; PUCT
            searches with every action legal; the others, and a failed capture, run eagerly).
            The same kernels in the same order: the same search; with ``compile`` the graph
            records the compiled simulations (fewer, fused kernels to replay).
    """
    if unvisited_q not in ("zero", "mean"):
        raise ValueError(f"unvisited_q must be 'zero' or 'mean', got {unvisited_q!r}")
    if num_simulations < 1:
        raise ValueError(f"num_simulations must be >= 1, got {num_simulations}")
    if root_logits.dim() != 2:
        raise ValueError(f"root_logits must be [B, A], got {tuple(root_logits.shape)}")
    batch, num_actions = root_logits.shape
    if root_value.shape != (batch,):
        raise ValueError(f"root_value must be [B] = [{batch}], got {tuple(root_value.shape)}")
    dtype, device = root_value.dtype, root_value.device
    if legal_actions_mask is None:
        legal = torch.ones(batch, num_actions, dtype=torch.bool, device=device)
    else:
        legal = legal_actions_mask.to(device=device, dtype=torch.bool)
        if legal.shape != (batch, num_actions):
            raise ValueError(f"legal_actions_mask must be [B, A] = [{batch}, {num_actions}], got {tuple(legal.shape)}")
        if not bool(legal.any(-1).all()):
            raise ValueError("legal_actions_mask has a root without any legal action")
    neg_inf = torch.tensor(float("-inf"), dtype=dtype, device=device)
    logits = torch.where(legal, root_logits.to(dtype), neg_inf)
    prior = torch.softmax(logits, -1)

    if gumbel:
        scale = gumbel_scale if explore else 0.0
        noise = sample_gumbel((batch, num_actions), generator, device, dtype) * scale
        rule: Rule = GumbelRule(logits, noise, legal, num_simulations, max_num_considered_actions, c_visit, c_scale)
    else:
        if explore and exploration_fraction > 0:
            noise = dirichlet_noise(dirichlet_alpha, legal, generator).to(dtype)
            prior = (1 - exploration_fraction) * prior + exploration_fraction * noise
        rule = PuctRule(discount, pb_c_init, pb_c_base, num_simulations, legal, unvisited_q == "mean")

    graph = None
    if cuda_graphs and capturable(device, gumbel, legal_actions_mask):
        puct = (discount, pb_c_init, pb_c_base, num_simulations, legal, unvisited_q == "mean")
        graph = simulation_graph(
            recurrent_fn, root_state, prior, root_value.to(dtype), num_simulations, discount,
            lambda: PuctRule(*puct), ("puct", *puct[:4], puct[5]), compile,
        )  # fmt: skip
    if graph is not None:
        visits, q, root_val, max_depth = graph(root_state, prior, root_value.to(dtype))
        action = select_action(visits, explore, temperature, generator)
        probs = visits / visits.sum(-1, keepdim=True)
        return SearchOutput(action, probs, root_val, visits, q, prior, max_depth)

    tree = Forest(root_state, prior, root_value.to(dtype), num_simulations, discount)
    step = compiled_simulate() if compile else simulate
    parent, action = tree.descend(rule, tree.slot_ids[1])
    for slot in range(1, num_simulations + 1):
        # the network's step, the new leaf's backup, then the next simulation's descent (after the last: unused)
        try:
            parent, action = step(recurrent_fn, tree, rule, tree.slot_ids[slot], parent, action, compile)
        except Exception as err:
            if compile and type(err).__module__.startswith(("torch._dynamo", "torch._inductor")):
                raise RuntimeError(
                    f"the compiled search failed ({type(err).__name__}: "
                    f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}); torch.compile "
                    "on CPU needs a working C++ compiler (g++ or clang). Install one, or turn "
                    "the option off (search.compile: false / mcts(compile=False))"
                ) from err
            raise

    visits, q = tree.root_children()
    root_val = tree.root_value()
    if gumbel:
        assert isinstance(rule, GumbelRule)
        action = rule.final_action(tree)
        probs = rule.improved_policy(tree)
    else:
        action = select_action(visits, explore, temperature, generator)
        probs = visits / visits.sum(-1, keepdim=True)
    return SearchOutput(
        action=action,
        visit_probs=probs,
        root_value=root_val,
        visit_counts=visits,
        q_values=q,
        root_prior=prior,
        max_depth=tree.max_depth(),
    )
