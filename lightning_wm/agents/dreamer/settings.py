"""Dreamer's settings groups: what ``model.init_args`` of a Dreamer config holds.

* :class:`DreamerNet` (``net``) — sizes and style of every network (RSSM, encoders/decoders,
  heads, actor, critic);
* :class:`WorldModelLoss` (``loss``) — the world-model loss: KL balancing with free bits and the
  weights of its prediction terms;
* :class:`BehaviorSettings` (``behavior``) — imagination, λ-returns, the actor and critic losses,
  the slow critic and return normalisation;
* :class:`DreamerOptim` (``optim``) — one :class:`~lightning_wm.optim.OptimSettings` per network
  (world model, actor, critic).

``docs/dreamer.md`` lists every option with its meaning, default and the DreamerV3 name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from lightning_wm.optim import GradClipSettings, OptimSettings
from lightning_wm.settings import check_at_least, check_in_range, check_one_of, check_positive
from lightning_wm.world_model import RolloutSchedule

__all__ = ["BehaviorSettings", "DreamerNet", "DreamerOptim", "WorldModelLoss"]

ACTIVATIONS = ("relu", "silu", "elu", "tanh", "gelu")


@dataclass(frozen=True)
class DreamerNet:
    """Sizes and style of Dreamer's networks.

    Attributes:
        deter: size of the RSSM's deterministic (GRU) state ``h``.
        stoch: categorical latents: number of groups; Gaussian latents: dimensions of ``z``.
        classes: classes per categorical group (``z`` has ``stoch * classes`` one-hot entries).
        hidden: units of each hidden layer (encoder and decoder MLPs, heads, actor, critic, RSSM).
        layers: hidden layers of those MLPs.
        latent: ``categorical`` (DreamerV2/V3) or ``gaussian`` (DreamerV1) latents.
        activation: ``silu`` (DreamerV3), ``elu``, ``relu``, ``tanh`` or ``gelu``.
        norm: LayerNorm after every hidden layer (DreamerV3).
        conv: the pixel encoder/decoder: ``strided`` (kernel-4 stride-2 conv stages, 64x64 frames)
            or ``small`` (the MinAtar paper's one 3x3 conv and a layer of ``hidden`` units,
            :class:`~lightning_wm.nn.blocks.SmallConvEncoder`, and its mirror for the decoder:
            frames of any size at least 3x3, e.g. MinAtar's 10x10).
        cnn_depth: channels of the first conv stage of the pixel encoder/decoder (doubling per
            stage; ``small``: of its one conv, 16 in the MinAtar paper).
        unimix: uniform mix of categorical latents and discrete actions (0.01: DreamerV3's 1%).
        symlog_obs: symlog vector observations (encoder input, decoder target), and scalar
            reward/critic targets when ``twohot`` is off.
        twohot: reward and critic heads as categoricals over ``bins`` symexp-spaced bins.
        bins: number of those bins.
    """

    deter: int = 256
    stoch: int = 32
    classes: int = 32
    hidden: int = 256
    layers: int = 1
    latent: Literal["categorical", "gaussian"] = "categorical"
    activation: str = "silu"
    norm: bool = True
    conv: Literal["strided", "small"] = "strided"
    cnn_depth: int = 32
    unimix: float = 0.01
    symlog_obs: bool = True
    twohot: bool = True
    bins: int = 255

    def __post_init__(self) -> None:
        for name in ("deter", "stoch", "classes", "hidden", "cnn_depth"):
            check_at_least(f"net.{name}", getattr(self, name), 1)
        check_at_least("net.layers", self.layers, 0)
        check_one_of("net.conv", self.conv, ("strided", "small"))
        check_one_of("net.latent", self.latent, ("categorical", "gaussian"))
        check_one_of("net.activation", self.activation.lower(), ACTIVATIONS)
        check_in_range("net.unimix", self.unimix, 0.0, 1.0)
        if self.twohot and self.bins < 2:
            raise ValueError(f"net.bins must be >= 2 with twohot heads, got {self.bins}")


@dataclass(frozen=True)
class WorldModelLoss:
    """The world-model loss ``mean(decoder_weight * L_dec + reward_weight * L_rew +
    continue_weight * L_con + kl_dyn_weight * L_dyn + kl_rep_weight * L_rep)`` (DreamerV3).

    Attributes:
        kl_dyn_weight: weight of the dynamics KL ``max(free_nats, KL(sg(post) || prior))``,
            which trains the prior.
        kl_rep_weight: weight of the representation KL ``max(free_nats, KL(post || sg(prior)))``,
            which trains the posterior.
        free_nats: free bits: each KL is clipped from below at this many nats (no gradient under it).
        decoder_weight: weight of the observation reconstruction loss.
        reward_weight: weight of the reward head's loss.
        continue_weight: weight of the continue head's loss.
        continue_terminal_weight: weight of the continue head's loss on rows that end an
            episode (``is_terminal``) relative to the other rows (1: DreamerV3). Ends are rare in
            replay once the agent is good, so the head can stay blind to a kind of end it sees seldom.
    """

    kl_dyn_weight: float = 0.5
    kl_rep_weight: float = 0.1
    free_nats: float = 1.0
    decoder_weight: float = 1.0
    reward_weight: float = 1.0
    continue_weight: float = 1.0
    continue_terminal_weight: float = 1.0

    def __post_init__(self) -> None:
        for name in ("kl_dyn_weight", "kl_rep_weight", "free_nats", "decoder_weight", "reward_weight"):
            check_at_least(f"loss.{name}", getattr(self, name), 0)
        check_at_least("loss.continue_weight", self.continue_weight, 0)
        check_positive("loss.continue_terminal_weight", self.continue_terminal_weight)


@dataclass(frozen=True)
class BehaviorSettings:
    """Learning the actor and critic in imagination.

    Attributes:
        horizon: imagined steps per update from every replayed posterior state.
        horizon_schedule: imagined steps as a function of this rank's env steps
            (:class:`~lightning_wm.world_model.RolloutSchedule`: ``min_length`` until
            ``start_step``, linearly more, ``max_length`` from ``end_step`` on); it replaces
            ``horizon``. None: always ``horizon``.
        discount: γ of the λ-returns, in [0, 1].
        lambda_: λ of the λ-returns, in [0, 1].
        entropy_weight: weight of the actor's entropy bonus.
        actor_grad: ``auto`` (REINFORCE for discrete actions, dynamics backprop for
            continuous), ``reinforce``, ``dynamics`` (backpropagate the returns through the
            learned dynamics; continuous actions only) or ``mix`` (``reinforce_weight`` times
            the REINFORCE loss plus ``1 - reinforce_weight`` times the dynamics loss, DreamerV2's
            ``both``; continuous actions only).
        reinforce_weight: ``ρ``, the REINFORCE loss's share of the ``mix`` (1: the ``reinforce``
            loss, 0: the ``dynamics`` loss); read only with ``actor_grad: mix``.
        bootstrap_critic: whose values ``v(s_t)`` the λ-returns bootstrap from and the REINFORCE
            baseline subtracts: ``critic`` (DreamerV3) or ``slow_critic`` (the slow EMA copy,
            DreamerV2's target critic).
        actor_dist: continuous actions as ``bounded_normal`` (DreamerV3) or ``tanh_normal``.
        action_min_std: lower bound of the continuous actions' std.
        action_max_std: upper bound of the continuous actions' std.
        replay_critic_weight: weight of a second critic loss on the replayed sequences (their
            λ-returns of the real rewards and terminations; DreamerV3's ``repval``, 0.3 there);
            0 turns it off.
        slow_critic_tau: fraction by which the slow (EMA) critic moves towards the critic.
        slow_critic_every: gradient steps between those moves.
        slow_critic_weight: weight of the critic's regulariser towards the slow critic's values.
        return_norm: divide advantages (REINFORCE) or returns (dynamics) by
            ``max(1, EMA(P_high) - EMA(P_low))`` of the returns.
        return_norm_decay: decay of those EMAs.
        return_norm_low: the low percentile ``P_low`` (a fraction).
        return_norm_high: the high percentile ``P_high`` (a fraction).
    """

    horizon: int = 15
    horizon_schedule: RolloutSchedule | None = None
    discount: float = 0.997
    lambda_: float = 0.95
    entropy_weight: float = 3e-4
    actor_grad: Literal["auto", "reinforce", "dynamics", "mix"] = "auto"
    reinforce_weight: float = 0.9
    bootstrap_critic: Literal["critic", "slow_critic"] = "critic"
    actor_dist: Literal["bounded_normal", "tanh_normal"] = "bounded_normal"
    action_min_std: float = 0.1
    action_max_std: float = 1.0
    replay_critic_weight: float = 0.0
    slow_critic_tau: float = 0.02
    slow_critic_every: int = 1
    slow_critic_weight: float = 1.0
    return_norm: bool = True
    return_norm_decay: float = 0.99
    return_norm_low: float = 0.05
    return_norm_high: float = 0.95

    def __post_init__(self) -> None:
        if isinstance(self.horizon_schedule, Mapping):  # from a checkpoint's plain dict
            object.__setattr__(self, "horizon_schedule", RolloutSchedule(**self.horizon_schedule))
        check_at_least("behavior.horizon", self.horizon, 1)
        if self.horizon_schedule is not None:
            check_at_least("behavior.horizon_schedule.min_length", self.horizon_schedule.min_length, 1)
        check_in_range("behavior.discount", self.discount, 0.0, 1.0)
        check_in_range("behavior.lambda_", self.lambda_, 0.0, 1.0)
        check_at_least("behavior.entropy_weight", self.entropy_weight, 0)
        check_one_of("behavior.actor_grad", self.actor_grad, ("auto", "reinforce", "dynamics", "mix"))
        check_in_range("behavior.reinforce_weight", self.reinforce_weight, 0.0, 1.0)
        check_one_of("behavior.bootstrap_critic", self.bootstrap_critic, ("critic", "slow_critic"))
        check_one_of("behavior.actor_dist", self.actor_dist, ("bounded_normal", "tanh_normal"))
        if not 0 < self.action_min_std <= self.action_max_std:
            raise ValueError(
                "behavior.action_min_std and action_max_std need 0 < min <= max, got "
                f"{self.action_min_std} and {self.action_max_std}"
            )
        check_at_least("behavior.replay_critic_weight", self.replay_critic_weight, 0)
        check_in_range("behavior.slow_critic_tau", self.slow_critic_tau, 0.0, 1.0)
        check_at_least("behavior.slow_critic_every", self.slow_critic_every, 1)
        check_at_least("behavior.slow_critic_weight", self.slow_critic_weight, 0)
        check_in_range("behavior.return_norm_decay", self.return_norm_decay, 0.0, 1.0)
        if not 0.0 <= self.return_norm_low < self.return_norm_high <= 1.0:
            raise ValueError(
                "behavior.return_norm_low and return_norm_high need 0 <= low < high <= 1, got "
                f"{self.return_norm_low} and {self.return_norm_high}"
            )

    def gradient_weight(self, discrete: bool) -> float:
        """``ρ``, the REINFORCE loss's share of the actor's loss for this action space (1:
        ``reinforce``, 0: ``dynamics``, ``reinforce_weight``: ``mix``; ``auto``: 1 for discrete
        actions, 0 for continuous ones). Discrete actions have no dynamics gradient (their samples
        carry none), so they take only ``reinforce`` or ``auto``."""
        grad = self.actor_grad
        if grad == "auto":
            return 1.0 if discrete else 0.0
        if discrete and grad in ("dynamics", "mix"):
            raise ValueError(f"behavior.actor_grad {grad!r} needs continuous actions; use 'reinforce' for Discrete")
        return {"reinforce": 1.0, "dynamics": 0.0}.get(grad, self.reinforce_weight)

    def current_horizon(self, env_steps: int) -> int:
        """Imagined steps per update after ``env_steps`` env steps (``horizon`` or the schedule's)."""
        return self.horizon if self.horizon_schedule is None else self.horizon_schedule(env_steps)


def _adam(lr: float, eps: float, clip: float) -> OptimSettings:
    return OptimSettings(name="adam", lr=lr, eps=eps, clip=GradClipSettings(type="clip_norm", value=clip))


@dataclass(frozen=True)
class DreamerOptim:
    """One optimizer per network (DreamerV3's defaults: Adam, world model lr 1e-4 eps 1e-8 with
    gradient norms clipped at 1000; actor and critic lr 3e-5 eps 1e-5 clipped at 100). Each is
    a :class:`~lightning_wm.optim.OptimSettings`; its ``lr_anneal_steps`` anneals that network's
    rate linearly to 0 over this many gradient steps.

    Attributes:
        model: the world model's optimizer (encoder, RSSM, decoder, reward and continue heads).
        actor: the actor's optimizer.
        critic: the critic's optimizer.
    """

    model: OptimSettings = field(default_factory=lambda: _adam(1e-4, 1e-8, 1000.0))
    actor: OptimSettings = field(default_factory=lambda: _adam(3e-5, 1e-5, 100.0))
    critic: OptimSettings = field(default_factory=lambda: _adam(3e-5, 1e-5, 100.0))
