"""IMPALA (Espeholt et al. 2018) with DI-engine's options: the V-trace loss on row-convention
unrolls and the LightningModule that learns from actors' unrolls.

* :func:`impala_loss` — policy gradient with V-trace advantages + ``value_weight`` * value
  loss - ``entropy_weight`` * entropy, as a pure function of time-major tensors;
  :func:`unroll_loss` runs an :class:`~lightning_wm.nn.actor_critic.ActorCritic` over a batch of
  unrolls ``[B, T+1, ...]`` and calls it.
* :class:`IMPALA` — the learner on an :class:`~lightning_wm.data.modules.UnrollDataModule`:
  unrolls acted in process or by actor processes (rows carry the behaviour policy and the
  ``policy_version`` that made them), one optimizer step per batch, optional prioritized
  replay feedback. The network, its heads and sampling are in :mod:`lightning_wm.nn.actor_critic`.

LSTM core: actors store the core state they acted from in every row (``core_h`` / ``core_c``);
the learner starts each unroll from the state of its first row and resets it where
``is_first`` inside the unroll. This costs two ``[lstm_size]`` columns per row and needs no
burn-in; the start state is the actor's (made by the weights of the row's ``policy_version``),
as in the IMPALA paper and torchbeast.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from lightning_wm.agents.base import RLModule
from lightning_wm.envs import EnvSpec
from lightning_wm.nn.actor_critic import ActorCritic, CoreState, Obs
from lightning_wm.optim import GradClipper, OptimSettings, build_optimizer, optimizer_beta, with_lr_schedule
from lightning_wm.returns import UnrollSteps, unroll_steps, vtrace

__all__ = ["IMPALA", "ImpalaLoss", "VTraceLossConfig", "impala_loss", "unroll_loss"]


# -- loss ------------------------------------------------------------------------------------
@dataclass
class VTraceLossConfig:
    """The loss options under DI-engine's names and defaults (``policy.learn`` of its IMPALA)."""

    value_weight: float = 0.5
    entropy_weight: float = 0.0001
    discount_factor: float = 0.99
    lambda_: float = 0.95
    rho_clip_ratio: float = 1.0
    c_clip_ratio: float = 1.0
    rho_pg_clip_ratio: float = 1.0
    reward_scale: float = 1.0  # rewards are multiplied by this before V-trace (sample-factory's reward_scale)


class ImpalaLoss(NamedTuple):
    """Scalars ``total_loss = policy_loss + value_weight * value_loss - entropy_weight *
    entropy_loss`` (``entropy_loss`` is the mean entropy, DI-engine's name), statistics for
    logging and ``priority [B]`` (mean ``|vs - V|`` per unroll, for prioritized replay)."""

    total_loss: Tensor
    policy_loss: Tensor
    value_loss: Tensor
    entropy_loss: Tensor
    stats: dict[str, Tensor]
    priority: Tensor


