""":class:`RLModule`, the base of every LightningModule that acts (the Agent protocol lives in
:mod:`lightning_wm.protocols`)."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import warnings
from collections.abc import Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn

from lightning_wm.envs import EnvSpec
from lightning_wm.optim import OptimSettings, anneal_outlasted
from lightning_wm.protocols import EnvStepCounter, EvaluationRequest
from lightning_wm.settings import find_settings, plain

__all__ = ["RLModule", "UntrainedPolicy"]


class RLModule(pl.LightningModule):
    """Base for agents trained on env interaction; implements :class:`~lightning_wm.protocols.ActingAgent`.

    * ``env_steps``: this rank's env steps so far, read from an
      :class:`~lightning_wm.protocols.EnvStepCounter`: the one given to
      :meth:`use_env_steps_from`, else the trainer's datamodule; 0 without either;
    * ``validation_step`` takes the datamodule's :class:`~lightning_wm.protocols.EvaluationRequest`
      batch, runs its evaluation episodes (``explore=False``) and logs ``val/return``,
      ``val/return_std`` and ``val/length``;
    * :meth:`acting_copy` ships a CPU copy for actor processes;
    * :meth:`save_settings` records the constructor's settings groups as plain dicts (what a
      checkpoint can hold and ``--ckpt_path`` compares key by key);
    * at the start of ``fit`` it warns when the trainer's ``max_steps`` outlasts an
      ``lr_anneal_steps`` of an :class:`~lightning_wm.optim.OptimSettings` of this module or of
      an agent inside it that anneals to 0 (the learning rate would sit at 0 for the rest of the run).
    """

    def __init__(self, env_spec: EnvSpec | None = None) -> None:
        super().__init__()
        self.env_spec = env_spec
        self._env_step_source: EnvStepCounter | None = None

    def use_env_steps_from(self, source: EnvStepCounter | None) -> None:
        """Count env steps with ``source`` (anything with an ``env_steps`` attribute) instead of
        the trainer's datamodule; ``None`` goes back to the datamodule."""
        self._env_step_source = source

    @property
    def env_steps(self) -> int:
        """This rank's env steps so far (see the class docstring)."""
        source = self._env_step_source
        if source is None:
            try:
                source = getattr(self.trainer, "datamodule", None)
            except RuntimeError:  # not attached to a Trainer
                return 0
        return int(source.env_steps) if isinstance(source, EnvStepCounter) else 0

    def logs_step(self, step: int) -> bool:
        """Whether the logger writes the ``on_step`` logs of optimizer step ``step`` (counted from
        1): Lightning writes every ``trainer.log_every_n_steps``-th; every step without a trainer.
        An agent that logs much may skip its ``self.log`` calls on the other steps."""
        try:
            every = self.trainer.log_every_n_steps
        except RuntimeError:  # not attached to a Trainer
            return True
        return step % max(1, every) == 0

    def save_settings(self, ignore: Sequence[str] = ()) -> None:
        """``save_hyperparameters`` of the calling ``__init__``'s arguments (without ``env_spec``
        and ``ignore``), settings groups (dataclasses) stored as plain nested dicts."""
        frame = inspect.currentframe()
        self.save_hyperparameters(ignore=["env_spec", *ignore], frame=frame.f_back if frame else None)
        for key, value in list(self.hparams.items()):
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                self.hparams[key] = plain(value)

    def optim_settings(self) -> list[OptimSettings]:
        """Every :class:`~lightning_wm.optim.OptimSettings` in this module's settings groups
        (the dataclass attributes it keeps)."""
        groups = [v for v in vars(self).values() if dataclasses.is_dataclass(v) and not isinstance(v, type)]
        return list(find_settings(groups, OptimSettings))

    # -- Agent protocol -------------------------------------------------------------------
    def initial_state(self, batch_size: int) -> Any:
        return None

    def act(self, obs: Any, state: Any, explore: bool) -> tuple[Tensor, Any, dict[str, Tensor]]:
        raise NotImplementedError(f"{type(self).__name__} does not implement act()")

    def acting_copy(self) -> nn.Module:
        """A CPU, eval-mode, gradient-free deep copy of this module for actor processes
        (without the trainer and optimizers). Agents override it to ship only what ``act``
        needs."""
        trainer, self._trainer = self._trainer, None
        try:
            clone = copy.deepcopy(self)
        finally:
            self._trainer = trainer
        return clone.cpu().eval().requires_grad_(False)

    def on_fit_start(self) -> None:
        for module in self.modules():
            if isinstance(module, RLModule):
                anneals = [(s.lr_anneal_steps, s.lr_end_factor) for s in module.optim_settings()]
                if not anneals and module.hparams.get("lr_anneal_steps") is not None:  # not yet grouped
                    anneals = [(module.hparams["lr_anneal_steps"], 0.0)]
                max_steps = self.trainer.max_steps
                why = next((w for a, end in anneals if (w := anneal_outlasted(a, max_steps, end))), None)
                if why is not None:
                    warnings.warn(f"{type(module).__name__}: {why}", UserWarning, stacklevel=2)
                    return

    # -- evaluation -----------------------------------------------------------------------
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if not isinstance(batch, EvaluationRequest):
            raise TypeError(
                f"{type(self).__name__} validates by running episodes: its validation batches must be "
                f"EvaluationRequest objects (ReplayDataModule, GenerationDataModule), got {type(batch).__name__}"
            )
        episodes = batch.run(self)
        returns = torch.tensor([e["return"] for e in episodes], dtype=torch.float32, device=self.device)
        lengths = torch.tensor([e["length"] for e in episodes], dtype=torch.float32, device=self.device)
        self.log("val/return", returns.mean(), prog_bar=True, sync_dist=True, batch_size=len(episodes))
        self.log("val/return_std", returns.std(unbiased=False), sync_dist=True, batch_size=len(episodes))
        self.log("val/length", lengths.mean(), sync_dist=True, batch_size=len(episodes))

    test_step = validation_step


class UntrainedPolicy(RLModule):
    """Base of agents that act without training (``record``'s data agents, e.g.
    :class:`~lightning_wm.agents.random.RandomPolicy`): ``fit`` refuses them in one line, and one
    frozen placeholder parameter gives the module a device."""

    def __init__(self, env_spec: EnvSpec | None = None) -> None:
        super().__init__(env_spec)
        self._dummy = nn.Parameter(torch.zeros(()), requires_grad=False)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        raise RuntimeError(f"{type(self).__name__} does not train; use it with `record` or `evaluate`")

    def configure_optimizers(self) -> Any:
        return None
