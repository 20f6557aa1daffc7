"""Network building blocks shared by the agent families.

Pixel tensors follow the row convention: observations are stored ``uint8 [..., H, W, C]``;
:func:`preprocess_pixels` turns them into ``float [..., C, H, W]`` in ``[-0.5, 0.5]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _module


def activation(name: str) -> type[nn.Module]:
    """Look up an activation class by its lower-case name (``silu``, ``elu``, ``relu``, ``tanh``)."""
    table = {"silu": nn.SiLU, "elu": nn.ELU, "relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}
    if name.lower() not in table:
        raise ValueError(f"unknown activation {name!r}; choose one of {sorted(table)}")
    return table[name.lower()]


def preprocess_pixels(obs: Tensor, centered: bool = True) -> Tensor:
    """``uint8 [..., H, W, C]`` -> ``float32 [..., C, H, W]`` in ``[-0.5, 0.5]`` (``centered``, the
    pixel convention of the encoders and decoders here) or in ``[0, 1]``."""
    x = obs.movedim(-1, -3).float().div_(255.0)
    return x.sub_(0.5) if centered else x


def postprocess_pixels(image: Tensor) -> Tensor:
    """Inverse of :func:`preprocess_pixels`: ``[..., C, H, W]`` -> ``uint8 [..., H, W, C]``."""
    return ((image + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).movedim(-3, -1)


class BatchNormLast(nn.BatchNorm1d):
    """BatchNorm over the last axis of ``[..., C]`` (the leading axes are the batch)."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.reshape(-1, x.shape[-1])).reshape(x.shape)


