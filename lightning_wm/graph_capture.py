"""A whole gradient step recorded once as a CUDA graph and replayed (``compile.mode: graph``).

A learner step on a GPU is bound by kernel launches (thousands of small kernels: a scan over
the replayed sequence, an imagined rollout, their backward, the optimizers), not by arithmetic.
:class:`CapturedStep` records the step's eager kernels once per input shape with
``torch.cuda.graph`` and then replays them with one launch: no compiler, so no compile time
(``compile.mode: step`` compiles the same step with Inductor for minutes). The price:

* the step must be *static*: fixed shapes, no host synchronisation (``.item()``, ``.tolist()``,
  data-dependent branches), no host-to-device copies; code asks :func:`static_control_flow` and
  takes its branch-free form then (the same form ``torch.compile`` traces);
* inputs are copied into static buffers before each replay, and the graph's activations and
  gradients live in a memory pool of their own (about one eager step's peak memory);
* Python inside the step runs once, at recording: what it computes from Python numbers (a
  learning rate, a schedule) is frozen into the graph unless it lives in a tensor that is
  updated outside it (:func:`make_capturable` turns the optimizers' learning rates into tensors);
* optimizers must be capturable (their step counters on the device): :func:`make_capturable`.

The first ``warmup`` calls of a shape run eagerly on a side stream (as ``torch.cuda.graph``
asks: lazy initialisations such as the optimizers' state happen there), the next one records and
replays; every call is one real gradient step. Off CUDA (``capture=False``) the same protocol
runs without a graph: the step runs on the static buffers with :func:`static_control_flow` set,
which is how the CPU tests check that the recorded form gives the eager losses.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_wm.compiling import shape_key
from lightning_wm.tree import leaves, tree_map

log = logging.getLogger(__name__)

__all__ = [
    "CapturedStep",
    "count_lightning_step",
    "make_capturable",
    "plain_optimizer_state",
    "set_learning_rate",
    "static_control_flow",
]

_recording = False


def static_control_flow() -> bool:
    """Whether the running code is traced (``torch.compile``) or recorded (:class:`CapturedStep`):
    it must then take its branch-free form, with no host synchronisation."""
    return _recording or torch.compiler.is_compiling()


@contextlib.contextmanager
def _static() -> Iterator[None]:
    global _recording
    before, _recording = _recording, True
    try:
        yield
    finally:
        _recording = before


def _clone(tree: Any) -> Any:
    """Copies of the tensors of a nested structure (other leaves as they are)."""
    return tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, tree)


def _autocast_key() -> tuple:
    """Autocast's state on CUDA (a graph recorded in fp32 must not serve a bf16 step)."""
    if not torch.cuda.is_available() or not torch.is_autocast_enabled("cuda"):
        return ()
    return (torch.get_autocast_dtype("cuda"),)


def _autocast_without_cache() -> contextlib.AbstractContextManager:
    """Autocast as the caller set it, with its weight-cast cache off (a cached cast made while
    recording would be a stale copy in later replays)."""
    if torch.is_autocast_enabled("cuda"):
        return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
    return contextlib.nullcontext()


