"""Policies that need no training, usable wherever an :class:`~lightning_wm.protocols.Agent` is
(the prefill of online datamodules, ``record``'s default :class:`~lightning_wm.agents.random.RandomPolicy`).

Nothing here imports ``data/`` or ``agents/``, so both can use it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_wm.actions import ActionCodec
from lightning_wm.envs import EnvSpec

__all__ = ["RandomAgent", "ar1_step"]


def ar1_step(x: Any, rho: float, noise: Any) -> Any:
    """One step of a unit-variance AR(1) process: ``rho * x + sqrt(1 - rho²) * noise``, with
    ``noise`` standard normal (tensors or arrays of one shape); N(0, 1) stays its stationary law."""
    return rho * x + (1 - rho**2) ** 0.5 * noise


class RandomAgent:
    """Random actions, optionally temporally correlated.

    ``correlation`` ρ in ``[0, 1)``. By default continuous actions follow an AR(1) process
    ``u_t = ρ u_{t-1} + sqrt(1-ρ²) ε`` clamped to ``[-1, 1]`` and mapped linearly onto the
    action bounds (independent uniform draws when ρ = 0); discrete actions repeat the
    previous action with probability ρ.

    ``action_mean`` / ``action_std`` (continuous actions only, one value per action
    dimension) choose a biased scheme instead: ``a_t = clip(mean + std * x_t, low, high)``
    with ``x_t = ρ x_{t-1} + sqrt(1-ρ²) ε`` an unclamped AR(1) process with stationary
    distribution N(0, 1). Each dimension then sits at ``mean`` on average and crosses a bound
    only as rarely as its z-score says: for CarRacing ``mean [0, 0.15, -0.3]``, ``std [0.3,
    0.1, 0.2]`` steers smoothly, keeps a light gas on ~93% of the steps and brakes on ~7% of
    them (brake > 0 needs ``x > 1.5``), so the car drives along the track instead of braking
    half the time as under the uniform mapping.
    """

    def __init__(
        self,
        spec: EnvSpec,
        correlation: float = 0.0,
        seed: int | None = None,
        action_mean: list[float] | None = None,
        action_std: list[float] | None = None,
    ) -> None:
        if not 0.0 <= correlation < 1.0:
            raise ValueError(f"correlation must be in [0, 1), got {correlation}")
        self.spec, self.correlation = spec, correlation
        self.actions = ActionCodec(spec, normalize=not spec.discrete)  # u in [-1, 1] -> the bounds
        self.generator = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
        self.mean = self.std = None
        if action_mean is not None or action_std is not None:
            if spec.discrete:
                raise ValueError("action_mean/action_std apply to continuous actions; this env's actions are discrete")
            dim = spec.action_dim
            mean = torch.as_tensor(action_mean if action_mean is not None else [0.0] * dim, dtype=torch.float32)
            std = torch.as_tensor(action_std if action_std is not None else [1.0] * dim, dtype=torch.float32)
            if mean.shape != (dim,) or std.shape != (dim,):
                raise ValueError(
                    f"action_mean and action_std need one value per action dimension ({dim}); "
                    f"got {list(mean.shape)} and {list(std.shape)}"
                )
            if (std < 0).any():
                raise ValueError(f"action_std must be >= 0, got {std.tolist()}")
            self.mean, self.std = mean, std

    def initial_state(self, batch_size: int) -> Tensor:
        if self.spec.discrete:
            return torch.randint(self.spec.action_dim, (batch_size,), generator=self.generator)
        if self.mean is not None:
            return torch.randn(batch_size, self.spec.action_dim, generator=self.generator)
        return torch.rand(batch_size, self.spec.action_dim, generator=self.generator) * 2 - 1

    def act(self, obs: Any, state: Tensor, explore: bool = True) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Actions ``[B]`` / ``[B, *shape]`` on the CPU; ``obs`` (a tensor or a dict) is not read:
        the batch size comes from ``state``."""
        batch, rho = state.shape[0], self.correlation
        if self.spec.discrete:
            fresh = torch.randint(self.spec.action_dim, (batch,), generator=self.generator)
            keep = torch.rand(batch, generator=self.generator) < rho
            action = torch.where(keep, state, fresh)
            return action, action, {}
        noise = torch.randn(batch, self.spec.action_dim, generator=self.generator)
        if self.mean is not None:
            x = ar1_step(state, rho, noise)
            return self.actions.clip((self.mean + self.std * x).reshape(batch, *self.actions.shape)), x, {}
        u = (
            ar1_step(state, rho, noise).clamp(-1, 1)
            if rho > 0
            else torch.rand(batch, self.spec.action_dim, generator=self.generator) * 2 - 1
        )
        return self.actions.decode(u), u, {}
