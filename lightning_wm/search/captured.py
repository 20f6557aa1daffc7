"""The simulation loop of :func:`~lightning_wm.search.muzero_policy` as one CUDA graph per search shape.

On a GPU the tensor search is bound by kernel launches (a 50-simulation search costs about the
same at batch 16 and 1024): every simulation launches the network's kernels and the tree's. A
:class:`SimulationGraph` records the whole loop — refilling the trees from the roots
(:meth:`Forest.reset`), every simulation's network call, backup and descent, and the root
statistics — once with ``torch.cuda.graph`` and replays it per search: one launch. Its static
inputs are the root states, priors (after the root noise) and values, copied in before each
replay; the network's weights are read where they live (updated in place by the optimizer).

Only PUCT searches with every action legal are captured (:func:`capturable`): the rule's
tables and the trees' shapes are then fixed by the search's settings. Graphs are kept per
(network, its weights' addresses, batch, actions, simulations, rule constants, dtype, autocast)
in a small cache; a search whose capture fails runs eagerly, with one warning.

The same code runs without capture (``capture=False``): the CPU tests compare it with
:func:`~lightning_wm.search.muzero_policy`.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_wm.search.forest import Forest, Rule, run_simulations
from lightning_wm.tree import tree_map

__all__ = ["SimulationGraph", "capturable", "simulation_graph"]

CACHE_SIZE = 8
_GRAPHS: OrderedDict[tuple, SimulationGraph | None] = OrderedDict()


def capturable(device: torch.device, legal_actions_mask: Tensor | None) -> bool:
    """Whether a PUCT search (:func:`~lightning_wm.search.muzero_policy`; Gumbel's is never
    captured) can run as a captured graph: on CUDA, every action legal."""
    return device.type == "cuda" and legal_actions_mask is None


class SimulationGraph:
    """``num_simulations`` simulations from fixed-shape roots, replayed as one CUDA graph.

    Args:
        recurrent_fn: the model's ``(state, action) -> (next_state, reward, logits, value)``.
        root_state, root_prior, root_value: roots of the shape this graph serves (``[B, ...]``,
            ``[B, A]`` after the root noise, ``[B]``); their values are copied, not kept.
        num_simulations, discount: as :func:`~lightning_wm.search.muzero_policy` (the discount
            goes to the graph's :class:`~lightning_wm.search.forest.Forest`).
        rule: the interior selection rule (PUCT); its tables move to the device in the warm-up.
        capture: record a CUDA graph (``False``: run the same steps eagerly on every call).
        compile: each simulation through ``torch.compile`` (:func:`~lightning_wm.search.forest.compiled_simulate`),
            compiled during the warm-up, so that the graph records the compiled (fused) kernels:
            fewer kernels per simulation to replay.
    """

    def __init__(
        self,
        recurrent_fn: Callable[..., Any],
        root_state: Any,
        root_prior: Tensor,
        root_value: Tensor,
        num_simulations: int,
        discount: float,
        rule: Rule,
        capture: bool = True,
        compile: bool = False,
    ) -> None:
        self.recurrent_fn, self.rule, self.compile = recurrent_fn, rule, compile
        self.static = tree_map(lambda x: x.detach().clone(), (root_state, root_prior, root_value))
        self.tree = Forest(*self.static, num_simulations, discount)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[Tensor, ...] = ()
        if capture:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: lazy initialisations, the rule's tables on the device
                self._simulate()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.outputs = self._simulate()

    @torch.no_grad()
    def _simulate(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Reset the trees to the static roots, run every simulation; ``(visits [B, A], q [B, A],
        root value [B], max depth [B])``."""
        tree = self.tree
        tree.reset(*self.static)
        run_simulations(self.recurrent_fn, tree, self.rule, self.compile)
        visits, q = tree.root_children()
        return visits, q, tree.root_value(), tree.max_depth()

    def __call__(
        self, root_state: Any, root_prior: Tensor, root_value: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The search statistics of these roots (fresh tensors: the next replay overwrites the graph's)."""
        tree_map(lambda store, x: store.copy_(x), self.static, (root_state, root_prior, root_value))
        if self.graph is None:
            return self._simulate()
        self.graph.replay()
        return tuple(x.clone() for x in self.outputs)  # type: ignore[return-value]


def _weights_key(recurrent_fn: Callable[..., Any]) -> tuple:
    """What the graph reads besides its inputs: the network (class, method) and where its weights live."""
    owner = getattr(recurrent_fn, "__self__", None)
    func = getattr(recurrent_fn, "__func__", recurrent_fn)
    if isinstance(owner, nn.Module):
        pointers = tuple(t.data_ptr() for t in (*owner.parameters(), *owner.buffers()))
        return (id(owner), type(owner), func, pointers)
    return (id(recurrent_fn), func)


def simulation_graph(
    recurrent_fn: Callable[..., Any],
    root_state: Any,
    root_prior: Tensor,
    root_value: Tensor,
    num_simulations: int,
    discount: float,
    make_rule: Callable[[], Rule],
    rule_key: tuple,
    compile: bool = False,
) -> SimulationGraph | None:
    """The cached :class:`SimulationGraph` of this search shape (captured on first use), or None
    when its capture failed (the caller searches eagerly)."""
    shapes = tree_map(lambda x: (tuple(x.shape), x.dtype), (root_state, root_prior, root_value))
    autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    key = (_weights_key(recurrent_fn), str(shapes), num_simulations, float(discount), rule_key, autocast)
    key = (*key, root_value.device.index, compile)
    if key in _GRAPHS:
        _GRAPHS.move_to_end(key)
        return _GRAPHS[key]
    try:
        graph = SimulationGraph(
            recurrent_fn, root_state, root_prior, root_value, num_simulations, discount, make_rule(), compile=compile
        )
    except Exception as err:  # noqa: BLE001 - any capture failure falls back to the eager search
        warnings.warn(
            f"the search's CUDA graph capture failed ({type(err).__name__}: {str(err).strip()[:200]}); "
            "searching without it (search.cuda_graphs: false turns the attempt off)",
            stacklevel=3,
        )
        graph = None
    _GRAPHS[key] = graph
    while len(_GRAPHS) > CACHE_SIZE:
        _GRAPHS.popitem(last=False)
    return graph
