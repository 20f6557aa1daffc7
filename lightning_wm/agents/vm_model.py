"""V + M as a :class:`~lightning_wm.world_model.WorldModel`: the dynamics of World Models' dream.

State: a dict ``{"z": [B, Z], "h": [B, H], "c": [B, H]}`` — the current latent frame and the
LSTM state that has read everything before it. ``features`` is ``[z, h]`` (the controller's
input), ``step`` feeds ``[z, a]`` to the LSTM and samples ``z'`` from the mixture at the
model's temperature, so ``features(next_state) = [z', h']`` exactly as when the controller
runs in the real env (``h'`` after reading ``z, a``; ``z'`` encoded from the next frame).

:meth:`VisionMemoryModel.dream_env` (and :func:`load_dream_env`, from checkpoints) builds the
:class:`~lightning_wm.dream_env.DreamEnv` over it, starting dreams from the first frames of
recorded episodes (an :class:`~lightning_wm.data.episodes.EpisodeStore`, pixel or latent).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor, nn

from lightning_wm.agents.memory import Memory, load_checkpoint_module
from lightning_wm.agents.vision import Vision, encode_frames
from lightning_wm.data.episodes import EpisodeStore
from lightning_wm.dream_env import DreamEnv
from lightning_wm.world_model import WorldModel

VMState = dict[str, Tensor]


class VisionMemoryModel(nn.Module, WorldModel):
    """Frozen V and M stepped together.

    Args:
        vision: trained :class:`Vision` (encodes real frames, decodes dreamed ones).
        memory: trained :class:`Memory` (z size must match V's).
        temperature: sampling temperature (``None``: the memory's own).
        sample_initial_z: draw the initial ``z`` from V's posterior instead of taking its mean.
    """

    def __init__(self, vision: Vision, memory: Memory, temperature: float | None = None,
                 sample_initial_z: bool = False) -> None:
        super().__init__()
        if vision.z_size != memory.z_size:
            raise ValueError(f"V's z_size {vision.z_size} differs from M's z_size {memory.z_size}")
        self.vision, self.memory = vision, memory
        self.temperature = memory.temperature if temperature is None else temperature
        self.sample_initial_z = sample_initial_z
        self.requires_grad_(False)
        self.eval()

    @classmethod
    def from_checkpoints(cls, vision_ckpt: str, memory_ckpt: str, device: torch.device | str = "cpu",
                         **kwargs: Any) -> "VisionMemoryModel":
        """Load V and M from their Lightning checkpoints (frozen, eval mode)."""
        return cls(load_checkpoint_module(Vision, vision_ckpt, device),
                   load_checkpoint_module(Memory, memory_ckpt, device), **kwargs)

    @property
    def z_size(self) -> int:
        return self.memory.z_size

    @property
    def feature_dim(self) -> int:
        return self.memory.z_size + self.memory.hidden_size

    # -- WorldModel -------------------------------------------------------------------
    def initial_state(self, obs: Tensor, generator: torch.Generator | None = None) -> VMState:
        """``uint8 [B, H, W, C]`` real frames -> state with zero LSTM memory."""
        mu, logvar = self.vision.encode(obs)
        return self.initial_state_from_latent(mu, logvar, generator)

    def initial_state_from_latent(self, mu: Tensor, logvar: Tensor | None = None,
                                  generator: torch.Generator | None = None) -> VMState:
        """``mu, logvar [B, Z]`` (V's posterior of real frames) -> state with zero LSTM memory."""
        z = mu
        if self.sample_initial_z and logvar is not None:
            z = Vision.sample(mu, logvar, generator)
        h, c = self.memory.initial_state(mu.shape[0], mu.device)
        return {"z": z, "h": h, "c": c}

    def step(self, state: VMState, action: Tensor, generator: torch.Generator | None = None,
             temperature: float | None = None) -> tuple[Tensor, VMState, Tensor]:
        """``action [B, A]`` float (one-hot for discrete) or int64 ``[B]`` ->
        ``(reward [B], next_state, done probability [B])``."""
        out, (h, c) = self.memory.step(state["z"], self.memory.action_input(action), (state["h"], state["c"]))
        heads = self.memory.heads(out)
        tau = self.temperature if temperature is None else temperature
        z = self.memory.sample_next(heads, tau, generator)
        return heads["reward"], {"z": z, "h": h, "c": c}, torch.sigmoid(heads["done_logit"])

    def features(self, state: VMState) -> Tensor:
        """``[B, Z + H]``: ``[z, h]``."""
        return torch.cat([state["z"], state["h"]], -1)

    # -- dreams ------------------------------------------------------------------------
    def dream_env(self, start_dir: str, action_space: gym.Space, num_envs: int = 1, **kwargs: Any) -> DreamEnv:
        """A :class:`DreamEnv` over this model (sampling at its temperature) whose dreams start
        from the first frames of the episodes in the store ``start_dir`` (pixel or latent
        episodes); ``kwargs`` go to DreamEnv."""
        if not Path(start_dir).is_dir():
            raise FileNotFoundError(f"dream start store {start_dir!r} does not exist; record (and convert) episodes first")
        device = next(self.memory.parameters()).device
        mu, logvar = initial_latents_from_store(EpisodeStore(start_dir), self.vision)
        return DreamEnv(self, action_space, mu.to(device), logvar.to(device), num_envs=num_envs,
                        temperature=self.temperature, **kwargs)

    # -- rendering --------------------------------------------------------------------
    def decode(self, state: VMState) -> Tensor:
        """V's decoding of the state's latent frame: ``uint8 [B, 64, 64, C]``."""
        return self.vision.decode_frames(state["z"])


def initial_latents_from_store(store: EpisodeStore, vision: Vision | None = None, max_starts: int = 1024,
                               batch_size: int = 256) -> tuple[Tensor, Tensor]:
    """``(mu, logvar) [N, Z]`` of the first frame of (up to ``max_starts``) stored episodes.

    Works on a latent store (episodes with ``mu``/``logvar``) or a pixel store (``obs``,
    encoded with ``vision``).
    """
    mus, logvars, frames = [], [], []
    for path in list(store.paths())[:max_starts]:
        episode = store.load(path)
        if "mu" in episode and "logvar" in episode:
            mus.append(torch.as_tensor(np.asarray(episode["mu"][:1])).float())
            logvars.append(torch.as_tensor(np.asarray(episode["logvar"][:1])).float())
        elif "obs" in episode:
            frames.append(np.asarray(episode["obs"][:1]))
        else:
            raise ValueError(f"episode {path} has neither latents (mu/logvar) nor pixel obs to start dreams from")
    if frames:
        if vision is None:
            raise ValueError("a pixel episode store needs a Vision model to encode the dream's start frames")
        mu, logvar = encode_frames(vision, np.concatenate(frames), batch_size)
        mus.append(mu)
        logvars.append(logvar)
    if not mus:
        raise ValueError(f"store {getattr(store, 'directory', store)} holds no episodes to start dreams from")
    return torch.cat(mus), torch.cat(logvars)


def load_dream_env(vision_ckpt: str, memory_ckpt: str, start_dir: str, action_space: gym.Space,
                   num_envs: int = 1, device: torch.device | str = "cpu", temperature: float = 1.0,
                   **kwargs: Any) -> DreamEnv:
    """:meth:`VisionMemoryModel.dream_env` with V and M loaded from their Lightning checkpoints."""
    model = VisionMemoryModel.from_checkpoints(vision_ckpt, memory_ckpt, device, temperature=temperature)
    return model.dream_env(start_dir, action_space, num_envs, **kwargs)
