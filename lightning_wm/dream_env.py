"""``DreamEnv``: a gymnasium vector env whose dynamics are any trained world model.

Each of ``num_envs`` dream episodes starts from a state drawn at random from a bank of real
start states (the model's filtered states of recorded episodes, :func:`start_states`: their
first rows, or any row of them), then follows ``model.step``: the next state (sampled by the
model: M's mixture at its temperature, the RSSM's prior), the reward from the model's reward
head (or ``+1`` per step with ``reward="survival"``, the VizDoom setup) and termination from its
done head (``done_prob > done_threshold``, or a Bernoulli draw with ``done_mode="sample"``);
episodes are truncated after ``max_episode_steps``. Observations are the model's features
(``observation="features"``, float32 ``[F]``: what the World Models controller reads) or the
decoded observation in the real env's format (``"decoded"``: uint8 frames, vectors, dicts, so
an agent with its own encoder can train inside the dream); ``render`` shows the decoded state.

Autoreset is gymnasium's *next-step* mode, as in :func:`lightning_wm.envs.make_vector_env`:
the step after an episode ends returns the new episode's first observation with reward 0
and ignores the action, so the Collector and the CMA-ES controller use it like a real env.
:class:`DreamSingleEnv` is the one-env ``gymnasium.Env`` view (passes gymnasium's env checker).

Everything random (start draws, the model's samples, done draws) comes from a
``torch.Generator`` seeded by ``reset(seed=...)``, so a seeded dream is reproducible.

This module knows only the :class:`~lightning_wm.world_model.WorldModel` it is given:
``step(state, action, generator=...)``, ``features``, ``decode`` (for ``render`` and decoded
observations), ``posterior_states`` (for :func:`start_states`) and its ``actions`` codec
(env actions -> the model's action input; a plain one-hot / identity codec if it has none).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor

from lightning_wm.actions import ActionCodec
from lightning_wm.tree import first_leaf, leaves, tree_map
from lightning_wm.world_model import State, WorldModel, check_done_mode, episode_ends


@torch.no_grad()
def start_states(
    model: WorldModel,
    episodes: Iterable[Mapping[str, Any]],
    where: Literal["first", "all"] = "first",
    max_starts: int | None = None,
    seed: int = 0,
) -> State:
    """A bank of dream start states ``[N, ...]`` from recorded episodes (row convention).

    Args:
        model: filters each episode (:meth:`WorldModel.posterior_states`).
        episodes: dicts of ``[T, ...]`` arrays (e.g. ``EpisodeStore(...).episodes()``).
        where: ``first``: each episode's first row (the real env's start distribution);
            ``all``: every row that is not an episode's last (``is_last``), with the model's
            memory of the rows before it, so dreams also start in the middle of episodes.
        max_starts: keep at most this many, drawn uniformly without replacement with ``seed``.
    Returns:
        the states stacked: a pytree of ``[N, ...]`` tensors.
    Raises:
        ValueError: an unknown ``where``, or no episode gave a start.
    """
    if where not in ("first", "all"):
        raise ValueError(f"dream starts must be 'first' or 'all', got {where!r}")
    banks = []
    for episode in episodes:
        if where == "first":
            episode = {k: np.asarray(v)[:1] for k, v in episode.items()}
        states = model.posterior_states(dict(episode))
        rows = np.ones(len(first_leaf(states)), bool)
        if where == "all" and "is_last" in episode:
            rows &= ~np.asarray(episode["is_last"], bool)
        if rows.any():
            index = torch.as_tensor(np.flatnonzero(rows), device=first_leaf(states).device)
            banks.append(tree_map(lambda x: x[index], states))
    if not banks:
        raise ValueError("no recorded episode gave a dream start; record episodes first")
    bank = tree_map(lambda *xs: torch.cat(xs), *banks) if len(banks) > 1 else banks[0]
    n = len(first_leaf(bank))
    if max_starts is not None and n > max_starts:
        keep = np.sort(np.random.default_rng(seed).choice(n, max_starts, replace=False))
        index = torch.as_tensor(keep, device=first_leaf(bank).device)
        bank = tree_map(lambda x: x[index], bank)
    return bank


def _space_of(sample: Any) -> gym.Space:
    """The single-env space of one decoded observation (uint8 -> [0, 255], float -> unbounded)."""
    if isinstance(sample, Mapping):
        return gym.spaces.Dict({k: _space_of(v) for k, v in sample.items()})
    shape = tuple(sample.shape)
    if sample.dtype == torch.uint8:
        return gym.spaces.Box(0, 255, shape, np.uint8)
    return gym.spaces.Box(-np.inf, np.inf, shape, np.float32)


def _to_numpy(obs: Any) -> Any:
    if isinstance(obs, Mapping):
        return {k: _to_numpy(v) for k, v in obs.items()}
    array = obs.cpu().numpy()
    return array if array.dtype == np.uint8 else array.astype(np.float32)


class DreamEnv(gym.vector.VectorEnv):
    """Vector env over ``num_envs`` dreams of a :class:`WorldModel` (V+M, Dreamer's RSSM, ...).

    Args:
        model: the world model (see the module docstring for what it must offer).
        action_space: the real env's (single) action space.
        starts: the bank of start states, a pytree of ``[N, ...]`` tensors (:func:`start_states`).
        num_envs: dreams stepped together.
        max_episode_steps: truncation length.
        done_mode: ``threshold`` (terminate when ``p > done_threshold``) or ``sample``.
        reward: ``head`` (the model's reward prediction) or ``survival`` (+1 per step).
        observation: ``features`` (the model's feature vector) or ``decoded`` (``model.decode``:
            the real env's observation format).
        seed: seed of the first reset when ``reset`` gets none.
    """

    metadata = {"render_modes": ["rgb_array"], "autoreset_mode": gym.vector.AutoresetMode.NEXT_STEP}

    def __init__(
        self,
        model: WorldModel,
        action_space: gym.Space,
        starts: State,
        num_envs: int = 1,
        max_episode_steps: int = 1000,
        done_mode: Literal["threshold", "sample"] = "threshold",
        done_threshold: float = 0.5,
        reward: Literal["head", "survival"] = "head",
        observation: Literal["features", "decoded"] = "features",
        seed: int | None = None,
        render_mode: str | None = "rgb_array",
    ) -> None:
        if not isinstance(action_space, (gym.spaces.Discrete, gym.spaces.Box)):
            raise ValueError(f"DreamEnv supports Discrete and Box actions, got {action_space}")
        check_done_mode(done_mode)
        if reward not in ("head", "survival"):
            raise ValueError(f"reward must be 'head' or 'survival', got {reward!r}")
        if observation not in ("features", "decoded"):
            raise ValueError(f"observation must be 'features' or 'decoded', got {observation!r}")
        if num_envs < 1 or max_episode_steps < 1:
            raise ValueError(f"num_envs and max_episode_steps must be >= 1, got {num_envs}, {max_episode_steps}")
        sizes = {x.shape[0] if x.dim() else 0 for x in leaves(starts)}
        if len(sizes) != 1 or 0 in sizes:
            raise ValueError(f"starts must be a pytree of [N >= 1, ...] tensors with one N, got sizes {sorted(sizes)}")
        self.model = model
        self.num_envs = num_envs
        self.max_episode_steps = max_episode_steps
        self.done_mode, self.done_threshold, self.reward_mode = done_mode, done_threshold, reward
        self.observation_mode = observation
        self.starts = starts
        self.num_starts = sizes.pop()
        self.device = first_leaf(starts).device
        self.state: State | None = None
        with torch.no_grad():
            first = tree_map(lambda x: x[:1], starts)
            probe = self._observe(first)
            self.state = first
            renderable = self._image() is not None  # a model that decodes to frames
            self.state = None
        self.render_mode = render_mode if renderable else None
        self.single_action_space = action_space
        self.action_space = gym.vector.utils.batch_space(action_space, num_envs)
        self.single_observation_space = _space_of(tree_map(lambda x: x[0], probe))
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        codec = getattr(model, "actions", None)
        self.actions = codec if isinstance(codec, ActionCodec) else ActionCodec(action_space).to(self.device)
        self._default_seed = seed
        self.generator = torch.Generator(device=self.device)
        self._elapsed = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self._needs_reset = torch.zeros(num_envs, dtype=torch.bool, device=self.device)

    # -- tensor API (what the controller uses) ----------------------------------------
    def _observe(self, state: State) -> Any:
        if self.observation_mode == "features":
            return self.model.features(state).float()
        return self.model.decode(state)

    def _draw(self, n: int) -> State:
        idx = torch.randint(self.num_starts, (n,), generator=self.generator, device=self.device)
        return tree_map(lambda x: x[idx], self.starts)

    @torch.no_grad()
    def reset_tensor(self, seed: int | None = None) -> Any:
        """Start every dream afresh -> observations ``[N, ...]`` (tensors)."""
        seed = self._default_seed if seed is None and self.state is None else seed
        if seed is not None:
            self._np_random, _ = gym.utils.seeding.np_random(seed)
            self.generator.manual_seed(int(seed))
        elif self.state is None:
            self.generator.seed()
        self.state = self._draw(self.num_envs)
        self._elapsed.zero_()
        self._needs_reset.zero_()
        return self._observe(self.state)

    def _action_tensor(self, actions: Any) -> Tensor:
        a = torch.as_tensor(np.asarray(actions) if not isinstance(actions, Tensor) else actions, device=self.device)
        return self.actions.encode(a.reshape(self.num_envs, *self.actions.shape))

    @torch.no_grad()
    def step_tensor(self, actions: Any) -> tuple[Any, Tensor, Tensor, Tensor]:
        """Step every dream -> ``(observations [N, ...], reward [N], terminated [N], truncated [N])``."""
        if self.state is None:
            raise RuntimeError("call reset() before step()")
        action = self._action_tensor(actions)
        reward, nxt, done_prob = self.model.step(self.state, action, generator=self.generator)
        terminated = episode_ends(done_prob, self.done_mode, self.done_threshold, self.generator)
        if self.reward_mode == "survival":
            reward = torch.ones_like(reward)
        self._elapsed += 1
        truncated = (self._elapsed >= self.max_episode_steps) & ~terminated
        # next-step autoreset: envs whose episode ended at the previous step start anew now
        resetting = self._needs_reset
        if bool(resetting.any()):
            index = resetting.nonzero().squeeze(-1)
            fresh = self._draw(len(index))
            nxt = tree_map(lambda x, f: x.index_copy(0, index, f.to(x.dtype)), nxt, fresh)
            reward = torch.where(resetting, torch.zeros_like(reward), reward)
            terminated = terminated & ~resetting
            truncated = truncated & ~resetting
            self._elapsed[resetting] = 0
        self.state = nxt
        self._needs_reset = terminated | truncated
        return self._observe(nxt), reward.float(), terminated, truncated

    # -- gymnasium VectorEnv API ------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        if isinstance(seed, (list, tuple)):
            seed = seed[0]
        return _to_numpy(self.reset_tensor(seed)), {}

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict]:
        obs, reward, terminated, truncated = self.step_tensor(actions)
        return (
            _to_numpy(obs),
            reward.cpu().numpy().astype(np.float64),
            terminated.cpu().numpy(),
            truncated.cpu().numpy(),
            {},
        )

    def _image(self) -> Tensor | None:
        """The decoded frames ``uint8 [N, H, W, C]`` of the current states (a dict observation's
        ``"image"``), or None where the model decodes no image (vectors, or no decoder)."""
        try:
            frames = self.model.decode(self.state)
        except NotImplementedError:
            return None
        if isinstance(frames, Mapping):
            frames = frames.get("image")
        if not isinstance(frames, Tensor) or frames.dtype != torch.uint8 or frames.dim() != 4:
            return None
        return frames

    @torch.no_grad()
    def render(self) -> np.ndarray | None:
        """The decoded image of every dream's current state, ``uint8 [N, H, W, C]``
        (``render_mode`` is None for a model that decodes no image)."""
        if self.render_mode != "rgb_array" or self.state is None:
            return None
        return self._image().cpu().numpy()

    def close_extras(self, **kwargs: Any) -> None:
        self.state = None


class DreamSingleEnv(gym.Env):
    """One dream as a plain ``gymnasium.Env`` (the dream's observation and the real action space).

    Episodes end by the model's done head or after ``max_episode_steps``; call ``reset`` after that.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 30}

    def __init__(self, dream: DreamEnv) -> None:
        if dream.num_envs != 1:
            raise ValueError(f"DreamSingleEnv needs a DreamEnv with num_envs=1, got {dream.num_envs}")
        self.dream = dream
        self.observation_space = dream.single_observation_space
        self.action_space = dream.single_action_space
        self.render_mode = dream.render_mode

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        # the dream's generator follows this env's np_random, so seeded resets reproduce
        obs = self.dream.reset_tensor(int(self.np_random.integers(2**31 - 1)))
        return _to_numpy(tree_map(lambda x: x[0], obs)), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        obs, reward, terminated, truncated = self.dream.step_tensor(np.asarray(action)[None])
        return (_to_numpy(tree_map(lambda x: x[0], obs)), float(reward[0]), bool(terminated[0]), bool(truncated[0]), {})

    def render(self) -> np.ndarray | None:
        frames = self.dream.render()
        return None if frames is None else frames[0]
