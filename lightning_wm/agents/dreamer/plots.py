"""Dreamer's open-loop pictures: real observations against the model's (filtered with the
posterior for a few steps, then imagined under the same actions): a matplotlib figure of the
curves of vector observations, and frame grids and GIF frames of pixel observations."""

from __future__ import annotations

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor


def openloop_curves(real: Tensor, pred: Tensor, context: int, max_dims: int = 8) -> Figure:
    """Vector observations ``[T, D]`` (real and model) -> a figure (Agg canvas) with one panel per
    dimension (the first ``max_dims``): the real and the predicted values against the step, and a
    dashed line where the model stops filtering with the posterior (``context``) and imagines the
    rest open-loop."""
    real, pred = real.float().cpu().numpy(), pred.float().cpu().numpy()
    T, D = real.shape
    dims = min(D, max_dims)
    figure = Figure(figsize=(6.4, 1.2 + 1.4 * dims), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(dims, 1, sharex=True, squeeze=False)[:, 0]
    steps = range(T)
    for d, ax in enumerate(axes):
        ax.plot(steps, real[:, d], color="black", linewidth=1.5, label="real")
        ax.plot(steps, pred[:, d], color="tab:red", linewidth=1.5, linestyle="-", label="model")
        ax.axvline(context - 0.5, color="tab:gray", linestyle="--", linewidth=1, label="open loop from here")
        ax.set_ylabel(f"obs[{d}]")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step of the sequence")
    figure.suptitle(f"open-loop prediction: {context} steps filtered, {T - context} imagined")
    figure.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=3, fontsize="small")
    return figure


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
