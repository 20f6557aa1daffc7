"""Dyna: any policy learner trained on real and imagined data from a world model learned beside it.

:class:`DynaLearner` composes two LightningModules built from the env spec and meets them only
through small interfaces:

* ``policy`` — any agent that acts (the :class:`~lightning_wm.protocols.Agent` protocol) and
  has ``learner_loss(batch, step) -> (loss, logs)``, ``configure_optimizers()`` and
  ``configure_gradient_clipping`` (IMPALA);
* ``world_model`` — a learner whose ``wm`` is a :class:`~lightning_wm.world_model.WorldModel`
  that can ``decode`` and whose ``world_model_loss(batch) -> (loss, logs, _)`` trains it on real
  sequences (Dreamer: only its world model is trained here, its actor and critic stay unused).
  Its optimizer is Dyna's own (``optim.model``), not one the world-model learner configures.

Each batch (from an :class:`~lightning_wm.data.modules.UnrollDataModule` with
``model_replay.capacity > 0``) holds the policy's unrolls — real ones and, once the imagination is
filled, imagined ones at ``imagination.real_ratio`` — and ``"model"``, real sequences for one
world-model step. The :class:`~lightning_wm.agents.dyna.Imagination` callback refills the
imagination buffer from the model every ``train_freq`` env steps and evaluates the model every
``eval_freq`` (:class:`~lightning_wm.agents.dyna.DynaWorldModel`, DI-engine's options).

With ``dream.weight > 0`` the model is used both ways (a
:class:`~lightning_wm.agents.dyna.HybridWorldModel`): beside the imagined rows, every policy step
also dreams on the fly from the model batch's real rows and adds ``dream.weight`` times the dream
loss (:func:`~lightning_wm.agents.dyna.losses.dream_loss`: λ-returns backpropagated through the
model into the policy) to the policy's loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn

from lightning_wm.agents.base import RLModule
from lightning_wm.agents.dyna.imagination import DynaWorldModel, HybridWorldModel, ImaginationSettings
from lightning_wm.agents.dyna.losses import dream_loss
from lightning_wm.envs import EnvSpec
from lightning_wm.optim import (
    GradClipper,
    GradClipSettings,
    OptimSettings,
    build_optimizer,
    optimizer_beta,
    split_lr_schedule,
)
from lightning_wm.protocols import acting_weights
from lightning_wm.seeding import derive_seed
from lightning_wm.settings import as_settings, check_at_least, plain
from lightning_wm.tree import tree_map
from lightning_wm.world_model import RolloutSchedule, WorldModel

__all__ = ["DreamSettings", "DynaLearner", "DynaOptimSettings"]


def _world_model_optim() -> OptimSettings:
    return OptimSettings(lr=1e-4, eps=1e-8, clip=GradClipSettings(type="clip_norm", value=1000.0))


@dataclass(frozen=True)
class DynaOptimSettings:
    """The optimizers Dyna owns (its ``optim`` group); the policy's is in the policy's settings.

    Attributes:
        model: the world model's optimizer and gradient clipping (default: Adam at 1e-4, eps
            1e-8, gradient norm clipped at 1000: DreamerV3's world-model constants).
    """

    model: OptimSettings = field(default_factory=_world_model_optim)


@dataclass(frozen=True)
class DreamSettings:
    """On-the-fly dreams beside the imagination buffer (Dyna's ``dream`` group; DI-engine's
    ``HybridWorldModel``: the buffer's reused rollouts and ``DreamWorldModel.rollout``'s
    backpropagation through the model, under one cadence and one rollout schedule).

    Attributes:
        weight: weight of the dream loss in the policy's loss; 0 (default) dreams nothing (Dyna
            alone, a :class:`~lightning_wm.agents.dyna.DynaWorldModel`).
        batch_size: dreams per policy step, each started from the last real row of one sequence
            of the model batch (at most ``model_replay.batch_size`` of them; the model filters the
            ``imagination.burn_in`` rows before it). The dream's length is ``rollout``'s.
    """

    weight: float = 0.0
    batch_size: int = 16

    def __post_init__(self) -> None:
        check_at_least("dream.weight", self.weight, 0)
        check_at_least("dream.batch_size", self.batch_size, 1)


DYNA_ROLLOUT = RolloutSchedule()  # DI-engine's rollout_length_scheduler defaults
DYNA_IMAGINATION = ImaginationSettings()
DYNA_OPTIM = DynaOptimSettings()
DYNA_DREAM = DreamSettings()


def _build(factory: Callable[[EnvSpec], RLModule], env_spec: EnvSpec) -> RLModule:
    """``factory(env_spec)``, recording the built module's own settings as its hyperparameters.

    While LightningCLI builds the outer module it hands the outer module's settings to every
    ``save_hyperparameters`` called, nested modules' included; a factory made by the CLI from a
    YAML ``class_path`` is a ``functools.partial`` whose keywords are the module's own
    ``init_args``, and those are recorded instead (with the public ``save_hyperparameters``), so
    a module that reads ``self.hparams`` reads its own settings.
    """
    module = factory(env_spec)
    if isinstance(factory, functools.partial) and isinstance(module, pl.LightningModule):
        module.hparams.clear()
        module.save_hyperparameters(plain(dict(factory.keywords)))
    return module


class DynaLearner(RLModule):
    """A policy learner on real + imagined unrolls and a world model trained beside it.

    Args:
        env_spec: the env's spaces (linked from the datamodule by the CLI).
        policy: builds the policy learner from the env spec (YAML ``class_path`` + ``init_args``,
            e.g. ``lightning_wm.agents.impala.IMPALA``).
        world_model: builds the world-model learner from the env spec (e.g.
            ``lightning_wm.agents.dreamer.Dreamer``; only its ``wm`` is trained).
        rollout: imagined rollout length per env step (DI-engine's ``rollout_length_scheduler``;
            :class:`~lightning_wm.world_model.RolloutSchedule`).
        imagination: the imagination buffer and the real/imagined mix
            (:class:`~lightning_wm.agents.dyna.ImaginationSettings`).
        optim: the world model's optimizer (:class:`DynaOptimSettings`).
        dream: on-the-fly dreams with gradients into the policy beside the imagined rows
            (:class:`DreamSettings`; off by default). The policy then also needs ``dream_act``,
            ``dream_value`` and ``dream_returns`` (IMPALA has them; discrete actions, no LSTM) and
            the world model's ``wm`` ``decode_features``.
        train_freq: env steps between imagination refills (one model version each).
        eval_freq: env steps between evaluations of the model's one-step prediction error on
            real rows (logged as ``world_model/eval_*``).
        model_train_start: env steps before which neither the model trains nor imagination is
            used (the model needs some real data first).
        seed: the imagination's seed (model transitions, sampled terminations, the imagination
            buffer's draws), derived per DDP rank; default: the run's seed (``seed_everything``,
            which the CLI sets before building the model), so seeded runs repeat exactly.

    ``trainer.global_step`` counts the policy's optimizer steps (the model's optimizer steps
    directly).
    """

    def __init__(
        self,
        env_spec: EnvSpec | None = None,
        *,
        policy: Callable[[EnvSpec], RLModule],
        world_model: Callable[[EnvSpec], RLModule],
        rollout: RolloutSchedule = DYNA_ROLLOUT,
        imagination: ImaginationSettings = DYNA_IMAGINATION,
        optim: DynaOptimSettings = DYNA_OPTIM,
        dream: DreamSettings = DYNA_DREAM,
        train_freq: int = 250,
        eval_freq: int = 250,
        model_train_start: int = 0,
        seed: int | None = None,
    ) -> None:
        super().__init__(env_spec)
        if env_spec is None:
            raise ValueError(
                "DynaLearner needs the env's spaces (env_spec); the CLI links them from the datamodule, "
                "in Python pass env_spec=datamodule.spec"
            )
        if model_train_start < 0:
            raise ValueError(f"model_train_start must be >= 0 env steps, got {model_train_start}")
        # the groups as dataclasses (also what save_settings records, as plain dicts)
        rollout = self.rollout = as_settings(RolloutSchedule, rollout, "rollout")
        imagination = self.imagination = as_settings(ImaginationSettings, imagination, "imagination")
        optim = self.optim = as_settings(DynaOptimSettings, optim, "optim")
        self.dream = as_settings(DreamSettings, dream, "dream")
        self.save_settings(ignore=["policy", "world_model"])
        self.automatic_optimization = False
        self.policy = _build(policy, env_spec)
        self.world_model = _build(world_model, env_spec)
        dreams = self.dream.weight > 0
        for name, module, needs in (
            ("policy", self.policy, ("act", "initial_state", "learner_loss", "configure_optimizers")),
            ("world_model", self.world_model, ("wm", "world_model_loss")),
            ("policy", self.policy, ("dream_act", "dream_value", "dream_returns") if dreams else ()),
        ):
            lacking = [n for n in needs if not hasattr(module, n)]
            if lacking:
                raise ValueError(
                    f"DynaLearner's {name} ({type(module).__name__}) lacks {lacking}"
                    + (" (needed by dream.weight > 0)" if lacking[0].startswith("dream") else "")
                )
        if not isinstance(self.world_model.wm, WorldModel):
            raise ValueError(f"DynaLearner's world_model.wm ({type(self.world_model.wm).__name__}) is no WorldModel")
        kind = HybridWorldModel if dreams else DynaWorldModel
        self.dyna = kind(self.world_model.wm, env_spec, imagination, rollout, train_freq, eval_freq)
        self.model_train_start = int(model_train_start)
        self.seed = int(torch.initial_seed()) if seed is None else int(seed)
        self.dyna.last_train_step = self.model_train_start  # the first imagination at model_train_start + train_freq
        self.model_clipper = GradClipper.from_settings(optim.model.clip)

    def setup(self, stage: str) -> None:
        self.dyna.reseed(derive_seed(self.seed % 2**63, "imagination", self.global_rank))

    # -- Agent protocol: the policy acts ------------------------------------------------------
    def initial_state(self, batch_size: int) -> Any:
        return self.policy.initial_state(batch_size)

    def act(self, obs: Any, state: Any, explore: bool) -> tuple[Tensor, Any, dict[str, Tensor]]:
        return self.policy.act(obs, state, explore)

    def acting_copy(self) -> nn.Module:
        return self.policy.acting_copy()

    def acting_weights(self) -> Mapping[str, Tensor]:
        return acting_weights(self.policy)

    # -- training ---------------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        policy_opt, schedule = split_lr_schedule(self.policy.configure_optimizers())
        schedulers = [schedule] if schedule is not None else []
        model_opt = build_optimizer(self.world_model.wm.parameters(), self.optim.model)
        self.model_clipper.beta = optimizer_beta(model_opt)
        return [policy_opt, model_opt], schedulers

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """One world-model step on ``batch["model"]`` (after ``model_train_start`` env steps) and
        one policy step on the (real + imagined) unrolls."""
        policy_opt, model_opt = self.optimizers()
        logs: dict[str, Tensor] = {}
        model_batch = batch.pop("model", None)
        if model_batch is not None and self.env_steps >= self.model_train_start:
            loss, model_logs, _ = self.world_model.world_model_loss(model_batch)
            model_opt.zero_grad()
            self.manual_backward(loss)
            logs["train/grad_norm/model"] = self.model_clipper(self.world_model.wm.parameters())["grad_norm"]
            model_opt.optimizer.step()  # the plain optimizer: only the policy's step counts global_step
            if hasattr(self.world_model, "log_p_end_at_terminal"):  # Dreamer's: summed between written logs
                self.world_model.log_p_end_at_terminal(model_logs, self.logs_step(self.global_step + 1))
            logs.update(model_logs)
        loss, policy_logs = self.policy.learner_loss(batch, self.global_step)
        if self._dreams_now(model_batch):
            dreamed, dream_logs = self.dream_loss(model_batch)
            loss = loss + self.dream.weight * dreamed
            logs.update(dream_logs)
        policy_opt.zero_grad()
        self.manual_backward(loss)
        self.policy.configure_gradient_clipping(policy_opt, None, None)
        policy_opt.step()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        if not self.logs_step(self.global_step):  # the step just taken
            return
        logs.update({f"train/{k}": v for k, v in policy_logs.items()})
        if "is_real" in batch:
            logs["train/real_fraction"] = batch["is_real"].float().mean()
        B = int(batch["is_first"].shape[0])
        self.log_dict(logs, on_step=True, on_epoch=False, batch_size=B)
        self.log("train/loss", loss.detach(), prog_bar=True, on_step=True, on_epoch=False, batch_size=B)

    def _dreams_now(self, model_batch: dict[str, Any] | None) -> bool:
        """Whether this policy step dreams: ``dream.weight > 0``, a model batch, the model trained
        (``model_train_start``) and a rollout length above 0 now."""
        if self.dream.weight <= 0 or model_batch is None or self.env_steps < self.model_train_start:
            return False
        return self.dyna.rollout_length_scheduler(int(self.env_steps)) > 0

    def dream_loss(self, model_batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        """One dream (the Hybrid's ``rollout``) from the last real rows of the model batch's
        sequences ``[B, L, ...]``: the policy acts on the decoded states with differentiable actions,
        the world model is frozen; returns the dream loss (scalar) and ``train/dream_*`` logs."""
        if not isinstance(self.dyna, HybridWorldModel):
            raise RuntimeError("dream_loss needs dream.weight > 0 (a HybridWorldModel)")
        wm, span = self.world_model.wm, self.imagination.burn_in + 1
        n = min(self.dream.batch_size, int(model_batch["is_first"].shape[0]))
        rows = {k: tree_map(lambda x: x[:n, -span:], model_batch[k]) for k in ("obs", "action", "is_first")}
        with torch.no_grad():
            _, start = self.dyna.filtered_states(rows)
        decoded: list[Any] = []

        def actor(features: Tensor) -> tuple[Tensor, Tensor]:
            obs = wm.decode_features(features)
            decoded.append(obs)
            return self.policy.dream_act(obs)

        out = self.dyna.rollout(start, actor, self.env_steps)
        value = torch.stack([self.policy.dream_value(obs) for obs in decoded])  # [N+1, B]
        discount, lambda_, reward_scale = self.policy.dream_returns()
        reward = out["rewards"].float() * reward_scale
        loss, returns = dream_loss(reward, value, out["dones"].float(), out["aug_rewards"].float(), discount, lambda_)
        return loss, {
            "train/dream_loss": loss.detach(),
            "train/dream_return": returns[0].mean().detach(),
            "train/dream_horizon": torch.tensor(float(reward.shape[0])),
        }

    # -- checkpoints ------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The imagination's cadence, the model's gradient clipper and what the parts keep outside
        their state dicts (Lightning calls these hooks on the outer module only)."""
        checkpoint["dyna_cadence"] = self.dyna.state_dict()
        checkpoint["model_grad_clipper"] = self.model_clipper.state_dict()
        for part in (self.policy, self.world_model):
            part.on_save_checkpoint(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "dyna_cadence" in checkpoint:
            self.dyna.load_state_dict(checkpoint["dyna_cadence"])
        if "model_grad_clipper" in checkpoint:
            self.model_clipper.load_state_dict(checkpoint["model_grad_clipper"])
        for part in (self.policy, self.world_model):
            part.on_load_checkpoint(checkpoint)
