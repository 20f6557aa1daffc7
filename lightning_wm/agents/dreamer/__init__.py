"""Dreamer (``lightning_wm.agents.dreamer.Dreamer`` is the configs' class path).

* :mod:`.world_model` — :class:`DreamerWorldModel` (encoder/decoder, RSSM, heads);
* :mod:`.agent` — the :class:`Dreamer` LightningModule (world model + actor + critic) and
  :class:`DreamerPolicy`, its acting copy for actor processes;
* :mod:`.plots` — open-loop prediction pictures.
"""

from lightning_wm.agents.dreamer.agent import Dreamer, DreamerPolicy
from lightning_wm.agents.dreamer.world_model import DreamerWorldModel, GRUCell, onehot_linear

__all__ = ["Dreamer", "DreamerPolicy", "DreamerWorldModel", "GRUCell", "onehot_linear"]
