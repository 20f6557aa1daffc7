"""World Models' validation pictures as matplotlib figures (logged with
:func:`lightning_wm.logging.log_figure`, i.e. TensorBoard's ``add_figure``).

* :func:`frames_figure` — labelled rows of frames: V's originals above its reconstructions, or
  real episodes above M's open-loop dreams decoded by V;
* :func:`open_loop_error_figure` — how far M's open-loop dream drifts from the real latents, per
  step, one curve per sequence and their mean;
* :func:`fitness_figure` — the controller's fitness by CMA-ES generation (the population's best,
  mean and worst return, and the best ever told).

Figures are built with ``matplotlib.figure.Figure`` (no pyplot state, no window) and rendered
by TensorBoard's Agg canvas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch import Tensor

__all__ = ["fitness_figure", "frames_figure", "open_loop_error_figure"]


def frames_figure(rows: Sequence[tuple[str, Tensor]], title: str, column_label: str = "frame ") -> Any:
    """A grid of frames, one labelled row per entry of ``rows``.

    Args:
        rows: ``(label, frames)`` pairs, ``frames`` ``uint8 [N, H, W, C]`` (``C`` 1 or 3), the same
            ``N`` in every row.
        title: the figure's title.
        column_label: columns are titled ``f"{column_label}{i}"``.
    Returns:
        a ``matplotlib.figure.Figure``.
    """
    from matplotlib.figure import Figure

    columns = int(rows[0][1].shape[0])
    fig = Figure(figsize=(1.0 * columns + 1.2, 1.05 * len(rows) + 0.6), layout="constrained")
    axes = fig.subplots(len(rows), columns, squeeze=False)
    for r, (label, frames) in enumerate(rows):
        images = frames.detach().cpu().numpy()
        for c in range(columns):
            ax = axes[r, c]
            image = images[c]
            gray = image.shape[-1] == 1
            ax.imshow(image[..., 0] if gray else image, cmap="gray" if gray else None, vmin=0, vmax=255)
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(f"{column_label}{c}", fontsize=8)
            if c == 0:
                ax.set_ylabel(label, fontsize=8)
    fig.suptitle(title, fontsize=10)
    return fig


def open_loop_error_figure(error: Tensor, valid: Tensor) -> Any:
    """Curves of M's open-loop latent error.

    Args:
        error: ``[N, T]`` mean squared difference (over the latent dimensions) between the dreamed
            ``z_t`` and V's latent of the real frame ``t``; step 0 is the real start.
        valid: bool ``[N, T]``: steps before the sequence's first episode border.
    Returns:
        a ``matplotlib.figure.Figure``: one curve per sequence (up to its border) and their mean.
    """
    from matplotlib.figure import Figure

    err = error.detach().float().cpu().numpy()
    ok = valid.detach().cpu().numpy().astype(bool)
    steps = np.arange(err.shape[1])
    fig = Figure(figsize=(6.0, 3.6), layout="constrained")
    ax = fig.subplots()
    for i in range(err.shape[0]):
        ax.plot(steps, np.where(ok[i], err[i], np.nan), marker=".", linewidth=1, alpha=0.7, label=f"sequence {i}")
    counts = ok.sum(0)
    mean = np.where(counts > 0, (err * ok).sum(0) / np.maximum(counts, 1), np.nan)
    ax.plot(steps, mean, color="black", linewidth=2, label="mean")
    ax.set_xlabel("open-loop step t (t = 0: the real start)")
    ax.set_ylabel("squared error of z (mean over dims)")
    ax.set_title("M's dream vs V's latents of the real frames")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


FITNESS_CURVES = ("best", "mean", "worst", "best_ever")


def fitness_figure(history: Tensor | np.ndarray) -> Any:
    """The controller's fitness by generation.

    Args:
        history: ``[G, 4]``, one row per generation ``1..G``: the population's best, mean and worst
            mean return and the best told fitness so far (columns in :data:`FITNESS_CURVES`).
    Returns:
        a ``matplotlib.figure.Figure``: the four curves against the generation, the band between
        the worst and the best shaded.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    values = np.asarray(history.detach().cpu() if isinstance(history, Tensor) else history, dtype=np.float64)
    if values.ndim != 2 or values.shape[1] != len(FITNESS_CURVES) or values.shape[0] == 0:
        raise ValueError(f"fitness history must be [G >= 1, {len(FITNESS_CURVES)}], got {list(values.shape)}")
    generations = np.arange(1, values.shape[0] + 1)
    fig = Figure(figsize=(6.0, 3.6), layout="constrained")
    ax = fig.subplots()
    ax.fill_between(generations, values[:, 2], values[:, 0], alpha=0.2, label="worst..best member")
    styles = {"best": ":", "mean": "-", "worst": ":", "best_ever": "--"}
    for i, name in enumerate(FITNESS_CURVES):
        ax.plot(generations, values[:, i], styles[name], marker="." if len(generations) < 50 else None, label=name)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("CMA-ES generation")
    ax.set_ylabel("mean return per member")
    ax.set_title("controller fitness by generation")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig
