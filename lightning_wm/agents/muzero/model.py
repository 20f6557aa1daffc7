"""MuZero's networks: representation ``h(o) -> s``, dynamics ``g(s, a) -> (r, s')`` and prediction
``f(s) -> (pi, v)``, as one :class:`MuZeroModel` that is also a
:class:`~lightning_wm.world_model.WorldModel` and gives :func:`lightning_wm.search.muzero_policy` its
``recurrent_fn``.

* Vector observations ``float [B, D]``: MLPs. Frames ``uint8 [B, H, W, C]`` (or a stack
  ``[B, K, H, W, C]``, oldest first): a residual conv net that downsamples by 16 as in MuZero's
  Atari network (two stride-2 convs, two stride-2 average pools; 96 -> 6, 84 -> 6, 64 -> 4);
  with ``net.conv: small`` (small frames such as MinAtar's 10x10) the MinAtar network's conv
  torso and a linear layer to a vector hidden state, then the MLPs of vector observations.
* The hidden state is min-max scaled to ``[0, 1]`` per sample after the representation and
  after every dynamics step (MuZero, Appendix G).
* Value and reward are categorical over ``2 S + 1`` integer bins in :func:`h_transform` space
  (:func:`lightning_wm.nn.dists.h_support`), decoded with :func:`h_twohot_mean`.
* An optional game-over head predicts that the episode terminated on arriving at ``s'`` (ALF's
  ``train_game_over_function``); without it ``step`` reports ``done = 0``.
* An optional projection and prediction head (``net.projection``: EfficientZero's SimSiam heads, as
  LightZero's ``self_supervised_learning_loss``) for the latent consistency loss; they take no
  part in acting or search.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import torch
from torch import Tensor, nn

from lightning_wm.agents.muzero.settings import MuZeroNet
from lightning_wm.envs import is_image_space
from lightning_wm.nn import dists
from lightning_wm.nn.blocks import MLP, BatchNormLast, ChannelNorm, SmallConvEncoder, activation, preprocess_pixels
from lightning_wm.settings import as_settings
from lightning_wm.world_model import WorldModel


def scale_hidden(state: Tensor, eps: float = 1e-5) -> Tensor:
    """Min-max scale each sample of ``state [B, ...]`` to ``[0, 1]`` over all its features (a
    constant sample becomes 0)."""
    flat = state.flatten(1)
    # amin/amax, not aminmax: torch before 2.13 has no derivative for aminmax
    lo, hi = flat.amin(dim=1, keepdim=True), flat.amax(dim=1, keepdim=True)
    return ((flat - lo) / (hi - lo).clamp(min=eps)).view_as(state)


def _norm2d(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "layer":
        return ChannelNorm(channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm {kind!r}; choose 'layer', 'batch' or 'none'")


def _mlp(
    in_dim: int,
    out_dim: int | None,
    hidden: int,
    layers: int,
    act: str,
    norm: str,
    zero_init_output: bool = False,
    bias: bool | None = None,
) -> MLP:
    return MLP(in_dim, out_dim, hidden, layers, act, norm, zero_init_output, bias)


class ResidualBlock(nn.Module):
    """``x + norm(conv(act(norm(conv(x)))))``, then the activation; shape-preserving ``[N, C, H, W]``."""

    def __init__(self, channels: int, norm: str = "layer", act: str = "relu") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=norm == "none")
        self.norm1 = _norm2d(norm, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=norm == "none")
        self.norm2 = _norm2d(norm, channels)
        self.act = activation(act)()

    def forward(self, x: Tensor) -> Tensor:
        y = self.act(self.norm1(self.conv1(x)))
        return self.act(x + self.norm2(self.conv2(y)))


class ConvRepresentation(nn.Module):
    """Frames ``float [N, C_in, H, W]`` -> hidden planes ``[N, channels, H/16, W/16]``: stride-2
    conv (``channels/2``), ``blocks`` residual blocks, stride-2 conv (``channels``), ``blocks``
    residual blocks, average pool /2, ``blocks`` residual blocks, average pool /2 (sizes rounded
    up), ``blocks`` residual blocks."""

    def __init__(self, in_channels: int, channels: int, blocks: int, norm: str, act: str) -> None:
        super().__init__()
        half = channels // 2

        def stage(c: int) -> list[nn.Module]:
            return [ResidualBlock(c, norm, act) for _ in range(blocks)]

        self.net = nn.Sequential(
            nn.Conv2d(in_channels, half, 3, stride=2, padding=1),
            activation(act)(),
            *stage(half),
            nn.Conv2d(half, channels, 3, stride=2, padding=1),
            activation(act)(),
            *stage(channels),
            nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False),
            *stage(channels),
            nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False),
            *stage(channels),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class _ConvHead(nn.Module):
    """Hidden planes ``[N, C, h, w]`` -> ``[N, out]``: 1x1 conv to ``reduced`` channels, flatten, MLP."""

    def __init__(
        self,
        channels: int,
        plane: tuple[int, int],
        reduced: int,
        hidden: int,
        out: int,
        act: str,
        zero_init_output: bool,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, reduced, 1)
        self.act = activation(act)()
        self.mlp = MLP(reduced * plane[0] * plane[1], out, hidden, 1, act, False, zero_init_output)

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.act(self.conv(x)).flatten(1))


class MuZeroModel(nn.Module, WorldModel):
    """MuZero's three networks for a discrete action space.

    Args:
        observation_space: ``Box`` of float vectors ``[D]`` or uint8 frames ``[H, W, C]`` (with
            ``net.frame_stack > 1`` the model reads ``[K, H, W, C]`` stacks, oldest first).
        num_actions: size of the discrete action space.
        net: the networks' sizes and options (:class:`~lightning_wm.agents.muzero.settings.MuZeroNet`,
            or a mapping of its fields; ``None``: the defaults).
        game_over_head: also predict termination on arriving at ``s'`` (ALF's
            ``train_game_over_function``).

    The latent consistency heads (``net.projection``, LightZero's ``proj_hid``, ``proj_out``,
    ``pred_hid``): a projector (two hidden layers and an output, each batch-normalised) and a
    predictor (one hidden layer) on the flattened hidden state (:meth:`project`,
    :meth:`predict_projection`); without them the loss compares the hidden states themselves.
    """

    def __init__(
        self,
        observation_space: gym.spaces.Box,
        num_actions: int,
        net: MuZeroNet | Mapping[str, Any] | None = None,
        *,
        game_over_head: bool = False,
    ) -> None:
        super().__init__()
        net = as_settings(MuZeroNet, net, "net")
        if not isinstance(observation_space, gym.spaces.Box):
            raise ValueError(f"MuZeroModel needs a Box observation space, got {type(observation_space).__name__}")
        if num_actions < 2:
            raise ValueError(f"MuZeroModel needs at least 2 discrete actions, got {num_actions}")
        self.net = net
        self.num_actions = num_actions
        self.frame_stack = frame_stack = net.frame_stack
        self.value_eps = net.value_eps
        self.state_norm = net.state_norm
        latent_dim, hidden, layers, head_hidden = net.latent_dim, net.hidden, net.layers, net.head_hidden
        channels, blocks, norm, act = net.channels, net.blocks, net.norm, net.activation
        support_size = net.support_size
        self.register_buffer("value_bins", dists.h_support(support_size), persistent=False)
        self.register_buffer("reward_bins", dists.h_support(net.reward_support_size or support_size), persistent=False)
        self.register_buffer("action_eye", torch.eye(num_actions), persistent=False)  # one-hot rows
        value_out, reward_out = self.value_bins.numel(), self.reward_bins.numel()
        self.is_image = is_image_space(observation_space)
        self.planes = self.is_image and net.conv == "resnet"  # hidden planes; else a vector hidden state
        if self.planes:
            h, w, c = observation_space.shape
            self.obs_shape = (frame_stack, h, w, c) if frame_stack > 1 else (h, w, c)
            self.repr_net = ConvRepresentation(c * frame_stack, channels, blocks, norm, act)
            with torch.no_grad():
                plane = tuple(self.repr_net(torch.zeros(1, c * frame_stack, h, w)).shape[-2:])
            self.state_shape: tuple[int, ...] = (channels, *plane)
            self.dyn_in = nn.Sequential(
                nn.Conv2d(channels + num_actions, channels, 3, padding=1, bias=norm == "none"), _norm2d(norm, channels)
            )
            self.dyn_act = activation(act)()
            self.dyn_blocks = nn.Sequential(*[ResidualBlock(channels, norm, act) for _ in range(blocks)])
            self.pred_blocks = nn.Sequential(*[ResidualBlock(channels, norm, act) for _ in range(blocks)])
            reduced = max(1, channels // 4)
            self.reward_head = _ConvHead(channels, plane, reduced, head_hidden, reward_out, act, True)
            self.value_head = _ConvHead(channels, plane, reduced, head_hidden, value_out, act, True)
            self.policy_head = _ConvHead(channels, plane, reduced, head_hidden, num_actions, act, True)
            self.done_head = _ConvHead(channels, plane, reduced, head_hidden, 1, act, False) if game_over_head else None
        elif self.is_image or len(observation_space.shape) == 1:
            if self.is_image:
                h, w, c = observation_space.shape
                self.obs_shape = (frame_stack, h, w, c) if frame_stack > 1 else (h, w, c)
                self.repr_net = nn.Sequential(
                    SmallConvEncoder(c * frame_stack, (h, w), channels, hidden, act), nn.Linear(hidden, latent_dim)
                )
            else:
                if frame_stack != 1:
                    raise ValueError("frame_stack applies to image observations only")
                self.obs_shape = tuple(observation_space.shape)
                # biases: under LayerNorm a bias-free first layer cannot tell an observation from a multiple of it
                self.repr_net = _mlp(observation_space.shape[0], latent_dim, hidden, layers, act, norm, bias=True)
            self.state_shape = (latent_dim,)
            self.dyn_net = _mlp(latent_dim + num_actions, latent_dim, hidden, layers, act, norm)
            self.reward_head = _mlp(latent_dim, reward_out, head_hidden, 1, act, norm, True)
            self.pred_net = _mlp(latent_dim, None, hidden, layers, act, norm)
            self.value_head = _mlp(hidden, value_out, head_hidden, 1, act, norm, True)
            self.policy_head = _mlp(hidden, num_actions, head_hidden, 1, act, norm, True)
            self.done_head = _mlp(latent_dim, 1, head_hidden, 1, act, norm) if game_over_head else None
        else:
            raise ValueError(
                f"MuZeroModel takes float vectors [D] or uint8 frames [H, W, C]; got shape {observation_space.shape}"
            )
        self._build_projection(net)

    def _build_projection(self, net: MuZeroNet) -> None:
        """The consistency loss's projector and predictor (``net.projection``), or None."""
        self.projector: nn.Module | None = None
        self.predictor: nn.Module | None = None
        if net.projection is not None:
            proj_hid, proj_out, pred_hid = net.projection
            self.projector = nn.Sequential(
                MLP(self.feature_dim, None, proj_hid, 2, net.activation, "batch"),
                nn.Linear(proj_hid, proj_out, bias=False),
                BatchNormLast(proj_out),
            )
            self.predictor = MLP(proj_out, proj_out, pred_hid, 1, net.activation, "batch")

    # -- the three functions ---------------------------------------------------------------------
    def representation(self, obs: Tensor) -> Tensor:
        """``h``: observations ``[B, *obs_shape]`` -> hidden state ``[B, *state_shape]`` (in ``[0, 1]``
        with ``state_norm``)."""
        if tuple(obs.shape[1:]) != self.obs_shape:
            raise ValueError(
                f"MuZeroModel expects observations [B, {', '.join(map(str, self.obs_shape))}], got {list(obs.shape)}"
            )
        if self.is_image:
            x = preprocess_pixels(obs, centered=False)  # [B, (K,) C, H, W] in [0, 1]
            if self.frame_stack > 1:  # [B, K, C, H, W] -> [B, K*C, H, W]
                x = x.flatten(1, 2)
            return self._scale(self.repr_net(x))
        return self._scale(self.repr_net(obs.float()))

    def _scale(self, state: Tensor) -> Tensor:
        return scale_hidden(state) if self.state_norm else state

    def dynamics(self, state: Tensor, action: Tensor) -> tuple[Tensor, Tensor]:
        """``g``: ``state [B, *state_shape]``, ``action`` int64 ``[B]`` or one-hot float ``[B, A]``
        -> ``(reward logits [B, K_r], next state [B, *state_shape])``."""
        onehot = self.action_onehot(action, state.dtype)
        if self.planes:
            planes = onehot[:, :, None, None].expand(-1, -1, *state.shape[-2:])
            y = self.dyn_act(self.dyn_in(torch.cat([state, planes], 1)) + state)
            nxt = self._scale(self.dyn_blocks(y))
        else:
            nxt = self._scale(self.dyn_net(torch.cat([state, onehot], -1)))
        return self.reward_head(nxt), nxt

    def prediction(self, state: Tensor) -> tuple[Tensor, Tensor]:
        """``f``: ``state`` -> ``(policy logits [B, A], value logits [B, K_v])``."""
        x = self.pred_blocks(state) if self.planes else self.pred_net(state)
        return self.policy_head(x), self.value_head(x)

    def game_over_logit(self, state: Tensor) -> Tensor:
        """Logit ``[B]`` that the episode terminated on arriving at ``state`` (game-over head)."""
        if self.done_head is None:
            raise ValueError("this MuZeroModel has no game-over head (game_over_head=False)")
        return self.done_head(state).squeeze(-1)

    # -- helpers ---------------------------------------------------------------------------------
    def action_onehot(self, action: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """int64 ``[B]`` -> one-hot ``[B, A]``; float ``[B, A]`` passes through."""
        if action.dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
            return self.action_eye.index_select(0, action.long()).to(dtype)
        if action.shape[-1] != self.num_actions:
            raise ValueError(f"one-hot actions must be [B, {self.num_actions}], got {list(action.shape)}")
        return action.to(dtype)

    def value(self, value_logits: Tensor) -> Tensor:
        """Scalar values ``[...]`` from value logits ``[..., K_v]``."""
        return dists.h_twohot_mean(value_logits, self.value_bins, self.value_eps)

    def reward(self, reward_logits: Tensor) -> Tensor:
        """Scalar rewards ``[...]`` from reward logits ``[..., K_r]``."""
        return dists.h_twohot_mean(reward_logits, self.reward_bins, self.value_eps)

    def initial_inference(self, obs: Tensor) -> dict[str, Tensor]:
        """``obs [B, ...]`` -> ``{"state", "policy_logits", "value_logits", "value"}``."""
        state = self.representation(obs)
        policy_logits, value_logits = self.prediction(state)
        return {
            "state": state,
            "policy_logits": policy_logits,
            "value_logits": value_logits,
            "value": self.value(value_logits),
        }

    def decode(self, reward_logits: Tensor, value_logits: Tensor) -> tuple[Tensor, Tensor]:
        """``(reward [...], value [...])`` from their logits, decoded together when both use the
        same support (one softmax and one inverse transform: the search calls this every
        simulation)."""
        if self.reward_bins.numel() != self.value_bins.numel():
            return self.reward(reward_logits), self.value(value_logits)
        both = dists.h_twohot_mean(torch.stack([reward_logits, value_logits]), self.value_bins, self.value_eps)
        return both[0], both[1]

    def recurrent_inference(self, state: Tensor, action: Tensor) -> dict[str, Tensor]:
        """One step in the model: ``{"state", "reward_logits", "reward", "policy_logits",
        "value_logits", "value"}`` (the state is the next one)."""
        reward_logits, nxt = self.dynamics(state, action)
        policy_logits, value_logits = self.prediction(nxt)
        reward, value = self.decode(reward_logits, value_logits)
        return {
            "state": nxt,
            "reward_logits": reward_logits,
            "reward": reward,
            "policy_logits": policy_logits,
            "value_logits": value_logits,
            "value": value,
        }

    def recurrent_fn(self, state: Tensor, action: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The search's view of the model: ``(state [B, ...], action [B] int64) -> (next_state,
        reward [B], policy logits [B, A], value [B])`` (see :data:`lightning_wm.search.RecurrentFn`)."""
        reward_logits, nxt = self.dynamics(state, action)
        policy_logits, value_logits = self.prediction(nxt)
        reward, value = self.decode(reward_logits, value_logits)
        return nxt, reward, policy_logits, value

    # -- WorldModel ------------------------------------------------------------------------------
    def initial_state(self, obs: Tensor) -> Tensor:
        return self.representation(obs)

    def step(self, state: Tensor, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``action [B, A]`` one-hot (or int64 ``[B]``) -> ``(reward [B], next_state, done [B])``;
        ``done`` is the game-over head's probability, 0 without one."""
        reward_logits, nxt = self.dynamics(state, action)
        if self.done_head is None:
            done = torch.zeros(state.shape[0], dtype=nxt.dtype, device=nxt.device)
        else:
            done = torch.sigmoid(self.game_over_logit(nxt))
        return self.reward(reward_logits), nxt, done

    # -- the latent consistency heads -----------------------------------------------------------
    def project(self, state: Tensor) -> Tensor:
        """``[N, *state_shape] -> [N, proj_out]`` through the projector (the target branch; the
        hidden state itself, flattened, without ``projection``)."""
        flat = state.flatten(1)
        return flat if self.projector is None else self.projector(flat)

    def predict_projection(self, state: Tensor) -> Tensor:
        """``[N, *state_shape] -> [N, proj_out]`` through projector and predictor (the online branch
        that the unrolled state takes; the hidden state itself, flattened, without ``projection``)."""
        projected = self.project(state)
        return projected if self.predictor is None else self.predictor(projected)

    def features(self, state: Tensor) -> Tensor:
        """``[B, F]``: the hidden state flattened."""
        return state.flatten(1)

    @property
    def feature_dim(self) -> int:
        n = 1
        for d in self.state_shape:
            n *= d
        return n

    def extra_repr(self) -> str:
        return f"obs_shape={self.obs_shape}, state_shape={self.state_shape}, num_actions={self.num_actions}"