def impala_loss(
    target_log_prob: Tensor,
    behaviour_log_prob: Tensor,
    entropy: Tensor,
    value: Tensor,
    steps: UnrollSteps,
    config: VTraceLossConfig | None = None,
    weight: Tensor | None = None,
) -> ImpalaLoss:
    """IMPALA's loss on time-major steps.

    Args:
        target_log_prob: ``log pi(a_t|x_t)`` ``[T, B]`` with gradient.
        behaviour_log_prob: ``log mu(a_t|x_t)`` ``[T, B]`` of the acting policy.
        entropy: of ``pi(.|x_t)`` ``[T, B]`` with gradient.
        value: ``V(x_t)`` ``[T+1, B]`` with gradient (the last row bootstraps).
        steps: rewards, discounts and the mask of real steps ``[T, B]`` (:func:`unroll_steps`).
        config: weights, clips and lambda (DI-engine's defaults if None).
        weight: importance-sampling weights ``[B]`` of prioritized replay, or None.
    Returns:
        :class:`ImpalaLoss`. Means run over the real steps (``steps.mask``) only: the policy
        term ``-mean(w * log pi * A)`` with V-trace advantages ``A``, the value term
        ``mean(w * (V - vs)^2)`` (DI-engine's squared error, no 1/2), the entropy
        ``mean(w * H)``; ``w`` the IS weight of the step's unroll (1 without). Steps out of a
        last row or into a first row (their extras may be zeros) are masked, not computed.
    """
    cfg = config or VTraceLossConfig()
    mask = steps.mask.bool()
    zero = torch.zeros((), dtype=target_log_prob.dtype, device=target_log_prob.device)
    # masked steps may hold zeroed extras (log of sigma 0): keep their values out of every sum
    blogp = torch.where(mask, behaviour_log_prob.detach(), zero)
    tlogp = torch.where(mask, target_log_prob, zero)
    reward = torch.where(mask, steps.reward, zero)
    vs, advantage = vtrace(
        blogp,
        tlogp.detach(),
        reward,
        value[:-1],
        value[-1],
        steps.discount,
        cfg.rho_clip_ratio,
        cfg.c_clip_ratio,
        cfg.rho_pg_clip_ratio,
        cfg.lambda_,
        mask=mask,
    )
    w = mask.to(tlogp.dtype)
    if weight is not None:
        w = w * weight.to(w.dtype).unsqueeze(0)
    count = mask.sum().clamp(min=1).to(w.dtype)
    policy_loss = -(w * tlogp * advantage).sum() / count
    td = value[:-1] - vs
    value_loss = (w * td.square()).sum() / count
    entropy_loss = (w * torch.where(mask, entropy, zero)).sum() / count
    total = policy_loss + cfg.value_weight * value_loss - cfg.entropy_weight * entropy_loss
    with torch.no_grad():
        valid = mask.to(tlogp.dtype)
        log_rho = tlogp.detach() - blogp
        stats = {
            "rho_mean": (log_rho.exp() * valid).sum() / count,
            # clipped by more than float noise (an on-policy ratio is 1 only up to rounding)
            "rho_clipped_fraction": ((log_rho > np.log(cfg.rho_clip_ratio) + 1e-4).to(valid.dtype) * valid).sum()
            / count,
            "vs_mean": (vs * valid).sum() / count,
            "advantage_mean": (advantage * valid).sum() / count,
        }
        per_unroll = valid.sum(0).clamp(min=1)
        priority = (td.detach().abs() * valid).sum(0) / per_unroll
    return ImpalaLoss(total, policy_loss, value_loss, entropy_loss, stats, priority)


def unroll_loss(
    net: ActorCritic, batch: dict[str, Any], config: VTraceLossConfig | None = None, weight: Tensor | None = None
) -> ImpalaLoss:
    """The loss of ``net`` on a batch of unrolls in the row convention, batch-major ``[B, T+1, ...]``.

    ``batch`` holds ``obs``, ``reward``, ``is_first``, ``is_last``, ``is_terminal``,
    ``action`` and the behaviour policy the rows were acted with (``logits``, or ``mu`` and
    ``sigma``); with an LSTM core, ``core_h`` / ``core_c`` of row 0 start the unroll (zeros if
    absent). ``weight [B]``: prioritized replay's IS weights, or None.
    """
    cfg = config or VTraceLossConfig()
    missing = [
        k
        for k in ("obs", "reward", "is_first", "is_last", "is_terminal", "action", *net.head.behaviour_keys)
        if k not in batch
    ]
    if missing:
        raise KeyError(f"unroll batch lacks {missing}; rows must carry the behaviour policy the actors acted with")

    def tm(x: Tensor) -> Tensor:  # batch-major [B, T+1, ...] -> time-major [T+1, B, ...]
        return x.transpose(0, 1)

    obs = tm(batch["obs"]) if isinstance(batch["obs"], Tensor) else {k: tm(v) for k, v in batch["obs"].items()}
    is_first = tm(batch["is_first"])
    state = None
    if net.core is not None and "core_h" in batch:
        state = (batch["core_h"][:, 0].float(), batch["core_c"][:, 0].float())
    params, value, _ = net.unroll(obs, is_first, state)
    reward = tm(batch["reward"]).float() * cfg.reward_scale
    steps = unroll_steps(reward, is_first, tm(batch["is_last"]), tm(batch["is_terminal"]), cfg.discount_factor)
    action = tm(batch["action"])[:-1]
    target = {k: v[:-1] for k, v in params.items()}
    behaviour = {k: tm(batch[k])[:-1].float() for k in net.head.behaviour_keys}
    return impala_loss(
        net.head.log_prob(target, action),
        net.head.log_prob(behaviour, action),
        net.head.entropy(target),
        value,
        steps,
        cfg,
        weight,
    )


