"""What environment to build: the env settings (:class:`EnvConfig`, :class:`AtariPreprocessingConfig`)
and :class:`EnvError`, shared by the env factories (:mod:`lightning_wm.envs` and the EnvPool backend,
:mod:`lightning_wm.envpool_backend`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


class EnvError(ValueError):
    """An environment that cannot be built or is not supported."""


@dataclass
class AtariPreprocessingConfig:
    """Options of gymnasium's ``AtariPreprocessing`` wrapper (same names and defaults): the
    standard DQN/IMPALA Atari pipeline (no-op starts, frame skipping with max-pooling of the last
    two frames, resize, grayscale). ``make_env`` builds the raw ALE env with ``frameskip=1``
    (unless ``kwargs`` sets it) so that the skipping happens here.

    Args:
        noop_max: at most this many no-op actions after a reset.
        frame_skip: emulator frames per agent step.
        screen_size: frames resized to ``screen_size x screen_size``.
        terminal_on_life_loss: end the episode when a life is lost.
        grayscale_obs: grayscale frames (1 channel) instead of RGB (3).
    """

    noop_max: int = 30
    frame_skip: int = 4
    screen_size: int = 84
    terminal_on_life_loss: bool = False
    grayscale_obs: bool = True


@dataclass
class EnvConfig:
    """What environment to build.

    Args:
        id: gymnasium id, e.g. ``CartPole-v1``, ``Pendulum-v1``, ``CarRacing-v3``, ``ALE/Pong-v5``.
        num_envs: envs stepped together by a vector env.
        seed: the root of the run's env seeds: each env's seed derives from it by role (training,
            evaluation, ...), DDP rank and env index (:mod:`lightning_wm.seeding`).
        pixels: observe rendered frames instead of the state vector (classic control);
            envs whose observations are already images are resized either way.
        keep_state: with ``pixels``, observe both: a dict ``{"image": uint8 [H, W, C], "state":
            the env's own vector observation}`` (Dreamer encodes and decodes both).
        size: frame size ``(height, width)`` for image observations.
        grayscale: single-channel frames.
        crop: ``(top, left, height, width)`` in pixels of the env's full frame (its rendering, or
            its own image observation): the box kept *before* the resize to ``size``. ``None``
            (default) keeps the whole frame. A box that does not fit in the frame raises
            :class:`EnvError` (on construction for image observations, on the first frame for
            rendered ones), and so does a crop without image observations. E.g.
            ``[160, 0, 160, 600]`` keeps pixel CartPole's pole and cart (rows 160-319 of its
            400x600 rendering) at full width.
        action_repeat: repeat each action this many times, summing rewards.
        max_episode_steps: truncate episodes after this many (agent) steps; replaces the limit the
            env id is registered with (longer or shorter).
        vectorization: ``sync`` (one process) or ``async`` (one process per env).
        atari_preprocessing: put an ALE game (``ALE/Pong-v5``) through gymnasium's
            ``AtariPreprocessing`` with these options (``{}`` for its defaults: 84x84 gray,
            frame skip 4, up to 30 no-ops); observations ``uint8 [S, S, 1]`` (``[S, S, 3]`` with
            ``grayscale_obs: false``). ``pixels``, ``size``, ``grayscale``, ``crop`` and
            ``action_repeat`` do not apply then; ``max_episode_steps`` counts agent steps.
        frame_stack: observe the last ``K`` frames of an image observation, stacked as channels
            by gymnasium's ``FrameStackObservation``: ``uint8 [H, W, K * C]``, oldest first
            (``[84, 84, 4]`` for Atari with ``frame_stack: 4``); the first observation of an
            episode is repeated to fill the stack.
        kwargs: extra keyword arguments for ``gym.make`` (with ``backend: envpool``, the ALE's
            ``repeat_action_probability``, ``full_action_space``, ``mode`` and ``difficulty``).
        backend: what steps the vector envs: ``gymnasium`` or ``envpool`` (EnvPool's C++ threads,
            ``pip install -e ".[envpool]"``; what it maps and refuses: :mod:`lightning_wm.envpool_backend`).
    """

    id: str = "CartPole-v1"
    num_envs: int = 1
    seed: int = 0
    pixels: bool = False
    keep_state: bool = False
    size: tuple[int, int] = (64, 64)
    grayscale: bool = False
    crop: tuple[int, int, int, int] | None = None
    action_repeat: int = 1
    max_episode_steps: int | None = None
    vectorization: Literal["sync", "async"] = "sync"
    atari_preprocessing: AtariPreprocessingConfig | None = None
    frame_stack: int = 1
    kwargs: dict[str, Any] = field(default_factory=dict)
    backend: Literal["gymnasium", "envpool"] = "gymnasium"


def atari_options(config: EnvConfig) -> AtariPreprocessingConfig | None:
    """``config.atari_preprocessing`` as an :class:`AtariPreprocessingConfig` (a dict, e.g. from an
    episode store's metadata, is converted), or None."""
    options = config.atari_preprocessing
    if options is None or isinstance(options, AtariPreprocessingConfig):
        return options
    if isinstance(options, dict):
        try:
            return AtariPreprocessingConfig(**options)
        except TypeError as err:
            raise EnvError(
                f"atari_preprocessing: {err}; its options are noop_max, frame_skip, screen_size, "
                "terminal_on_life_loss and grayscale_obs"
            ) from None
    raise EnvError(f"atari_preprocessing must be a mapping of AtariPreprocessing options or null, got {options!r}")
