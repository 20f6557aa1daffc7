"""``DreamEnv``: a gymnasium vector env whose dynamics are a trained world model.

Each of ``num_envs`` dream episodes starts from a real initial frame (V's posterior ``mu,
logvar``, drawn at random from a bank of real episode starts), then follows ``model.step``: ``z'`` sampled from
M's mixture at ``temperature``, the reward from M's reward head (or ``+1`` per step with
``reward="survival"``, the VizDoom setup) and termination from M's done head (``done_prob >
done_threshold``, or a Bernoulli draw with ``done_mode="sample"``); episodes are truncated after
``max_episode_steps``. Observations are the controller's features ``[z, h]`` (float32).

Autoreset is gymnasium's *next-step* mode, as in :func:`lightning_wm.envs.make_vector_env`:
the step after an episode ends returns the new episode's first observation with reward 0
and ignores the action, so the Collector and the CMA-ES controller use it like a real env.
:class:`DreamSingleEnv` is the one-env ``gymnasium.Env`` view (passes gymnasium's env checker).

Everything random (start frames, ``z`` draws, done draws) comes from a ``torch.Generator``
seeded by ``reset(seed=...)``, so a seeded dream is reproducible.

This module knows only the :class:`~lightning_wm.world_model.WorldModel` it is given and the
start latents; :meth:`lightning_wm.agents.vm_model.VisionMemoryModel.dream_env` builds one over
World Models' V+M from a store of real episodes.
"""

from __future__ import annotations

from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor

from lightning_wm.actions import ActionCodec
from lightning_wm.world_model import WorldModel


