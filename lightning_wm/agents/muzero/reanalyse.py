"""The values a training step's targets bootstrap from: MuZero Reanalyse (fresh searches with the
target network for the first samples of a batch) and the target network's values of the
bootstrap rows without a fresh search value (:func:`bootstrap_values`). Nothing here writes into
its inputs: new values and policies come back as new tensors, with the buffer write of the
searched rows (:class:`Reanalysed`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_wm.agents.muzero.model import MuZeroModel
from lightning_wm.agents.muzero.search_policy import search
from lightning_wm.agents.muzero.settings import ReanalyseSettings, UnrollSettings
from lightning_wm.agents.muzero.targets import bootstrap_rows
from lightning_wm.agents.muzero.windows import Window
from lightning_wm.search import SearchSettings

__all__ = ["reanalyse_td_steps", "Reanalysed", "reanalyse", "search_fixed_shape", "bootstrap_values", "target_values"]


@torch.no_grad()
def target_values(model: MuZeroModel, obs: Tensor) -> Tensor:
    """The values ``[N]`` (float32) of observations ``obs [N, ...]`` under ``model`` in eval mode."""
    if obs.shape[0] == 0:
        return obs.new_zeros(0, dtype=torch.float32)
    model.eval()
    return model.initial_inference(obs)["value"].float()


def reanalyse_td_steps(age: Tensor, td_steps: int, schedule: tuple[int, int] | None) -> Tensor:
    """Reanalyse's n per sample ``[B]`` (int64): ``td_steps``, or with ``schedule = (max_age,
    min_td_steps)`` (ALF's ``LinearTdStepFunc``, EfficientZero's "dynamic horizon")
    ``ceil(min + (td_steps - min) * max(0, 1 - age / max_age))``: fresh rows bootstrap
    ``td_steps`` ahead, rows ``max_age`` or more rows old ``min_td_steps``."""
    if schedule is None:
        return torch.full_like(age, td_steps, dtype=torch.long)
    max_age, low = schedule
    frac = (1.0 - age.double() / float(max_age)).clamp(min=0.0)
    return torch.ceil(low + (td_steps - low) * frac).long()


@dataclass
class Reanalysed:
    """A batch's bootstrap values and policy targets after reanalyse (``B`` samples, ``W`` rows).

    Attributes:
        root_value: ``[B, W]`` the stored values, the reanalysed samples' searched rows replaced
            by their new search values and their later bootstrap rows by the target network's.
        visit_probs: ``[B, W, A]`` the stored policies, the searched rows' replaced.
        td_steps: ``[B]`` int64, n of each sample's value targets.
        count: the reanalysed samples (the first ``count``).
        write: the buffer write of the searched rows (``index``, ``generation``, ``columns``:
            ``root_value``, ``visit_probs``), or None.
    """

    root_value: Tensor
    visit_probs: Tensor
    td_steps: Tensor
    count: int
    write: dict[str, Any] | None


def search_fixed_shape(
    model: MuZeroModel, settings: SearchSettings, discount: float, roots: Tensor, size: int, noise: bool = False
) -> tuple[Tensor, Tensor]:
    """Searches from ``roots [N, ...]`` (with the acting search's root noise if ``noise``) in calls
    of exactly ``size`` roots, the last padded with copies of the first root (whose results are
    dropped): the root values ``[N]`` (float32) and visit distributions ``[N, A]``. A compiled
    search compiles once per shape and a CUDA graph is captured per shape, so the number of rows a
    batch happens to search must not reach the search (the trees of a batch are independent:
    padding changes no real root's)."""
    n = roots.shape[0]
    pad = (-n) % size
    if pad:
        roots = torch.cat([roots, roots[:1].expand(pad, *roots.shape[1:])])
    outs = [search(model, settings, discount, chunk, explore=noise) for chunk in roots.split(size)]
    root_value = torch.cat([o.root_value for o in outs])[:n].float()
    return root_value, torch.cat([o.visit_probs for o in outs])[:n]


def reanalyse(
    target_model: MuZeroModel,
    search_settings: SearchSettings,
    discount: float,
    window: Window,
    unroll: UnrollSettings,
    settings: ReanalyseSettings,
) -> Reanalysed:
    """New targets for the first ``round(settings.ratio * B)`` samples of ``window``: a search with
    ``target_model`` (root noise with ``settings.root_noise``) at unroll rows ``0..K`` where an
    action was taken (every such row with ``settings.full``), the later bootstrap rows valued by
    ``target_model`` directly, bootstrapping ``settings.td_steps`` ahead (by age with
    ``settings.td_steps_schedule``); the other samples keep their stored values and
    ``unroll.td_steps``."""
    B, W = window.mask.shape
    device = window.mask.device
    count = round(settings.ratio * B)
    td = torch.full((B,), unroll.td_steps, dtype=torch.long, device=device)
    value, probs = window.root_value, window.visit_probs
    if count == 0:
        return Reanalysed(value, probs, td, 0, None)
    age = window.age[:count] if window.age is not None else torch.zeros(count, dtype=torch.long, device=device)
    head_td = reanalyse_td_steps(age, settings.td_steps, settings.td_steps_schedule).to(device)
    td = torch.cat([head_td, td[count:]])
    head = (torch.arange(B, device=device) < count).unsqueeze(1)  # [B, 1]
    valid = window.mask.bool()
    acted = valid & ~window.is_last.bool() & head  # rows where a search decides something
    searched = acted if settings.full else acted & (torch.arange(W, device=device) <= unroll.num_unroll_steps)
    # bootstrap rows without a fresh search value: valued by the target network directly
    later = bootstrap_rows(valid, td, unroll.num_unroll_steps + 1) & head & ~searched & ~window.is_terminal.bool()
    write = None
    if searched.any():
        most = count * (W if settings.full else min(W, unroll.num_unroll_steps + 1))  # roots at most
        root_value, new_probs = search_fixed_shape(
            target_model,
            search_settings,
            discount,
            window.obs[searched],
            settings.batch_size or most,
            settings.root_noise,
        )
        new_probs = new_probs.to(probs.dtype)
        where = searched.nonzero(as_tuple=True)
        value = value.index_put(where, root_value)
        probs = probs.index_put(where, new_probs)
        write = {
            "index": window.row_index[searched].cpu(),
            "generation": window.row_generation[searched].cpu(),
            "columns": {"root_value": root_value.cpu(), "visit_probs": new_probs.float().cpu()},
        }
    if later.any():
        value = value.index_put(later.nonzero(as_tuple=True), target_values(target_model, window.obs[later]))
    return Reanalysed(value, probs, td, count, write)


def bootstrap_values(
    target_model: MuZeroModel, window: Window, reanalysed: Reanalysed, unroll: UnrollSettings
) -> Tensor:
    """The values ``[B, W]`` the value targets bootstrap from: ``reanalysed.root_value`` with the
    bootstrap rows of the samples not reanalysed valued by ``target_model``
    (``unroll.bootstrap_value: target_network``), or only those without a search value
    (``stored``: the last row of a truncated episode, where no action is taken, and the random
    prefill)."""
    B = window.mask.shape[0]
    rest = (torch.arange(B, device=window.mask.device) >= reanalysed.count).unsqueeze(1)  # [B, 1]
    boot = bootstrap_rows(window.mask.bool(), reanalysed.td_steps, unroll.num_unroll_steps + 1)
    boot = boot & ~window.is_terminal.bool() & rest
    if unroll.bootstrap_value == "stored":  # only rows without a search
        boot &= window.is_last.bool() | (reanalysed.visit_probs.sum(-1) <= 0)
    if not boot.any():
        return reanalysed.root_value
    return reanalysed.root_value.index_put(boot.nonzero(as_tuple=True), target_values(target_model, window.obs[boot]))
