"""Dyna in one package: a policy learner on real and imagined data from a world model learned
beside it (DI-engine's world-model base: ``DynaWorldModel``, ``HybridWorldModel``).

* :mod:`~lightning_wm.agents.dyna.imagination` — :class:`ImaginationSettings`,
  :func:`imagine_episodes` (roll a policy through a model in the row convention),
  :class:`DynaWorldModel` (the imagination buffer, ``real_ratio``, the model's evaluation) and
  :class:`HybridWorldModel`.
* :mod:`~lightning_wm.agents.dyna.learner` — :class:`DynaLearner`, the LightningModule, and its
  ``dream`` group :class:`DreamSettings` (Hybrid: on-the-fly dreams beside the imagined rows).
* :mod:`~lightning_wm.agents.dyna.losses` — :func:`dream_loss`, the policy's loss on a dream.
* :mod:`~lightning_wm.agents.dyna.callback` — :class:`Imagination`, the callback that refills
  the imagination buffer and evaluates the model on the cadence (a default of the CLI).
"""

from lightning_wm.agents.dyna.callback import Imagination
from lightning_wm.agents.dyna.imagination import DynaWorldModel, HybridWorldModel, ImaginationSettings, imagine_episodes
from lightning_wm.agents.dyna.learner import DreamSettings, DynaLearner, DynaOptimSettings
from lightning_wm.agents.dyna.losses import dream_loss

__all__ = [
    "DreamSettings",
    "DynaLearner",
    "DynaOptimSettings",
    "DynaWorldModel",
    "HybridWorldModel",
    "Imagination",
    "ImaginationSettings",
    "dream_loss",
    "imagine_episodes",
]
