"""IMPALA's learner (Espeholt et al. 2018): the LightningModule that learns from actors' unrolls.

Its settings come in groups (:mod:`~lightning_wm.agents.impala.settings`): ``net``
(:class:`~lightning_wm.nn.actor_critic.ActorCriticSettings`) or an injected ``encoder``, ``loss``
(:class:`~lightning_wm.agents.impala.settings.VTraceLossSettings`), ``optim``
(:class:`~lightning_wm.optim.OptimSettings`), and the two prioritized-replay switches.
``training_step`` is: the loss (:func:`~lightning_wm.agents.impala.losses.unroll_loss`), then
its report.

LSTM core: actors store the core state they acted from in every row (``core_h`` / ``core_c``);
the learner starts each unroll from the state of its first row and resets it where
``is_first`` inside the unroll. This costs two ``[lstm_size]`` columns per row and needs no
burn-in; the start state is the actor's (made by the weights of the row's ``policy_version``),
as in the IMPALA paper and torchbeast.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_wm.agents.base import RLModule
from lightning_wm.agents.impala.losses import ImpalaLoss, at_step, unroll_loss
from lightning_wm.agents.impala.settings import (
    IMPALA_LOSS,
    IMPALA_NET,
    IMPALA_OPTIM,
    VTraceLossSettings,
    warn_summed_loss_eps,
)
from lightning_wm.compiling import CompileSettings, ShapeCompiled, as_compile_settings
from lightning_wm.envs import EnvSpec
from lightning_wm.nn.actor_critic import ActorCritic, ActorCriticSettings, CoreState, Obs
from lightning_wm.optim import GradClipper, OptimSettings, build_optimizer, optimizer_beta, with_lr_schedule
from lightning_wm.settings import as_settings
from lightning_wm.world_model import frozen

__all__ = ["IMPALA", "IMPALA_LOSS", "IMPALA_NET", "IMPALA_OPTIM", "policy_lag_sums"]


def policy_lag_sums(policy_version: Tensor, step: int) -> Tensor:
    """``[lag summed over the acted rows, their count]`` (float64 ``[2]``) of a batch trained at
    optimizer step ``step``: a row's lag is ``step - policy_version``, the learner steps between the
    weights that acted and the ones that learn. ``policy_version`` ``[B, T+1]``: the last column
    (the bootstrap row) is not trained on, and rows of the random prefill policy (version -1) are
    left out. Summed over the steps between two logged ones, their ratio is ``train/policy_lag``:
    one step's batch alone would read one phase of a chunk that feeds several batches."""
    version = policy_version[:, :-1]
    acted = version >= 0
    lag = torch.where(acted, step - version, torch.zeros_like(version))
    return torch.stack([lag.sum(), acted.sum()]).double()


