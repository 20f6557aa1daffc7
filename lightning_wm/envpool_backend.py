"""EnvPool as the env backend (``env.backend: envpool``): a gymnasium ``VectorEnv`` over
``envpool.make(...)`` that gives what the gymnasium backend of
:func:`lightning_wm.envs.make_vector_env` gives: the same spaces, observations in the same layout
(pixels ``uint8 [N, H, W, K * C]``, channels last, oldest frame first), unclipped rewards,
``terminated`` / ``truncated``, and *next-step* autoreset (the step after an episode's last
returns the next episode's first observation with reward 0 and ignores the action; EnvPool does
exactly this itself).

Supported ids: ALE games ``ALE/<Game>-v5`` with ``atari_preprocessing`` (EnvPool's ``<Game>-v5``)
and the classic-control ids of :data:`CLASSIC_CONTROL`. Our options -> EnvPool's:

* ``atari_preprocessing``: ``frame_skip`` -> ``frame_skip`` (max-pool of the last two frames),
  ``noop_max`` -> ``noop_max`` (1..noop_max no-ops at reset, as gymnasium), ``screen_size`` ->
  ``img_height`` and ``img_width``, ``grayscale_obs`` -> ``gray_scale``,
  ``terminal_on_life_loss`` -> ``episodic_life``;
* ``frame_stack`` -> ``stack_num`` (the first frame repeated at reset, as gymnasium);
* ``kwargs``: ``repeat_action_probability`` (0.25 by default, as ALE v5), ``full_action_space``,
  ``mode``, ``difficulty`` -> the same names;
* ``max_episode_steps`` (agent steps) -> ``max_episode_steps``, for Atari at most ALE v5's cap of
  108,000 frames (27,000 agent steps at frame skip 4, also the default);
* always ``use_fire_reset: false`` and ``reward_clip: false`` (gymnasium's wrappers neither fire
  at reset nor clip rewards).

Known differences: EnvPool's ``episodic_life`` goes on with the same game after a lost life where
gymnasium's ``terminal_on_life_loss`` restarts it; a truncated episode counts the no-ops of its
reset in gymnasium's limit, not in EnvPool's. Seeds are fixed when EnvPool builds its envs, so the
pool is built at the first ``reset`` (and again at a ``reset`` with new seeds), one seed per env.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import gymnasium as gym
import numpy as np

from lightning_wm.env_config import EnvConfig, EnvError, atari_options
from lightning_wm.seeding import reset_seeds

CLASSIC_CONTROL = (
    "CartPole-v0",
    "CartPole-v1",
    "Pendulum-v1",
    "MountainCar-v0",
    "MountainCarContinuous-v0",
    "Acrobot-v1",
)
ALE_V5_MAX_FRAMES = 108_000  # ALE v5's max_num_frames_per_episode
ALE_KWARGS = {"repeat_action_probability": 0.25, "full_action_space": False, "mode": None, "difficulty": None}
INSTALL = 'pip install -e ".[envpool]"'


def envpool_options(config: EnvConfig) -> tuple[str, dict[str, Any]]:
    """EnvPool's task id and ``envpool.make`` options for ``config`` (without ``num_envs`` and
    seeds); pure, it needs no EnvPool.

    Raises:
        EnvError: an id EnvPool does not step like gymnasium, or an option it cannot express.
    """
    if config.vectorization != "sync":
        raise EnvError(
            f"{config.id}: vectorization: {config.vectorization} does not apply with backend: envpool "
            "(EnvPool steps its envs on its own threads); drop it"
        )
    if config.max_episode_steps is not None and config.max_episode_steps < 1:
        raise EnvError(f"max_episode_steps must be >= 1, got {config.max_episode_steps}")
    wrapped = [
        name
        for name, on in (
            ("pixels", config.pixels),
            ("keep_state", config.keep_state),
            ("crop", config.crop is not None),
            ("action_repeat", config.action_repeat != 1),
        )
        if on
    ]
    if wrapped:
        raise EnvError(
            f"{config.id}: backend: envpool cannot express {', '.join(wrapped)}; drop "
            f"{'it' if len(wrapped) == 1 else 'them'} or use backend: gymnasium"
        )
    if config.id.startswith("ALE/") and config.id.endswith("-v5"):
        return _atari_options(config)
    if config.id in CLASSIC_CONTROL:
        extra = [
            name
            for name, on in (
                ("atari_preprocessing", config.atari_preprocessing is not None),
                ("frame_stack", config.frame_stack != 1),
                ("kwargs", bool(config.kwargs)),
            )
            if on
        ]
        if extra:
            raise EnvError(
                f"{config.id}: backend: envpool steps the plain {config.id}; drop {', '.join(extra)} "
                "or use backend: gymnasium"
            )
        options = {} if config.max_episode_steps is None else {"max_episode_steps": config.max_episode_steps}
        return config.id, options
    raise EnvError(
        f"backend: envpool steps ALE games (ALE/<Game>-v5 with atari_preprocessing) and "
        f"{', '.join(CLASSIC_CONTROL)}; got {config.id!r}: use backend: gymnasium"
    )


def _atari_options(config: EnvConfig) -> tuple[str, dict[str, Any]]:
    atari = atari_options(config)
    if atari is None:
        raise EnvError(
            f"{config.id}: backend: envpool makes preprocessed Atari frames; set atari_preprocessing "
            "({} for 84x84 gray, frame skip 4, up to 30 no-ops) or use backend: gymnasium"
        )
    if atari.noop_max < 1 or atari.frame_skip < 2:
        raise EnvError(
            f"{config.id}: backend: envpool needs atari_preprocessing.noop_max >= 1 and frame_skip >= 2 "
            f"(got {atari.noop_max} and {atari.frame_skip}); use backend: gymnasium for these"
        )
    unknown = sorted(set(config.kwargs) - set(ALE_KWARGS))
    if unknown:
        raise EnvError(
            f"{config.id}: backend: envpool takes the env kwargs {', '.join(ALE_KWARGS)}; got {', '.join(unknown)}"
        )
    kwargs = {**ALE_KWARGS, **config.kwargs}
    cap = ALE_V5_MAX_FRAMES // atari.frame_skip
    options = {
        "frame_skip": atari.frame_skip,
        "noop_max": atari.noop_max,
        "img_height": atari.screen_size,
        "img_width": atari.screen_size,
        "gray_scale": atari.grayscale_obs,
        "episodic_life": atari.terminal_on_life_loss,
        "stack_num": config.frame_stack,
        "repeat_action_probability": float(kwargs["repeat_action_probability"]),
        "full_action_space": bool(kwargs["full_action_space"]),
        "max_episode_steps": cap if config.max_episode_steps is None else min(cap, config.max_episode_steps),
        "use_fire_reset": False,
        "reward_clip": False,
    }
    for name in ("mode", "difficulty"):
        if kwargs[name] is not None:
            options[name] = int(kwargs[name])
    return config.id[len("ALE/") :], options


def _envpool() -> Any:
    try:
        import envpool
    except ImportError:
        raise EnvError(f"backend: envpool needs the EnvPool package: {INSTALL}") from None
    return envpool


def _channels_last(space: gym.spaces.Space) -> gym.spaces.Space:
    """EnvPool's frames ``uint8 [K * C, H, W]`` -> ours ``uint8 [H, W, K * C]``."""
    if isinstance(space, gym.spaces.Box) and space.dtype == np.uint8 and len(space.shape) == 3:
        c, h, w = space.shape
        return gym.spaces.Box(0, 255, (h, w, c), np.uint8)
    return space


