"""MuZero (``lightning_wm.agents.muzero.MuZero`` is the configs' class path; ``docs/muzero.md``).

* :mod:`.settings` — the settings groups: :class:`MuZeroNet`, :class:`UnrollSettings`,
  :class:`MuZeroLossSettings`, :class:`ReanalyseSettings`, :class:`TargetSettings` (the search's
  is :class:`lightning_wm.search.SearchSettings`, the optimizer's :class:`lightning_wm.optim.OptimSettings`);
* :mod:`.model` — :class:`MuZeroModel`: representation, dynamics and prediction networks (also
  a :class:`~lightning_wm.world_model.WorldModel` and the search's ``recurrent_fn``);
* :mod:`.windows` — replay batches read as unroll windows, frame stacks, whether a sampler fits;
* :mod:`.targets` — the K-step unroll targets from replayed windows;
* :mod:`.reanalyse` — MuZero Reanalyse and the bootstrap values from the target network;
* :mod:`.losses` — the unroll and :func:`muzero_loss`, the paper's loss;
* :mod:`.search_policy` — the search from observations (acting and reanalyse run it) and
  :class:`MuZeroPolicy`, the acting copy for actor processes;
* :mod:`.agent` — the :class:`MuZero` LightningModule (targets -> loss -> report);
* :mod:`.representation` — :class:`MuZeroRepresentation`, MuZero's representation as another
  agent's encoder (ALF's representation learner).
"""

from lightning_wm.agents.muzero.agent import MuZero
from lightning_wm.agents.muzero.losses import muzero_loss
from lightning_wm.agents.muzero.model import MuZeroModel, scale_hidden
from lightning_wm.agents.muzero.representation import MuZeroRepresentation
from lightning_wm.agents.muzero.search_policy import MuZeroPolicy
from lightning_wm.agents.muzero.settings import (
    MuZeroLossSettings,
    MuZeroNet,
    ReanalyseSettings,
    TargetSettings,
    UnrollSettings,
)
from lightning_wm.agents.muzero.targets import UnrollTargets, muzero_targets
from lightning_wm.search import SearchSettings

__all__ = [
    "MuZero",
    "MuZeroPolicy",
    "MuZeroModel",
    "MuZeroRepresentation",
    "MuZeroNet",
    "UnrollSettings",
    "MuZeroLossSettings",
    "ReanalyseSettings",
    "TargetSettings",
    "SearchSettings",
    "scale_hidden",
    "UnrollTargets",
    "muzero_targets",
    "muzero_loss",
]
