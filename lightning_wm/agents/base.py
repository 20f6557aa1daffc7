"""The Agent protocol and :class:`RLModule`, the base of every LightningModule that acts."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import pytorch_lightning as pl
import torch
from torch import Tensor
from torchmetrics import SumMetric

from lightning_wm.envs import EnvSpec


@runtime_checkable
class Agent(Protocol):
    """What the Collector needs: batched acting with a recurrent state.

    ``state`` is ``None`` or a pytree of tensors whose first dimension is the batch; the
    Collector resets entries where a new episode begins by taking them from
    ``initial_state``.
    """

    def initial_state(self, batch_size: int) -> Any: ...

    def act(self, obs: Tensor, state: Any, explore: bool) -> tuple[Tensor, Any, dict[str, Tensor]]:
        """``obs [B, ...]`` -> ``(action, state, extras)``: action ``int64 [B]`` (discrete)
        or ``float32 [B, A]`` (continuous, within the env bounds); extras ``[B, ...]``."""
        ...


class RLModule(pl.LightningModule):
    """Base for agents trained on env interaction.

    * logs the datamodule's env statistics (env steps, episode return/length, reduced
      across DDP ranks with torchmetrics) every ``trainer.log_every_n_steps`` steps;
    * ``validation_step`` runs ``datamodule.eval_episodes`` evaluation episodes with
      ``explore=False`` and logs ``val/return`` and ``val/length``.
    """

    def __init__(self, env_spec: EnvSpec | None = None) -> None:
        super().__init__()
        self.env_spec = env_spec
        self.episode_return_sum = SumMetric()
        self.episode_length_sum = SumMetric()
        self.episode_count = SumMetric()

    # -- Agent protocol -------------------------------------------------------------------
    def initial_state(self, batch_size: int) -> Any:
        return None

    def act(self, obs: Tensor, state: Any, explore: bool) -> tuple[Tensor, Any, dict[str, Tensor]]:
        raise NotImplementedError(f"{type(self).__name__} does not implement act()")

    # -- env statistics -------------------------------------------------------------------
    def _collector_stats(self) -> Any:
        trainer = self._trainer
        datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
        return getattr(datamodule, "collector_stats", None)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        stats = self._collector_stats()
        if stats is None:
            return
        for episode in stats.pop_finished():
            self.episode_return_sum.update(episode["return"])
            self.episode_length_sum.update(episode["length"])
            self.episode_count.update(1.0)
        every = max(1, self.trainer.log_every_n_steps)
        if (self.trainer.global_step % every) != 0:
            return
        for metric in (self.episode_return_sum, self.episode_length_sum, self.episode_count):
            metric.update(0.0)  # sums unchanged; a rank without finished episodes still has state to reduce
        env_steps = torch.tensor(float(stats.env_steps), device=self.device)
        env_steps = self.trainer.strategy.reduce(env_steps, reduce_op="sum")
        self.log("env/steps", env_steps, on_step=True, prog_bar=True, rank_zero_only=True, batch_size=1)
        count = self.episode_count.compute()
        if count > 0:
            self.log("env/episode_return", self.episode_return_sum.compute() / count, prog_bar=True, rank_zero_only=True, batch_size=1)
            self.log("env/episode_length", self.episode_length_sum.compute() / count, rank_zero_only=True, batch_size=1)
            self.log("env/episodes", count, rank_zero_only=True, batch_size=1)
        for metric in (self.episode_return_sum, self.episode_length_sum, self.episode_count):
            metric.reset()

    # -- evaluation -----------------------------------------------------------------------
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        datamodule = self.trainer.datamodule
        if not hasattr(datamodule, "evaluate"):
            raise RuntimeError(
                f"{type(self).__name__} validates by running episodes; its datamodule "
                f"{type(datamodule).__name__} has no evaluate()"
            )
        episodes = datamodule.evaluate(self)
        returns = torch.tensor([e["return"] for e in episodes], dtype=torch.float32, device=self.device)
        lengths = torch.tensor([e["length"] for e in episodes], dtype=torch.float32, device=self.device)
        self.log("val/return", returns.mean(), prog_bar=True, sync_dist=True, batch_size=len(episodes))
        self.log("val/return_std", returns.std(unbiased=False), sync_dist=True, batch_size=len(episodes))
        self.log("val/length", lengths.mean(), sync_dist=True, batch_size=len(episodes))

    test_step = validation_step
