"""One action codec: env actions <-> the format a model reads and writes.

* **Env format** (what ``env.step`` takes, what rows store): ``int64 [...]`` indices for a
  ``Discrete`` space, ``float32 [..., *shape]`` within the bounds for a ``Box``.
* **Model format**: ``float [..., A]``: one-hot for ``Discrete`` (``A`` actions); for ``Box``
  the flattened env values (``normalize=False``) or those values mapped linearly from the
  bounds onto ``[-1, 1]`` (``normalize=True``, what a tanh/bounded actor emits).

:class:`ActionCodec` is an ``nn.Module`` whose bounds are non-persistent buffers: it moves with
the model that owns it and adds nothing to checkpoints.
"""

from __future__ import annotations

from typing import TypeVar

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_wm.envs import EnvSpec

__all__ = ["ActionCodec"]

ArrayT = TypeVar("ArrayT", np.ndarray, Tensor)


class ActionCodec(nn.Module):
    """Converts actions of one action space between env and model format.

    Args:
        space: a ``Discrete`` or ``Box`` action space, or an :class:`~lightning_wm.envs.EnvSpec`.
        normalize: continuous model actions live in ``[-1, 1]`` (mapped onto the bounds, which
            must then be finite); otherwise they are the env values themselves.
    """

    def __init__(self, space: gym.Space | EnvSpec, normalize: bool = False) -> None:
        super().__init__()
        space = space.action_space if isinstance(space, EnvSpec) else space
        if not isinstance(space, (gym.spaces.Discrete, gym.spaces.Box)):
            raise ValueError(f"actions must be Discrete or Box, got {space}")
        self.discrete = isinstance(space, gym.spaces.Discrete)
        self.normalize = normalize and not self.discrete
        self.shape: tuple[int, ...] = () if self.discrete else tuple(space.shape)
        self.dim = int(space.n) if self.discrete else int(np.prod(space.shape))
        low = np.zeros(0, np.float32) if self.discrete else np.asarray(space.low, np.float32).reshape(-1)
        high = np.zeros(0, np.float32) if self.discrete else np.asarray(space.high, np.float32).reshape(-1)
        if self.normalize and not (np.isfinite(low).all() and np.isfinite(high).all()):
            raise ValueError(f"normalize=True maps the bounds onto [-1, 1]; they must be finite, got {space}")
        self.register_buffer("low", torch.from_numpy(low), persistent=False)
        self.register_buffer("high", torch.from_numpy(high), persistent=False)
        self._low_np, self._high_np = low, high

    # -- env format ----------------------------------------------------------------------
    def clip(self, action: ArrayT) -> ArrayT:
        """An agent's action -> valid env format: ``int64`` indices (discrete), or ``float32``
        clipped to the bounds (continuous). Numpy arrays stay numpy, tensors stay tensors."""
        if isinstance(action, np.ndarray):
            if self.discrete:
                return action.astype(np.int64)
            flat = action.reshape(*action.shape[: action.ndim - len(self.shape)], -1)
            return np.clip(flat, self._low_np, self._high_np).astype(np.float32).reshape(action.shape)
        if self.discrete:
            return action.long()
        flat = self._flat(action.float())
        return torch.maximum(torch.minimum(flat, self.high), self.low).reshape(action.shape)

    def from_unit(self, u: Tensor) -> Tensor:
        """``u [..., A]`` in ``[-1, 1]`` -> the bounds, linearly (continuous only)."""
        return self.low + (u + 1.0) * 0.5 * (self.high - self.low)

    def to_unit(self, action: Tensor) -> Tensor:
        """Env values ``[..., A]`` -> ``[-1, 1]`` (clamped), the inverse of :meth:`from_unit`."""
        return (2.0 * (action - self.low) / (self.high - self.low) - 1.0).clamp(-1.0, 1.0)

    # -- model format --------------------------------------------------------------------
    def encode(self, action: Tensor) -> Tensor:
        """Env actions -> model input ``float32 [..., A]``.

        Discrete: indices ``[...]`` -> one-hot (a float ``[..., A]`` input is taken as already
        one-hot). Continuous: ``[..., *shape]`` flattened to ``[..., A]``, then mapped onto
        ``[-1, 1]`` (``normalize``) or clipped to the bounds.
        """
        if self.discrete:
            if torch.is_floating_point(action):
                if action.shape[-1] != self.dim:
                    raise ValueError(
                        f"discrete actions must be integer indices or one-hot [..., {self.dim}] "
                        f"floats, got {tuple(action.shape)}"
                    )
                return action.float()
            return F.one_hot(action.long(), self.dim).float()
        flat = self._flat(action.float())
        if flat.shape[-1] != self.dim:
            raise ValueError(f"continuous actions must be [..., {self.dim}] floats, got {tuple(action.shape)}")
        if self.normalize:
            return self.to_unit(flat)
        return torch.maximum(torch.minimum(flat, self.high), self.low)

    def decode(self, x: Tensor) -> Tensor:
        """Model output ``[..., A]`` -> env actions: the argmax index ``int64 [...]`` (discrete;
        one-hot samples or logits), or ``float32 [..., *shape]`` within the bounds (continuous;
        mapped from ``[-1, 1]`` with ``normalize``)."""
        if self.discrete:
            return x.argmax(-1)
        values = self.from_unit(x.float()) if self.normalize else x.float()
        values = torch.maximum(torch.minimum(values, self.high), self.low)
        return values.reshape(*x.shape[:-1], *self.shape)

    def zeros(self, batch_size: int, device: torch.device | str | None = None) -> Tensor:
        """The model-format "no action" ``float32 [B, A]`` (zeros; a recurrent model's first input)."""
        return torch.zeros(batch_size, self.dim, device=device if device is not None else self.low.device)

    def _flat(self, action: Tensor) -> Tensor:
        return action.reshape(*action.shape[: action.dim() - len(self.shape)], -1)

    def extra_repr(self) -> str:
        kind = f"Discrete({self.dim})" if self.discrete else f"Box{self.shape}"
        return f"{kind}, normalize={self.normalize}"