class DreamEnv(gym.vector.VectorEnv):
    """Vector env over ``num_envs`` dreams of a :class:`WorldModel` (e.g. ``VisionMemoryModel``).

    Args:
        model: the world model; must offer ``initial_state_from_latent(mu, logvar, generator)``,
            ``step(state, action, generator=..., temperature=...)``, ``features``, and
            ``decode(state)`` for ``render``.
        action_space: the real env's (single) action space.
        start_mu, start_logvar: ``[N, Z]`` V posteriors of real initial frames
            (see :func:`lightning_wm.agents.vm_model.initial_latents_from_store`).
        num_envs: dreams stepped together.
        temperature: M's sampling temperature.
        max_episode_steps: truncation length.
        done_mode: ``threshold`` (terminate when ``p > done_threshold``) or ``sample``.
        reward: ``head`` (M's reward prediction) or ``survival`` (+1 per step).
        seed: seed of the first reset when ``reset`` gets none.
    """

    metadata = {"render_modes": ["rgb_array"], "autoreset_mode": gym.vector.AutoresetMode.NEXT_STEP}

    def __init__(
        self,
        model: WorldModel,
        action_space: gym.Space,
        start_mu: Tensor,
        start_logvar: Tensor | None = None,
        num_envs: int = 1,
        temperature: float = 1.0,
        max_episode_steps: int = 1000,
        done_mode: Literal["threshold", "sample"] = "threshold",
        done_threshold: float = 0.5,
        reward: Literal["head", "survival"] = "head",
        seed: int | None = None,
        render_mode: str | None = "rgb_array",
    ) -> None:
        if not isinstance(action_space, (gym.spaces.Discrete, gym.spaces.Box)):
            raise ValueError(f"DreamEnv supports Discrete and Box actions, got {action_space}")
        if done_mode not in ("threshold", "sample"):
            raise ValueError(f"done_mode must be 'threshold' or 'sample', got {done_mode!r}")
        if reward not in ("head", "survival"):
            raise ValueError(f"reward must be 'head' or 'survival', got {reward!r}")
        if start_mu.ndim != 2 or start_mu.shape[0] == 0:
            raise ValueError(f"start_mu must be [N >= 1, Z], got {tuple(start_mu.shape)}")
        self.model = model
        self.num_envs = num_envs
        self.temperature, self.max_episode_steps = temperature, max_episode_steps
        self.done_mode, self.done_threshold, self.reward_mode = done_mode, done_threshold, reward
        self.render_mode = render_mode
        self.device = start_mu.device
        self.start_mu = start_mu
        self.start_logvar = start_logvar
        with torch.no_grad():
            probe = model.initial_state_from_latent(start_mu[:1], None if start_logvar is None else start_logvar[:1])
            feature_dim = int(model.features(probe).shape[-1])
        self.single_action_space = action_space
        self.action_space = gym.vector.utils.batch_space(action_space, num_envs)
        self.single_observation_space = gym.spaces.Box(-np.inf, np.inf, (feature_dim,), np.float32)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.actions = ActionCodec(action_space).to(self.device)
        self._default_seed = seed
        self.generator = torch.Generator(device=self.device)
        self.state: dict[str, Tensor] | None = None
        self._elapsed = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self._needs_reset = torch.zeros(num_envs, dtype=torch.bool, device=self.device)

    # -- tensor API (what the controller uses) ----------------------------------------
    def _starts(self, n: int) -> Any:
        idx = torch.randint(self.start_mu.shape[0], (n,), generator=self.generator, device=self.device)
        logvar = None if self.start_logvar is None else self.start_logvar[idx]
        return self.model.initial_state_from_latent(self.start_mu[idx], logvar, self.generator)

    @torch.no_grad()
    def reset_tensor(self, seed: int | None = None) -> Tensor:
        """Start every dream afresh -> features ``[N, F]``."""
        seed = self._default_seed if seed is None and self.state is None else seed
        if seed is not None:
            self._np_random, _ = gym.utils.seeding.np_random(seed)
            self.generator.manual_seed(int(seed))
        elif self.state is None:
            self.generator.seed()
        self.state = self._starts(self.num_envs)
        self._elapsed.zero_()
        self._needs_reset.zero_()
        return self.model.features(self.state).float()

    def _action_tensor(self, actions: Any) -> Tensor:
        a = torch.as_tensor(np.asarray(actions) if not isinstance(actions, Tensor) else actions, device=self.device)
        return self.actions.encode(a.reshape(self.num_envs, *self.actions.shape))

    @torch.no_grad()
    def step_tensor(self, actions: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Step every dream -> ``(features [N, F], reward [N], terminated [N], truncated [N])``."""
        if self.state is None:
            raise RuntimeError("call reset() before step()")
        action = self._action_tensor(actions)
        reward, nxt, done_prob = self.model.step(self.state, action, generator=self.generator,
                                                 temperature=self.temperature)
        if self.done_mode == "threshold":
            terminated = done_prob > self.done_threshold
        else:
            terminated = torch.rand(done_prob.shape, generator=self.generator, device=self.device) < done_prob
        if self.reward_mode == "survival":
            reward = torch.ones_like(reward)
        self._elapsed += 1
        truncated = (self._elapsed >= self.max_episode_steps) & ~terminated
        # next-step autoreset: envs whose episode ended at the previous step start anew now
        resetting = self._needs_reset
        if bool(resetting.any()):
            fresh = self._starts(int(resetting.sum()))
            for key in nxt:
                nxt[key] = nxt[key].clone()
                nxt[key][resetting] = fresh[key]
            reward = torch.where(resetting, torch.zeros_like(reward), reward)
            terminated = terminated & ~resetting
            truncated = truncated & ~resetting
            self._elapsed[resetting] = 0
        self.state = nxt
        self._needs_reset = terminated | truncated
        return self.model.features(nxt).float(), reward.float(), terminated, truncated

    # -- gymnasium VectorEnv API ------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        if isinstance(seed, (list, tuple)):
            seed = seed[0]
        obs = self.reset_tensor(seed)
        return obs.cpu().numpy(), {}

    def step(self, actions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict]:
        obs, reward, terminated, truncated = self.step_tensor(actions)
        return (obs.cpu().numpy(), reward.cpu().numpy().astype(np.float64), terminated.cpu().numpy(),
                truncated.cpu().numpy(), {})

    @torch.no_grad()
    def render(self) -> np.ndarray | None:
        """V's decoding of every dream's current latent frame: ``uint8 [N, 64, 64, C]``."""
        if self.render_mode != "rgb_array" or self.state is None:
            return None
        return self.model.decode(self.state).cpu().numpy()

    def close_extras(self, **kwargs: Any) -> None:
        self.state = None


class DreamSingleEnv(gym.Env):
    """One dream as a plain ``gymnasium.Env`` (observation ``[z, h]``, real action space).

    Episodes end by M's done head or after ``max_episode_steps``; call ``reset`` after that.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 30}

    def __init__(self, dream: DreamEnv) -> None:
        if dream.num_envs != 1:
            raise ValueError(f"DreamSingleEnv needs a DreamEnv with num_envs=1, got {dream.num_envs}")
        self.dream = dream
        self.observation_space = dream.single_observation_space
        self.action_space = dream.single_action_space
        self.render_mode = dream.render_mode

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        # the dream's generator follows this env's np_random, so seeded resets reproduce
        obs = self.dream.reset_tensor(int(self.np_random.integers(2**31 - 1)))
        return obs[0].cpu().numpy(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        obs, reward, terminated, truncated = self.dream.step_tensor(np.asarray(action)[None])
        return obs[0].cpu().numpy(), float(reward[0]), bool(terminated[0]), bool(truncated[0]), {}

    def render(self) -> np.ndarray | None:
        frames = self.dream.render()
        return None if frames is None else frames[0]
