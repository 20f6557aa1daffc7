"""Optimizers, learning-rate schedules and gradient clipping: one settings group, one builder.

* :class:`OptimSettings` — every agent's ``optim`` group (or one per network): optimizer
  ``name`` (``adam``, ``rmsprop``, ``sgd``), ``lr``, the optimizer's constants, the schedule
  (``lr_warmup_steps``, ``lr_anneal_steps``, ``lr_end``), ``clip`` (:class:`GradClipSettings`) and the
  kernels (``implementation``: ``auto``, ``for_loop``, ``foreach``, ``fused``).
* :func:`build_optimizer` — the one place an optimizer is built from :class:`OptimSettings`.
* :func:`lr_factor` / :func:`with_lr_schedule` — linear warm-up and linear annealing of the
  learning rate over optimizer steps, to 0 or to ``lr_end`` (held after); :func:`anneal_outlasted`
  says when a run would outlast an anneal to 0 (warned at the start of ``fit``).
* :class:`GradClipper` — DI-engine's ``grad_clip_type`` (``clip_value``, ``clip_norm``,
  ``clip_momentum``, ``clip_momentum_norm``; here ``clip.type``) with its bound, coefficient,
  norm type and momentum timestep, applied to the gradients between
  ``backward`` and the optimizer step. It works with either optimizer (DI-engine's IMPALA
  passes the clip options to Adam only).
* :func:`clip_grad_norms_` — ``clip_norm`` of several parameter groups (Dreamer's three networks)
  at once, with a fixed handful of multi-tensor kernels instead of a set per group: the same
  numbers as each group's own :class:`GradClipper`; :func:`clip_groups` uses it where a set of
  clippers allows it.

The two momentum variants compare gradients with a running estimate of their own size: an
exponential moving average ``v`` (decay ``beta``: Adam's ``betas[1]``, RMSProp's ``alpha``)
of each parameter's squared unclipped gradient, bias-corrected ``v_hat = v / (1 - beta^n)``
after ``n`` updates, and act once ``n > clip_momentum_timestep`` (before, the estimate is
too young):

* ``clip_momentum``: each gradient element is clamped to ``±clip_coef * sqrt(v_hat)``
  (OpenAI's rule; DI-engine replaces a clipped element by the positive threshold whatever
  its sign, here the sign is kept);
* ``clip_momentum_norm``: if the total gradient norm exceeds the norm of
  ``clip_coef * sqrt(v_hat)`` over all parameters, all gradients are scaled down to it, so
  a gradient may be at most ``clip_coef`` times as large as the recent RMS gradient.

The estimate and ``n`` are kept per parameter (DI-engine keeps them in each parameter's optimizer
state): a parameter without a gradient in a call (e.g. a module trained only every few steps)
keeps both as they were and is not clipped; ``clip_momentum_norm`` compares the norms over the
parameters that have a gradient, once each of their estimates is old enough.

DI-engine's bias correction uses the step count before the current update (one behind) and
its RMSProp variant none; here both use the number of updates including the current one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

OptimName = Literal["adam", "rmsprop", "sgd"]
OPTIMIZERS = ("adam", "rmsprop", "sgd")
OptimImplementation = Literal["auto", "for_loop", "foreach", "fused"]
IMPLEMENTATIONS = ("auto", "for_loop", "foreach", "fused")
GradClipType = Literal["clip_value", "clip_norm", "clip_momentum", "clip_momentum_norm"]
GRAD_CLIP_TYPES = ("clip_value", "clip_norm", "clip_momentum", "clip_momentum_norm")


@dataclass(frozen=True)
class GradClipSettings:
    """Gradient clipping between ``backward`` and the optimizer step (:class:`GradClipper`).

    Attributes:
        type: ``None`` (no clipping), ``clip_norm`` (total norm at most ``value``), ``clip_value``
            (each element within ``±value``), ``clip_momentum`` / ``clip_momentum_norm`` (against
            a running RMS of the gradients, ``coef`` times it; see the module docstring).
        value: the bound of ``clip_norm`` / ``clip_value``.
        coef: the multiple of the RMS gradient the momentum variants allow.
        norm_type: the p of the p-norm (2.0; ``inf`` for the max norm).
        momentum_timestep: updates of the running estimate before the momentum variants act.
    """

    type: GradClipType | None = None
    value: float = 0.5
    coef: float = 5.0
    norm_type: float = 2.0
    momentum_timestep: int = 100


@dataclass(frozen=True)
class OptimSettings:
    """One optimizer, its learning-rate schedule and its gradient clipping.

    Attributes:
        name: ``adam``, ``rmsprop`` or ``sgd``.
        lr: the learning rate.
        eps: Adam's / RMSProp's epsilon.
        betas: Adam's decays of the gradient and squared-gradient averages.
        alpha: RMSProp's squared-gradient decay.
        momentum: RMSProp's / SGD's momentum.
        weight_decay: L2 penalty added to the gradients (torch's ``weight_decay``).
        lr_warmup_steps: linear warm-up from ``lr / lr_warmup_steps`` over this many optimizer steps.
        lr_anneal_steps: the optimizer step at which a linear anneal from ``lr`` reaches ``lr_end``
            (``None``: constant).
        lr_end: the rate the anneal ends at and holds after ``lr_anneal_steps`` (0: the IMPALA
            paper's anneal to 0; e.g. ``lr / 2`` to halve the rate over the run).
        clip: gradient clipping (:class:`GradClipSettings`).
        implementation: the optimizer's kernels: ``auto`` (torch's choice: one multi-tensor
            ``foreach`` kernel per operation on CUDA, a loop over the parameters on the CPU),
            ``for_loop``, ``foreach``, or ``fused`` (one kernel for the whole update: Adam and
            SGD, on CUDA and CPU; what CUDA graphs want). Results agree to float rounding.
    """

    name: OptimName = "adam"
    lr: float = 1e-3
    eps: float = 1e-8
    betas: tuple[float, float] = (0.9, 0.999)
    alpha: float = 0.99
    momentum: float = 0.0
    weight_decay: float = 0.0
    lr_warmup_steps: int = 0
    lr_anneal_steps: int | None = None
    lr_end: float = 0.0
    clip: GradClipSettings = field(default_factory=GradClipSettings)
    implementation: OptimImplementation = "auto"

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optim name must be one of {list(OPTIMIZERS)}, got {self.name!r}")
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"optim implementation must be one of {list(IMPLEMENTATIONS)}, got {self.implementation!r}"
            )
        if self.implementation == "fused" and self.name == "rmsprop":
            raise ValueError("optim implementation 'fused' exists for adam and sgd; use foreach for rmsprop")
        if not self.lr > 0:
            raise ValueError(f"optim lr must be > 0, got {self.lr}")
        if self.lr_warmup_steps < 0 or (self.lr_anneal_steps is not None and self.lr_anneal_steps < 1):
            raise ValueError(
                f"optim lr_warmup_steps must be >= 0 and lr_anneal_steps >= 1 or null, got {self.lr_warmup_steps}, "
                f"{self.lr_anneal_steps}"
            )
        if not 0.0 <= self.lr_end <= self.lr:
            raise ValueError(f"optim lr_end must be in [0, lr={self.lr}], got {self.lr_end}")
        if self.lr_end > 0 and self.lr_anneal_steps is None:
            raise ValueError(
                f"optim lr_end={self.lr_end} needs lr_anneal_steps (the step the anneal reaches it); "
                "set lr_anneal_steps, or lr_end 0 for a constant rate"
            )

    @property
    def lr_end_factor(self) -> float:
        """``lr_end`` as a fraction of ``lr`` (what :func:`lr_factor` takes)."""
        return self.lr_end / self.lr

    @property
    def scheduled(self) -> bool:
        """Whether the rate changes during the run (a warm-up or an anneal)."""
        return self.lr_warmup_steps > 0 or self.lr_anneal_steps is not None

    def lr_factor_at(self, step: int) -> float:
        """:func:`lr_factor` of these settings after ``step`` optimizer steps."""
        return lr_factor(step, self.lr_warmup_steps, self.lr_anneal_steps, self.lr_end_factor)


def build_optimizer(params: Iterable[nn.Parameter], settings: OptimSettings) -> torch.optim.Optimizer:
    """The one optimizer builder: ``torch.optim.Adam`` (``betas``, ``eps``), ``RMSprop``
    (``alpha`` the squared-gradient decay, ``eps``, ``momentum``) or ``SGD`` (``momentum``) over
    ``params`` at ``settings.lr``, each with ``weight_decay``. The IMPALA paper's RMSProp used
    ``eps=0.01``, ``momentum=0``, ``alpha=0.99``."""
    s = settings
    kernels = implementation_kwargs(s.implementation)
    if s.name == "adam":
        return torch.optim.Adam(
            params, lr=s.lr, betas=tuple(s.betas), eps=s.eps, weight_decay=s.weight_decay, **kernels
        )
    if s.name == "rmsprop":
        return torch.optim.RMSprop(
            params, lr=s.lr, alpha=s.alpha, eps=s.eps, momentum=s.momentum, weight_decay=s.weight_decay, **kernels
        )
    return torch.optim.SGD(params, lr=s.lr, momentum=s.momentum, weight_decay=s.weight_decay, **kernels)


def implementation_kwargs(implementation: str) -> dict[str, bool]:
    """torch's optimizer keywords for ``OptimSettings.implementation`` (none for ``auto``)."""
    return {"auto": {}, "for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[
        implementation
    ]


def optimizer_beta(optimizer: torch.optim.Optimizer) -> float:
    """The squared-gradient decay the optimizer itself uses (Adam ``betas[1]``, RMSProp
    ``alpha``); :class:`GradClipper` uses it for its own running estimate, as DI-engine does."""
    group = optimizer.param_groups[0]
    if "betas" in group:
        return float(group["betas"][1])
    if "alpha" in group:
        return float(group["alpha"])
    raise ValueError(f"{type(optimizer).__name__} has neither betas nor alpha; pass beta to GradClipper")


def lr_factor(step: int, warmup_steps: int = 0, anneal_steps: int | None = None, end_factor: float = 0.0) -> float:
    """The learning-rate multiplier after ``step`` optimizer steps: ``(step + 1) / warmup_steps``
    while warming up (capped at 1), times ``1 - (1 - end_factor) * min(1, step / anneal_steps)``
    when annealing (linear from 1 to ``end_factor`` at ``anneal_steps``, held there after); 1
    without either."""
    factor = 1.0
    if warmup_steps > 0:
        factor = min(1.0, (step + 1) / warmup_steps)
    if anneal_steps is not None:
        factor *= 1.0 - (1.0 - end_factor) * min(1.0, step / anneal_steps)
    return factor


def anneal_outlasted(anneal_steps: int | None, max_steps: int, end_factor: float = 0.0) -> str | None:
    """Why a run of ``max_steps`` optimizer steps (``-1``: no step limit) would go on learning
    nothing after a linear anneal to 0 over ``anneal_steps`` (the message to warn with), or None
    when the anneal ends at or after the run's end, ends above 0 (``end_factor``) or there is none."""
    if anneal_steps is None or end_factor > 0 or 0 <= max_steps <= anneal_steps:
        return None
    run = "has no step limit" if max_steps < 0 else f"runs {max_steps} optimizer steps"
    return (
        f"the learning rate anneals to 0 at lr_anneal_steps={anneal_steps} but the trainer {run}: every "
        f"step after {anneal_steps} changes nothing. Set lr_anneal_steps to the trainer's max_steps (they go "
        "together), lr_end above 0 to hold a rate after the anneal, or null for a constant learning rate"
    )


def with_lr_schedule(optimizer: torch.optim.Optimizer, settings: OptimSettings) -> Any:
    """What ``configure_optimizers`` returns for one optimizer: the optimizer alone, or with a
    per-step :func:`lr_factor` schedule when ``settings`` warm up or anneal."""
    if not settings.scheduled:
        return optimizer
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: settings.lr_factor_at(step))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def split_lr_schedule(configured: Any) -> tuple[torch.optim.Optimizer, dict[str, Any] | None]:
    """:func:`with_lr_schedule`'s result taken apart: ``(optimizer, lr_scheduler config or None)``;
    the config's ``"scheduler"`` is the per-step schedule to step after each optimizer step."""
    if isinstance(configured, dict):
        return configured["optimizer"], configured["lr_scheduler"]
    return configured, None


