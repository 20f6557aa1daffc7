"""The settings groups of World Models' memory (M) and controller (C).

V takes its few options flat (``latent_dim``, ``depth``, ``kl_tolerance``, ``output``) beside
an ``optim`` group (:class:`~lightning_wm.optim.OptimSettings`). M and C take these groups;
``docs/worldmodels.md`` lists every option with its meaning, default and HumbleRL's name.

* :class:`MemoryNetSettings` (``net``), :class:`MemoryLossSettings` (``loss``),
  :class:`MemoryDreamSettings` (``dream``) of :class:`~lightning_wm.agents.worldmodels.memory.Memory`;
* :class:`ESSettings` (``es``), :class:`ControllerDreamSettings` (``dream``) of
  :class:`~lightning_wm.agents.worldmodels.controller.Controller`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_wm.settings import check_at_least, check_one_of, check_positive
from lightning_wm.world_model import check_done_mode

__all__ = ["MemoryNetSettings", "MemoryLossSettings", "MemoryDreamSettings", "ESSettings", "ControllerDreamSettings"]


@dataclass(frozen=True)
class MemoryNetSettings:
    """M's network: an LSTM on ``[z_t, a_t]`` with a mixture-density head for ``z_{t+1}`` and
    reward and done heads.

    Attributes:
        latent_dim: size of V's latent ``z`` (V's ``latent_dim``; 32 in the paper).
        hidden: LSTM units (256).
        num_mixtures: Gaussians per mixture (5).
        mixture: ``per_dim`` (the reference: each latent dimension has its own
            ``num_mixtures``-component 1-D mixture) or ``joint`` (components over the whole ``z``).
        done_input: what the done head reads: ``hidden`` (M's LSTM output at ``t``, the
            reference) or ``latent`` (a small MLP on the next latent ``z_{t+1}``: the real one in
            training, M's draw in a dream), for envs whose end is a function of what the frame shows.
    """

    latent_dim: int = 32
    hidden: int = 256
    num_mixtures: int = 5
    mixture: Literal["per_dim", "joint"] = "per_dim"
    done_input: Literal["hidden", "latent"] = "hidden"

    def __post_init__(self) -> None:
        for name in ("latent_dim", "hidden", "num_mixtures"):
            check_at_least(f"net.{name}", getattr(self, name), 1)
        check_one_of("net.mixture", self.mixture, ("per_dim", "joint"))
        check_one_of("net.done_input", self.done_input, ("hidden", "latent"))


@dataclass(frozen=True)
class MemoryLossSettings:
    """M's loss: the mixture's negative log-likelihood of ``z_{t+1}`` plus weighted reward and
    done terms (:func:`~lightning_wm.agents.worldmodels.losses.mdn_rnn_loss`), optionally the same
    loss once more with M reading its own predictions (open loop).

    Attributes:
        reward_weight: weight of the reward loss (squared error); 0 switches it off.
        done_weight: weight of the done loss (binary cross-entropy on ``is_terminal``); 0 switches it off.
        done_pos_weight: weight of the positive (terminal) class in the done loss.
        burn_in: first steps of every window that only warm the LSTM (no loss).
        reward_horizon: the reward head's target at ``t+1`` is the mean of the episode's next
            ``reward_horizon`` rewards from ``t+1`` (1: the reward itself, the reference); a
            head for dreams where one step's reward is mostly noise (CarRacing's tiles).
        open_loop_weight: weight of the open-loop loss (0: off, the reference). M reads every
            window a second time feeding back its own predictions: after ``open_loop_warmup``
            real latents from each window or episode start, its input ``z_t`` is its draw from its
            prediction for ``t`` (reparameterised, so gradients flow through the fed-back draws),
            and the real ``z_{t+1}``, reward and done are scored against what it predicts there.
        open_loop_warmup: real latents read before the first fed-back one (>= 1).
        open_loop_input: what is fed back: ``sample`` (a draw at ``dream.temperature``) or
            ``mean`` (the mixture's mean).
    """

    reward_weight: float = 1.0
    done_weight: float = 1.0
    done_pos_weight: float = 1.0
    burn_in: int = 0
    reward_horizon: int = 1
    open_loop_weight: float = 0.0
    open_loop_warmup: int = 8
    open_loop_input: Literal["sample", "mean"] = "sample"

    def __post_init__(self) -> None:
        for name in ("reward_weight", "done_weight", "done_pos_weight", "burn_in", "open_loop_weight"):
            check_at_least(f"loss.{name}", getattr(self, name), 0)
        check_at_least("loss.open_loop_warmup", self.open_loop_warmup, 1)
        check_at_least("loss.reward_horizon", self.reward_horizon, 1)
        check_one_of("loss.open_loop_input", self.open_loop_input, ("sample", "mean"))


@dataclass(frozen=True)
class MemoryDreamSettings:
    """How M samples: in dreams, in the open-loop loss and in the validation dream pictures.

    Attributes:
        temperature: sampling temperature ``tau``: mixture logits divided by ``tau``, standard
            deviations times ``sqrt(tau)`` (1.0; the paper's Doom used 1.15).
        length: steps of the open-loop dream drawn at each validation (needs ``vision_ckpt``).
        sequences: validation sequences dreamed and drawn.
    """

    temperature: float = 1.0
    length: int = 16
    sequences: int = 4

    def __post_init__(self) -> None:
        check_at_least("dream.temperature", self.temperature, 0)
        check_at_least("dream.length", self.length, 1)
        check_at_least("dream.sequences", self.sequences, 1)


@dataclass(frozen=True)
class ESSettings:
    """The controller's evolution strategy (CMA-ES, the ``cma`` package): one training step is
    one generation.

    Attributes:
        popsize: members per generation (64 in the paper).
        episodes_per_member: episodes averaged into one member's fitness (16 in the paper).
        sigma0: initial step size (0.1).
        l2_decay: weight decay of the fitness, ``mean return - l2_decay * mean(theta^2)``
            (HumbleRL's and estool's; 0 switches it off).
        seed: seed of CMA-ES's sampler, of the fitness episodes, of the dream starts and of the
            exploration noise.
        env_workers: subprocesses that step the population's real envs (0: in this process).
    """

    popsize: int = 64
    episodes_per_member: int = 16
    sigma0: float = 0.1
    l2_decay: float = 0.01
    seed: int = 0
    env_workers: int = 0

    def __post_init__(self) -> None:
        check_at_least("es.popsize", self.popsize, 2)
        check_at_least("es.episodes_per_member", self.episodes_per_member, 1)
        check_positive("es.sigma0", self.sigma0)
        check_at_least("es.l2_decay", self.l2_decay, 0)
        check_at_least("es.env_workers", self.env_workers, 0)


@dataclass(frozen=True)
class ControllerDreamSettings:
    """The dream the controller is evolved in with ``train_in: dream``
    (:class:`~lightning_wm.dream_env.DreamEnv` over the world model).

    Attributes:
        dir: store of recorded episodes (pixel or latent for V+M; the env's observations for
            Dreamer) whose filtered states start dreams.
        starts: dreams start at the episodes' ``first`` rows (the real start distribution) or
            at ``all`` their rows (the model's memory warmed up on the real prefix).
        max_starts: at most this many start states are kept (drawn at random).
        temperature: M's sampling temperature in the dream (V+M).
        max_steps: truncation of a dream episode (``max_episode_steps`` wins if set).
        done_mode: a dream ends where the done probability exceeds ``done_threshold``
            (``threshold``) or by a Bernoulli draw of it (``sample``).
        done_threshold: see ``done_mode``.
        reward: ``head`` (the model's reward) or ``survival`` (+1 per step).
        ensemble: further M checkpoints trained on the same latents (other seeds) that dream
            together with M (V+M only; the real env still runs M alone).
        ensemble_next: whose mixture gives ``z'``: a member drawn per step (``random``) or M
            (``primary``).
        ensemble_done: a dream step ends with the members' ``max`` or ``mean`` done probability.
        ensemble_penalty: the dream's reward less this times the members' disagreement (the std
            over members of their mean next latent, averaged over its dimensions; MOPO's
            penalty); 0: none.
    """

    dir: str | None = None
    starts: Literal["first", "all"] = "first"
    max_starts: int = 4096
    temperature: float = 1.0
    max_steps: int = 1000
    done_mode: Literal["threshold", "sample"] = "threshold"
    done_threshold: float = 0.5
    reward: Literal["head", "survival"] = "head"
    ensemble: tuple[str, ...] = ()
    ensemble_next: Literal["random", "primary"] = "random"
    ensemble_done: Literal["max", "mean"] = "max"
    ensemble_penalty: float = 0.0

    def __post_init__(self) -> None:
        check_one_of("dream.starts", self.starts, ("first", "all"))
        check_at_least("dream.max_starts", self.max_starts, 1)
        check_at_least("dream.temperature", self.temperature, 0)
        check_at_least("dream.max_steps", self.max_steps, 1)
        check_done_mode(self.done_mode, "dream.done_mode")
        check_one_of("dream.reward", self.reward, ("head", "survival"))
        check_one_of("dream.ensemble_next", self.ensemble_next, ("random", "primary"))
        check_one_of("dream.ensemble_done", self.ensemble_done, ("max", "mean"))
        check_at_least("dream.ensemble_penalty", self.ensemble_penalty, 0)
        if self.ensemble_penalty and not self.ensemble:
            raise ValueError("dream.ensemble_penalty needs dream.ensemble (the members whose disagreement it costs)")
