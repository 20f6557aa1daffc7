"""World Models vision (V): a convolutional VAE on 64x64 frames, and the ``convert`` step.

* :class:`Vision` — the LightningModule, fit on frames streamed by
  ``EpisodeDataModule(mode='frames')`` with :func:`~lightning_wm.agents.worldmodels.losses.vae_loss`;
  validation logs the losses and a figure of originals above their reconstructions;
* :func:`convert_episodes` — encodes every episode of a pixel store into a latent store
  (``mu``, ``logvar`` per frame, plus actions, rewards and flags) for the memory model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from lightning_wm.agents.worldmodels.figures import frames_figure
from lightning_wm.agents.worldmodels.losses import vae_loss
from lightning_wm.agents.worldmodels.offline import OfflineModel, check_patience
from lightning_wm.envs import EnvSpec
from lightning_wm.logging import log_figure
from lightning_wm.nn.blocks import ConvDecoder, ConvEncoder, postprocess_pixels, preprocess_pixels
from lightning_wm.optim import OptimSettings
from lightning_wm.settings import as_settings

LATENT_KEYS = ("mu", "logvar")


class Vision(OfflineModel):
    """Convolutional VAE (World Models' V).

    Encoder: conv 32-64-128-256, kernel 4, stride 2 (ReLU) on 64x64 frames -> ``mu``, ``logvar``
    of a ``latent_dim`` Gaussian. Decoder: linear -> 1x1x1024 -> deconvs (5, 5, 6, 6) -> output.

    Args:
        env_spec: pixel env spec (linked by the CLI); fixes the frame channels.
        latent_dim: size of the latent ``z`` (32 in the paper).
        depth: channels of the first conv (32).
        kl_tolerance: free bits per latent dimension (0.5: each frame's KL floored at 16 nats for
            ``latent_dim`` 32).
        output: decoder output layer: ``sigmoid`` (the reference's) or ``linear``, which does not
            saturate on frames that are mostly one extreme value (pixel CartPole's white
            background). Decoded frames are clamped to the pixel range either way.
        image_channels: frame channels when no ``env_spec`` is given (3, or 1 for grayscale).
        optim: the optimizer (Adam, learning rate 1e-4 as in the reference).
        patience: stop training after this many validations (epochs) without a lower
            ``val/loss`` (HumbleRL's ``vae_training.patience``, 5); None trains for ``max_epochs``.
            The best model by ``val/loss`` is kept as ``best.ckpt`` beside ``last.ckpt``.
        grid_frames: frames of the validation figure.
    """

    def __init__(
        self,
        env_spec: EnvSpec | None = None,
        latent_dim: int = 32,
        depth: int = 32,
        kl_tolerance: float = 0.5,
        output: Literal["linear", "sigmoid"] = "linear",
        image_channels: int = 3,
        optim: OptimSettings = OptimSettings(lr=1e-4),
        patience: int | None = 5,
        grid_frames: int = 8,
    ) -> None:
        super().__init__(env_spec)
        if env_spec is not None:
            if not env_spec.is_pixels:
                raise ValueError(
                    f"Vision needs pixel observations (uint8 [64, 64, C]); {env_spec.env_id or 'the env'} "
                    f"observes {env_spec.observation_space}. Set env.pixels: true."
                )
            if env_spec.obs_shape[:2] != (64, 64):
                raise ValueError(f"Vision works on 64x64 frames; got {env_spec.obs_shape}. Set env.size: [64, 64].")
            image_channels = int(env_spec.obs_shape[-1])
        if output not in ("linear", "sigmoid"):
            raise ValueError(f"output must be 'linear' or 'sigmoid', got {output!r}")
        check_patience(patience)
        self.optim = as_settings(OptimSettings, optim, "optim")
        self.save_settings()
        self.hparams["image_channels"] = image_channels  # checkpoints rebuild without env_spec
        self.latent_dim, self.kl_tolerance, self.grid_frames = latent_dim, kl_tolerance, grid_frames
        self.output, self.patience = output, patience
        self.encoder = ConvEncoder(image_channels, 64, depth=depth, stages=4, act="relu")
        self.to_stats = torch.nn.Linear(self.encoder.out_dim, 2 * latent_dim)
        self.decoder = ConvDecoder(latent_dim, image_channels, depth=depth, act="relu")

    # -- model ------------------------------------------------------------------------
    def encode(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        """``uint8 [..., H, W, C]`` frames -> ``(mu, logvar)``, each ``[..., Z]``."""
        mu, logvar = self.to_stats(self.encoder(preprocess_pixels(obs))).chunk(2, -1)
        return mu, logvar

    def decode(self, z: Tensor) -> Tensor:
        """``[..., Z]`` -> images ``[..., C, 64, 64]`` on the ``[-0.5, 0.5]`` pixel scale
        (``linear`` output is not clamped here; :meth:`decode_frames` clamps)."""
        y = self.decoder(z)
        return torch.sigmoid(y) - 0.5 if self.output == "sigmoid" else y

    def decode_frames(self, z: Tensor) -> Tensor:
        """``[..., Z]`` -> ``uint8 [..., 64, 64, C]`` frames."""
        return postprocess_pixels(self.decode(z))

    @staticmethod
    def sample(mu: Tensor, logvar: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Reparameterised draw ``mu + exp(logvar / 2) * eps``."""
        eps = torch.randn(mu.shape, generator=generator, device=mu.device, dtype=mu.dtype)
        return mu + (0.5 * logvar).exp() * eps

    def forward(self, obs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``uint8 [B, H, W, C]`` -> ``(recon [B, C, H, W], mu [B, Z], logvar [B, Z])``."""
        mu, logvar = self.encode(obs)
        return self.decode(self.sample(mu, logvar)), mu, logvar

    # -- training ---------------------------------------------------------------------
    def losses(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """:func:`vae_loss` of the frames ``batch["obs"]`` (``uint8 [B, H, W, C]``), decoded
        from one posterior draw each."""
        obs = batch["obs"]
        recon, mu, logvar = self(obs)
        return vae_loss(recon, preprocess_pixels(obs), mu, logvar, self.kl_tolerance)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.report("val", self.losses(batch), batch_size=batch["obs"].shape[0])
        if batch_idx == 0:
            log_figure(self, "val/original_vs_reconstruction", lambda: self.reconstruction_figure(batch["obs"]))

    test_step = validation_step

    @torch.no_grad()
    def reconstruction_figure(self, obs: Tensor) -> Any:
        """The first ``grid_frames`` frames of ``obs`` above their reconstructions from ``mu``."""
        frames = obs[: self.grid_frames]
        rows = [("original", frames), ("reconstruction", self.decode_frames(self.encode(frames)[0]))]
        return frames_figure(rows, f"V: originals and reconstructions (from the mean), step {self.global_step}")


@torch.no_grad()
def encode_frames(vision: Vision, obs: np.ndarray | Tensor, batch_size: int = 256) -> tuple[Tensor, Tensor]:
    """Encode ``uint8 [T, H, W, C]`` frames in chunks on ``vision``'s device -> CPU ``(mu, logvar)`` ``[T, Z]``."""
    obs = torch.as_tensor(np.asarray(obs))
    mus, logvars = [], []
    for start in range(0, obs.shape[0], batch_size):
        mu, logvar = vision.encode(obs[start : start + batch_size].to(vision.device))
        mus.append(mu.float().cpu())
        logvars.append(logvar.float().cpu())
    return torch.cat(mus), torch.cat(logvars)


def convert_episodes(
    vision: Vision, source: Any, target: Any, batch_size: int = 256, progress: Callable[[int], Any] | None = None
) -> int:
    """Encode every episode of ``source`` (pixel EpisodeStore) into ``target`` (latent store).

    Each target episode holds ``mu``, ``logvar`` (``float32 [T, Z]``) for every frame and every
    other key of the source episode except ``obs`` (``action``, ``reward``, ``is_first``,
    ``is_last``, ``is_terminal``, agent extras) unchanged. The target's metadata gains
    ``latent: {latent_dim, keys}``; the rest of its metadata (``env``) is left as the caller wrote it.

    Args:
        vision: a trained :class:`Vision` (put in eval mode; its device is used).
        source: ``EpisodeStore`` of pixel episodes (``obs uint8 [T, 64, 64, C]``).
        target: ``EpisodeStore`` to write into; must hold no episodes yet.
        batch_size: frames per encoder forward.
        progress: called with 1 after each episode (e.g. a progress bar's ``update``).
    Returns:
        the number of episodes written.
    Raises:
        ValueError: the target already holds episodes, or a source episode has no pixel ``obs``.
    """
    if list(target.paths()):
        raise ValueError(
            f"convert target {getattr(target, 'directory', target)} already holds episodes; "
            "choose an empty directory (converting twice would duplicate them)"
        )
    paths = list(source.paths())
    if not paths:
        raise ValueError(f"convert source {getattr(source, 'directory', source)} holds no episodes")
    was_training = vision.training
    vision.eval()
    written = 0
    try:
        for path in paths:
            episode = source.load(path)
            obs = np.asarray(episode.get("obs")) if "obs" in episode else None
            if obs is None or obs.dtype != np.uint8 or obs.ndim != 4:
                raise ValueError(f"episode {path} has no uint8 [T, H, W, C] 'obs' to encode")
            mu, logvar = encode_frames(vision, obs, batch_size)
            out = {k: np.asarray(v) for k, v in episode.items() if k != "obs"}
            out["mu"], out["logvar"] = mu.numpy(), logvar.numpy()
            target.add(out)
            written += 1
            if progress is not None:
                progress(1)
    finally:
        vision.train(was_training)
    meta = dict(target.read_metadata() or {})
    meta["latent"] = {"latent_dim": vision.latent_dim, "keys": list(LATENT_KEYS)}
    target.write_metadata(meta)
    return written