class MLP(nn.Sequential):
    """``[..., in_dim] -> [..., out_dim]``: ``layers`` hidden layers of ``hidden`` units.

    Each hidden layer is Linear -> (norm) -> activation; ``norm`` True or ``"layer"``:
    LayerNorm, ``"batch"``: BatchNorm over the batch (train-mode statistics, running ones in
    eval mode), False or ``"none"``: none. ``out_dim=None`` ends on the last hidden layer.
    ``zero_init_output`` zeroes the output layer (DreamerV3 reward/critic).

    ``bias``: whether the hidden layers' Linear have a bias; ``None`` (default): only without a
    norm, whose shift takes its place. That is exact for BatchNorm, not for LayerNorm: a bias-free
    first layer under LayerNorm makes the output blind to the input's scale (``LN(W c x) = LN(W x)``
    for ``c > 0``), so raw observations (a cart at 0.9 or at 1.8 moving twice as fast) need
    ``bias=True``.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int | None,
        hidden: int = 256,
        layers: int = 2,
        act: str = "silu",
        norm: bool | str = True,
        zero_init_output: bool = False,
        bias: bool | None = None,
    ) -> None:
        kind = ("layer" if norm else "none") if isinstance(norm, bool) else norm
        if kind not in ("layer", "batch", "none"):
            raise ValueError(f"MLP norm must be 'layer', 'batch' or 'none', got {norm!r}")
        modules: list[nn.Module] = []
        dim = in_dim
        for _ in range(layers):
            modules.append(nn.Linear(dim, hidden, bias=kind == "none" if bias is None else bias))
            if kind == "layer":
                modules.append(nn.LayerNorm(hidden, eps=1e-3))
            elif kind == "batch":
                modules.append(BatchNormLast(hidden))
            modules.append(activation(act)())
            dim = hidden
        if out_dim is not None:
            out = nn.Linear(dim, out_dim)
            if zero_init_output:
                nn.init.zeros_(out.weight)
                nn.init.zeros_(out.bias)
            modules.append(out)
            dim = out_dim
        super().__init__(*modules)
        self.out_dim = dim

    def forward(self, x: Tensor) -> Tensor:
        """``nn.Sequential``'s forward, bit for bit, calling ``F.linear`` / ``F.layer_norm`` / the
        activation directly instead of each layer's ``nn.Module.__call__``: for the tiny networks
        of a search loop that machinery is most of the cost (MuZero's CartPole network: 300 -> 268
        us per recurrent step). Where any hook is registered on a layer or globally, the layers
        are called as modules, so hooks always run."""
        if (
            _module._global_forward_hooks
            or _module._global_forward_pre_hooks
            or _module._global_backward_hooks
            or _module._global_backward_pre_hooks
            or any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks for m in self)
        ):
            return super().forward(x)
        for m in self:
            kind = type(m)
            if kind is nn.Linear:
                x = F.linear(x, m.weight, m.bias)
            elif kind is nn.LayerNorm:
                x = F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)
            elif kind is nn.ReLU:
                x = torch.relu(x)
            elif kind is nn.SiLU:
                x = F.silu(x)
            else:
                x = m(x)
        return x


class ChannelNorm(nn.Module):
    """LayerNorm over the channel axis of ``[N, C, H, W]``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels, eps=1e-3)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvEncoder(nn.Module):
    """Strided conv stack, kernel 4 stride 2 (World Models / Dreamer).

    ``[..., C, H, W]`` float -> ``[..., out_dim]``. With ``depth=32, stages=4`` the channels
    are 32-64-128-256 as in the World Models VAE; a 64x64 input gives 256x2x2 = 1024 features
    without padding (``padding=0``, the papers' layout) or 256x4x4 with ``padding=1``.
    """

    def __init__(
        self,
        in_channels: int = 3,
        image_size: int = 64,
        depth: int = 32,
        stages: int = 4,
        act: str = "relu",
        norm: bool = False,
        padding: int = 0,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels, size = in_channels, image_size
        for i in range(stages):
            out_ch = depth * 2**i
            layers.append(nn.Conv2d(channels, out_ch, 4, 2, padding=padding, bias=not norm))
            if norm:
                layers.append(ChannelNorm(out_ch))
            layers.append(activation(act)())
            channels = out_ch
            size = (size + 2 * padding - 4) // 2 + 1
        self.net = nn.Sequential(*layers)
        self.out_shape = (channels, size, size)
        self.out_dim = channels * size * size

    def forward(self, x: Tensor) -> Tensor:
        batch = x.shape[:-3]
        y = self.net(x.reshape(-1, *x.shape[-3:]))
        return y.reshape(*batch, -1)


class ConvDecoder(nn.Module):
    """Transposed-conv stack mirroring :class:`ConvEncoder`: ``[..., in_dim] -> [..., C, 64, 64]``.

    The World Models layout: a linear layer to ``depth*32`` features seen as a 1x1 image, then
    transposed convs with kernels 5, 5, 6, 6 (stride 2) giving 5, 13, 30, 64 pixels.
    """

    def __init__(
        self,
        in_dim: int,
        out_channels: int = 3,
        depth: int = 32,
        act: str = "relu",
        norm: bool = False,
        image_size: int = 64,
    ) -> None:
        super().__init__()
        if image_size != 64:
            raise ValueError(f"ConvDecoder produces 64x64 images; got image_size={image_size}")
        self.depth = depth
        self.linear = nn.Linear(in_dim, depth * 32)
        chans = [depth * 32, depth * 4, depth * 2, depth]
        kernels = [5, 5, 6]
        layers: list[nn.Module] = []
        for cin, cout, k in zip(chans[:-1], chans[1:], kernels):
            layers.append(nn.ConvTranspose2d(cin, cout, k, 2, bias=not norm))
            if norm:
                layers.append(ChannelNorm(cout))
            layers.append(activation(act)())
        layers.append(nn.ConvTranspose2d(chans[-1], out_channels, 6, 2))
        self.net = nn.Sequential(*layers)
        self.out_shape = (out_channels, image_size, image_size)

    def forward(self, x: Tensor) -> Tensor:
        batch = x.shape[:-1]
        y = self.linear(x.reshape(-1, x.shape[-1])).reshape(-1, self.depth * 32, 1, 1)
        return self.net(y).reshape(*batch, *self.out_shape)


class SmallConvEncoder(nn.Module):
    """The MinAtar network's torso (Young & Tian 2019) for small frames such as MinAtar's 10x10:
    one 3x3 conv of ``channels`` filters, stride 1, no padding, the activation, flatten, a linear
    layer of ``hidden`` units and the activation. ``float [..., C, H, W]`` -> ``[..., hidden]``
    (10x10 frames: 16 x 8 x 8 = 1024 conv features -> 128)."""

    def __init__(
        self,
        in_channels: int,
        image_size: tuple[int, int],
        channels: int = 16,
        hidden: int = 128,
        act: str = "relu",
    ) -> None:
        super().__init__()
        h, w = image_size
        if h < 3 or w < 3:
            raise ValueError(f"SmallConvEncoder needs frames of at least 3x3, got {h}x{w}")
        self.conv = nn.Conv2d(in_channels, channels, 3, 1)
        self.fc = nn.Linear(channels * (h - 2) * (w - 2), hidden)
        self.act = activation(act)()
        self.out_dim = hidden

    def forward(self, x: Tensor) -> Tensor:
        batch = x.shape[:-3]
        y = self.act(self.conv(x.reshape(-1, *x.shape[-3:]))).flatten(1)
        return self.act(self.fc(y)).reshape(*batch, self.out_dim)


class SmallConvDecoder(nn.Module):
    """:class:`SmallConvEncoder` mirrored: ``[..., in_dim]`` -> a linear layer to ``channels`` planes
    of ``(H - 2) x (W - 2)``, the activation, a 3x3 transposed conv (stride 1) to ``[..., C, H, W]``."""

    def __init__(
        self,
        in_dim: int,
        out_channels: int,
        image_size: tuple[int, int],
        channels: int = 16,
        act: str = "relu",
    ) -> None:
        super().__init__()
        h, w = image_size
        self.plane = (channels, h - 2, w - 2)
        self.linear = nn.Linear(in_dim, channels * (h - 2) * (w - 2))
        self.act = activation(act)()
        self.deconv = nn.ConvTranspose2d(channels, out_channels, 3, 1)
        self.out_shape = (out_channels, h, w)

    def forward(self, x: Tensor) -> Tensor:
        batch = x.shape[:-1]
        y = self.act(self.linear(x.reshape(-1, x.shape[-1]))).reshape(-1, *self.plane)
        return self.deconv(y).reshape(*batch, *self.out_shape)


def scale_gradient(x: Tensor, scale: float) -> Tensor:
    """``x`` in the forward pass; its gradient multiplied by ``scale`` in the backward pass
    (MuZero's hidden-state scaling between unroll steps)."""
    if scale == 1.0:
        return x
    return x * scale + x.detach() * (1.0 - scale)


@torch.no_grad()
def soft_update_tensors(targets: Sequence[Tensor], sources: Sequence[Tensor], tau: float) -> None:
    """The one exponential-moving-average step, on lists: ``t <- (1 - tau) t + tau s`` for each pair.

    Floating tensors go through one fused ``torch._foreach_lerp_`` (on CPU the same per-tensor
    ``lerp_``, bit for bit); other dtypes (integer counters such as BatchNorm's
    ``num_batches_tracked``) become ``(1 - tau) t + tau s`` rounded toward zero, the rule of
    ``torch.optim.swa_utils.get_ema_multi_avg_fn`` (``tau = 1``: a copy). With ``tau = 1 -
    decay`` this is that function's update (exactly so for ``decay >= 0.5``).
    """
    if len(targets) != len(sources):
        raise ValueError(f"soft_update_tensors: {len(targets)} targets but {len(sources)} sources")
    floats = [i for i, t in enumerate(targets) if t.is_floating_point() or t.is_complex()]
    if floats:
        torch._foreach_lerp_([targets[i] for i in floats], [sources[i] for i in floats], tau)
    for t, s in zip(targets, sources):
        if not (t.is_floating_point() or t.is_complex()):
            t.copy_(t * (1.0 - tau) + s * tau)


@torch.no_grad()
def soft_update(target: nn.Module, source: nn.Module, tau: float) -> None:
    """``target <- (1 - tau) target + tau source`` (:func:`soft_update_tensors`) for every parameter
    and floating buffer (``tau = 1``: a copy); integer buffers are copied."""
    soft_update_tensors(list(target.parameters()), list(source.parameters()), tau)
    pairs = list(zip(target.buffers(), source.buffers()))
    averaged = [(t, s) for t, s in pairs if t.is_floating_point() and tau != 1.0]
    soft_update_tensors([t for t, _ in averaged], [s for _, s in averaged], tau)
    for t, s in pairs:
        if not (t.is_floating_point() and tau != 1.0):
            t.copy_(s)