class CapturedStep:
    """``step(batch) -> outputs`` recorded as one CUDA graph per input shape and replayed.

    Args:
        step: one gradient step on a batch (a nested structure of tensors, e.g. ``[B, L, ...]``
            rows); returns a nested structure of tensors (losses and logged values). It must be
            static (module docstring).
        warmup: eager calls of a shape before it is recorded.
        max_shapes: shapes that get a graph of their own; a batch of any further shape (a last
            short batch) runs eagerly, never a new recording per step.
        capture: record CUDA graphs where the batch is on CUDA (``False``: the static protocol
            without a graph, anywhere).
        strict: raise when a recording fails (benches, tests); otherwise log one line saying why
            and run the step eagerly from then on.

    ``calls`` counts ``{"eager", "recorded", "replayed"}``. The outputs of a replay are copies
    (the graph's own output tensors are overwritten by the next replay).
    """

    def __init__(
        self,
        step: Callable[[Any], Any],
        warmup: int = 2,
        max_shapes: int = 1,
        capture: bool = True,
        strict: bool = False,
    ) -> None:
        self.step, self.warmup, self.max_shapes = step, warmup, max_shapes
        self.capture, self.strict = capture, strict
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph | None, Any, Any]] = {}
        self.seen: dict[Hashable, int] = {}
        self.failed: str | None = None
        self.calls = {"eager": 0, "recorded": 0, "replayed": 0}
        self._pool: Any = None

    def __call__(self, batch: Any, key: Hashable = ()) -> Any:
        """One gradient step on ``batch``; ``key`` adds what else the graph depends on (e.g. an
        imagination horizon that a schedule changes)."""
        full_key = (shape_key(batch), key, _autocast_key())
        entry = self.graphs.get(full_key)
        if entry is None:
            self.seen[full_key] = self.seen.get(full_key, 0) + 1
            if self.failed or len(self.graphs) >= self.max_shapes or self.seen[full_key] <= self.warmup:
                return self._eager(batch)
            entry = self._record(batch, full_key)
            if entry is None:
                return self._eager(batch)
        graph, static_in, static_out = entry
        tree_map(
            lambda store, x: store.copy_(x, non_blocking=True) if isinstance(store, Tensor) else store, static_in, batch
        )
        if graph is None:  # the protocol without a graph
            with _static():
                out = self.step(static_in)
        else:
            graph.replay()
            out = static_out
        self.calls["replayed"] += 1
        return _clone(out)

    def _eager(self, batch: Any) -> Any:
        self.calls["eager"] += 1
        if not (self.capture and _on_cuda(batch)):
            return self.step(batch)
        side = torch.cuda.Stream()  # warm-up off the default stream, as torch.cuda.graph asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self.step(batch)
        torch.cuda.current_stream().wait_stream(side)
        return out

    def _record(self, batch: Any, key: Hashable) -> tuple[Any, Any, Any] | None:
        static_in = _clone(batch)
        if not (self.capture and _on_cuda(batch)):
            self.graphs[key] = (None, static_in, None)
            return self.graphs[key]
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        try:
            with (
                _static(),
                _autocast_without_cache(),
                torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"),
            ):
                static_out = self.step(static_in)
        except Exception as error:  # noqa: BLE001  (any failure to record: say why, then eager)
            if self.strict:
                raise
            self.failed = f"{type(error).__name__}: {error}".splitlines()[0][:300]
            log.warning(
                "compile.mode graph: the step could not be recorded as a CUDA graph (%s); it runs eagerly", self.failed
            )
            return None
        self.calls["recorded"] += 1
        self.graphs[key] = (graph, static_in, static_out)
        return self.graphs[key]


def _on_cuda(tree: Any) -> bool:
    tensors = [x for x in leaves(tree) if isinstance(x, Tensor)]
    return bool(tensors) and all(x.is_cuda for x in tensors)


def make_capturable(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Make ``optimizers`` safe to record in a CUDA graph: ``capturable`` where the optimizer has
    it (Adam, RMSprop: step counters kept on the device, moved there if they exist), and each
    group's learning rate a 0-dim tensor on its parameters' device, so that a schedule that
    writes it with ``fill_`` outside the graph reaches the replays (:func:`set_learning_rate`).
    Groups whose parameters are not on CUDA stay as they are (nothing is recorded there)."""
    for opt in optimizers:
        for group in opt.param_groups:
            device = group["params"][0].device
            if device.type != "cuda":
                continue
            if "capturable" in group:
                group["capturable"] = True
            if not isinstance(group["lr"], Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), device=device)
            for p in group["params"]:
                state = opt.state.get(p, {})
                if isinstance(state.get("step"), Tensor):
                    state["step"] = state["step"].to(device=device, dtype=torch.float32)


def set_learning_rate(group: dict[str, Any], lr: float) -> None:
    """Write ``lr`` into an optimizer's param group: in place where it is a tensor (a recorded
    step reads it there), else as a number."""
    if isinstance(group["lr"], Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


def plain_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer ``state_dict`` as an eager optimizer saves it (learning rates as numbers,
    ``capturable`` off), so that a checkpoint of a recorded run resumes anywhere."""
    groups = []
    for group in state.get("param_groups", []):
        group = dict(group)
        if isinstance(group.get("lr"), Tensor):
            group["lr"] = float(group["lr"])
        if group.get("capturable"):
            group["capturable"] = False
        groups.append(group)
    return {**state, "param_groups": groups}


def count_lightning_step(optimizer: Any) -> None:
    """Lightning's bookkeeping of one optimizer step (``trainer.global_step``) for a
    ``LightningOptimizer`` whose plain optimizer stepped inside a replayed graph; nothing for a
    plain optimizer (benches and tests without a trainer)."""
    for hook in ("_on_before_step", "_on_after_step"):
        fn = getattr(optimizer, hook, None)
        if callable(fn):
            fn()
