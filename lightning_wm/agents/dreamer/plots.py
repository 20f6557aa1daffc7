"""Dreamer's open-loop pictures: real observations against the model's (filtered with the
posterior for a few steps, then imagined under the same actions), as images and GIF frames."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def openloop_curves(
    real: Tensor, pred: Tensor, context: int, max_dims: int = 8, height: int = 60, step_px: int = 6
) -> np.ndarray:
    """Vector observations ``[T, D]`` (real and model) -> a uint8 RGB plot ``[P*height, T*step_px, 3]``:
    one panel per dimension (the first ``max_dims``), the real values in white and the model's
    in red, each panel scaled to its own range; a grey line where the model stops filtering
    (``context``) and starts imagining."""
    from PIL import Image, ImageDraw

    real, pred = real.float().cpu().numpy(), pred.float().cpu().numpy()
    T, D = real.shape
    dims = min(D, max_dims)
    width = max(2, T * step_px)
    image = Image.new("RGB", (width, dims * height), (20, 20, 20))
    draw = ImageDraw.Draw(image)
    for d in range(dims):
        top = d * height
        both = np.concatenate([real[:, d], pred[:, d]])
        low, high = float(both.min()), float(both.max())
        span = max(high - low, 1e-6)

        def y(v: float) -> float:
            return top + 3 + (height - 6) * (1 - (v - low) / span)

        draw.line([(0, top), (width, top)], fill=(60, 60, 60))
        draw.line([(context * step_px, top), (context * step_px, top + height)], fill=(110, 110, 110))
        for series, color in ((real[:, d], (235, 235, 235)), (pred[:, d], (230, 60, 60))):
            draw.line([(t * step_px, y(float(v))) for t, v in enumerate(series)], fill=color, width=2)
    return np.asarray(image)


def openloop_grid(real: Tensor, pred: Tensor) -> Tensor:
    """uint8 frames ``[B, T, H, W, C]`` -> one uint8 image ``[B*3*H, T*W, C]``: for each
    sequence a row of real frames, a row of model frames and a row of absolute differences."""
    B, T, H, W, C = real.shape
    diff = (real.float() - pred.float()).abs().to(torch.uint8)
    rows = torch.stack([real, pred, diff], 1)  # [B, 3, T, H, W, C]
    return rows.permute(0, 1, 3, 2, 4, 5).reshape(B * 3 * H, T * W, C).cpu()


def openloop_frames(real: Tensor, pred: Tensor, context: int, gap: int = 2, bar: int = 3) -> Tensor:
    """uint8 frames ``[B, T, H, W, C]`` (real and model) -> video ``[T, B*(bar+H+gap), 2*W+gap, 3]``:
    per frame one row per sequence, the real frame left and the model's right, with a bar over
    the model frame: green where it is filtered with the posterior (``t < context``), red where it
    is imagined open-loop."""
    B, T, H, W, C = real.shape
    real, pred = real.cpu(), pred.cpu()
    if C == 1:
        real, pred = real.expand(-1, -1, -1, -1, 3), pred.expand(-1, -1, -1, -1, 3)
    elif C != 3:
        real, pred = real[..., :3], pred[..., :3]
    video = torch.full((T, B, bar + H + gap, 2 * W + gap, 3), 255, dtype=torch.uint8)
    video[:, :, bar : bar + H, :W] = real.transpose(0, 1)
    video[:, :, bar : bar + H, W + gap :] = pred.transpose(0, 1)
    color = torch.tensor([[40, 170, 40] if t < context else [210, 40, 40] for t in range(T)], dtype=torch.uint8)
    video[:, :, :bar, W + gap :] = color[:, None, None, None]
    return video.reshape(T, B * (bar + H + gap), 2 * W + gap, 3)