# -- the learner -----------------------------------------------------------------------------
class IMPALA(RLModule):
    """IMPALA's learner: V-trace actor-critic on batches of unrolls ``[B, T+1, ...]``.

    Feed it an :class:`~lightning_wm.data.modules.UnrollDataModule` (``unroll_length`` is
    DI-engine's ``unroll_len``, its ``batch_size`` DI-engine's ``learn.batch_size``,
    ``replay_size`` / ``max_use`` DI-engine's ``replay_buffer_size`` / ``max_use``). Options
    keep DI-engine's names and defaults (``policy.learn.*``); the network's are those of
    :class:`~lightning_wm.nn.actor_critic.ActorCritic`.

    Args:
        env_spec: the env's spaces (linked from the datamodule by the CLI).
        hidden_size, hidden_layers, activation, conv, conv_channels, fc_size, lstm_size,
            sigma_type, bound_type, init_sigma: the network.
        encoder: build the observation encoder from the env spec instead (YAML ``class_path``
            of a module whose first argument is the :class:`EnvSpec`, e.g. another model's
            representation network); see ``ActorCritic``'s ``encoder``. An encoder with a
            ``representation_loss(batch, step) -> (loss, logs) | None`` method trains itself:
            its loss is added to IMPALA's and its logs logged (e.g.
            :class:`~lightning_wm.agents.muzero.MuZeroRepresentation`).
        learning_rate: the optimizer's step size, logged as ``train/cur_lr``.
        lr_anneal_steps: anneal the learning rate linearly to 0 over this many optimizer steps
            (the IMPALA paper's schedule); None keeps it constant (DI-engine).
        value_weight, entropy_weight, discount_factor, lambda_, rho_clip_ratio, c_clip_ratio,
            rho_pg_clip_ratio: the loss (:class:`VTraceLossConfig`).
        reward_scale: multiply rewards by this before V-trace (not in DI-engine; sample-factory's
            ``reward_scale``): keeps the value targets near unit scale where returns are large
            (Pendulum's are about -16 per step), so the value loss does not swamp the policy
            gradient under ``clip_norm``. Values are then in scaled units.
        optim: ``adam`` or ``rmsprop``; ``betas``, ``eps``, ``alpha``, ``momentum``: their constants.
        grad_clip_type, clip_value, clip_coef, clip_norm_type, clip_momentum_timestep: gradient
            clipping (:class:`~lightning_wm.optim.GradClipper`).
        priority: return each unroll's priority (mean ``|vs - V|`` over its steps) as
            ``"priority"`` so a prioritized unroll replay (``data.prioritized: true``) updates it.
        priority_IS_weight: weight each unroll's loss terms by the batch's importance weights
            (``weight``; needs ``priority`` and a prioritized replay).
    """

    def __init__(
        self,
        env_spec: EnvSpec | None = None,
        *,
        hidden_size: int = 64,
        hidden_layers: int = 2,
        activation: str = "relu",
        conv: Literal["deep", "shallow"] = "deep",
        conv_channels: tuple[int, ...] = (16, 32, 32),
        fc_size: int = 256,
        lstm_size: int = 0,
        sigma_type: Literal["independent", "conditioned"] = "independent",
        bound_type: Literal["tanh"] | None = None,
        init_sigma: float = 1.0,
        encoder: Callable[[EnvSpec], nn.Module] | None = None,
        learning_rate: float = 0.0005,
        lr_anneal_steps: int | None = None,
        value_weight: float = 0.5,
        entropy_weight: float = 0.0001,
        discount_factor: float = 0.99,
        lambda_: float = 0.95,
        rho_clip_ratio: float = 1.0,
        c_clip_ratio: float = 1.0,
        rho_pg_clip_ratio: float = 1.0,
        reward_scale: float = 1.0,
        optim: Literal["adam", "rmsprop"] = "adam",
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        alpha: float = 0.99,
        momentum: float = 0.0,
        grad_clip_type: Literal["clip_value", "clip_norm", "clip_momentum", "clip_momentum_norm"] | None = None,
        clip_value: float = 0.5,
        clip_coef: float = 5.0,
        clip_norm_type: float = 2.0,
        clip_momentum_timestep: int = 100,
        priority: bool = False,
        priority_IS_weight: bool = False,
    ) -> None:
        super().__init__(env_spec)
        if env_spec is None:
            raise ValueError(
                "IMPALA needs the env's spaces (env_spec); the CLI links them from the datamodule, "
                "in Python pass env_spec=datamodule.spec"
            )
        if priority_IS_weight and not priority:
            raise ValueError("priority_IS_weight corrects prioritized sampling: it needs priority: true (as DI-engine)")
        if lr_anneal_steps is not None and lr_anneal_steps < 1:
            raise ValueError(f"lr_anneal_steps must be >= 1 or null, got {lr_anneal_steps}")
        self.save_hyperparameters(ignore=["env_spec", "encoder"])
        self.net = ActorCritic(
            env_spec,
            hidden_size,
            hidden_layers,
            activation,
            conv,
            tuple(conv_channels),
            fc_size,
            lstm_size,
            sigma_type,
            bound_type,
            init_sigma,
            encoder=encoder(env_spec) if encoder is not None else None,
        )
        self.loss_config = VTraceLossConfig(
            value_weight,
            entropy_weight,
            discount_factor,
            lambda_,
            rho_clip_ratio,
            c_clip_ratio,
            rho_pg_clip_ratio,
            reward_scale,
        )
        self.clipper = GradClipper(grad_clip_type, clip_value, clip_coef, clip_norm_type, clip_momentum_timestep)
        self._clip_stats: dict[str, Tensor] = {}

    # -- Agent protocol ------------------------------------------------------------------
    def initial_state(self, batch_size: int) -> CoreState:
        return self.net.initial_state(batch_size)

    def act(self, obs: Obs, state: CoreState, explore: bool) -> tuple[Tensor, CoreState, dict[str, Tensor]]:
        return self.net.act(obs, state, explore)

    def acting_copy(self) -> nn.Module:
        """Only the network (an :class:`ActorCritic`, an Agent itself): CPU, eval mode, no gradients."""
        return copy.deepcopy(self.net).cpu().eval().requires_grad_(False)

    # -- optimization ----------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        settings = OptimSettings(
            name=hp.optim,
            lr=hp.learning_rate,
            betas=tuple(hp.betas),
            eps=hp.eps,
            alpha=hp.alpha,
            momentum=hp.momentum,
            lr_anneal_steps=hp.lr_anneal_steps,
        )
        optimizer = build_optimizer(self.parameters(), settings)
        self.clipper.beta = optimizer_beta(optimizer)
        return with_lr_schedule(optimizer, settings)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        """DI-engine's ``grad_clip_type`` between backward and the step (after DDP's all-reduce,
        so every rank clips the same gradients); Lightning's own ``gradient_clip_val`` still works."""
        if gradient_clip_val:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self._clip_stats = self.clipper(self.parameters())

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Tensor]:
        """V-trace loss of a batch of unrolls; returns ``{"loss"}`` (and ``"priority" [B]`` with
        ``priority``) and logs ``train/*`` on the steps the logger writes (every
        ``trainer.log_every_n_steps``)."""
        hp = self.hparams
        weight = None
        if hp.priority_IS_weight:
            if "weight" not in batch:
                raise ValueError(
                    "priority_IS_weight: the batch has no importance weights; use a prioritized unroll "
                    "replay (data.init_args.prioritized: true, replay_size > 0)"
                )
            weight = batch["weight"]
        out, loss, encoder_logs = self._losses(batch, weight, self.global_step)
        result = {"loss": loss}
        if hp.priority:
            result["priority"] = out.priority.detach()
        if self._trainer is not None and (self.global_step + 1) % max(1, self._trainer.log_every_n_steps):
            # Lightning writes on_step logs every log_every_n_steps steps anyway, and each self.log
            # call cost ~10 ms on the loaded 2-core machine (Lightning moves and copies its result
            # metadata per call): logging every step took 40% of a CartPole learner's time. Log only
            # on the steps that are written.
            return result
        B = int(batch["is_first"].shape[0])
        logs = {
            "train/total_loss": out.total_loss.detach(),
            "train/policy_loss": out.policy_loss.detach(),
            "train/value_loss": out.value_loss.detach(),
            "train/entropy_loss": out.entropy_loss.detach(),
            "train/cur_lr": torch.tensor(self._current_lr()),
            "train/rho_mean": out.stats["rho_mean"],
            "train/rho_clipped_fraction": out.stats["rho_clipped_fraction"],
        }
        if "policy_version" in batch:  # rows of the random prefill policy carry -1
            version = batch["policy_version"][:, :-1]
            acted = version >= 0
            if acted.any():
                logs["train/policy_lag"] = (self.global_step - version[acted].double()).mean().float()
        logs.update({f"train/{k}": v for k, v in self._clip_stats.items()})
        logs.update(encoder_logs)
        self.log_dict(logs, on_step=True, on_epoch=False, batch_size=B)
        self.log("train/loss", out.total_loss.detach(), prog_bar=True, on_step=True, on_epoch=False, batch_size=B)
        return result

    def _losses(self, batch: dict[str, Any], weight: Tensor | None, step: int) -> tuple[Any, Tensor, dict[str, Tensor]]:
        """``(unroll_loss output, loss to minimise, encoder logs)``: the V-trace loss plus, where the
        injected encoder trains itself (``representation_loss``, e.g. MuZeroRepresentation), its loss."""
        out = unroll_loss(self.net, batch, self.loss_config, weight)
        loss, encoder_logs = out.total_loss, {}
        encoder_loss = getattr(self.net.encoder, "representation_loss", None)
        if encoder_loss is not None:
            extra = encoder_loss(batch, step)
            if extra is not None:
                loss, encoder_logs = loss + extra[0], extra[1]
        return out, loss, encoder_logs

    def learner_loss(self, batch: dict[str, Any], step: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of a batch of unrolls (scalar: V-trace, plus a self-training encoder's) and its
        parts for logging (no ``train/`` prefix), for learners that compose this one
        (``DynaLearner``; ``step``: the composing learner's step, default this module's)."""
        weight = batch.get("weight") if self.hparams.priority_IS_weight else None
        out, loss, encoder_logs = self._losses(batch, weight, self.global_step if step is None else step)
        return loss, {
            "total_loss": out.total_loss.detach(),
            "policy_loss": out.policy_loss.detach(),
            "value_loss": out.value_loss.detach(),
            "entropy_loss": out.entropy_loss.detach(),
            **out.stats,
            **encoder_logs,
        }

    def _current_lr(self) -> float:
        optimizers = self._trainer.optimizers if self._trainer is not None else []
        return float(optimizers[0].param_groups[0]["lr"]) if optimizers else float(self.hparams.learning_rate)

    # -- checkpoints -----------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["grad_clipper"] = self.clipper.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "grad_clipper" in checkpoint:
            self.clipper.load_state_dict(checkpoint["grad_clipper"])