def envpool_spaces(config: EnvConfig) -> tuple[gym.spaces.Space, gym.spaces.Space]:
    """``(observation_space, action_space)`` of one env of ``config`` on EnvPool (builds no env)."""
    task, options = envpool_options(config)
    with warnings.catch_warnings():  # EnvPool's float64 bounds cast to float32
        warnings.simplefilter("ignore", UserWarning)
        spec = _envpool().make_spec(task, **options)
        return _channels_last(spec.gymnasium_observation_space), spec.gymnasium_action_space


def usable_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class EnvPoolVectorEnv(gym.vector.VectorEnv):
    """``config.num_envs`` envs stepped by EnvPool, seen as a gymnasium ``VectorEnv`` with
    next-step autoreset (see the module's docstring for the option mapping).

    Args:
        config: the env settings (``backend`` is not read: this class is the EnvPool backend).
        num_threads: EnvPool's worker threads; default ``min(num_envs, usable cores)``.
    """

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.NEXT_STEP}

    def __init__(self, config: EnvConfig, num_threads: int | None = None) -> None:
        self.config = config
        self.task, self.options = envpool_options(config)
        self.num_envs = config.num_envs
        if self.num_envs < 1:
            raise EnvError(f"num_envs must be >= 1, got {self.num_envs}")
        self.num_threads = num_threads or min(self.num_envs, usable_cores())
        self.single_observation_space, self.single_action_space = envpool_spaces(config)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, self.num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, self.num_envs)
        self._images = "stack_num" in self.options  # Atari frames, channels first in EnvPool
        self._pool: Any = None

    def _build(self, seeds: list[int]) -> None:
        self.close_extras()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self._pool = _envpool().make(
                self.task,
                env_type="gymnasium",
                num_envs=self.num_envs,
                batch_size=self.num_envs,
                num_threads=self.num_threads,
                env_seed=seeds,
                **self.options,
            )
            self._pool.observation_space  # noqa: B018 - built (and its warnings silenced) here, not at the first reset

    def _obs(self, obs: np.ndarray) -> np.ndarray:
        return obs.transpose(0, 2, 3, 1) if self._images else obs  # a view: copied once, where it is stored

    def reset(self, *, seed: int | list[int] | None = None, options: dict[str, Any] | None = None):
        """Reset every env. ``seed``: one per env, or an int (env ``i`` gets ``seed + i``), or None
        (the first reset seeds env ``i`` with ``config.seed + i``; later ones go on with each
        env's random stream). EnvPool takes each seed modulo ``2**31``."""
        if options:
            raise EnvError(f"EnvPoolVectorEnv.reset takes no options, got {sorted(options)}")
        if seed is None and self._pool is None:
            seed = self.config.seed
        if seed is not None:
            seeds = reset_seeds(seed, self.num_envs)
            if None in seeds:
                raise EnvError("EnvPoolVectorEnv.reset: give a seed for every env (EnvPool seeds all envs at once)")
            self._build([s % 2**31 for s in seeds])  # EnvPool takes int32 seeds; ours are 64-bit
        obs, info = self._pool.reset()
        return self._obs(obs), info

    def step(self, actions: Any):
        """One step of every env: ``(obs, reward [N], terminated [N], truncated [N], info)``."""
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions: Any) -> None:
        """Send one step's actions; EnvPool's threads step the envs while the caller goes on."""
        if self._pool is None:
            raise EnvError("EnvPoolVectorEnv: call reset() before step()")
        self._pool.send(np.asarray(actions))

    def step_wait(self, **kwargs: Any):
        """The results of the step :meth:`step_async` sent (waiting for it): what :meth:`step` returns."""
        obs, reward, terminated, truncated, info = self._pool.recv()
        return self._obs(obs), reward, terminated, truncated, info

    def close_extras(self, **kwargs: Any) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
