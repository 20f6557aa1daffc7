"""Dreamer (``lightning_wm.agents.dreamer.Dreamer`` is the configs' class path).

* :mod:`.settings` — the settings groups ``net``, ``loss``, ``behavior``, ``optim``;
* :mod:`.world_model` — :class:`DreamerWorldModel` (encoder/decoder, RSSM, heads);
* :mod:`.losses` — the world-model, actor and critic losses as pure functions;
* :mod:`.policy` — the actor's distribution and :class:`DreamerPolicy`, the acting copy for
  actor processes;
* :mod:`.agent` — the :class:`Dreamer` LightningModule (world model + actor + critic);
* :mod:`.plots` — open-loop prediction figures;
* :mod:`.dream` — a trained Dreamer's dream as the gymnasium env ``lightning_wm/Dream-v0``
  (registered by :mod:`lightning_wm.env_ids` when ``lightning_wm`` is imported).
"""

from lightning_wm.agents.dreamer.agent import Dreamer
from lightning_wm.agents.dreamer.dream import dream_from_checkpoint
from lightning_wm.agents.dreamer.policy import DreamerPolicy
from lightning_wm.agents.dreamer.settings import BehaviorSettings, DreamerNet, DreamerOptim, WorldModelLoss
from lightning_wm.agents.dreamer.world_model import DreamerWorldModel, GRUCell, onehot_linear

__all__ = [
    "BehaviorSettings",
    "Dreamer",
    "DreamerNet",
    "DreamerOptim",
    "DreamerPolicy",
    "DreamerWorldModel",
    "GRUCell",
    "WorldModelLoss",
    "dream_from_checkpoint",
    "onehot_linear",
]
