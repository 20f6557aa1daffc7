"""World Models vision (V): a convolutional VAE on 64x64 frames, and the ``convert`` step.

* :func:`vae_losses` — reconstruction (sum of squared errors per frame) and KL with the
  reference's free-bits floor ``max(KL, kl_tolerance * z_size)`` per frame;
* :class:`Vision` — the LightningModule, fit on frames streamed by
  ``EpisodeDataModule(mode='frames')``; validation logs losses and an original-vs-reconstruction
  grid to TensorBoard;
* :func:`convert_episodes` — encodes every episode of a pixel store into a latent store
  (``mu``, ``logvar`` per frame, plus actions, rewards and flags) for the memory model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EarlyStopping
from torch import Tensor

from lightning_wm.envs import EnvSpec
from lightning_wm.logging import image_grid, log_image
from lightning_wm.nn.blocks import ConvDecoder, ConvEncoder, postprocess_pixels, preprocess_pixels
from lightning_wm.nn.mdn import gaussian_kl_standard

LATENT_KEYS = ("mu", "logvar")


def vae_losses(recon: Tensor, target: Tensor, mu: Tensor, logvar: Tensor, kl_tolerance: float) -> dict[str, Tensor]:
    """The World Models VAE loss.

    Args:
        recon, target: ``[B, C, H, W]`` images (same scale; pixels in ``[-0.5, 0.5]``).
        mu, logvar: ``[B, Z]`` posterior parameters.
        kl_tolerance: free bits per latent dimension: each frame's KL is floored at
            ``kl_tolerance * Z`` nats (0.5 * 32 = 16 in the reference), so no gradient pushes
            it below that.
    Returns:
        ``loss`` = ``recon`` + ``kl_floored``; ``recon``: squared error summed over pixels,
        mean over frames; ``kl``: raw KL mean over frames; ``kl_floored``; ``mse``: mean
        squared error per pixel value (on the ``[0, 1]`` scale).
    """
    sq = (recon - target).square()
    recon_loss = sq.flatten(1).sum(-1).mean()
    kl = gaussian_kl_standard(mu, logvar)  # [B]
    kl_floored = kl.clamp(min=kl_tolerance * mu.shape[-1])
    return {
        "loss": recon_loss + kl_floored.mean(),
        "recon": recon_loss,
        "kl": kl.mean(),
        "kl_floored": kl_floored.mean(),
        "mse": sq.mean(),
    }


class Vision(pl.LightningModule):
    """Convolutional VAE (World Models' V).

    Encoder: conv 32-64-128-256, kernel 4, stride 2 (ReLU) on 64x64 frames -> ``mu``, ``logvar``
    of a ``z_size`` Gaussian. Decoder: linear -> 1x1x1024 -> deconvs (5, 5, 6, 6) -> output.

    Args:
        env_spec: pixel env spec (linked by the CLI); fixes the frame channels.
        z_size: latent size (32 in the paper).
        depth: channels of the first conv (32).
        kl_tolerance: free bits per dimension (0.5 -> KL floored at 16 nats for z=32).
        lr: Adam learning rate (1e-4 in the reference).
        image_channels: frame channels when no ``env_spec`` is given (3, or 1 for grayscale).
        grid_frames: frames per row of the validation image grid.
        output: decoder output layer. ``sigmoid`` is the reference's; ``linear`` (default)
            avoids its saturation: on frames that are mostly one extreme value (pixel CartPole's
            white background) a sigmoid decoder saturates on the background and gets almost
            no gradient on the small objects, and stays at the mean image (measured here:
            summed squared error stuck at 70 per frame vs 16 with ``linear`` after 300 steps).
            Decoded frames are clamped to the pixel range either way.
        patience: stop training after this many validations (epochs) without a lower
            ``val/loss`` (HumbleRL's ``vae_training.patience``, 5; Lightning's ``EarlyStopping``);
            None trains for ``max_epochs``. The best model by ``val/loss`` is kept as
            ``best.ckpt`` beside ``last.ckpt``.
    """

    def __init__(
        self,
        env_spec: EnvSpec | None = None,
        z_size: int = 32,
        depth: int = 32,
        kl_tolerance: float = 0.5,
        lr: float = 1e-4,
        image_channels: int = 3,
        grid_frames: int = 8,
        output: Literal["linear", "sigmoid"] = "linear",
        patience: int | None = 5,
    ) -> None:
        super().__init__()
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
        if patience is not None and patience < 1:
            raise ValueError(f"patience must be >= 1 validations (or null: no early stopping), got {patience}")
        self.save_hyperparameters(ignore=["env_spec"])
        self.hparams["image_channels"] = image_channels  # checkpoints rebuild without env_spec
        self.env_spec = env_spec
        self.z_size, self.kl_tolerance, self.lr, self.grid_frames = z_size, kl_tolerance, lr, grid_frames
        self.output, self.patience = output, patience
        self.encoder = ConvEncoder(image_channels, 64, depth=depth, stages=4, act="relu")
        self.to_stats = torch.nn.Linear(self.encoder.out_dim, 2 * z_size)
        self.decoder = ConvDecoder(z_size, image_channels, depth=depth, act="relu")

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
    def _losses(self, obs: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        recon, mu, logvar = self(obs)
        return vae_losses(recon, preprocess_pixels(obs), mu, logvar, self.kl_tolerance), recon

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        losses, _ = self._losses(batch["obs"])
        self.log_dict({f"train/{k}": v for k, v in losses.items() if k != "loss"})
        self.log("train/loss", losses["loss"], prog_bar=True)
        return losses["loss"]

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        obs = batch["obs"]
        losses, _ = self._losses(obs)
        n = obs.shape[0]
        if self._trainer is not None:
            self.log_dict({f"val/{k}": v for k, v in losses.items()}, batch_size=n, sync_dist=True)
        if batch_idx == 0:
            frames = obs[: self.grid_frames]
            mu, _ = self.encode(frames)
            grid = image_grid([frames, self.decode_frames(mu)])
            log_image(self, "val/original_vs_reconstruction", grid)

    test_step = validation_step

    def configure_callbacks(self) -> list[EarlyStopping]:
        if self.patience is None:
            return []
        return [EarlyStopping(monitor="val/loss", mode="min", patience=self.patience)]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


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
    ``latent: {z_size, keys}``; the rest of its metadata (``env``) is left as the caller wrote it.

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
    meta["latent"] = {"z_size": vision.z_size, "keys": list(LATENT_KEYS)}
    target.write_metadata(meta)
    return written
