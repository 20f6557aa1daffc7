"""Dyna: any policy learner trained on real and imagined data from a world model learned beside it.

:class:`DynaLearner` composes two LightningModules built from the env spec and meets them only
through small interfaces:

* ``policy`` — any agent that acts (the :class:`~lightning_wm.protocols.Agent` protocol) and
  has ``learner_loss(batch) -> (loss, logs)`` and ``configure_optimizers()`` (IMPALA);
* ``world_model`` — a learner whose ``wm`` is a :class:`~lightning_wm.world_model.WorldModel`
  that can ``decode`` and whose ``world_model_loss(batch) -> (loss, logs, _)`` trains it on real
  sequences, with an ``optim.model`` optimizer group (Dreamer: only its world model is trained
  here, its actor and critic stay unused).

Each batch (from an :class:`~lightning_wm.data.modules.UnrollDataModule` with
``model_replay_size > 0``) holds the policy's unrolls — real ones and, once the imagination is
filled, imagined ones at ``real_ratio`` — and ``"model"``, real sequences for one world-model
step. The :class:`~lightning_wm.callbacks.Imagination` callback refills the imagination buffer
from the model every ``train_freq`` env steps (:class:`~lightning_wm.data.imagination.DynaWorldModel`,
DI-engine's options and defaults).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_wm.agents.base import RLModule
from lightning_wm.data.imagination import DynaWorldModel
from lightning_wm.envs import EnvSpec
from lightning_wm.optim import build_optimizer
from lightning_wm.seeding import derive_seed
from lightning_wm.world_model import RolloutSchedule

__all__ = ["DynaLearner"]


def _build(factory: Callable[[EnvSpec], nn.Module], env_spec: EnvSpec) -> nn.Module:
    """``factory(env_spec)`` with the built module's own hyperparameters.

    LightningCLI's instantiator hands the *outer* model's config to every
    ``save_hyperparameters`` called while it instantiates a LightningModule, nested ones
    included, so a policy built here from its YAML ``class_path`` would read the outer hparams;
    its own (the factory's ``init_args``) are put back.
    """
    module = factory(env_spec)
    hparams = getattr(module, "hparams", None)
    if hparams is not None and "_class_path" in hparams and isinstance(factory, functools.partial):
        module._set_hparams(dict(factory.keywords))
        module._hparams_initial = copy.deepcopy(module._hparams)
    return module


class DynaLearner(RLModule):
    """A policy learner on real + imagined unrolls and a world model trained beside it.

    Args:
        env_spec: the env's spaces (linked from the datamodule by the CLI).
        policy: builds the policy learner from the env spec (YAML ``class_path`` + ``init_args``,
            e.g. ``lightning_wm.agents.impala.IMPALA``).
        world_model: builds the world-model learner from the env spec (e.g.
            ``lightning_wm.agents.dreamer.Dreamer``; only its ``wm`` is trained).
        train_freq, eval_freq: model cadence in env steps (imagination refilled every
            ``train_freq``).
        rollout_start_step, rollout_end_step, rollout_length_min, rollout_length_max: the
            rollout-length scheduler (DI-engine's ``rollout_length_scheduler``).
        real_ratio, rollout_batch_size, rollout_retain, terminal_threshold, burn_in,
            terminal_mode: the imagination (:class:`~lightning_wm.data.imagination.DynaWorldModel`;
            ``terminal_mode: sample`` ends an imagined episode with the done head's probability
            instead of above ``terminal_threshold``).
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
        policy: Callable[[EnvSpec], nn.Module],
        world_model: Callable[[EnvSpec], nn.Module],
        train_freq: int = 250,
        eval_freq: int = 250,
        rollout_start_step: int = 20_000,
        rollout_end_step: int = 150_000,
        rollout_length_min: int = 1,
        rollout_length_max: int = 25,
        real_ratio: float = 0.05,
        rollout_batch_size: int = 100_000,
        rollout_retain: int = 4,
        terminal_threshold: float = 0.5,
        burn_in: int = 0,
        model_train_start: int = 0,
        terminal_mode: Literal["threshold", "sample"] = "threshold",
        seed: int | None = None,
    ) -> None:
        super().__init__(env_spec)
        if env_spec is None:
            raise ValueError(
                "DynaLearner needs the env's spaces (env_spec); the CLI links them from the datamodule, "
                "in Python pass env_spec=datamodule.spec"
            )
        self.save_hyperparameters(ignore=["env_spec", "policy", "world_model"])
        self.automatic_optimization = False
        self.policy = _build(policy, env_spec)
        self.world_model = _build(world_model, env_spec)
        for name, module, needs in (
            ("policy", self.policy, ("act", "initial_state", "learner_loss")),
            ("world_model", self.world_model, ("wm", "world_model_loss")),
        ):
            lacking = [n for n in needs if not hasattr(module, n)]
            if lacking:
                raise ValueError(f"DynaLearner's {name} ({type(module).__name__}) lacks {lacking}")
        schedule = RolloutSchedule(rollout_start_step, rollout_end_step, rollout_length_min, rollout_length_max)
        self.dyna = DynaWorldModel(
            self.world_model.wm,
            env_spec,
            train_freq,
            eval_freq,
            schedule,
            real_ratio,
            rollout_batch_size,
            rollout_retain,
            terminal_threshold,
            burn_in,
            terminal_mode=terminal_mode,
        )
        self.model_train_start = model_train_start
        self.seed = int(torch.initial_seed()) if seed is None else int(seed)
        self.dyna.last_train_step = model_train_start  # the first imagination at model_train_start + train_freq

    def setup(self, stage: str) -> None:
        self.dyna.reseed(derive_seed(self.seed % 2**63, "imagination", self.global_rank))

    # -- Agent protocol: the policy acts ------------------------------------------------------
    def initial_state(self, batch_size: int) -> Any:
        return self.policy.initial_state(batch_size)

    def act(self, obs: Any, state: Any, explore: bool) -> tuple[Tensor, Any, dict[str, Tensor]]:
        return self.policy.act(obs, state, explore)

    def acting_copy(self) -> nn.Module:
        return self.policy.acting_copy()

    # -- training ---------------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        config = self.policy.configure_optimizers()
        policy_opt, schedulers = (
            (config["optimizer"], [config["lr_scheduler"]]) if isinstance(config, dict) else (config, [])
        )
        model_opt = build_optimizer(self.world_model.wm.parameters(), self.world_model.optim.model)
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
            logs["train/grad_norm/model"] = torch.nn.utils.clip_grad_norm_(
                self.world_model.wm.parameters(), self.world_model.optim.model.clip.value
            )
            getattr(model_opt, "optimizer", model_opt).step()  # the policy's step counts global_step
            logs.update(model_logs)
        loss, policy_logs = self.policy.learner_loss(batch, self.global_step)
        policy_opt.zero_grad()
        self.manual_backward(loss)
        self.policy.configure_gradient_clipping(policy_opt, None, None)
        policy_opt.step()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        if self._trainer is not None and (self.global_step % max(1, self._trainer.log_every_n_steps)):
            return  # log only on the steps the logger writes
        logs.update({f"train/{k}": v for k, v in policy_logs.items()})
        if "is_real" in batch:
            logs["train/real_fraction"] = batch["is_real"].float().mean()
        B = int(batch["is_first"].shape[0])
        self.log_dict(logs, on_step=True, on_epoch=False, batch_size=B)
        self.log("train/loss", loss.detach(), prog_bar=True, on_step=True, on_epoch=False, batch_size=B)

    # -- checkpoints ------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The imagination's cadence and what the parts keep outside their state dicts
        (Lightning calls these hooks on the outer module only)."""
        checkpoint["dyna_cadence"] = self.dyna.state_dict()
        for part in (self.policy, self.world_model):
            part.on_save_checkpoint(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "dyna_cadence" in checkpoint:
            self.dyna.load_state_dict(checkpoint["dyna_cadence"])
        for part in (self.policy, self.world_model):
            part.on_load_checkpoint(checkpoint)
