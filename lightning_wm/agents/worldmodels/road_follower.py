"""``RoadFollower``: a CarRacing data agent that follows the road in the pixels, for ``record``.

World Models' V must see the road to encode it, and C must see the views a driving car sees;
a random agent leaves the road at its first bend (``bench/worldmodels_log.md``). This agent
steers towards the grey road pixels ahead of the car in the 64x64 frame and holds a target
speed read from the dashboard's speed bar, with smoothed (AR(1)) noise on the steering so the
episodes vary and sometimes leave the road and come back. It reads only the frame it is given
(no simulator state), so ``record`` runs it like any agent.

Frame geometry (CarRacing-v3's 96x96 observation resized, not cropped, to 64x64): the car sits
at rows 44-51 around column 31.5; rows 0-43 are the road ahead; the speed bar brightens
columns 8-9 of rows 56-63 in proportion to the speed (their mean ~7 per unit of speed).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_wm.agents.base import UntrainedPolicy
from lightning_wm.envs import EnvSpec
from lightning_wm.policies import ar1_step

FAR_ROWS, NEAR_ROWS = (14, 26), (30, 42)  # bands of the road ahead of the car
CAR_COLUMN = 31.5
SPEED_BAR = (slice(56, 64), slice(8, 10))  # rows, columns of the speed bar
TURN_ERROR = 6.0  # columns off centre at which the road ahead counts as a bend


def road_mask(frames: np.ndarray) -> np.ndarray:
    """``uint8 [B, H, W, 3]`` -> ``bool [B, H, W]``: grey road pixels (channels within 12 of each
    other, red in (80, 135)); grass is green, kerbs red/white, the car red."""
    f = frames.astype(np.int16)
    r, g, b = f[..., 0], f[..., 1], f[..., 2]
    return (np.abs(r - g) < 12) & (np.abs(g - b) < 12) & (r > 80) & (r < 135)


def road_offsets(frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Columns of the road's centre right of the car, far and near, ``[B]`` each, from
    ``uint8 [B, 64, 64, 3]`` frames; a band without road gives the other band's (0 if neither)."""
    mask = road_mask(frames[:, : NEAR_ROWS[1]])
    columns = np.arange(frames.shape[2], dtype=np.float64) - CAR_COLUMN

    def centre(rows: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        band = mask[:, rows[0] : rows[1]]
        count = band.sum((1, 2))
        return (band * columns).sum((1, 2)) / np.maximum(count, 1), count > 0

    far, far_ok = centre(FAR_ROWS)
    near, near_ok = centre(NEAR_ROWS)
    far = np.where(far_ok, far, np.where(near_ok, near, 0.0))
    return far, np.where(near_ok, near, far)


def speed_bar(frames: np.ndarray) -> np.ndarray:
    """``uint8 [B, 64, 64, 3]`` -> ``[B]``: mean brightness of the speed bar (~7 x speed)."""
    return frames[:, SPEED_BAR[0], SPEED_BAR[1]].astype(np.float64).mean((1, 2, 3))


class RoadFollower(UntrainedPolicy):
    """Follows CarRacing's road from the 64x64 frame (see the module docstring).

    Args:
        env_spec: linked from the datamodule; CarRacing-v3, ``size [64, 64]``, no crop.
        steer_gain: steering per column of road offset (``0.6 far + 0.4 near``), clipped to [-1, 1].
        speed: target speed-bar brightness on straights and in bends (the bar reads ~7 x speed).
        gas, brake: pedal values below the target, and above 1.3 x the target.
        steer_noise: std of the AR(1) noise added to the steering (0: deterministic).
        correlation: the noise's AR(1) coefficient (its variance stays 1).
        pedal_noise: scale of a second AR(1) noise ``n`` on the pedals: ``pedal_noise * max(n, 0)``
            added to the gas, ``pedal_noise * max(-n, 0)`` to the brake, clipped to [0, 1] (0: off).
            Data for a dream-trained controller: M must see what full gas and hard braking do.
        pedal_correlation: that noise's AR(1) coefficient (0.97: pushes that last ~30 steps).
        seed: seed of the noise.
    """

    def __init__(
        self,
        env_spec: EnvSpec | None = None,
        steer_gain: float = 0.12,
        speed: tuple[float, float] = (60.0, 30.0),
        gas: float = 0.25,
        brake: float = 0.3,
        steer_noise: float = 0.0,
        correlation: float = 0.9,
        pedal_noise: float = 0.0,
        pedal_correlation: float = 0.97,
        seed: int | None = None,
    ) -> None:
        super().__init__(env_spec)
        if env_spec is None or tuple(env_spec.obs_shape) != (64, 64, 3) or env_spec.action_dim != 3:
            shape = None if env_spec is None else env_spec.obs_shape
            raise ValueError(
                f"RoadFollower drives CarRacing from uint8 [64, 64, 3] frames (size: [64, 64]); got {shape}"
            )
        if not (0.0 <= correlation < 1.0 and 0.0 <= pedal_correlation < 1.0) or min(steer_noise, pedal_noise) < 0:
            raise ValueError(
                "need 0 <= correlation, pedal_correlation < 1 and steer_noise, pedal_noise >= 0, got "
                f"{correlation}, {pedal_correlation}, {steer_noise}, {pedal_noise}"
            )
        self.save_settings()
        self.steer_gain, self.speed, self.gas, self.brake = steer_gain, tuple(speed), gas, brake
        self.steer_noise, self.correlation = steer_noise, correlation
        self.pedal_noise, self.pedal_correlation = pedal_noise, pedal_correlation
        self._rng = np.random.default_rng(seed)

    def initial_state(self, batch_size: int) -> Tensor:
        """The AR(1) noises ``[B, 2]`` (steering, pedals) from their stationary distribution (the
        pedals' stays 0 and draws nothing with ``pedal_noise`` 0)."""
        return torch.from_numpy(self._draw_noise(batch_size))

    def _draw_noise(self, batch_size: int) -> np.ndarray:
        steer = self._rng.standard_normal(batch_size)
        pedal = self._rng.standard_normal(batch_size) if self.pedal_noise else np.zeros(batch_size)
        return np.stack([steer, pedal], -1)

    def act(self, obs: Any, state: Tensor, explore: bool = True) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """``uint8 [B, 64, 64, 3]`` frames -> actions ``float32 [B, 3]`` (steer, gas, brake)."""
        frames = torch.as_tensor(obs).cpu().numpy()
        noise = state.cpu().numpy()
        if noise.shape[0] != frames.shape[0]:
            noise = self._draw_noise(frames.shape[0])
        noise = noise.copy()
        noise[:, 0] = ar1_step(noise[:, 0], self.correlation, self._rng.standard_normal(len(noise)))
        if self.pedal_noise:
            noise[:, 1] = ar1_step(noise[:, 1], self.pedal_correlation, self._rng.standard_normal(len(noise)))
        push = self.pedal_noise * noise[:, 1]
        far, near = road_offsets(frames)
        steer = self.steer_gain * (0.6 * far + 0.4 * near) + self.steer_noise * noise[:, 0]
        speed = speed_bar(frames)
        target = np.where(np.abs(far) > TURN_ERROR, self.speed[1], self.speed[0])
        action = np.stack(
            [
                np.clip(steer, -1.0, 1.0),
                np.clip(np.where(speed < target, self.gas, 0.0) + np.maximum(push, 0.0), 0.0, 1.0),
                np.clip(np.where(speed > 1.3 * target, self.brake, 0.0) + np.maximum(-push, 0.0), 0.0, 1.0),
            ],
            -1,
        )
        return torch.from_numpy(action.astype(np.float32)), torch.from_numpy(noise), {}
