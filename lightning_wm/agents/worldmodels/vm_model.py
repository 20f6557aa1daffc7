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

**An ensemble of Ms** (``ensemble``: more Ms trained on the same latents with other seeds) makes
the dream harder to exploit, the remedy of ME-TRPO / PETS / MOPO for a policy that finds where
one model is wrong. Every member reads the same ``[z, a]`` with its own LSTM state (the state
gains ``eh``/``ec`` ``[B, K-1, H]``); the first M stays the controller's memory (``features`` =
``[z, h]`` of ``memory``, as in the real env). Each dream step draws ``z'`` from one member
chosen at random for that step and env (``ensemble_next="random"``: PETS's TS-1 sampling, so a
controller must do well under every member) or from ``memory`` alone (``"primary"``), and the episode ends
with the members' largest done probability (``ensemble_done="max"``: a state any member thinks
is terminal is terminal) or their mean (``"mean"``). The reward is the members' mean, less
``ensemble_penalty`` times their disagreement (MOPO's uncertainty-penalised reward): the std over
members of the mean next latent each predicts, averaged over the latent's dimensions.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor, nn

from lightning_wm.agents.worldmodels.memory import Memory
from lightning_wm.agents.worldmodels.vision import Vision, encode_frames
from lightning_wm.checkpoints import load_module
from lightning_wm.data.episodes import EpisodeStore
from lightning_wm.dream_env import DreamEnv, start_states
from lightning_wm.world_model import WorldModel

VMState = dict[str, Tensor]


class VisionMemoryModel(nn.Module, WorldModel):
    """Frozen V and M stepped together.

    Args:
        vision: trained :class:`Vision` (encodes real frames, decodes dreamed ones).
        memory: trained :class:`Memory` (its ``net.latent_dim`` must be V's ``latent_dim``).
        temperature: sampling temperature of ``step`` (``None``: the memory's own).
        sample_z: real frames give a ``z`` drawn from V's posterior (as M's training targets
            were, and as the reference's controller sees them) instead of its mean.
        ensemble: further Ms on the same latents (same ``latent_dim``, ``hidden`` and actions),
            used in ``step`` only as the module docstring says; empty: M alone.
        ensemble_next: whose mixture gives ``z'``: a member drawn per dream step and env
            (``random``) or ``memory`` (``primary``).
        ensemble_done: the done probability of a step: the members' ``max`` or ``mean``.
        ensemble_penalty: the step's reward less this times the members' disagreement
            (:meth:`disagreement`); 0: the members' mean reward alone.
    """

    def __init__(
        self,
        vision: Vision,
        memory: Memory,
        temperature: float | None = None,
        sample_z: bool = False,
        ensemble: Sequence[Memory] = (),
        ensemble_next: Literal["random", "primary"] = "random",
        ensemble_done: Literal["max", "mean"] = "max",
        ensemble_penalty: float = 0.0,
    ) -> None:
        super().__init__()
        if vision.latent_dim != memory.latent_dim:
            raise ValueError(f"V's latent_dim {vision.latent_dim} differs from M's net.latent_dim {memory.latent_dim}")
        for i, other in enumerate(ensemble):
            if (other.latent_dim, other.hidden, other.actions.dim) != (
                memory.latent_dim,
                memory.hidden,
                memory.actions.dim,
            ):
                raise ValueError(
                    f"ensemble member {i} has latent_dim {other.latent_dim}, hidden {other.hidden} and action "
                    f"input {other.actions.dim}; M has {memory.latent_dim}, {memory.hidden} and "
                    f"{memory.actions.dim}: train every member with M's config on the same latents"
                )
        if ensemble_next not in ("random", "primary"):
            raise ValueError(f"ensemble_next must be 'random' or 'primary', got {ensemble_next!r}")
        if ensemble_done not in ("max", "mean"):
            raise ValueError(f"ensemble_done must be 'max' or 'mean', got {ensemble_done!r}")
        if ensemble_penalty < 0 or (ensemble_penalty and not ensemble):
            raise ValueError(f"ensemble_penalty must be >= 0 and needs an ensemble, got {ensemble_penalty}")
        self.vision, self.memory = vision, memory
        self.ensemble = nn.ModuleList(ensemble)
        self.ensemble_next, self.ensemble_done = ensemble_next, ensemble_done
        self.ensemble_penalty = ensemble_penalty
        self.actions = memory.actions  # env actions <-> M's action input (one-hot / env values)
        self.temperature = memory.temperature if temperature is None else temperature
        self.sample_z = sample_z
        self.requires_grad_(False)
        self.eval()

    @classmethod
    def from_checkpoints(
        cls,
        vision_ckpt: str,
        memory_ckpt: str,
        device: torch.device | str = "cpu",
        ensemble_ckpts: Sequence[str] = (),
        **kwargs: Any,
    ) -> VisionMemoryModel:
        """Load V, M and the ensemble's further Ms from their Lightning checkpoints (frozen, eval mode)."""
        return cls(
            load_module(Vision, vision_ckpt, device),
            load_module(Memory, memory_ckpt, device),
            ensemble=[load_module(Memory, path, device) for path in ensemble_ckpts],
            **kwargs,
        )

    @property
    def latent_dim(self) -> int:
        return self.memory.latent_dim

    @property
    def feature_dim(self) -> int:
        return self.memory.latent_dim + self.memory.hidden

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
        """Zeros ``{"z": [B, Z], "h": [B, H], "c": [B, H]}`` (and the ensemble's ``eh``/``ec`` ``[B, K-1, H]``)."""
        h, c = self.memory.initial_state(batch_size, device if device is not None else self._device())
        return self._with_ensemble({"z": h.new_zeros(h.shape[0], self.latent_dim), "h": h, "c": c})

    def _with_ensemble(self, state: VMState) -> VMState:
        """Add the ensemble's zero LSTM states ``eh``/``ec`` ``[B, K-1, H]`` (nothing without one)."""
        if len(self.ensemble):
            zeros = state["h"].new_zeros(state["h"].shape[0], len(self.ensemble), state["h"].shape[-1])
            state.update(eh=zeros, ec=zeros.clone())
        return state

    def read_step(self, state: VMState, action_in: Tensor) -> tuple[list[Tensor], VMState]:
        """Every member (M first) reads ``[z, action_in]`` (``action_in [B, A]``, M's input
        format) -> (their LSTM outputs, each ``[B, H]``; the state with every member's next LSTM
        state and the old ``z``). ``step`` and ``observe_step`` then set the next ``z``."""
        out, (h, c) = self.memory.step(state["z"], action_in, (state["h"], state["c"]))
        outs, new = [out], {"z": state["z"], "h": h, "c": c}
        if len(self.ensemble):
            ehs, ecs = [], []
            for k, member in enumerate(self.ensemble):
                o, (eh, ec) = member.step(state["z"], action_in, (state["eh"][:, k], state["ec"][:, k]))
                outs.append(o)
                ehs.append(eh)
                ecs.append(ec)
            new.update(eh=torch.stack(ehs, 1), ec=torch.stack(ecs, 1))
        return outs, new

    def initial_state(self, obs: Tensor, generator: torch.Generator | None = None) -> VMState:
        """``uint8 [B, H, W, C]`` real frames -> state with zero LSTM memory."""
        z = self.encode(obs, generator)
        return {**self.zero_state(z.shape[0], z.device), "z": z}

    def observe_step(
        self,
        state: VMState,
        action: Tensor,
        obs: Tensor,
        is_first: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> VMState:
        """M reads ``[z, action]`` (``action [B, A]`` M's input format), V encodes the next
        frame ``obs``; the LSTM memory is zero where ``is_first``."""
        _, new = self.read_step(state, action)
        if is_first is not None:
            keep = (~is_first.bool()).to(new["h"].dtype)
            for key in ("h", "c", "eh", "ec"):
                if key in new:
                    new[key] = new[key] * keep.view(-1, *[1] * (new[key].dim() - 1))
        new["z"] = self.encode(obs, generator)
        return new

    def step(
        self, state: VMState, action: Tensor, generator: torch.Generator | None = None, temperature: float | None = None
    ) -> tuple[Tensor, VMState, Tensor]:
        """``action [B, A]`` float (one-hot for discrete) or int64 ``[B]`` ->
        ``(reward [B], next_state, done probability [B])``."""
        outs, new = self.read_step(state, self.memory.action_input(action))
        tau = self.temperature if temperature is None else temperature
        members = [self.memory, *self.ensemble]
        heads = [member.heads(out) for member, out in zip(members, outs)]
        if len(members) == 1:  # M alone: its own heads, nothing to combine (the dream's hot path)
            new["z"] = self.memory.sample_next(heads[0], tau, generator)
            return heads[0]["reward"], new, torch.sigmoid(self.memory.next_done_logit(heads[0], new["z"]))
        if self.ensemble_next == "primary":
            new["z"] = self.memory.sample_next(heads[0], tau, generator)
        else:
            draws = torch.stack([m.sample_next(h, tau, generator) for m, h in zip(members, heads)])  # [K, B, Z]
            pick = torch.randint(len(members), (draws.shape[1],), generator=generator, device=draws.device)
            new["z"] = draws[pick, torch.arange(draws.shape[1], device=draws.device)]
        done = torch.stack([torch.sigmoid(m.next_done_logit(h, new["z"])) for m, h in zip(members, heads)])  # [K, B]
        done = done.max(0).values if self.ensemble_done == "max" else done.mean(0)
        reward = torch.stack([h["reward"] for h in heads]).mean(0)
        if self.ensemble_penalty:
            reward = reward - self.ensemble_penalty * self.disagreement(members, heads)
        return reward, new, done

    @staticmethod
    def disagreement(members: Sequence[Memory], heads: Sequence[dict[str, Tensor]]) -> Tensor:
        """The members' disagreement on a step, ``[B]``: the std over members (population std)
        of each one's mean next latent ``[K, B, Z]``, averaged over the ``Z`` dimensions."""
        means = torch.stack([m.mean_next(h) for m, h in zip(members, heads)])
        return means.std(0, correction=0).mean(-1)

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
            logvar = (
                torch.as_tensor(np.asarray(episode["logvar"]), device=device).float() if "logvar" in episode else None
            )
        elif "obs" in episode:
            mu, logvar = (x.to(device) for x in encode_frames(self.vision, np.asarray(episode["obs"])))
        else:
            raise ValueError("an episode needs latents (mu/logvar) or pixel obs to be filtered by V+M")
        z = self.latent(mu, logvar)
        actions = self.memory.action_input(torch.as_tensor(np.asarray(episode["action"]), device=device))
        state = self.zero_state(1, device)
        states = [state]
        for t in range(z.shape[0] - 1):
            state = self.read_step({**state, "z": z[t : t + 1]}, actions[t : t + 1])[1]
            states.append(state)
        rows = {key: torch.cat([s[key] for s in states]) for key in states[0] if key != "z"}
        return {"z": z, **rows}

    # -- dreams ------------------------------------------------------------------------
    def dream_env(
        self,
        start_dir: str,
        action_space: gym.Space,
        num_envs: int = 1,
        starts: Literal["first", "all"] = "first",
        max_starts: int = 4096,
        seed: int = 0,
        **kwargs: Any,
    ) -> DreamEnv:
        """A :class:`DreamEnv` over this model whose dreams start from the recorded episodes
        in the store ``start_dir`` (pixel or latent): their first rows (``starts="first"``) or
        any row that is not an episode's last (``"all"``; at most ``max_starts``, drawn with
        ``seed``). ``kwargs`` go to DreamEnv."""
        if not Path(start_dir).is_dir():
            raise FileNotFoundError(
                f"dream start store {start_dir!r} does not exist; record (and convert) episodes first"
            )
        bank = start_states(self, EpisodeStore(start_dir).episodes(), where=starts, max_starts=max_starts, seed=seed)
        return DreamEnv(self, action_space, bank, num_envs=num_envs, **kwargs)


def load_dream_env(
    vision_ckpt: str,
    memory_ckpt: str,
    start_dir: str,
    action_space: gym.Space,
    num_envs: int = 1,
    device: torch.device | str = "cpu",
    temperature: float = 1.0,
    **kwargs: Any,
) -> DreamEnv:
    """:meth:`VisionMemoryModel.dream_env` with V and M loaded from their Lightning checkpoints."""
    model = VisionMemoryModel.from_checkpoints(vision_ckpt, memory_ckpt, device, temperature=temperature)
    return model.dream_env(start_dir, action_space, num_envs, **kwargs)
