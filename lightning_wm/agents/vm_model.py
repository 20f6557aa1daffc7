"""V + M as a :class:`~lightning_wm.world_model.WorldModel`: the dynamics of World Models' dream.

State: a dict ``{"z": [B, Z], "h": [B, H], "c": [B, H]}`` — the current latent frame and the
LSTM state that has read everything before it. ``features`` is ``[z, h]`` (the controller's
input), ``step`` feeds ``[z, a]`` to the LSTM and samples ``z'`` from the mixture at the
model's temperature, so ``features(next_state) = [z', h']`` exactly as when the controller
runs in the real env (``observe_step``: ``h'`` after reading ``z, a``; ``z'`` encoded from the
next frame).

:meth:`VisionMemoryModel.dream_env` (and :func:`load_dream_env`, from checkpoints) builds the
:class:`~lightning_wm.dream_env.DreamEnv` over it, starting dreams from the states of recorded
episodes (an :class:`~lightning_wm.data.episodes.EpisodeStore`, pixel or latent): their first
frames, or any row with M's memory of the rows before it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor, nn

from lightning_wm.agents.memory import Memory
from lightning_wm.agents.vision import Vision, encode_frames
from lightning_wm.checkpoints import load_module
from lightning_wm.data.episodes import EpisodeStore
from lightning_wm.dream_env import DreamEnv, start_states
from lightning_wm.world_model import WorldModel

VMState = dict[str, Tensor]


class VisionMemoryModel(nn.Module, WorldModel):
    """Frozen V and M stepped together.

    Args:
        vision: trained :class:`Vision` (encodes real frames, decodes dreamed ones).
        memory: trained :class:`Memory` (z size must match V's).
        temperature: sampling temperature of ``step`` (``None``: the memory's own).
        sample_z: real frames give a ``z`` drawn from V's posterior (as M's training targets
            were, and as the reference's controller sees them) instead of its mean.
    """

    def __init__(self, vision: Vision, memory: Memory, temperature: float | None = None,
                 sample_z: bool = False) -> None:
        super().__init__()
        if vision.z_size != memory.z_size:
            raise ValueError(f"V's z_size {vision.z_size} differs from M's z_size {memory.z_size}")
        self.vision, self.memory = vision, memory
        self.actions = memory.actions  # env actions <-> M's action input (one-hot / env values)
        self.temperature = memory.temperature if temperature is None else temperature
        self.sample_z = sample_z
        self.requires_grad_(False)
        self.eval()

    @classmethod
    def from_checkpoints(cls, vision_ckpt: str, memory_ckpt: str, device: torch.device | str = "cpu",
                         **kwargs: Any) -> "VisionMemoryModel":
        """Load V and M from their Lightning checkpoints (frozen, eval mode)."""
        return cls(load_module(Vision, vision_ckpt, device),
                   load_module(Memory, memory_ckpt, device), **kwargs)

    @property
    def z_size(self) -> int:
        return self.memory.z_size

    @property
    def feature_dim(self) -> int:
        return self.memory.z_size + self.memory.hidden_size

    def _device(self) -> torch.device:
        return next(self.memory.parameters()).device

    def latent(self, mu: Tensor, logvar: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:
        """The ``z [..., Z]`` a real frame gives: V's mean, or a posterior draw with ``sample_z``."""
        if self.sample_z and logvar is not None:
            return Vision.sample(mu, logvar, generator)
        return mu

    def encode(self, obs: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """``uint8 [B, H, W, C]`` real frames -> ``z [B, Z]``."""
        return self.latent(*self.vision.encode(obs), generator)

    # -- WorldModel -------------------------------------------------------------------
    def zero_state(self, batch_size: int, device: torch.device | None = None) -> VMState:
        """Zeros ``{"z": [B, Z], "h": [B, H], "c": [B, H]}``."""
        h, c = self.memory.initial_state(batch_size, device if device is not None else self._device())
        return {"z": torch.zeros_like(h[:, : self.z_size]), "h": h, "c": c}

    def initial_state(self, obs: Tensor, generator: torch.Generator | None = None) -> VMState:
        """``uint8 [B, H, W, C]`` real frames -> state with zero LSTM memory."""
        z = self.encode(obs, generator)
        h, c = self.memory.initial_state(z.shape[0], z.device)
        return {"z": z, "h": h, "c": c}

    def observe_step(self, state: VMState, action: Tensor, obs: Tensor, is_first: Tensor | None = None,
                     generator: torch.Generator | None = None) -> VMState:
        """M reads ``[z, action]`` (``action [B, A]`` M's input format), V encodes the next
        frame ``obs``; the LSTM memory is zero where ``is_first``."""
        _, (h, c) = self.memory.step(state["z"], action, (state["h"], state["c"]))
        if is_first is not None:
            keep = (~is_first.bool()).to(h.dtype).unsqueeze(-1)
            h, c = h * keep, c * keep
        return {"z": self.encode(obs, generator), "h": h, "c": c}

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

    def decode(self, state: VMState) -> Tensor:
        """V's decoding of the state's latent frame: ``uint8 [B, 64, 64, C]``."""
        return self.vision.decode_frames(state["z"])

    @torch.no_grad()
    def posterior_states(self, episode: dict[str, Any]) -> VMState:
        """Every row's state ``[T, ...]`` of one recorded episode (latent: ``mu``/``logvar``;
        or pixel: ``obs``): ``z_t`` from row ``t``, ``(h_t, c_t)`` after M read rows ``0..t-1``
        with their actions (zero at row 0)."""
        device = self._device()
        if "mu" in episode:
            mu = torch.as_tensor(np.asarray(episode["mu"]), device=device).float()
            logvar = torch.as_tensor(np.asarray(episode["logvar"]), device=device).float() \
                if "logvar" in episode else None
        elif "obs" in episode:
            mu, logvar = (x.to(device) for x in encode_frames(self.vision, np.asarray(episode["obs"])))
        else:
            raise ValueError("an episode needs latents (mu/logvar) or pixel obs to be filtered by V+M")
        z = self.latent(mu, logvar)
        actions = self.memory.action_input(torch.as_tensor(np.asarray(episode["action"]), device=device))
        h, c = self.memory.initial_state(1, device)
        hs, cs = [h], [c]
        for t in range(z.shape[0] - 1):
            _, (h, c) = self.memory.step(z[t : t + 1], actions[t : t + 1], (h, c))
            hs.append(h)
            cs.append(c)
        return {"z": z, "h": torch.cat(hs), "c": torch.cat(cs)}

    # -- dreams ------------------------------------------------------------------------
    def dream_env(self, start_dir: str, action_space: gym.Space, num_envs: int = 1,
                  starts: Literal["first", "all"] = "first", max_starts: int = 4096, seed: int = 0,
                  **kwargs: Any) -> DreamEnv:
        """A :class:`DreamEnv` over this model whose dreams start from the recorded episodes
        in the store ``start_dir`` (pixel or latent): their first rows (``starts="first"``) or
        any row that is not an episode's last (``"all"``; at most ``max_starts``, drawn with
        ``seed``). ``kwargs`` go to DreamEnv."""
        if not Path(start_dir).is_dir():
            raise FileNotFoundError(f"dream start store {start_dir!r} does not exist; record (and convert) episodes first")
        bank = start_states(self, EpisodeStore(start_dir).episodes(), where=starts, max_starts=max_starts,
                            seed=seed)
        return DreamEnv(self, action_space, bank, num_envs=num_envs, **kwargs)


def load_dream_env(vision_ckpt: str, memory_ckpt: str, start_dir: str, action_space: gym.Space,
                   num_envs: int = 1, device: torch.device | str = "cpu", temperature: float = 1.0,
                   **kwargs: Any) -> DreamEnv:
    """:meth:`VisionMemoryModel.dream_env` with V and M loaded from their Lightning checkpoints."""
    model = VisionMemoryModel.from_checkpoints(vision_ckpt, memory_ckpt, device, temperature=temperature)
    return model.dream_env(start_dir, action_space, num_envs, **kwargs)
