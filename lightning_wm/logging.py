"""One place that logs pictures: still images and figures to TensorBoard, animations as GIF files beside the logs.

TensorBoard's ``add_video`` writes nothing with moviepy 2, so animations are written as GIFs
(:func:`lightning_wm.video.write_gif`) into the run's log directory instead. Every function
is a no-op for a module without a trainer or logger, and logs from the global-zero rank only.

* :func:`image_grid` — rows of frames -> one image;
* :func:`log_image` — ``add_image`` at the module's global step;
* :func:`log_figure` — ``add_figure`` (a matplotlib figure, rendered with Agg) at the module's global step;
* :func:`log_gif` — ``<log_dir>/<name>/step_<global step>.gif``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch import Tensor

from lightning_wm.video import write_gif

__all__ = ["image_grid", "log_image", "log_figure", "log_gif"]


def image_grid(rows: Sequence[Tensor]) -> Tensor:
    """``rows`` of ``uint8 [N, H, W, C]`` frames -> one ``uint8 [C, rows*H, N*W]`` image."""
    stacked = torch.stack([r.detach().cpu() for r in rows])  # [R, N, H, W, C]
    r, n, h, w, c = stacked.shape
    return stacked.permute(4, 0, 2, 1, 3).reshape(c, r * h, n * w)


def _logger(module: pl.LightningModule) -> Any:
    """The module's logger if it is attached to a trainer and this is the global-zero rank."""
    try:
        trainer = module.trainer
    except RuntimeError:  # not attached to a Trainer
        return None
    if trainer is None or not trainer.is_global_zero:
        return None
    return trainer.logger


def log_image(module: pl.LightningModule, tag: str, image: Tensor | np.ndarray, dataformats: str = "CHW") -> bool:
    """``add_image(tag, image)`` on the module's TensorBoard logger at its global step (``image``
    ``uint8`` or float in ``[0, 1]``, laid out as ``dataformats``). Returns whether it was logged."""
    experiment = getattr(_logger(module), "experiment", None)
    if experiment is None or not hasattr(experiment, "add_image"):
        return False
    experiment.add_image(tag, image, module.global_step, dataformats=dataformats)
    return True


def log_figure(module: pl.LightningModule, tag: str, figure: Any | Callable[[], Any]) -> bool:
    """``add_figure(tag, figure)`` on the module's TensorBoard logger at its global step; the
    figure (a ``matplotlib.figure.Figure``, or a function that draws one: then it is drawn only
    where it is logged) is rendered with the Agg canvas and closed. Returns whether it was logged."""
    experiment = getattr(_logger(module), "experiment", None)
    if experiment is None or not hasattr(experiment, "add_figure"):
        return False
    experiment.add_figure(tag, figure() if callable(figure) else figure, module.global_step, close=True)
    return True


def log_gif(module: pl.LightningModule, name: str, frames: Tensor | Sequence[np.ndarray], fps: int = 8) -> str | None:
    """Write ``frames`` (``uint8 [T, H, W, 3]``, or a list of ``[H, W(, 3)]`` arrays) as an
    animated GIF ``<log_dir>/<name>/step_<global step>.gif`` (folders created). Returns the path,
    or None where the module has no log directory."""
    log_dir = getattr(_logger(module), "log_dir", None)
    if not log_dir:
        return None
    path = os.path.join(log_dir, name, f"step_{module.global_step}.gif")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if isinstance(frames, Tensor):
        frames = list(frames.detach().cpu().numpy())
    write_gif(frames, path, fps=fps)
    return path
