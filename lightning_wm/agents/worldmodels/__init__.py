"""World Models (Ha & Schmidhuber, 2018): a VAE vision model V, an MDN-RNN memory M trained on V's
latents, and a linear controller C evolved by CMA-ES in the real env or inside M's dream.

* :class:`Vision` — V, trained on recorded frames (``record`` then ``fit``; ``convert`` encodes a store);
* :class:`Memory` — M, trained on the converted latent sequences;
* :class:`Controller` — C, one CMA-ES generation per training step;
* :mod:`~lightning_wm.agents.worldmodels.losses` — the VAE and MDN-RNN losses as pure functions.
"""

from lightning_wm.agents.worldmodels.controller import Controller
from lightning_wm.agents.worldmodels.memory import Memory
from lightning_wm.agents.worldmodels.vision import Vision

__all__ = ["Controller", "Memory", "Vision"]
