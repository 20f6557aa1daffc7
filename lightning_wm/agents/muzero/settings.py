"""MuZero's settings groups (frozen dataclasses; jsonargparse reads them from nested YAML and lists
them in ``--model.help``). :class:`~lightning_wm.agents.muzero.MuZero` takes all of them;
:class:`~lightning_wm.agents.muzero.MuZeroModel` takes ``net`` and
:class:`~lightning_wm.agents.muzero.MuZeroRepresentation` ``net``, ``unroll`` and ``loss``, so
every option is declared once. The search group is :class:`lightning_wm.search.SearchSettings`,
the optimizer :class:`lightning_wm.optim.OptimSettings`. ``docs/muzero.md`` has every option and
the names ALF, EfficientZero and LightZero give them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_wm.settings import check_at_least, check_one_of

__all__ = ["MuZeroNet", "UnrollSettings", "MuZeroLossSettings", "ReanalyseSettings", "TargetSettings"]

NORMS = ("layer", "batch", "none")


@dataclass(frozen=True)
class MuZeroNet:
    """MuZero's networks: representation, dynamics and prediction (``MuZeroModel``).

    Attributes:
        latent_dim: hidden state size (vector observations).
        hidden: width of each hidden layer of the MLP trunks of representation, dynamics and
            prediction (vector observations).
        layers: hidden layers of each MLP trunk (vector observations).
        head_hidden: width of the one hidden layer of every head (reward, value, policy, game over).
        conv: the representation of frames: ``resnet`` (MuZero's Atari network: residual conv
            net downsampling by 16 to hidden planes) or ``small`` (the MinAtar paper's network,
            :class:`~lightning_wm.nn.blocks.SmallConvEncoder`: one 3x3 conv of ``channels``, a
            layer of ``hidden`` units, then a linear layer to a ``latent_dim`` hidden state that
            the MLP dynamics and prediction of vector observations take; for small frames such
            as MinAtar's 10x10).
        channels: conv channels of the hidden planes (frames; ``small``: of its one conv).
        blocks: residual blocks per stage of the conv representation, and of dynamics and
            prediction (frames).
        frame_stack: frames per observation (frames); training windows read ``frame_stack - 1``
            rows of history before each position.
        support_size: value bins ``-S..S`` in the h-transformed space (MuZero Atari: 300).
        reward_support_size: reward bins (null: ``support_size``).
        value_eps: the ``eps`` of the value transform ``h(x) = sign(x)(sqrt(|x| + 1) - 1) + eps x``.
        norm: ``layer`` (LayerNorm, channel LayerNorm for planes), ``batch`` (BatchNorm:
            LightZero's ``norm_type='BN'``) or ``none``.
        activation: ``relu``, ``silu``, ``elu``, ``tanh`` or ``gelu``.
        state_norm: min-max scale every hidden state to ``[0, 1]`` (the paper's rule; LightZero's
            ``state_norm``); false: the trunks' raw outputs.
        projection: ``[proj_hid, proj_out, pred_hid]``: EfficientZero's projector (two hidden
            layers of ``proj_hid``, output ``proj_out``) and predictor (one hidden layer of
            ``pred_hid``) for the latent consistency loss (LightZero: ``[1024, 1024, 512]``);
            null: the loss compares the hidden states themselves.
    """

    latent_dim: int = 128
    hidden: int = 128
    layers: int = 2
    head_hidden: int = 32
    conv: Literal["resnet", "small"] = "resnet"
    channels: int = 64
    blocks: int = 1
    frame_stack: int = 1
    support_size: int = 300
    reward_support_size: int | None = None
    value_eps: float = 0.001
    norm: Literal["layer", "batch", "none"] = "layer"
    activation: str = "relu"
    state_norm: bool = True
    projection: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.projection is not None:
            if len(self.projection) != 3 or min(self.projection) < 1:
                raise ValueError(
                    f"projection is [proj_hid, proj_out, pred_hid], three widths >= 1; got {list(self.projection)}"
                )
            object.__setattr__(self, "projection", tuple(int(d) for d in self.projection))
        sizes = {
            "latent_dim": self.latent_dim,
            "hidden": self.hidden,
            "head_hidden": self.head_hidden,
            "channels": self.channels,
            "frame_stack": self.frame_stack,
            "support_size": self.support_size,
        }
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"net {name} must be >= 1, got {value}")
        if self.layers < 0 or self.blocks < 0:
            raise ValueError(f"net layers and blocks must be >= 0, got {self.layers}, {self.blocks}")
        if self.reward_support_size is not None and self.reward_support_size < 1:
            raise ValueError(f"net reward_support_size must be >= 1 or null, got {self.reward_support_size}")
        check_one_of("net.conv", self.conv, ("resnet", "small"))
        if self.norm not in NORMS:
            raise ValueError(f"unknown norm {self.norm!r}; choose 'layer', 'batch' or 'none'")


@dataclass(frozen=True)
class UnrollSettings:
    """The K-step unroll and its targets (``agents/muzero/targets.py``).

    Attributes:
        num_unroll_steps: K, the steps the model is unrolled from each sampled position.
        td_steps: n of the n-step value targets; -1: Monte Carlo to the end of the sampled window.
        bootstrap_value: what value targets bootstrap from: ``target_network`` (the target
            network's value of the bootstrap row: EfficientZero, LightZero) or ``stored`` (the
            search value stored when acting: the MuZero paper, ALF; rows without one use the
            target network's).
        policy_after_end: the policy target at and past a termination: ``uniform`` or ``mask``.
        random_action_after_episode_end: unroll past the episode's end with uniformly random
            actions instead of repeating the last one (ALF).
    """

    num_unroll_steps: int = 5
    td_steps: int = 10
    bootstrap_value: Literal["target_network", "stored"] = "target_network"
    policy_after_end: Literal["uniform", "mask"] = "uniform"
    random_action_after_episode_end: bool = False

    def __post_init__(self) -> None:
        check_at_least("unroll.num_unroll_steps", self.num_unroll_steps, 1)
        if self.td_steps == 0 or self.td_steps < -1:
            raise ValueError(f"td_steps must be >= 1 or -1, got {self.td_steps}")
        check_one_of("unroll.bootstrap_value", self.bootstrap_value, ("target_network", "stored"))
        check_one_of("unroll.policy_after_end", self.policy_after_end, ("uniform", "mask"))


@dataclass(frozen=True)
class MuZeroLossSettings:
    """What the unroll loss trains and how much each part weighs (ALF's switches).

    Attributes:
        value_weight: weight of the value loss (MuZero: 0.25).
        reward_weight: weight of the reward loss.
        policy_weight: weight of the policy loss.
        game_over_weight: weight of the game-over loss.
        repr_weight: weight of the latent consistency loss.
        train_reward_function: train the reward head.
        train_policy: train the policy head (needed for the search).
        train_game_over_function: add a termination head and train it.
        train_repr_prediction: latent consistency: the negative cosine similarity of each unrolled
            state with the representation of the observation reached (gradient stopped on it;
            through ``net.projection``'s heads when set, as EfficientZero).
        recurrent_gradient_scaling_factor: the hidden state's gradient is scaled by this at
            every unroll step (MuZero, Appendix G).
        unroll_step_weights: ``pseudocode`` (step 0 weighs 1, each unrolled step ``1 / K``: the
            MuZero pseudocode, ALF) or ``equal`` (every step ``1 / K``: EfficientZero, LightZero).
    """

    value_weight: float = 0.25
    reward_weight: float = 1.0
    policy_weight: float = 1.0
    game_over_weight: float = 1.0
    repr_weight: float = 1.0
    train_reward_function: bool = True
    train_policy: bool = True
    train_game_over_function: bool = False
    train_repr_prediction: bool = False
    recurrent_gradient_scaling_factor: float = 0.5
    unroll_step_weights: Literal["pseudocode", "equal"] = "pseudocode"

    def __post_init__(self) -> None:
        check_one_of("loss.unroll_step_weights", self.unroll_step_weights, ("pseudocode", "equal"))
        weights = {
            "value_weight": self.value_weight,
            "reward_weight": self.reward_weight,
            "policy_weight": self.policy_weight,
            "game_over_weight": self.game_over_weight,
            "repr_weight": self.repr_weight,
            "recurrent_gradient_scaling_factor": self.recurrent_gradient_scaling_factor,
        }
        for name, value in weights.items():
            if value < 0:
                raise ValueError(f"loss {name} must be >= 0, got {value}")


@dataclass(frozen=True)
class ReanalyseSettings:
    """MuZero Reanalyse (ALF's ``reanalyze_*`` options).

    Attributes:
        ratio: the share of each batch whose policy and value targets come from a fresh search
            with the target network (the first ``round(ratio * B)`` samples).
        td_steps: n of the reanalysed n-step value targets.
        td_steps_schedule: ``[max_age, min_td_steps]``: n falls linearly with the sample's age
            (rows written to its stream since) from ``td_steps`` to ``min_td_steps`` at
            ``max_age`` (ALF's ``LinearTdStepFunc``, EfficientZero's "dynamic horizon"); null: n
            is ``td_steps``.
        batch_size: roots per search call (null: all the possible roots at once); every call is
            padded to this one shape.
        full: search at every row of the window (else at unroll rows ``0..K``; later rows are
            valued by the target network).
        root_noise: the acting search's root noise in the reanalysing search too (Dirichlet for
            PUCT, Gumbel for Gumbel MuZero; LightZero's ``reanalyze_noise``, EfficientZero's
            reanalyse): without it the policy targets are the noise-free visits of the policy's
            own prior, which the policy then sharpens towards (on MinAtar SpaceInvaders it
            collapsed; bench/RESULTS.md).
    """

    ratio: float = 0.0
    td_steps: int = 5
    td_steps_schedule: tuple[int, int] | None = None
    batch_size: int | None = None
    full: bool = False
    root_noise: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"reanalyse ratio must be in [0, 1], got {self.ratio}")
        if self.td_steps < 1:
            raise ValueError(f"reanalyse td_steps must be >= 1, got {self.td_steps}")
        schedule = self.td_steps_schedule
        if schedule is not None:
            if len(schedule) != 2 or schedule[0] < 1 or not 1 <= schedule[1] <= self.td_steps:
                raise ValueError(
                    f"reanalyse td_steps_schedule is [max_age >= 1, min_td_steps in 1..td_steps], got {list(schedule)}"
                )
            object.__setattr__(self, "td_steps_schedule", (int(schedule[0]), int(schedule[1])))
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"reanalyse batch_size must be >= 1 or null, got {self.batch_size}")


@dataclass(frozen=True)
class TargetSettings:
    """The target network (reanalyse's searches and the bootstrap values):
    ``target <- (1 - update_tau) target + update_tau model`` every ``update_period`` optimizer
    steps (:func:`lightning_wm.nn.blocks.soft_update`).

    Attributes:
        update_tau: the share of the model's weights taken at an update (1: a copy).
        update_period: optimizer steps between updates.
    """

    update_tau: float = 1.0
    update_period: int = 1000

    def __post_init__(self) -> None:
        if not 0.0 < self.update_tau <= 1.0:
            raise ValueError(f"target update_tau must be in (0, 1], got {self.update_tau}")
        if self.update_period < 1:
            raise ValueError(f"target update_period must be >= 1, got {self.update_period}")