class GradClipper:
    """Clip the gradients of a fixed list of parameters in place (see the module docstring).

    Args:
        grad_clip_type: None (no clipping) or one of :data:`GRAD_CLIP_TYPES`.
        clip_value: the element bound (``clip_value``) or the total-norm bound
            (``clip_norm``); DI-engine's default 0.5. The momentum variants use ``clip_coef``.
        clip_coef: multiple of the RMS gradient allowed by the momentum variants (5).
        clip_norm_type: the p of the p-norm (2.0; ``math.inf`` for the max norm).
        clip_momentum_timestep: updates of the running estimate before the momentum
            variants act (100).
        beta: decay of the running estimate of squared gradients (use
            :func:`optimizer_beta`).
    """

    def __init__(
        self,
        grad_clip_type: str | None = None,
        clip_value: float = 0.5,
        clip_coef: float = 5.0,
        clip_norm_type: float = 2.0,
        clip_momentum_timestep: int = 100,
        beta: float = 0.999,
    ) -> None:
        if grad_clip_type is not None and grad_clip_type not in GRAD_CLIP_TYPES:
            raise ValueError(f"grad_clip_type must be None or one of {list(GRAD_CLIP_TYPES)}, got {grad_clip_type!r}")
        if grad_clip_type in ("clip_value", "clip_norm") and not clip_value > 0:
            raise ValueError(f"clip_value must be > 0 for {grad_clip_type}, got {clip_value}")
        if grad_clip_type in ("clip_momentum", "clip_momentum_norm") and not clip_coef > 0:
            raise ValueError(f"clip_coef must be > 0 for {grad_clip_type}, got {clip_coef}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        self.grad_clip_type = grad_clip_type
        self.clip_value, self.clip_coef = float(clip_value), float(clip_coef)
        self.clip_norm_type = float(clip_norm_type)
        self.clip_momentum_timestep = int(clip_momentum_timestep)
        self.beta = float(beta)
        self.counts: list[int] = []  # per parameter: updates of its running estimate
        self.square_avg: list[Tensor] = []  # per parameter (every one passed, with a gradient or not)

    @classmethod
    def from_settings(cls, settings: GradClipSettings, beta: float = 0.999) -> GradClipper:
        """The clipper of ``settings`` (``beta``: :func:`optimizer_beta` of the optimizer it serves)."""
        return cls(settings.type, settings.value, settings.coef, settings.norm_type, settings.momentum_timestep, beta)

    @property
    def uses_momentum(self) -> bool:
        return self.grad_clip_type in ("clip_momentum", "clip_momentum_norm")

    def _norm(self, tensors: list[Tensor], norm_type: float | None = None) -> Tensor:
        """The ``norm_type``-norm (default ``clip_norm_type``) of all ``tensors`` together: the norm of
        their per-tensor norms (one ``_foreach_norm`` kernel on CUDA, per-tensor norms on the CPU)."""
        if not tensors:
            return torch.zeros(())
        return torch.nn.utils.get_total_norm(tensors, self.clip_norm_type if norm_type is None else norm_type)

    def __call__(self, params: Iterable[Tensor]) -> dict[str, Tensor]:
        """Clip ``params``' gradients (the same parameters, in the same order, every call).

        Returns ``grad_norm`` (the total norm before clipping) and ``clipped`` (1.0 if any
        gradient was changed), both 0-dim tensors for logging.
        """
        every = list(params)
        params = [p for p in every if p.grad is not None]
        grads = [p.grad for p in params]
        if self.grad_clip_type == "clip_norm" and grads:  # the total norm, computed once, is what clips
            norm = clip_grad_norms_([params], [self.clip_value], self.clip_norm_type)[0]
            return {"grad_norm": norm, "clipped": norm.gt(self.clip_value).float()}
        norm = self._norm(grads)
        clipped = torch.zeros(())
        if self.grad_clip_type == "clip_value":
            clipped = self._norm(grads, math.inf).gt(self.clip_value).float() if grads else clipped  # the largest |g|
            torch.nn.utils.clip_grad_value_(params, self.clip_value)
        elif self.uses_momentum and grads:
            clipped = self._momentum_clip(every, grads, norm)
        return {"grad_norm": norm.detach(), "clipped": clipped}

    def _momentum_clip(self, every: list[Tensor], grads: list[Tensor], norm: Tensor) -> Tensor:
        """Update the estimates of the parameters with a gradient (``grads``: those of ``every``
        that have one, in order) and clip those whose estimate is old enough."""
        if not self.square_avg:
            self.square_avg = [torch.zeros_like(p) for p in every]
            self.counts = [0] * len(every)
        if len(self.square_avg) != len(every):
            raise RuntimeError(
                f"GradClipper got {len(every)} parameters after {len(self.square_avg)}: "
                "pass the same parameters every call"
            )
        present = [i for i, p in enumerate(every) if p.grad is not None]
        avgs = [self.square_avg[i] for i in present]
        for i in present:
            self.counts[i] += 1
        torch._foreach_mul_(avgs, self.beta)  # per tensor on the CPU, the same numbers
        torch._foreach_addcmul_(avgs, grads, grads, value=1.0 - self.beta)
        counts = [self.counts[i] for i in present]
        if self.grad_clip_type == "clip_momentum":
            changed = torch.zeros((), dtype=torch.bool, device=grads[0].device)
            for g, avg, n in zip(grads, avgs, counts):
                if n > self.clip_momentum_timestep:
                    limit = avg.div(1.0 - self.beta**n).sqrt_().mul_(self.clip_coef)
                    changed |= (g.abs() > limit).any()
                    torch.maximum(torch.minimum(g, limit), -limit, out=g)
            return changed.float()
        if min(counts) <= self.clip_momentum_timestep:
            return torch.zeros(())
        limits = [avg.div(1.0 - self.beta**n).sqrt_().mul_(self.clip_coef) for avg, n in zip(avgs, counts)]
        limit_norm = self._norm(limits)
        if norm > limit_norm:
            scale = limit_norm / norm
            for g in grads:
                g.mul_(scale)
            return torch.ones(())
        return torch.zeros(())

    @property
    def count(self) -> int:
        """Updates of the oldest running estimate (0 before the first)."""
        return max(self.counts, default=0)

    def state_dict(self) -> dict:
        """``count`` and ``square_avg``, plus the per-parameter ``counts`` where they differ (a
        parameter skipped on some calls): where every parameter had a gradient every time, the
        format of the clippers that kept one count."""
        state = {"count": self.count, "square_avg": [t.clone() for t in self.square_avg]}
        if len(set(self.counts)) > 1:
            state["counts"] = list(self.counts)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (without ``counts``: ``count`` for every parameter)."""
        self.square_avg = [t.clone() for t in state["square_avg"]]
        counts = state.get("counts")
        self.counts = [int(c) for c in counts] if counts is not None else [int(state["count"])] * len(self.square_avg)


def clip_grad_norms_(groups: Sequence[Sequence[Tensor]], max_norms: Sequence[float], norm_type: float = 2.0) -> Tensor:
    """``clip_norm`` of each group of parameters to its own bound, all groups together: per group
    the total ``norm_type``-norm of its gradients (the norm of the per-tensor norms, as
    ``torch.nn.utils.clip_grad_norm_`` computes it, to the bit), scaled by
    ``min(1, max_norm / (norm + 1e-6))``. One ``_foreach_norm`` over every gradient, one stack, a
    norm per group, four kernels for the coefficients and a ``_foreach_mul_`` per group, where
    separate clippers launch that set once per group (the kernel count of a Dreamer step).

    Args:
        groups: ``G`` lists of parameters (those without a gradient are skipped).
        max_norms: ``G`` bounds.
        norm_type: the p of the p-norm (``math.inf``: the largest element).

    Returns:
        ``[G]`` the total norms before clipping (0 for a group without gradients).
    """
    if len(groups) != len(max_norms):
        raise ValueError(f"clip_grad_norms_ got {len(groups)} groups and {len(max_norms)} bounds")
    grads = [[p.grad for p in group if p.grad is not None] for group in groups]
    flat = [g for group in grads for g in group]
    if not flat:
        return torch.zeros(len(groups))
    with torch.no_grad():
        return _clip_grad_norms(grads, flat, max_norms, norm_type)


def _clip_grad_norms(grads: list[list[Tensor]], flat: list[Tensor], max_norms: Sequence[float], p: float) -> Tensor:
    per_tensor = torch.stack(torch._foreach_norm(flat, p))
    norms, start = [], 0
    for group in grads:
        part = per_tensor[start : start + len(group)]
        norms.append(torch.linalg.vector_norm(part, p) if group else per_tensor.new_zeros(()))
        start += len(group)
    norms = torch.stack(norms)
    bounds = _bounds(tuple(max_norms), norms.dtype, norms.device)
    coefs = ((norms + 1e-6).reciprocal_() * bounds).clamp_(max=1.0)  # float / tensor, as torch computes it
    for i, group in enumerate(grads):
        if group:
            torch._foreach_mul_(group, coefs[i])
    return norms


@functools.lru_cache(maxsize=16)
def _bounds(max_norms: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """The bounds as a tensor on the gradients' device, made once (no host-to-device copy a step)."""
    return torch.tensor(max_norms, dtype=dtype, device=device)


def clip_groups(clippers: Sequence[GradClipper], groups: Sequence[Iterable[Tensor]]) -> list[Tensor]:
    """Apply each clipper to its group of parameters; returns each group's gradient norm before
    clipping. Where every clipper is ``clip_norm`` with one norm type, the groups are clipped
    together (:func:`clip_grad_norms_`: the same numbers, a few kernels instead of a set per group)."""
    groups = [list(group) for group in groups]
    if clippers and all(c.grad_clip_type == "clip_norm" for c in clippers):
        if len({c.clip_norm_type for c in clippers}) == 1:
            return list(clip_grad_norms_(groups, [c.clip_value for c in clippers], clippers[0].clip_norm_type))
    return [clipper(group)["grad_norm"] for clipper, group in zip(clippers, groups, strict=True)]
