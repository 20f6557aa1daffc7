"""Shared pieces of the World Models tests: a synthetic pixel spec, a tiny seeded V+M, a minimal
checkpoint writer and a latent store of constant episodes."""

import gymnasium as gym
import numpy as np
import pytorch_lightning as pl
import torch

from lightning_wm.agents.worldmodels.memory import Memory
from lightning_wm.agents.worldmodels.vision import Vision
from lightning_wm.agents.worldmodels.vm_model import VisionMemoryModel
from lightning_wm.data.episodes import EpisodeStore
from lightning_wm.envs import EnvSpec

from support.presets import MEMORY_TINY, VISION_TINY

DISCRETE = EnvSpec(gym.spaces.Box(0, 255, (64, 64, 3), np.uint8), gym.spaces.Discrete(2), "Synthetic")


def tiny_vision_memory(spec: EnvSpec = DISCRETE, temperature: float | None = None) -> VisionMemoryModel:
    """A tiny V+M (``VISION_TINY``, ``MEMORY_TINY``: z 4, LSTM 8, 2 Gaussians), seeded."""
    torch.manual_seed(0)
    return VisionMemoryModel(Vision(spec, **VISION_TINY), Memory(spec, **MEMORY_TINY), temperature=temperature)


def save_module(module: pl.LightningModule, path) -> str:
    """A minimal Lightning checkpoint of an (untrained) module, loadable by load_from_checkpoint."""
    torch.save(
        {
            "state_dict": module.state_dict(),
            "hyper_parameters": dict(module.hparams),
            "pytorch-lightning_version": pl.__version__,
        },
        path,
    )
    return str(path)


def constant_latent_store(directory, episodes: int = 3, length: int = 4, latent_dim: int = 4) -> str:
    """A latent store of ``episodes`` episodes of ``length`` rows whose ``mu`` is the episode's
    index everywhere (action 0, ``is_first`` on row 0); its path."""
    store = EpisodeStore(directory)
    for i in range(episodes):
        store.add(
            {
                "mu": np.full((length, latent_dim), i, np.float32),
                "logvar": np.zeros((length, latent_dim), np.float32),
                "action": np.zeros(length, np.int64),
                "is_first": np.eye(1, length, dtype=bool)[0],
            }
        )
    return str(directory)
