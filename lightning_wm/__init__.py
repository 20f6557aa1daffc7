"""lightning_wm: world-model reinforcement learning agents trained with PyTorch Lightning.

Importing the package registers its gymnasium ids (:mod:`lightning_wm.env_ids`)."""

from lightning_wm import env_ids as _env_ids  # noqa: F401  (registers lightning_wm/Dream-v0)
