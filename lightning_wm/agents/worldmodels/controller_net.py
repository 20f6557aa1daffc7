"""The controller's network as pure functions of a flat parameter vector (CMA-ES searches
that vector): its size, its batched forward pass, and the widening that starts a controller on
more features from one on fewer (a V-only controller on ``z`` starting a ``[z, h]`` one)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["controller_num_params", "controller_forward", "widen_controller_params"]


def controller_num_params(in_dim: int, out_dim: int, hidden: int = 0) -> int:
    """Parameters of the controller: ``(in+1)*out`` linear, ``(in+1)*hidden + (hidden+1)*out`` with a hidden layer."""
    if hidden <= 0:
        return (in_dim + 1) * out_dim
    return (in_dim + 1) * hidden + (hidden + 1) * out_dim


def controller_forward(params: Tensor, features: Tensor, in_dim: int, out_dim: int, hidden: int = 0) -> Tensor:
    """The controller's pre-activation output, with one parameter vector per batch entry.

    Args:
        params: ``[B, P]`` flat parameters (layout: ``W [O, F]`` row-major, then ``b [O]``;
            with a hidden layer ``W1 [H, F], b1 [H], W2 [O, H], b2 [O]``); ``[P]`` is broadcast.
        features: ``[B, F]``.
    Returns:
        ``[B, O]``.
    """
    if params.dim() == 1:
        params = params.unsqueeze(0).expand(features.shape[0], -1)
    b = features.shape[0]
    if params.shape[-1] != controller_num_params(in_dim, out_dim, hidden):
        raise ValueError(
            f"expected {controller_num_params(in_dim, out_dim, hidden)} parameters, got {params.shape[-1]}"
        )
    x, offset = features, 0
    layers = [(in_dim, out_dim)] if hidden <= 0 else [(in_dim, hidden), (hidden, out_dim)]
    for i, (fan_in, fan_out) in enumerate(layers):
        w = params[:, offset : offset + fan_out * fan_in].reshape(b, fan_out, fan_in)
        offset += fan_out * fan_in
        bias = params[:, offset : offset + fan_out]
        offset += fan_out
        x = torch.einsum("bf,bof->bo", x, w) + bias
        if i < len(layers) - 1:
            x = torch.tanh(x)
    return x


def widen_controller_params(params: np.ndarray, in_dim: int, new_in_dim: int, out_dim: int) -> np.ndarray:
    """A linear controller's ``[(in_dim + 1) * O]`` weights as those of a linear controller on
    ``new_in_dim >= in_dim`` features whose first ``in_dim`` are the old ones: the new features'
    weights are zero, so the widened controller acts exactly as the old one did.

    Returns:
        ``[(new_in_dim + 1) * O]`` in :func:`controller_forward`'s layout (``W [O, F]``, ``b [O]``).
    """
    if new_in_dim < in_dim or params.shape != (controller_num_params(in_dim, out_dim),):
        raise ValueError(
            f"cannot widen {params.shape} linear controller weights from {in_dim} to {new_in_dim} features "
            f"with {out_dim} outputs"
        )
    w, b = params[: in_dim * out_dim].reshape(out_dim, in_dim), params[in_dim * out_dim :]
    wide = np.zeros((out_dim, new_in_dim), dtype=params.dtype)
    wide[:, :in_dim] = w
    return np.concatenate([wide.reshape(-1), b])
