"""``torch.compile`` of the learners' hot paths: one settings group for every family, one wrapper.

* :class:`CompileSettings` — every learner's ``compile`` group: ``mode`` (``none``, ``cells``,
  ``step``, ``graph``), ``cuda_graphs`` (CUDA graphs through ``torch.compile``'s ``reduce-overhead`` mode on
  CUDA) and ``max_shapes`` (how many input shapes get a compiled graph of their own).
* :class:`ShapeCompiled` — a function through ``torch.compile(dynamic=False)``, one graph per
  input shape up to ``max_shapes``; inputs of any further shape (the last short batch, an
  evaluation batch) run the eager function, so nothing is recompiled every step.
* :func:`as_compile_settings` — the group from YAML / code (``true`` / ``false`` stand for
  ``cells`` / ``none``, the older switch).

What each mode compiles is the family's choice (its docs say): ``cells`` the per-step modules
(Dreamer's RSSM cell and dense heads; MuZero's and IMPALA's networks), ``step`` the whole loss
function of a gradient step (its backward is compiled with it by AOTAutograd; the optimizer step
stays eager and uses the fused or foreach kernels of ``optim.implementation``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from lightning_wm.settings import as_settings, check_at_least, check_one_of

CompileMode = Literal["none", "cells", "step", "graph"]
COMPILE_MODES = ("none", "cells", "step", "graph")

__all__ = ["COMPILE_MODES", "CompileSettings", "ShapeCompiled", "as_compile_settings", "drop_compiled", "shape_key"]


@dataclass(frozen=True)
class CompileSettings:
    """Which hot path of a learner runs through ``torch.compile``.

    Attributes:
        mode: ``none`` (eager), ``cells`` (the per-step modules: short compile, few ops saved) or
            ``step`` (the whole loss of a gradient step and its backward as one graph: the fewest
            dispatched ops, a compile time of tens of seconds to minutes on a CPU) or ``graph``
            (Dreamer: on CUDA the whole gradient step -- losses, backward, clipping, the
            optimizers' steps -- recorded once as a CUDA graph of its eager kernels and replayed,
            :mod:`~lightning_wm.graph_capture`: no compile time; one device; eager elsewhere).
        cuda_graphs: on CUDA, ``step`` replays the compiled step as a CUDA graph
            (``torch.compile(mode="reduce-overhead")``: one launch per graph instead of one per
            kernel; static input copies cost memory of one batch and the graph's activations).
            Ignored on the CPU.
        max_shapes: distinct input shapes that each get a compiled graph; inputs of any other
            shape run eagerly (never a recompilation per step).
    """

    mode: CompileMode = "none"
    cuda_graphs: bool = True
    max_shapes: int = 2

    def __post_init__(self) -> None:
        check_one_of("compile.mode", self.mode, COMPILE_MODES)
        check_at_least("compile.max_shapes", self.max_shapes, 1)


def as_compile_settings(value: CompileSettings | Mapping[str, Any] | bool | None) -> CompileSettings:
    """The ``compile`` group: a :class:`CompileSettings`, a mapping of its fields, or a bool
    (``true``: ``cells``, ``false`` / null: ``none``)."""
    if isinstance(value, bool):
        return CompileSettings(mode="cells" if value else "none")
    return as_settings(CompileSettings, value, "compile")


def shape_key(tree: Any) -> tuple:
    """Shapes, dtypes and devices of the tensors of a nested structure (what a graph is specialised to)."""
    if isinstance(tree, torch.Tensor):
        return (tuple(tree.shape), tree.dtype, tree.device.type)
    if isinstance(tree, Mapping):
        return tuple((k, shape_key(v)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return tuple(shape_key(v) for v in tree)
    return (type(tree).__name__,)


class ShapeCompiled:
    """``fn`` through ``torch.compile(dynamic=False)`` for its first ``max_shapes`` input shapes,
    eager for any other; ``cuda_graphs`` uses the ``reduce-overhead`` mode (CUDA graphs) when the
    inputs are on CUDA.

    The compiled callables are built lazily (a CPU-only run never asks for CUDA graphs).
    ``calls`` counts the compiled and the eager calls (``{"compiled": n, "eager": m}``).
    """

    def __init__(self, fn: Callable[..., Any], max_shapes: int = 2, cuda_graphs: bool = True) -> None:
        self.fn, self.max_shapes, self.cuda_graphs = fn, max_shapes, cuda_graphs
        self.shapes: set[tuple] = set()
        self.calls = {"compiled": 0, "eager": 0}
        self._compiled: dict[bool, Callable[..., Any]] = {}

    def __getstate__(self) -> dict[str, Any]:  # pickles (DDP spawn) without the compiled code
        return {**self.__dict__, "shapes": set(), "_compiled": {}}

    def __deepcopy__(self, memo: dict[int, Any]) -> ShapeCompiled:  # a copy compiles its own graphs
        return ShapeCompiled(copy.deepcopy(self.fn, memo), self.max_shapes, self.cuda_graphs)

    def _compiled_fn(self, on_cuda: bool) -> Callable[..., Any]:
        graphs = on_cuda and self.cuda_graphs
        if graphs not in self._compiled:
            mode = "reduce-overhead" if graphs else None
            self._compiled[graphs] = torch.compile(self.fn, dynamic=False, mode=mode)
        return self._compiled[graphs]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = shape_key((args, kwargs))
        if key not in self.shapes and len(self.shapes) >= self.max_shapes:
            self.calls["eager"] += 1
            return self.fn(*args, **kwargs)
        self.shapes.add(key)
        self.calls["compiled"] += 1
        on_cuda = "cuda" in str(key)
        if on_cuda and self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs are free
        return self._compiled_fn(on_cuda)(*args, **kwargs)


def drop_compiled(module: nn.Module) -> nn.Module:
    """``module`` with the ``torch.compile`` wrappers of ``nn.Module.compile`` removed from it and
    its children (a copy for actors: the wrappers are bound to the original and do not pickle)."""
    for child in module.modules():
        child._compiled_call_impl = None
    return module
