"""Observation encoder + decoder chosen from the observation space (Dreamer's world model).

One part per array of the observation: a conv encoder/decoder for ``uint8 [64, 64, C]``
frames (``conv="small"``: the MinAtar network's for frames of any size, e.g. ``[10, 10, C]``), an MLP for float ``[D]`` vectors (in symlog space when ``symlog``). A Dict space
(e.g. ``{"image", "state"}``) gets one part per key: the embeddings are concatenated and the
reconstruction losses summed. A plain Box is one part, and observations stay plain tensors.
"""

from __future__ import annotations

from collections.abc import Iterator

import gymnasium as gym
import torch
from torch import Tensor, nn

from lightning_wm.envs import is_image_space
from lightning_wm.nn import dists
from lightning_wm.nn.blocks import (
    MLP,
    ConvDecoder,
    ConvEncoder,
    SmallConvDecoder,
    SmallConvEncoder,
    postprocess_pixels,
    preprocess_pixels,
)

Obs = Tensor | dict[str, Tensor]


class ObservationCodec(nn.Module):
    """Encode ``obs [..., *]`` to ``[..., embed_dim]``; decode features ``[..., F]`` back.

    Args:
        space: a Box (vector or image) or a Dict of them.
        feat_dim: size of the features the decoders read.
        hidden, layers, act, norm: MLP sizes and style.
        cnn_depth: channels of the first conv stage (doubling per stage).
        symlog: encode and reconstruct vectors in symlog space.
        conv: ``strided`` (:class:`ConvEncoder` / :class:`ConvDecoder`, 64x64 frames) or ``small``
            (:class:`SmallConvEncoder` with ``cnn_depth`` channels and ``hidden`` units /
            :class:`SmallConvDecoder`, frames at their own size).
    """

    def __init__(
        self,
        space: gym.Space,
        feat_dim: int,
        hidden: int,
        layers: int,
        act: str,
        norm: bool,
        cnn_depth: int,
        symlog: bool,
        conv: str = "strided",
    ) -> None:
        super().__init__()
        self.is_dict = isinstance(space, gym.spaces.Dict)
        spaces = dict(space.spaces) if self.is_dict else {"obs": space}
        self.symlog = symlog
        self.images: list[str] = []
        self.encoders, self.decoders = nn.ModuleDict(), nn.ModuleDict()
        for key, part in spaces.items():
            if is_image_space(part) and conv == "small":
                h, w, c = part.shape
                self.encoders[key] = SmallConvEncoder(c, (h, w), cnn_depth, hidden, act)
                self.decoders[key] = SmallConvDecoder(feat_dim, c, (h, w), cnn_depth, act)
                self.images.append(key)
            elif is_image_space(part):
                h, w, c = part.shape
                if (h, w) != (64, 64):
                    raise ValueError(
                        f"observation {key!r}: the strided conv encoder/decoder expect 64x64 frames, got {h}x{w}; "
                        "net.conv: small takes frames at their own size (e.g. MinAtar's 10x10)"
                    )
                self.encoders[key] = ConvEncoder(c, 64, depth=cnn_depth, stages=4, act=act, norm=norm)
                self.decoders[key] = ConvDecoder(feat_dim, c, depth=cnn_depth, act=act, norm=norm)
                self.images.append(key)
            elif len(part.shape) == 1:
                self.encoders[key] = MLP(part.shape[0], None, hidden, layers, act, norm)
                self.decoders[key] = MLP(feat_dim, part.shape[0], hidden, layers, act, norm)
            else:
                raise ValueError(
                    f"observation {key!r} of shape {part.shape}: supported are float vectors [D] "
                    "and uint8 images [64, 64, C]"
                )
        self.embed_dim = sum(enc.out_dim for enc in self.encoders.values())

    @property
    def has_image(self) -> bool:
        return bool(self.images)

    def parts(self, obs: Obs) -> Iterator[tuple[str, Tensor]]:
        """``(key, array)`` per part of an observation (``"obs"`` for a plain tensor)."""
        if self.is_dict:
            for key in self.encoders:
                yield key, obs[key]
        else:
            yield "obs", obs

    def encode(self, obs: Obs) -> Tensor:
        """``obs [..., *]`` -> ``[..., embed_dim]``."""
        embeds = []
        for key, x in self.parts(obs):
            if key in self.images:
                embeds.append(self.encoders[key](preprocess_pixels(x)))
            else:
                x = x.float()
                embeds.append(self.encoders[key](dists.symlog(x) if self.symlog else x))
        return embeds[0] if len(embeds) == 1 else torch.cat(embeds, -1)

    def loss(self, feat: Tensor, obs: Obs) -> Tensor:
        """Reconstruction loss ``[...]`` of ``obs`` from ``feat [..., F]``: summed squared error
        per part (pixels in [-0.5, 0.5], vectors in symlog space with ``symlog``), parts summed."""
        total: Tensor | int = 0
        for key, x in self.parts(obs):
            pred = self.decoders[key](feat).float()
            if key in self.images:
                total = total + (pred - preprocess_pixels(x)).square().sum((-3, -2, -1))
            else:
                total = total + dists.symlog_mse(pred, x.float(), transform=self.symlog)
        return total  # type: ignore[return-value]

    def decode(self, feat: Tensor) -> Obs:
        """Predicted observation in the env's format: uint8 frames, float vectors; a dict for Dict spaces."""
        out: dict[str, Tensor] = {}
        for key, decoder in self.decoders.items():
            pred = decoder(feat).float()
            if key in self.images:
                out[key] = postprocess_pixels(pred)
            else:
                out[key] = dists.symexp(pred) if self.symlog else pred
        return out if self.is_dict else out["obs"]

    def openloop_error(self, real: Obs, pred: Obs) -> Tensor:
        """Per-step squared error ``[B, L]`` averaged over parts: pixels scaled to [0, 1],
        vectors compared in symlog space."""
        errors = []
        pred_parts = dict(self.parts(pred))
        for key, x in self.parts(real):
            y = pred_parts[key]
            if key in self.images:
                errors.append((x.float() - y.float()).div(255.0).square().flatten(2).mean(-1))
            else:
                errors.append((dists.symlog(x.float()) - dists.symlog(y.float())).square().mean(-1))
        return torch.stack(errors).mean(0)

    def image(self, obs: Obs) -> Tensor | None:
        """The first image part of ``obs`` (for videos), or None."""
        if not self.images:
            return None
        return obs[self.images[0]] if self.is_dict else obs
