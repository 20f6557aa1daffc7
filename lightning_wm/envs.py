"""Gymnasium environments: one factory for single and vector envs, and the :class:`EnvSpec`
that models are built from.

Pixel observations are ``uint8 [H, W, C]`` (``C`` = 3, or 1 with ``grayscale``; ``K * C`` with
a stack of ``K`` frames). Binary frames (an env observing ``bool [H, W, C]``, e.g. MinAtar's
``MinAtar/Breakout-v1``, ``[10, 10, 4]``) become ``uint8`` frames of 0 and 255 at their own size
(:class:`BinaryFrames`), so every family's image path reads them as they are. Atari games can go through gymnasium's own ``AtariPreprocessing``
(:class:`AtariPreprocessingConfig`) and ``FrameStackObservation`` (``frame_stack``). Vector
envs use gymnasium's *next-step* autoreset: the step after an episode ends returns the first
observation of the next one with reward 0 and ignores the action, which is exactly the row
convention of the replay data (``is_first`` rows carry reward 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import (
    wrappers as gym_wrappers,
)  # looked up at use: the module imports under older gymnasium (LightZero's venv)

from lightning_wm.env_config import AtariPreprocessingConfig, EnvConfig, EnvError, atari_options
from lightning_wm.env_ids import DREAM_ENV_ID  # a Dreamer's dream as an env: registered there, named here

PIXEL_KEY = "pixels"
_ATARI_REGISTERED = False
MINATAR_PREFIX = "MinAtar/"


@dataclass(frozen=True)
class EnvSpec:
    """Spaces of *one* env (not batched), what a model needs to build itself."""

    observation_space: gym.spaces.Space
    action_space: gym.spaces.Space
    env_id: str = ""

    @property
    def discrete(self) -> bool:
        return isinstance(self.action_space, gym.spaces.Discrete)

    @property
    def action_dim(self) -> int:
        """Number of actions (discrete) or action vector size (continuous)."""
        if self.discrete:
            return int(self.action_space.n)
        return int(np.prod(self.action_space.shape))

    @property
    def is_dict(self) -> bool:
        """Observations are dicts of arrays (e.g. ``{"image", "state"}``)."""
        return isinstance(self.observation_space, gym.spaces.Dict)

    @property
    def obs_spaces(self) -> dict[str, gym.spaces.Box]:
        """The observation's parts: the Dict's entries, or ``{"obs": space}`` for one array."""
        if self.is_dict:
            return dict(self.observation_space.spaces)
        return {"obs": self.observation_space}

    @property
    def obs_shape(self) -> tuple[int, ...]:
        if self.is_dict:
            raise ValueError(
                f"{self.env_id}: dict observations have one shape per key: "
                f"{ {k: v.shape for k, v in self.obs_spaces.items()} }"
            )
        return tuple(self.observation_space.shape)

    @property
    def is_pixels(self) -> bool:
        """Observations are ``uint8 [H, W, C]`` images (a single array, not a dict)."""
        return not self.is_dict and is_image_space(self.observation_space)

    @property
    def action_low(self) -> np.ndarray:
        return np.asarray(self.action_space.low, dtype=np.float32)

    @property
    def action_high(self) -> np.ndarray:
        return np.asarray(self.action_space.high, dtype=np.float32)


def is_image_space(space: gym.spaces.Box) -> bool:
    """``uint8 [H, W, C]``."""
    return space.dtype == np.uint8 and len(space.shape) == 3


def _register_minatar() -> None:
    """Register MinAtar's gymnasium ids (``MinAtar/<Game>-v0`` full and ``-v1`` minimal action
    sets); the package is the optional extra ``minatar``."""
    if any(k.startswith(MINATAR_PREFIX) for k in gym.registry):
        return
    try:
        import minatar.gym
    except ImportError:
        raise EnvError(
            f'MinAtar ids ({MINATAR_PREFIX}Breakout-v1, ...) need the minatar package: pip install -e ".[minatar]"'
        ) from None
    minatar.gym.register_envs()


def is_binary_frame_space(space: gym.Space) -> bool:
    """``bool [H, W, C]`` (MinAtar's observations)."""
    return isinstance(space, gym.spaces.Box) and space.dtype == np.bool_ and len(space.shape) == 3


class LegacySeed(gym.Wrapper):
    """Reset seeds folded into ``[0, 2**32)`` for envs that seed a legacy numpy ``RandomState``
    (MinAtar), which refuses the 64-bit seeds :mod:`lightning_wm.seeding` derives."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        return self.env.reset(seed=None if seed is None else seed % 2**32, options=options)


class BinaryFrames(gym.ObservationWrapper):
    """``bool [H, W, C]`` observations -> ``uint8 [H, W, C]`` frames of 0 and 255 (same size and
    channels), the format of every other image observation."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.observation_space = gym.spaces.Box(0, 255, env.observation_space.shape, np.uint8)

    def observation(self, observation: Any) -> np.ndarray:
        return np.asarray(observation, dtype=np.uint8) * np.uint8(255)


def _register_atari() -> None:
    global _ATARI_REGISTERED
    if not _ATARI_REGISTERED:
        try:
            import ale_py

            gym.register_envs(ale_py)
        except ImportError:  # pragma: no cover - ale-py is a dependency
            pass
        _ATARI_REGISTERED = True


def _resize(frame: np.ndarray, size: tuple[int, int], grayscale: bool) -> np.ndarray:
    from PIL import Image

    if not grayscale and frame.shape[:2] == tuple(size):  # nothing to do (e.g. an 84x84 Atari stack)
        return frame if frame.ndim == 3 else frame[..., None]
    if frame.ndim == 3 and frame.shape[-1] not in (1, 3) and not grayscale:
        # not RGB (e.g. stacked gray frames): each channel on its own (PIL would take 4 as RGBA)
        return np.stack([_resize(frame[..., c], size, False)[..., 0] for c in range(frame.shape[-1])], -1)
    image = Image.fromarray(frame)
    if grayscale:
        image = image.convert("L")
    if image.size != (size[1], size[0]):
        image = image.resize((size[1], size[0]), Image.BILINEAR)
    out = np.asarray(image, dtype=np.uint8)
    return out[..., None] if out.ndim == 2 else out


def check_crop(crop: Any, frame_shape: tuple[int, ...] | None = None) -> tuple[int, int, int, int]:
    """Validate a crop box ``(top, left, height, width)``, against ``frame_shape`` ``(H, W, ...)`` if given.

    Returns the box as a tuple of ints.

    Raises:
        EnvError: not four integers, a non-positive height/width, a negative corner, or a box
            that extends past the frame.
    """
    try:
        values = [int(v) for v in crop]
        ok = len(values) == 4 and all(float(v) == float(w) for v, w in zip(values, crop))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise EnvError(f"crop must be four integers [top, left, height, width], got {crop!r}")
    top, left, height, width = values
    if top < 0 or left < 0 or height <= 0 or width <= 0:
        raise EnvError(f"crop [top, left, height, width] = {values} needs top, left >= 0 and height, width > 0")
    if frame_shape is not None:
        frame_h, frame_w = int(frame_shape[0]), int(frame_shape[1])
        if top + height > frame_h or left + width > frame_w:
            raise EnvError(
                f"crop [top, left, height, width] = {values} falls outside the {frame_h}x{frame_w} "
                f"(height x width) frame: rows {top}..{top + height - 1} and columns {left}..{left + width - 1} "
                f"must lie within 0..{frame_h - 1} and 0..{frame_w - 1}"
            )
    return top, left, height, width


class PixelObservation(gym.ObservationWrapper):
    """Observations become ``uint8 [H, W, C]`` frames: the env's rendering (``render=True``)
    or its own image observation, optionally cropped to ``crop`` ``(top, left, height, width)``
    first, then resized (and converted to grayscale) with PIL."""

    def __init__(
        self,
        env: gym.Env,
        size: tuple[int, int],
        grayscale: bool,
        render: bool,
        crop: tuple[int, int, int, int] | None = None,
        keep_state: bool = False,
    ) -> None:
        super().__init__(env)
        self.size, self.grayscale, self.render_frames = tuple(size), grayscale, render
        self.keep_state = keep_state
        self.crop = None if crop is None else check_crop(crop)
        self._crop_checked = False
        if self.crop is not None and not render:  # the frame size is known: check now
            check_crop(self.crop, env.observation_space.shape)
            self._crop_checked = True
        # an env's own image keeps its channels (e.g. 4 stacked gray frames); renderings are RGB
        channels = 1 if grayscale else (3 if render else int(env.observation_space.shape[-1]))
        image_space = gym.spaces.Box(0, 255, (*self.size, channels), np.uint8)
        if keep_state:
            state = env.observation_space
            self.observation_space = gym.spaces.Dict(
                {"image": image_space, "state": gym.spaces.Box(state.low, state.high, state.shape, np.float32)}
            )
        else:
            self.observation_space = image_space

    def observation(self, observation: Any) -> Any:
        image = self._frame(observation)
        if self.keep_state:
            return {"image": image, "state": np.asarray(observation, np.float32)}
        return image

    def _frame(self, observation: Any) -> np.ndarray:
        frame = np.asarray(self.env.render() if self.render_frames else observation)
        if self.crop is not None:
            if not self._crop_checked:
                check_crop(self.crop, frame.shape)
                self._crop_checked = True
            top, left, height, width = self.crop
            frame = np.ascontiguousarray(frame[top : top + height, left : left + width])
        return _resize(frame, self.size, self.grayscale)


class ActionRepeat(gym.Wrapper):
    """Repeat an action ``repeat`` times (stopping at episode end), summing the rewards."""

    def __init__(self, env: gym.Env, repeat: int) -> None:
        super().__init__(env)
        self.repeat = repeat

    def step(self, action: Any):
        total = 0.0
        for _ in range(self.repeat):
            obs, reward, terminated, truncated, info = self.env.step(action)
            total += float(reward)
            if terminated or truncated:
                break
        return obs, total, terminated, truncated, info


def _check_spaces(env: gym.Env, env_id: str) -> None:
    obs, act = env.observation_space, env.action_space
    parts = obs.spaces.values() if isinstance(obs, gym.spaces.Dict) else [obs]
    if not all(isinstance(p, gym.spaces.Box) for p in parts):
        raise EnvError(
            f"{env_id}: observation space {obs} is not supported; lightning_wm supports Box "
            "observations (float vectors or uint8 images) and Dicts of them"
        )
    if not isinstance(act, (gym.spaces.Discrete, gym.spaces.Box)):
        raise EnvError(f"{env_id}: action space {act} is not supported; lightning_wm supports Discrete and Box actions")
    if isinstance(act, gym.spaces.Box) and not np.all(np.isfinite(act.low) & np.isfinite(act.high)):
        raise EnvError(f"{env_id}: continuous actions need finite bounds, got {act}")


def make_env(config: EnvConfig, render_mode: str | None = None) -> gym.Env:
    """Build one env with the configured wrappers.

    Raises:
        EnvError: the id is unknown or its spaces are not supported.
    """
    if config.id.startswith("ALE/") or "NoFrameskip" in config.id:
        _register_atari()
    if config.id.startswith(MINATAR_PREFIX):
        _register_minatar()
    if config.id == DREAM_ENV_ID:
        _check_dream_config(config)
    if config.action_repeat < 1:
        raise EnvError(f"action_repeat must be >= 1, got {config.action_repeat}")
    if config.frame_stack < 1:
        raise EnvError(f"frame_stack must be >= 1, got {config.frame_stack}")
    atari = atari_options(config)
    kwargs = dict(config.kwargs)
    if config.pixels:
        render_mode = "rgb_array"
    if render_mode is not None:
        kwargs["render_mode"] = render_mode
    frames_per_step = config.action_repeat
    if atari is not None:
        kwargs.setdefault("frameskip", 1)  # AtariPreprocessing skips frames itself
        frames_per_step = atari.frame_skip
    if config.max_episode_steps is not None:
        if config.max_episode_steps < 1:
            raise EnvError(f"max_episode_steps must be >= 1, got {config.max_episode_steps}")
        # given to gym.make, it replaces the registered limit (CartPole-v1's 500) instead of
        # adding a second TimeLimit that could only shorten episodes
        kwargs["max_episode_steps"] = config.max_episode_steps * frames_per_step
    try:
        env = gym.make(config.id, **kwargs)
    except gym.error.Error as err:
        known = sorted(k for k in gym.registry if "/" not in k or k.startswith(("ALE/", MINATAR_PREFIX)))
        hint = ", ".join(k for k in known if config.id.split("-")[0].lower() in k.lower())[:300]
        raise EnvError(
            f"unknown or unbuildable env id {config.id!r} ({err}). "
            f"Use a registered gymnasium id such as CartPole-v1, Pendulum-v1, CarRacing-v3, ALE/Pong-v5 or "
            f'MinAtar/Breakout-v1 (pip install -e ".[minatar]"){"; close matches: " + hint if hint else ""}'
        ) from None
    if config.id.startswith(MINATAR_PREFIX):
        env = LegacySeed(env)
    if is_binary_frame_space(env.observation_space):
        _check_binary_frame_config(config)
        env = BinaryFrames(env)
        if config.action_repeat > 1:
            env = ActionRepeat(env, config.action_repeat)
        return _stack_frames(env, config) if config.frame_stack > 1 else env
    if atari is not None:
        env = _atari_preprocessing(env, config, atari)
    elif config.action_repeat > 1:
        env = ActionRepeat(env, config.action_repeat)
    is_image = isinstance(env.observation_space, gym.spaces.Box) and len(env.observation_space.shape) == 3
    if config.crop is not None and not (config.pixels or is_image):
        raise EnvError(f"{config.id}: crop applies to image observations; set pixels: true or drop crop")
    if config.keep_state and not (config.pixels and not is_image):
        raise EnvError(
            f"{config.id}: keep_state adds the state vector to rendered frames; it needs pixels: true "
            "and an env whose own observation is a vector"
        )
    if (config.pixels or is_image) and atari is None:
        env = PixelObservation(
            env,
            config.size,
            config.grayscale,
            render=config.pixels and not is_image,
            crop=config.crop,
            keep_state=config.keep_state,
        )
    if config.frame_stack > 1:
        env = _stack_frames(env, config)
    _check_spaces(env, config.id)
    return env


def _check_binary_frame_config(config: EnvConfig) -> None:
    """Binary frames are observed at their own size: the options that render, crop or resize do not apply."""
    wrapped = [
        name
        for name, on in (
            ("pixels", config.pixels),
            ("keep_state", config.keep_state),
            ("grayscale", config.grayscale),
            ("crop", config.crop is not None),
            ("atari_preprocessing", config.atari_preprocessing is not None),
        )
        if on
    ]
    if wrapped:
        raise EnvError(
            f"{config.id}: its binary frames are observed at their own size as uint8 0/255; drop "
            f"{', '.join(wrapped)} (size does not apply either; frame_stack and action_repeat do)"
        )


def _atari_preprocessing(env: gym.Env, config: EnvConfig, atari: AtariPreprocessingConfig) -> gym.Env:
    """gymnasium's ``AtariPreprocessing`` on the raw ALE env -> ``uint8 [S, S, C]`` frames."""
    if config.pixels or config.crop is not None or config.keep_state or config.action_repeat != 1:
        raise EnvError(
            f"{config.id}: atari_preprocessing makes the frames and skips frames itself; drop pixels, "
            "crop, keep_state and action_repeat (its options: screen_size, grayscale_obs, frame_skip)"
        )
    try:
        return gym_wrappers.AtariPreprocessing(
            env,
            noop_max=atari.noop_max,
            frame_skip=atari.frame_skip,
            screen_size=atari.screen_size,
            terminal_on_life_loss=atari.terminal_on_life_loss,
            grayscale_obs=atari.grayscale_obs,
            grayscale_newaxis=True,
        )
    except gym.error.DependencyNotInstalled as err:
        raise EnvError(f'{config.id}: atari_preprocessing needs opencv: pip install -e ".[atari]" ({err})') from None
    except (ValueError, AssertionError) as err:
        raise EnvError(
            f"{config.id}: AtariPreprocessing refused the env or its options ({err}); it takes a raw "
            "ALE env such as ALE/Pong-v5 (built with frameskip=1)"
        ) from None


def _stack_frames(env: gym.Env, config: EnvConfig) -> gym.Env:
    """gymnasium's ``FrameStackObservation`` on ``uint8 [H, W, C]`` frames, then the stack
    ``[K, H, W, C]`` laid out as channels ``[H, W, K * C]`` (oldest frame first)."""
    space = env.observation_space
    if not (isinstance(space, gym.spaces.Box) and is_image_space(space)):
        raise EnvError(
            f"{config.id}: frame_stack stacks image observations (uint8 [H, W, C]); this env observes "
            f"{space}. Set pixels: true or atari_preprocessing, or frame_stack: 1"
        )
    k = config.frame_stack
    h, w, c = space.shape
    env = gym_wrappers.FrameStackObservation(env, k)
    stacked = gym.spaces.Box(0, 255, (h, w, k * c), np.uint8)
    return gym_wrappers.TransformObservation(
        env, lambda obs: np.ascontiguousarray(np.asarray(obs).transpose(1, 2, 0, 3)).reshape(h, w, k * c), stacked
    )


def _check_dream_config(config: EnvConfig) -> None:
    """A dream decodes into the real env's observation format, so the real env's settings go in its
    ``kwargs.real_env``; wrappers on the dream itself would change what the model was trained on."""
    if DREAM_ENV_ID not in gym.registry:
        raise EnvError(f"{DREAM_ENV_ID} is not registered: lightning_wm.env_ids.register_env_ids() registers it")
    wrapped = [
        name
        for name, on in (
            ("pixels", config.pixels),
            ("action_repeat", config.action_repeat != 1),
            ("crop", config.crop is not None),
            ("frame_stack", config.frame_stack != 1),
            ("atari_preprocessing", config.atari_preprocessing is not None),
        )
        if on
    ]
    if wrapped:
        raise EnvError(
            f"{DREAM_ENV_ID}: {', '.join(wrapped)} cannot wrap a dream; give the real env's settings as "
            "env.kwargs.real_env (e.g. {id: CartPole-v1, pixels: true}), the Dreamer was trained on them"
        )
    if "dreamer_ckpt" not in config.kwargs or "episodes" not in config.kwargs:
        raise EnvError(
            f"{DREAM_ENV_ID} needs env.kwargs.dreamer_ckpt (a Dreamer checkpoint) and env.kwargs.episodes "
            "(an episode store of the real env, where dreams start)"
        )


def minatar_in_one_loop(config: EnvConfig) -> bool:
    """Whether :func:`make_vector_env` steps ``config``'s envs in one loop
    (:class:`~lightning_wm.minatar_vector.MinAtarVectorEnv`): MinAtar ids in sync, one frame a step."""
    return (
        config.id.startswith(MINATAR_PREFIX)
        and config.backend == "gymnasium"
        and config.vectorization == "sync"
        and config.action_repeat == 1
        and config.frame_stack == 1
    )


def make_vector_env(config: EnvConfig) -> gym.vector.VectorEnv:
    """``config.num_envs`` envs with next-step autoreset (unseeded: the caller seeds the first
    reset, e.g. ``env.reset(seed=lightning_wm.seeding.env_seeds(config.seed, n, role))``); with
    ``backend: envpool`` an :class:`~lightning_wm.envpool_backend.EnvPoolVectorEnv`; MinAtar ids
    stepped in sync, a :class:`~lightning_wm.minatar_vector.MinAtarVectorEnv`."""
    if config.backend == "envpool":
        from lightning_wm.envpool_backend import EnvPoolVectorEnv  # only where asked for (gymnasium 1.x vector API)

        return EnvPoolVectorEnv(config)
    if config.backend != "gymnasium":
        raise EnvError(f"backend must be 'gymnasium' or 'envpool', got {config.backend!r}")
    if config.id == DREAM_ENV_ID:  # all dreams in one batch through the model
        _check_dream_config(config)
        kwargs = dict(config.kwargs)
        if config.max_episode_steps is not None:
            kwargs["max_episode_steps"] = config.max_episode_steps
        return gym.make_vec(DREAM_ENV_ID, config.num_envs, vectorization_mode="vector_entry_point", **kwargs)
    if minatar_in_one_loop(config):  # the sync vector env bit for bit, in less time a step
        from lightning_wm.minatar_vector import MinAtarVectorEnv  # gymnasium 1.x's vector API, as EnvPool's

        return MinAtarVectorEnv([make_env(config) for _ in range(config.num_envs)], config.max_episode_steps)
    return gymnasium_vector_env(config)


def gymnasium_vector_env(config: EnvConfig) -> gym.vector.VectorEnv:
    """Gymnasium's own vector env (``SyncVectorEnv`` or ``AsyncVectorEnv`` by ``config.vectorization``,
    next-step autoreset) over :func:`make_env`'s envs: what :func:`make_vector_env` gives where no
    engine of its own applies, and the reference the MinAtar loop is held to."""
    fns = [lambda: make_env(config) for _ in range(config.num_envs)]
    kwargs = dict(autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)
    if config.vectorization == "async":
        return gym.vector.AsyncVectorEnv(fns, **kwargs)
    if config.vectorization != "sync":
        raise EnvError(f"vectorization must be 'sync' or 'async', got {config.vectorization!r}")
    return gym.vector.SyncVectorEnv(fns, **kwargs)


_SPEC_CACHE: dict[str, EnvSpec] = {}


def env_spec(config: EnvConfig) -> EnvSpec:
    """The spaces of one env of ``config`` (builds and closes one env; cached)."""
    key = repr(
        (
            config.backend,
            config.id,
            config.pixels,
            config.keep_state,
            tuple(config.size),
            config.grayscale,
            None if config.crop is None else tuple(config.crop),
            atari_options(config),
            config.frame_stack,
            sorted(config.kwargs.items()),
        )
    )
    if key not in _SPEC_CACHE and config.backend == "envpool":
        from lightning_wm.envpool_backend import envpool_spaces

        _SPEC_CACHE[key] = EnvSpec(*envpool_spaces(config), config.id)
    if key not in _SPEC_CACHE:
        env = make_env(config)
        _SPEC_CACHE[key] = EnvSpec(env.observation_space, env.action_space, config.id)
        env.close()
    return _SPEC_CACHE[key]
