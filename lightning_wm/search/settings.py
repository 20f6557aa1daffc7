"""The search's settings group: :class:`SearchSettings` (acting and reanalyse share it; the search
policies take it whole) and its visit-count :class:`TemperatureSchedule`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lightning_wm.settings import check_at_least, check_in_range, check_one_of, check_positive

__all__ = ["SearchSettings", "TemperatureSchedule"]


@dataclass(frozen=True)
class TemperatureSchedule:
    """Visit-count temperature by training step: ``values[i]`` until ``boundaries[i]`` steps.

    The default is MuZero's Atari schedule: 1.0 for the first 500k training steps, 0.5 for the
    next 250k, 0.25 afterwards. ``TemperatureSchedule((), (1.0,))`` is a constant.

    Attributes:
        boundaries: the training steps (optimizer steps) where the temperature changes, increasing.
        values: the temperature before the first boundary, between each two, after the last
            (one more value than boundaries).
    """

    boundaries: tuple[int, ...] = (500_000, 750_000)
    values: tuple[float, ...] = (1.0, 0.5, 0.25)

    def __post_init__(self) -> None:
        object.__setattr__(self, "boundaries", tuple(int(b) for b in self.boundaries))
        object.__setattr__(self, "values", tuple(float(v) for v in self.values))
        if len(self.values) != len(self.boundaries) + 1:
            raise ValueError(
                f"TemperatureSchedule needs one value more than boundaries; got "
                f"{len(self.values)} values for {len(self.boundaries)} boundaries"
            )
        if list(self.boundaries) != sorted(self.boundaries):
            raise ValueError(f"TemperatureSchedule boundaries must increase, got {list(self.boundaries)}")

    def __call__(self, step: int) -> float:
        for boundary, value in zip(self.boundaries, self.values):
            if step < boundary:
                return float(value)
        return float(self.values[-1])


@dataclass(frozen=True)
class SearchSettings:
    """The tree search of acting and reanalyse: what :func:`~lightning_wm.search.muzero_policy` and
    :func:`~lightning_wm.search.gumbel_muzero_policy` read (``gumbel`` picks which one the agents
    call), passed down whole.

    Attributes:
        num_simulations: expansions per search (per root).
        pb_c_init: PUCT's ``c1`` (MuZero 1.25).
        pb_c_base: PUCT's ``c2`` (MuZero 19652).
        dirichlet_alpha: the root noise's Dirichlet ``alpha`` (when exploring).
        exploration_fraction: the root prior's share of noise, ``(1 - f) P + f Dir(alpha)``.
        gumbel: Gumbel MuZero at the root (Gumbel-top-k, sequential halving) and its deterministic
            rule inside the tree, instead of PUCT with Dirichlet noise.
        max_num_considered_actions: Gumbel MuZero's ``m``, root actions sampled without replacement.
        unvisited_q: an untried action's value in PUCT: ``mean`` (the mean Q of its tried siblings,
            EfficientZero's and LightZero's rule) or ``zero`` (the pseudocode's bottom of the
            normalised range).
        compile: run each simulation past its descent (the network's step, the backup, the next
            descent) through ``torch.compile`` as one graph: the same search up to float rounding
            (exact ties among children may break the other way), faster per simulation after a
            one-time compilation per process, network class and search shape. Needs a C++
            compiler on CPU.
        cuda_graphs: on CUDA, replay the simulation loop (network calls included) as one
            captured CUDA graph per search shape (PUCT with every action legal; the others run
            eagerly): one launch instead of thousands, the same search. Costs a graph's memory
            per shape (the trees and activations of one search). Ignored on the CPU.
        temperature: the visit-count temperature of exploring actions by training step.
    """

    num_simulations: int = 50
    pb_c_init: float = 1.25
    pb_c_base: float = 19652.0
    dirichlet_alpha: float = 0.25
    exploration_fraction: float = 0.25
    gumbel: bool = False
    max_num_considered_actions: int = 16
    unvisited_q: Literal["zero", "mean"] = "mean"
    compile: bool = False
    cuda_graphs: bool = True
    temperature: TemperatureSchedule = field(default_factory=TemperatureSchedule)

    def __post_init__(self) -> None:
        check_at_least("search.num_simulations", self.num_simulations, 1)
        check_one_of("search.unvisited_q", self.unvisited_q, ("zero", "mean"))
        check_in_range("search.exploration_fraction", self.exploration_fraction, 0.0, 1.0)
        check_positive("search.dirichlet_alpha", self.dirichlet_alpha)
        check_at_least("search.max_num_considered_actions", self.max_num_considered_actions, 1)
