"""MuZero (``lightning_wm.agents.muzero.MuZero`` is the configs' class path).

* :mod:`.model` — :class:`MuZeroModel`: representation, dynamics and prediction networks (also
  a :class:`~lightning_wm.world_model.WorldModel` and the search's ``recurrent_fn``);
* :mod:`.targets` — the K-step unroll targets from replayed windows;
* :mod:`.agent` — the :class:`MuZero` LightningModule (acting by search, training, reanalyse)
  and :class:`MuZeroPolicy`, its acting copy for actor processes;
* :mod:`.representation` — :class:`MuZeroRepresentation`, MuZero's representation as another
  agent's encoder (ALF's representation learner).
"""

from lightning_wm.agents.muzero.agent import MuZero, MuZeroPolicy, SearchSettings
from lightning_wm.agents.muzero.model import MuZeroModel, scale_hidden
from lightning_wm.agents.muzero.representation import MuZeroRepresentation
from lightning_wm.agents.muzero.targets import UnrollTargets, muzero_targets

__all__ = [
    "MuZero",
    "MuZeroPolicy",
    "SearchSettings",
    "MuZeroModel",
    "MuZeroRepresentation",
    "scale_hidden",
    "UnrollTargets",
    "muzero_targets",
]
