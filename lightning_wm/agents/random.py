"""``RandomPolicy``: :class:`~lightning_wm.policies.RandomAgent` as a LightningModule, the default
model of ``record`` (the prefill of online datamodules uses ``RandomAgent`` itself)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_wm.agents.base import UntrainedPolicy
from lightning_wm.envs import EnvSpec
from lightning_wm.policies import RandomAgent


class RandomPolicy(UntrainedPolicy):
    """Random actions, optionally temporally correlated and biased (see :class:`RandomAgent`).

    Args:
        env_spec: linked from the datamodule.
        correlation: 0 for independent actions; e.g. 0.95 for CarRacing's smooth steering.
        seed: seed of the action sampler.
        action_mean, action_std: continuous actions only, one value per action dimension:
            act ``clip(mean + std * x_t)`` with ``x_t`` a unit-variance AR(1) process instead of
            mapping it uniformly onto the bounds (None: the uniform mapping). E.g. CarRacing
            ``[0, 0.15, -0.3]`` / ``[0.3, 0.1, 0.2]``: smooth steering, gas mostly on, rare braking.
    """

    def __init__(
        self,
        env_spec: EnvSpec | None = None,
        correlation: float = 0.0,
        seed: int | None = None,
        action_mean: list[float] | None = None,
        action_std: list[float] | None = None,
    ) -> None:
        super().__init__(env_spec)
        if env_spec is None:
            raise ValueError("RandomPolicy needs the env spec (linked from the datamodule's env)")
        self.sampler = RandomAgent(
            env_spec, correlation=correlation, seed=seed, action_mean=action_mean, action_std=action_std
        )

    def initial_state(self, batch_size: int) -> Tensor:
        return self.sampler.initial_state(batch_size)

    def act(self, obs: Any, state: Any, explore: bool) -> tuple[Tensor, Any, dict[str, Tensor]]:
        """Random actions for the batch of ``state``; ``obs`` (a tensor or a dict of them) is not read."""
        return self.sampler.act(obs, state.cpu(), explore)
