"""IMPALA's settings groups: what ``model.init_args`` of an IMPALA config holds.

* ``net`` — :class:`~lightning_wm.nn.actor_critic.ActorCriticSettings`, the actor-critic network
  (defined beside the network in :mod:`lightning_wm.nn.actor_critic`, a building block that other
  learners can use; re-exported here);
* ``loss`` — :class:`VTraceLossSettings`, the V-trace loss: weights, discount, lambda, the three
  V-trace clips and the reward scale;
* ``optim`` — :class:`~lightning_wm.optim.OptimSettings` (Adam or RMSProp and its clipping);
* ``compile`` — :class:`~lightning_wm.compiling.CompileSettings`.

``IMPALA_NET``, ``IMPALA_LOSS`` and ``IMPALA_OPTIM`` are the groups' defaults (DI-engine's IMPALA:
Adam at 0.0005, no clipping). ``docs/impala.md`` lists every option with its meaning, default and
DI-engine's name.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from lightning_wm.nn.actor_critic import ActorCriticSettings
from lightning_wm.optim import OptimSettings
from lightning_wm.settings import check_at_least

__all__ = [
    "IMPALA_LOSS",
    "IMPALA_NET",
    "IMPALA_OPTIM",
    "ActorCriticSettings",
    "VTraceLossSettings",
    "warn_summed_loss_eps",
]


@dataclass(frozen=True)
class VTraceLossSettings:
    """IMPALA's loss (the ``loss`` group; DI-engine's ``policy.learn`` defaults).

    Attributes:
        value_weight: weight of the value loss (the policy term's weight is 1).
        entropy_weight: weight of the entropy bonus (subtracted from the loss).
        discount: gamma, in [0, 1].
        lambda_: V-trace's trace-cutting factor in [0, 1] (``c_t = lambda_ * min(c_clip, rho_t)``;
            1 is the paper's eq. 1).
        rho_clip: clip of the importance ratio in the TD errors (rho bar).
        c_clip: clip of the importance ratio in the traces (c bar).
        rho_pg_clip: clip of the importance ratio of the policy-gradient advantage.
        reward_scale: rewards are multiplied by this before V-trace (sample-factory's
            ``reward_scale``; not in DI-engine): it keeps the value targets near unit scale where
            returns are large, so the value loss does not swamp the policy gradient under a
            gradient-norm clip. Values are then in scaled units.
        normalize_advantage: scale the policy term's V-trace advantages to mean 0 and standard
            deviation 1 over the batch's real steps (SB3's ``normalize_advantage``).
        entropy_weight_end: with ``entropy_anneal_steps``, the entropy weight moves linearly from
            ``entropy_weight`` at ``entropy_anneal_start`` to this that many steps later and stays there
            (:func:`entropy_weight_at`); ``None``: ``entropy_weight`` throughout.
        entropy_anneal_steps: learner steps of that move.
        entropy_anneal_start: learner step where the move starts (``entropy_weight`` until then).
        entropy_relative: the entropy bonus is ``entropy_weight`` times the standard deviation of
            the batch's V-trace advantages (over its real steps, no gradient): it counts in units
            of the advantage scale, so a game whose advantages are tiny (sparse rewards) is not
            held near uniform by a bonus sized for one whose advantages are large. Before
            ``normalize_advantage``.
    """

    value_weight: float = 0.5
    entropy_weight: float = 0.0001
    discount: float = 0.99
    lambda_: float = 0.95
    rho_clip: float = 1.0
    c_clip: float = 1.0
    rho_pg_clip: float = 1.0
    reward_scale: float = 1.0
    normalize_advantage: bool = False
    entropy_weight_end: float | None = None
    entropy_anneal_steps: int = 0
    entropy_anneal_start: int = 0
    entropy_relative: bool = False

    def __post_init__(self) -> None:
        for name in ("discount", "lambda_"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"loss.{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("value_weight", "entropy_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"loss.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("rho_clip", "c_clip", "rho_pg_clip", "reward_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"loss.{name} must be > 0, got {getattr(self, name)}")
        check_at_least("loss.entropy_anneal_start", self.entropy_anneal_start, 0)
        if self.entropy_weight_end is not None and (self.entropy_weight_end < 0 or self.entropy_anneal_steps < 1):
            raise ValueError(
                f"loss.entropy_weight_end ({self.entropy_weight_end}) must be >= 0 and needs "
                f"entropy_anneal_steps >= 1, got {self.entropy_anneal_steps}"
            )


# the defaults of the groups (DI-engine's IMPALA: Adam at 0.0005, no clipping)
IMPALA_NET = ActorCriticSettings()
IMPALA_LOSS = VTraceLossSettings()
IMPALA_OPTIM = OptimSettings(lr=0.0005)


# RMSProp's eps at or above this is a constant meant for a loss summed over the batch's steps
SUMMED_LOSS_EPS = 1e-3


def warn_summed_loss_eps(optim: OptimSettings) -> None:
    """Warn when RMSProp's ``eps`` is a summed loss's constant (the IMPALA paper's 0.01).

    The paper's loss is summed over the ``T x B`` steps of a batch; this one is their mean, so its
    gradients are ``T x B`` times smaller. RMSProp divides by ``sqrt(v) + eps``: with ``eps = 0.01``
    almost every element has ``sqrt(v) < eps`` (99.9% after 2,900 steps of a Pong run with
    ``impala/pong_cpu.yaml``'s network), which makes it plain SGD at ``lr / eps``: that run's policy
    stayed uniform. The paper's update for this loss is ``eps = 0.01 / (T x B)`` and a clip norm of
    ``40 / (T x B)``.
    """
    if optim.name == "rmsprop" and optim.eps >= SUMMED_LOSS_EPS:
        warnings.warn(
            f"optim.eps {optim.eps:g} with rmsprop: IMPALA's loss is the mean over a batch's steps, and an eps "
            "this large (the paper's 0.01, for a loss summed over them) turns RMSProp into SGD at lr/eps, "
            "so the policy hardly learns; use eps = 0.01 / (batch_size x unroll_length) and clip.value = "
            "40 / (batch_size x unroll_length) for the paper's update (1.6e-5 and 0.0625 for 32 x 20)",
            UserWarning,
            stacklevel=3,
        )