class IMPALA(RLModule):
    """IMPALA's learner: V-trace actor-critic on batches of unrolls ``[B, T+1, ...]``.

    Feed it an :class:`~lightning_wm.data.modules.UnrollDataModule` (its ``unroll_length``,
    ``batch_size`` and ``replay`` group: ``capacity``, ``max_use``; see ``docs/impala.md`` for DI-engine's names).

    Args:
        env_spec: the env's spaces (linked from the datamodule by the CLI).
        net: the actor-critic network (:class:`~lightning_wm.nn.actor_critic.ActorCriticSettings`).
        encoder: build the observation encoder from the env spec instead of ``net``'s (YAML
            ``class_path`` of a module whose first argument is the :class:`EnvSpec`, e.g. another
            model's representation network; see ``ActorCritic``'s ``encoder``). An encoder with a
            ``representation_loss(batch, step) -> (loss, logs) | None`` method trains itself:
            its loss is added to IMPALA's and its logs logged (e.g.
            :class:`~lightning_wm.agents.muzero.MuZeroRepresentation`).
        loss: the V-trace loss (:class:`~lightning_wm.agents.impala.settings.VTraceLossSettings`).
        optim: the optimizer (``adam`` or ``rmsprop``), its learning rate (logged as
            ``train/cur_lr``; ``lr_anneal_steps`` anneals it linearly to 0, the IMPALA paper's
            schedule) and its gradient clipping ``optim.clip`` (DI-engine's ``grad_clip_type``,
            ``clip_value``; :class:`~lightning_wm.optim.GradClipper`). Default: Adam at 0.0005.
        priority: return each unroll's priority (mean ``|vs - V|`` over its steps) as
            ``"priority"`` so a prioritized unroll replay (``data.init_args.replay.prioritized: true``) updates it.
        priority_is_weight: weight each unroll's loss terms by the batch's importance weights
            (``weight``; needs ``priority`` and a prioritized replay).
        compile: ``torch.compile`` of the learner (:class:`~lightning_wm.compiling.CompileSettings`):
            ``mode: step`` compiles the V-trace loss (the unroll of the network, V-trace, the
            loss terms) and its backward as one graph (CUDA graphs on CUDA with ``cuda_graphs``);
            ``cells`` is not available here.
    """

    def __init__(
        self,
        env_spec: EnvSpec | None = None,
        *,
        net: ActorCriticSettings = IMPALA_NET,
        encoder: Callable[[EnvSpec], nn.Module] | None = None,
        loss: VTraceLossSettings = IMPALA_LOSS,
        optim: OptimSettings = IMPALA_OPTIM,
        priority: bool = False,
        priority_is_weight: bool = False,
        compile: CompileSettings = CompileSettings(),
    ) -> None:
        super().__init__(env_spec)
        if env_spec is None:
            raise ValueError(
                "IMPALA needs the env's spaces (env_spec); the CLI links them from the datamodule, "
                "in Python pass env_spec=datamodule.spec"
            )
        if priority_is_weight and not priority:
            raise ValueError("priority_is_weight corrects prioritized sampling: it needs priority: true (as DI-engine)")
        # the groups as dataclasses (also what save_settings records, as plain dicts)
        net = self.net_settings = as_settings(ActorCriticSettings, net, "net")
        loss = self.loss = as_settings(VTraceLossSettings, loss, "loss")
        optim = self.optim = as_settings(OptimSettings, optim, "optim", IMPALA_OPTIM)
        if self.optim.name not in ("adam", "rmsprop"):
            raise ValueError(f"IMPALA's optim.name must be 'adam' or 'rmsprop', got {self.optim.name!r}")
        warn_summed_loss_eps(self.optim)
        self.priority, self.priority_is_weight = bool(priority), bool(priority_is_weight)
        self.save_settings(ignore=["encoder"])
        self.net = ActorCritic(env_spec, self.net_settings, encoder=encoder(env_spec) if encoder is not None else None)
        self.clipper = GradClipper.from_settings(self.optim.clip)
        self._clip_stats: dict[str, Tensor] = {}
        self._lag_sums: Tensor | None = None  # [2]: lag summed over acted rows, their count
        self.compile_settings = compile = as_compile_settings(compile)
        if compile.mode in ("cells", "graph"):
            raise ValueError(
                f"IMPALA's compile.mode is none or step (the loss and its backward, CUDA graphs with "
                f"compile.cuda_graphs); {compile.mode} is Dreamer's"
            )
        self._unroll_loss = unroll_loss
        if compile.mode == "step":
            self._unroll_loss = ShapeCompiled(unroll_loss, compile.max_shapes, compile.cuda_graphs)

    # -- Agent protocol ------------------------------------------------------------------
    def initial_state(self, batch_size: int) -> CoreState:
        return self.net.initial_state(batch_size)

    def act(self, obs: Obs, state: CoreState, explore: bool) -> tuple[Tensor, CoreState, dict[str, Tensor]]:
        return self.net.act(obs, state, explore)

    def acting_copy(self) -> nn.Module:
        """Only the network (an :class:`ActorCritic`, an Agent itself): CPU, eval mode, no gradients."""
        return copy.deepcopy(self.net).cpu().eval().requires_grad_(False)

    def acting_weights(self) -> dict[str, Tensor]:
        """:meth:`acting_copy`'s ``state_dict`` read from the live network (what a publish sends)."""
        return self.net.state_dict()

    # -- optimization ----------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        optimizer = build_optimizer(self.parameters(), self.optim)
        self.clipper.beta = optimizer_beta(optimizer)
        return with_lr_schedule(optimizer, self.optim)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        """``optim.clip`` (DI-engine's ``grad_clip_type``) between backward and the step (after
        DDP's all-reduce, so every rank clips the same gradients); Lightning's own
        ``gradient_clip_val`` still works."""
        if gradient_clip_val:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self._clip_stats = self.clipper(self.parameters())

    # -- training --------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Tensor]:
        """The V-trace loss of a batch of unrolls; returns ``{"loss"}`` (and ``"priority" [B]``
        with ``priority``) and logs ``train/*`` on the steps the logger writes."""
        out, loss, encoder_logs = self._losses(batch, self._is_weight(batch, strict=True), self.global_step)
        result = {"loss": loss}
        if self.priority:
            result["priority"] = out.priority.detach()
        if "policy_version" in batch:  # summed on the device every step, read on the written ones
            sums = policy_lag_sums(batch["policy_version"], self.global_step)
            self._lag_sums = sums if self._lag_sums is None else self._lag_sums + sums
        # only on the steps Lightning writes: each self.log call costs time in Lightning's bookkeeping
        if self.logs_step(self.global_step + 1):
            self._report(batch, out, encoder_logs)
        return result

    def _is_weight(self, batch: dict[str, Any], strict: bool = False) -> Tensor | None:
        """The batch's importance weights ``[B]`` where ``priority_is_weight`` asks for them."""
        if not self.priority_is_weight:
            return None
        if strict and "weight" not in batch:
            raise ValueError(
                "priority_is_weight: the batch has no importance weights; use a prioritized unroll "
                "replay (data.init_args.replay.prioritized: true, replay.capacity > 0)"
            )
        return batch.get("weight")

    def _losses(
        self, batch: dict[str, Any], weight: Tensor | None, step: int
    ) -> tuple[ImpalaLoss, Tensor, dict[str, Tensor]]:
        """``(unroll_loss output, loss to minimise, encoder logs)``: the V-trace loss plus, where the
        injected encoder trains itself (``representation_loss``, e.g. MuZeroRepresentation), its loss."""
        out = self._unroll_loss(self.net, batch, at_step(self.loss, step), weight)
        loss, encoder_logs = out.total_loss, {}
        encoder_loss = getattr(self.net.encoder, "representation_loss", None)
        if encoder_loss is not None:
            extra = encoder_loss(batch, step)
            if extra is not None:
                loss, encoder_logs = loss + extra[0], extra[1]
        return out, loss, encoder_logs

    def _report(self, batch: dict[str, Any], out: ImpalaLoss, encoder_logs: dict[str, Tensor]) -> None:
        """Log the loss's parts, the learning rate, the importance ratios, the policy lag and the
        gradient clipping (``train/*``)."""
        B = int(batch["is_first"].shape[0])
        logs = {
            "train/total_loss": out.total_loss.detach(),
            "train/policy_loss": out.policy_loss.detach(),
            "train/value_loss": out.value_loss.detach(),
            "train/entropy_loss": out.entropy_loss.detach(),
            "train/cur_lr": torch.tensor(self._current_lr()),
            "train/rho_mean": out.stats["rho_mean"],
            "train/rho_clipped_fraction": out.stats["rho_clipped_fraction"],
            "train/entropy_weight": out.stats["entropy_weight"],
        }
        if self._lag_sums is not None:  # the mean over the steps since the last written one
            lag_total, rows = self._lag_sums
            self._lag_sums = None
            if rows > 0:
                logs["train/policy_lag"] = (lag_total / rows).float()
        logs.update({f"train/{k}": v for k, v in self._clip_stats.items()})
        logs.update(encoder_logs)
        self.log_dict(logs, on_step=True, on_epoch=False, batch_size=B)
        self.log("train/loss", out.total_loss.detach(), prog_bar=True, on_step=True, on_epoch=False, batch_size=B)

    def learner_loss(self, batch: dict[str, Any], step: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of a batch of unrolls (scalar: V-trace, plus a self-training encoder's) and its
        parts for logging (no ``train/`` prefix), for learners that compose this one
        (``DynaLearner``; ``step``: the composing learner's step, default this module's)."""
        out, loss, encoder_logs = self._losses(
            batch, self._is_weight(batch), self.global_step if step is None else step
        )
        return loss, {
            "total_loss": out.total_loss.detach(),
            "policy_loss": out.policy_loss.detach(),
            "value_loss": out.value_loss.detach(),
            "entropy_loss": out.entropy_loss.detach(),
            **out.stats,
            **encoder_logs,
        }

    def _current_lr(self) -> float:
        """The optimizer's learning rate now (``optim.lr`` when no trainer holds an optimizer)."""
        try:
            optimizer = self.optimizers(use_pl_optimizer=False)
        except RuntimeError:  # not attached to a Trainer
            return float(self.optim.lr)
        if isinstance(optimizer, list):
            if not optimizer:
                return float(self.optim.lr)
            optimizer = optimizer[0]
        return float(optimizer.param_groups[0]["lr"])

    # -- learning in a dream (DynaLearner's dream group, a Hybrid world model) -----------------
    def _one_step(self, obs: Obs) -> tuple[dict[str, Tensor], Tensor]:
        """``obs [B, ...]`` -> the policy's parameters ``{name: [B, ...]}`` and ``V [B]``."""
        if self.net.core is not None:
            raise ValueError("learning in a dream needs a feed-forward IMPALA (net.lstm_size: 0)")
        first = obs if isinstance(obs, Tensor) else next(iter(obs.values()))
        single = obs.unsqueeze(0) if isinstance(obs, Tensor) else {k: v.unsqueeze(0) for k, v in obs.items()}
        is_first = torch.ones(1, first.shape[0], dtype=torch.bool, device=first.device)
        params, value, _ = self.net.unroll(single, is_first)
        return {k: v[0] for k, v in params.items()}, value[0]

    def dream_act(self, obs: Obs) -> tuple[Tensor, Tensor]:
        """A differentiable action in an imagined state: ``obs [B, ...]`` -> ``(action [B, A],
        bonus [B])``. The action is a one-hot draw from the policy whose gradient is that of its
        probabilities (straight-through); the bonus is ``loss.entropy_weight`` times the policy's
        entropy. Discrete actions only."""
        if not self.env_spec.discrete:
            raise ValueError("learning in a dream needs discrete actions (a one-hot straight-through draw)")
        params, _ = self._one_step(obs)
        probs = torch.softmax(params["logits"].float(), -1)
        draw = torch.multinomial(probs.detach(), 1).squeeze(-1)
        onehot = torch.nn.functional.one_hot(draw, probs.shape[-1]).to(probs.dtype)
        return onehot + probs - probs.detach(), self.loss.entropy_weight * self.net.head.entropy(params)

    def dream_value(self, obs: Obs) -> Tensor:
        """``V(obs)`` ``[B]`` with the network's parameters frozen: gradients flow to whatever made
        ``obs`` (the actions of a dream), never into the value function."""
        with frozen(self.net):
            return self._one_step(obs)[1].float()

    def dream_returns(self) -> tuple[float, float, float]:
        """``(discount, lambda_, reward_scale)`` of the ``loss`` group: how a dream's returns are
        discounted and scaled, as the V-trace targets are."""
        return float(self.loss.discount), float(self.loss.lambda_), float(self.loss.reward_scale)

    # -- checkpoints -----------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["grad_clipper"] = self.clipper.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "grad_clipper" in checkpoint:
            self.clipper.load_state_dict(checkpoint["grad_clipper"])
