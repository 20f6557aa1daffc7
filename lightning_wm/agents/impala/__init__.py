"""IMPALA (Espeholt et al. 2018) with DI-engine's options under the project's names.

* :mod:`~lightning_wm.agents.impala.settings` — the settings groups (``net``:
  :class:`ActorCriticSettings`, ``loss``: :class:`VTraceLossSettings`) and their defaults.
* :mod:`~lightning_wm.agents.impala.losses` — the pure V-trace loss (:func:`impala_loss`,
  :func:`unroll_loss`).
* :mod:`~lightning_wm.agents.impala.agent` — :class:`IMPALA`, the LightningModule that learns
  from actors' unrolls. The network, its heads and sampling are in
  :mod:`lightning_wm.nn.actor_critic`.
"""

from lightning_wm.agents.impala.agent import IMPALA
from lightning_wm.agents.impala.losses import ImpalaLoss, impala_loss, unroll_loss
from lightning_wm.agents.impala.settings import ActorCriticSettings, VTraceLossSettings

__all__ = [
    "IMPALA",
    "ActorCriticSettings",
    "ImpalaLoss",
    "VTraceLossSettings",
    "impala_loss",
    "unroll_loss",
]
