"""IMPALA's actor-critic network (Espeholt et al. 2018) and its action heads, with DI-engine's
sampling names.

* :class:`ActorCriticSettings` — the network's settings group (IMPALA's ``net``).
* :class:`ActorCritic` — observation encoder (MLP for vectors; the IMPALA conv stack,
  ``deep`` or ``shallow``, for ``uint8 [H, W, C]`` frames; one encoder per key of a dict
  observation; or an injected module), an optional LSTM core reset where ``is_first``, a
  policy head and a value head. It implements the Agent protocol (``initial_state`` /
  ``act``), so a CPU copy of it is what actors act with.
* :class:`CategoricalHead` (discrete actions, extras ``logits``) and :class:`GaussianHead`
  (continuous actions, extras ``mu`` / ``sigma``) sample as DI-engine names it:
  ``multinomial_sample`` / ``reparam_sample`` while collecting, ``argmax_sample`` /
  ``deterministic_sample`` in evaluation.

Continuous actions live in ``[-1, 1]^A`` inside the network, mapped affinely onto the env's
bounds (identity for unbounded spaces). The Gaussian's sample is clipped to the bounds before
it reaches the env, so the behaviour policy is a *censored* Gaussian: an action on a bound
has the probability mass beyond it. :meth:`GaussianHead.log_prob` computes exactly that
likelihood, so the importance ratios compare the policies on the actions really taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor, nn

from lightning_wm.envs import EnvSpec, is_image_space
from lightning_wm.nn import dists
from lightning_wm.nn.blocks import MLP, SmallConvEncoder, preprocess_pixels
from lightning_wm.nn.blocks import activation as activation_class
from lightning_wm.settings import check_one_of, check_positive

Obs = Tensor | dict[str, Tensor]
CoreState = tuple[Tensor, Tensor] | None  # LSTM (h, c), each [B, H]; None without a core


@dataclass(frozen=True)
class ActorCriticSettings:
    """The actor-critic network (IMPALA's ``net`` group).

    Attributes:
        hidden: units of each hidden layer of the MLP that encodes vector observations.
        layers: hidden layers of that MLP.
        activation: of that MLP (``relu``, ``silu``, ``elu``, ``tanh``, ``gelu``).
        conv: ``deep`` (the IMPALA paper's residual stack), ``shallow`` (its two-layer stack) or
            ``small`` (the MinAtar paper's one 3x3 conv, stride 1:
            :class:`~lightning_wm.nn.blocks.SmallConvEncoder`, for small frames such as MinAtar's
            10x10) for frame observations (``uint8 [H, W, C]``).
        conv_channels: channels of the deep stack's stages; ``small`` uses the first (16).
        fc_size: features after the conv stack (one linear layer and a ReLU; MinAtar: 128).
        pixel_range: frames (``uint8``) enter the conv stack scaled to ``[-0.5, 0.5]``
            (``centered``, the pixel convention of every encoder here) or to ``[0, 1]`` (``unit``:
            an empty cell is 0, as the MinAtar paper feeds its binary channels; on mostly-empty
            frames the input's mean stays near 0 instead of near -0.5).
        lstm_size: 0 for a feed-forward network, else the size of an LSTM core between the
            encoder and the heads (reset where ``is_first``; acting stores its state in every row
            as ``core_h`` / ``core_c``).
        sigma_type: continuous actions: ``independent`` (a learned, state-independent log sigma,
            DI-engine's default) or ``conditioned`` (a linear layer of the features).
        bound_type: continuous actions: None (DI-engine's default) or ``tanh`` (the mean stays
            inside the action bounds).
        init_sigma: continuous actions: sigma at initialisation, in normalised action units.
        share_encoder: one built-in encoder under both heads (the paper's network); ``false``
            gives the value head an encoder of its own with the same settings, so the value
            loss no longer moves the policy's features (DI-engine's ``share_encoder``; a
            feed-forward network with the built-in encoder only).
    """

    hidden: int = 64
    layers: int = 2
    activation: str = "relu"
    conv: Literal["deep", "shallow", "small"] = "deep"
    conv_channels: tuple[int, ...] = (16, 32, 32)
    fc_size: int = 256
    pixel_range: Literal["centered", "unit"] = "centered"
    lstm_size: int = 0
    sigma_type: Literal["independent", "conditioned"] = "independent"
    bound_type: Literal["tanh"] | None = None
    init_sigma: float = 1.0
    share_encoder: bool = True

    def __post_init__(self) -> None:
        if self.hidden < 1 or self.layers < 0 or self.fc_size < 1 or self.lstm_size < 0:
            raise ValueError(
                f"net needs hidden >= 1, layers >= 0, fc_size >= 1 and lstm_size >= 0, got {self.hidden}, "
                f"{self.layers}, {self.fc_size} and {self.lstm_size}"
            )
        activation_class(self.activation)  # an unknown name is one clear error
        check_one_of("net.conv", self.conv, ("deep", "shallow", "small"))
        check_one_of("net.pixel_range", self.pixel_range, ("centered", "unit"))
        if not self.conv_channels or min(self.conv_channels) < 1:
            raise ValueError(f"net.conv_channels must be channel counts >= 1, got {list(self.conv_channels)}")
        check_one_of("net.sigma_type", self.sigma_type, ("independent", "conditioned"))
        if self.bound_type not in (None, "tanh"):
            raise ValueError(f"bound_type must be None or 'tanh', got {self.bound_type!r}")
        check_positive("net.init_sigma", self.init_sigma)
        if not self.share_encoder and self.lstm_size > 0:
            raise ValueError(
                "net.share_encoder: false needs a feed-forward network (lstm_size 0): the LSTM core sits "
                "between one encoder and both heads"
            )


# -- sampling (DI-engine's names) --------------------------------------------------------------
def multinomial_sample(logits: Tensor) -> Tensor:
    """Actions ``int64 [...]`` drawn from ``softmax(logits [..., N])``."""
    return dists.sample_index(torch.softmax(logits.float(), -1))


def argmax_sample(logits: Tensor) -> Tensor:
    """The most probable actions ``int64 [...]`` of ``logits [..., N]``."""
    return logits.argmax(-1)


def reparam_sample(mu: Tensor, sigma: Tensor) -> Tensor:
    """``mu + sigma * eps``, ``eps ~ N(0, 1)``: ``[..., A]``."""
    return mu + sigma * torch.randn_like(mu)


def deterministic_sample(mu: Tensor, sigma: Tensor) -> Tensor:
    """The mean ``mu [..., A]``."""
    return mu


# -- action heads ------------------------------------------------------------------------------
class CategoricalHead(nn.Module):
    """``features [..., F]`` -> ``{"logits": [..., N]}``; actions ``int64 [...]``.

    The output layer starts at 1% of its default scale, so the first policy is near uniform.
    """

    behaviour_keys = ("logits",)

    def __init__(self, in_dim: int, num_actions: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_dim, num_actions)
        with torch.no_grad():
            self.linear.weight.mul_(0.01)
            self.linear.bias.zero_()

    def forward(self, features: Tensor) -> dict[str, Tensor]:
        return {"logits": self.linear(features)}

    def sample(self, params: dict[str, Tensor], explore: bool) -> Tensor:
        """``multinomial_sample`` when exploring, else ``argmax_sample``."""
        return multinomial_sample(params["logits"]) if explore else argmax_sample(params["logits"])

    def log_prob(self, params: dict[str, Tensor], action: Tensor) -> Tensor:
        """``log pi(action)`` ``[...]`` for ``action`` ``[...]`` (any integer or float dtype)."""
        logp = torch.log_softmax(params["logits"].float(), -1)
        return logp.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)

    def entropy(self, params: dict[str, Tensor]) -> Tensor:
        return dists.categorical_entropy(params["logits"].float())


class GaussianHead(nn.Module):
    """``features [..., F]`` -> ``{"mu", "sigma"}`` ``[..., A]`` in the normalised action space
    ``[-1, 1]^A``; actions in the env's units ``float32 [..., A]``, within its bounds.

    Args:
        in_dim: feature size.
        space: the env's Box action space (bounded in every dimension or in none).
        sigma_type: ``independent`` (a learned state-independent log sigma, DI-engine's
            default) or ``conditioned`` (a linear layer of the features, log sigma clamped to
            ``[-20, 2]`` as DI-engine).
        bound_type: None (DI-engine's default) or ``tanh``: ``mu = tanh(.)`` stays inside the
            bounds.
        init_sigma: sigma at initialisation (normalised units).
    """

    behaviour_keys = ("mu", "sigma")

    def __init__(
        self,
        in_dim: int,
        space: gym.spaces.Box,
        sigma_type: str = "independent",
        bound_type: str | None = None,
        init_sigma: float = 1.0,
    ) -> None:
        super().__init__()
        if sigma_type not in ("independent", "conditioned"):
            raise ValueError(f"sigma_type must be 'independent' or 'conditioned', got {sigma_type!r}")
        if bound_type not in (None, "tanh"):
            raise ValueError(f"bound_type must be None or 'tanh', got {bound_type!r}")
        if not init_sigma > 0:
            raise ValueError(f"init_sigma must be > 0, got {init_sigma}")
        low = np.asarray(space.low, np.float32).reshape(-1)
        high = np.asarray(space.high, np.float32).reshape(-1)
        finite = np.isfinite(low) & np.isfinite(high)
        if finite.any() and not finite.all():
            raise ValueError(
                "continuous actions need bounds in every dimension or in none; "
                f"got low {low.tolist()}, high {high.tolist()}"
            )
        self.bounded = bool(finite.all())
        dim = low.shape[0]
        self.register_buffer("low", torch.from_numpy(low if self.bounded else np.full(dim, -1, np.float32)))
        self.register_buffer("high", torch.from_numpy(high if self.bounded else np.full(dim, 1, np.float32)))
        self.sigma_type, self.bound_type = sigma_type, bound_type
        self.mu = nn.Linear(in_dim, dim)
        with torch.no_grad():
            self.mu.weight.mul_(0.01)
            self.mu.bias.zero_()
        log_init = float(np.log(init_sigma))
        if sigma_type == "independent":
            self.log_sigma = nn.Parameter(torch.full((dim,), log_init))
        else:
            self.log_sigma_layer = nn.Linear(in_dim, dim)
            with torch.no_grad():
                self.log_sigma_layer.weight.mul_(0.01)
                self.log_sigma_layer.bias.fill_(log_init)

    def forward(self, features: Tensor) -> dict[str, Tensor]:
        mu = self.mu(features)
        if self.bound_type == "tanh":
            mu = torch.tanh(mu)
        if self.sigma_type == "independent":
            sigma = self.log_sigma.exp().expand_as(mu)
        else:
            sigma = self.log_sigma_layer(features).clamp(-20.0, 2.0).exp()
        return {"mu": mu, "sigma": sigma}

    def to_env(self, u: Tensor) -> Tensor:
        """Normalised ``u [..., A]`` -> env actions: ``clip(u, -1, 1)`` mapped onto ``[low, high]``
        (unbounded spaces: ``u`` itself)."""
        if not self.bounded:
            return u
        return self.low + (u.clamp(-1.0, 1.0) + 1.0) * 0.5 * (self.high - self.low)

    def from_env(self, action: Tensor) -> Tensor:
        """Env actions ``[..., A]`` -> normalised ``[-1, 1]`` (inverse of :meth:`to_env` on the bounds)."""
        if not self.bounded:
            return action.float()
        return ((action.float() - self.low) / (self.high - self.low) * 2.0 - 1.0).clamp(-1.0, 1.0)

    def sample(self, params: dict[str, Tensor], explore: bool) -> Tensor:
        """``reparam_sample`` when exploring, else ``deterministic_sample``; in env units."""
        sampler = reparam_sample if explore else deterministic_sample
        return self.to_env(sampler(params["mu"], params["sigma"]))

    def log_prob(self, params: dict[str, Tensor], action: Tensor, edge: float = 1e-6) -> Tensor:
        """Log-likelihood ``[...]`` of env ``action [..., A]`` under the censored Gaussian: the
        density inside the bounds, ``log P(u <= -1)`` / ``log P(u >= 1)`` on them (within
        ``edge``), summed over dimensions."""
        mu, sigma = params["mu"].float(), params["sigma"].float()
        u = self.from_env(action)
        inside = dists.normal_log_prob(u.unsqueeze(-1), mu.unsqueeze(-1), sigma.unsqueeze(-1))  # per dimension
        if not self.bounded:
            return inside.sum(-1)
        below = torch.special.log_ndtr((-1.0 - mu) / sigma)
        above = torch.special.log_ndtr((mu - 1.0) / sigma)
        logp = torch.where(u <= -1.0 + edge, below, torch.where(u >= 1.0 - edge, above, inside))
        return logp.sum(-1)

    def entropy(self, params: dict[str, Tensor]) -> Tensor:
        """Entropy of the (uncensored) Gaussian ``[...]``."""
        return dists.normal_entropy(params["sigma"].float())


# -- encoders ------------------------------------------------------------------------------
class ResidualBlock(nn.Module):
    """``x + conv(relu(conv(relu(x))))`` with 3x3 convs keeping the channels."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


def impala_deep_stack(in_channels: int, channels: tuple[int, ...] = (16, 32, 32)) -> nn.Sequential:
    """The IMPALA paper's deep stack: per stage a 3x3 conv, 3x3 max-pool (stride 2) and two
    residual blocks; a final ReLU. ``[N, C, H, W]`` -> ``[N, channels[-1], H/8, W/8]`` (rounded up)."""
    layers: list[nn.Module] = []
    for out in channels:
        layers += [
            nn.Conv2d(in_channels, out, 3, padding=1),
            nn.MaxPool2d(3, 2, padding=1),
            ResidualBlock(out),
            ResidualBlock(out),
        ]
        in_channels = out
    layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def impala_shallow_stack(in_channels: int) -> nn.Sequential:
    """The IMPALA paper's shallow stack: 16 8x8 filters stride 4, 32 4x4 filters stride 2, ReLUs."""
    return nn.Sequential(nn.Conv2d(in_channels, 16, 8, 4), nn.ReLU(), nn.Conv2d(16, 32, 4, 2), nn.ReLU())


class FrameEncoder(nn.Module):
    """``uint8 [N, H, W, C]`` frames -> ``[N, fc_size]``: the frames scaled (``pixel_range``:
    ``centered`` to ``[-0.5, 0.5]``, ``unit`` to ``[0, 1]``), a conv stack, flatten, linear, ReLU
    (``small``: :class:`~lightning_wm.nn.blocks.SmallConvEncoder`, which is all of that)."""

    def __init__(
        self,
        shape: tuple[int, int, int],
        conv: str = "deep",
        channels: tuple[int, ...] = (16, 32, 32),
        fc_size: int = 256,
        pixel_range: str = "centered",
    ) -> None:
        super().__init__()
        h, w, c = shape
        self.centered = pixel_range == "centered"
        self.fc: nn.Linear | None = None
        self.out_dim = fc_size
        if conv == "small":
            self.stack: nn.Module = SmallConvEncoder(c, (h, w), channels[0], fc_size)
            return
        if conv == "deep":
            self.stack = impala_deep_stack(c, tuple(channels))
        elif conv == "shallow":
            self.stack = impala_shallow_stack(c)
        else:
            raise ValueError(f"conv must be 'deep', 'shallow' or 'small', got {conv!r}")
        with torch.no_grad():
            flat = self.stack(torch.zeros(1, c, h, w)).numel()
        self.fc = nn.Linear(flat, fc_size)

    def forward(self, frames: Tensor) -> Tensor:
        x = self.stack(preprocess_pixels(frames, self.centered))
        return x if self.fc is None else torch.relu(self.fc(x.flatten(1)))


class ObservationEncoder(nn.Module):
    """One encoder per observation part (a plain Box is the part ``"obs"``): frames (``uint8
    [H, W, C]``) through :class:`FrameEncoder`, float arrays flattened through an MLP; the
    embeddings concatenated. ``obs [N, ...]`` (or a dict of them) -> ``[N, out_dim]``."""

    def __init__(
        self,
        spec: EnvSpec,
        hidden: int,
        layers: int,
        act: str,
        conv: str,
        conv_channels: tuple[int, ...],
        fc_size: int,
        pixel_range: str = "centered",
    ) -> None:
        super().__init__()
        self.is_dict = spec.is_dict
        self.parts = nn.ModuleDict()
        self.out_dim = 0
        for key, space in spec.obs_spaces.items():
            if is_image_space(space):
                encoder = FrameEncoder(tuple(space.shape), conv, conv_channels, fc_size, pixel_range)
                self.parts[key], self.out_dim = encoder, self.out_dim + encoder.out_dim
            else:
                mlp = MLP(int(np.prod(space.shape)), None, hidden, layers, act, norm=False)
                self.parts[key], self.out_dim = nn.Sequential(nn.Flatten(), mlp), self.out_dim + mlp.out_dim

    def forward(self, obs: Obs) -> Tensor:
        if not self.is_dict:
            obs = {"obs": obs}
        out = []
        for key, part in self.parts.items():
            x = obs[key]
            out.append(part(x if x.dtype == torch.uint8 else x.float()))
        return out[0] if len(out) == 1 else torch.cat(out, -1)


def encoder_out_dim(encoder: nn.Module, spec: EnvSpec) -> int:
    """Feature size of an injected encoder: its ``out_dim`` attribute, else the size of its
    (flattened) output for one zero observation of ``spec``."""
    out_dim = getattr(encoder, "out_dim", None)
    if isinstance(out_dim, int) and out_dim > 0:
        return out_dim
    zeros = {k: torch.as_tensor(np.zeros((1, *space.shape), space.dtype)) for k, space in spec.obs_spaces.items()}
    obs = zeros if spec.is_dict else zeros["obs"]
    param = next(encoder.parameters(), None)
    if param is not None:
        obs = {k: v.to(param.device) for k, v in obs.items()} if isinstance(obs, dict) else obs.to(param.device)
    with torch.no_grad():
        try:
            out = encoder(obs)
        except Exception as err:  # noqa: BLE001 - one message naming the encoder
            raise ValueError(
                f"the IMPALA encoder {type(encoder).__name__} failed on a zero observation "
                f"{ {k: tuple(v.shape) for k, v in zeros.items()} }: {err}"
            ) from err
    if not isinstance(out, Tensor) or out.dim() < 2 or out.shape[0] != 1:
        raise ValueError(
            f"the IMPALA encoder {type(encoder).__name__} must map observations [N, ...] to features "
            f"[N, ...]; it returned {type(out).__name__} {getattr(out, 'shape', '')}"
        )
    return int(out[0].numel())


# -- the network ------------------------------------------------------------------------------
class ActorCritic(nn.Module):
    """IMPALA's actor-critic: encoder -> (LSTM core) -> policy head and value head (the value
    head on an encoder of its own with ``share_encoder: false``).

    Args:
        spec: the env's spaces (Discrete or Box actions).
        net: the network's settings (:class:`ActorCriticSettings`; its defaults if None).
        encoder: a module to use as the observation encoder instead of the built-in one: it maps
            a batch of observations as rows hold them (``[N, ...]``, ``uint8`` frames or float
            vectors, or a dict of them) to features ``[N, ...]`` (flattened to ``[N, F]``). Its
            ``out_dim`` attribute gives ``F``; without one ``F`` is measured on a zero observation.
    """

    def __init__(self, spec: EnvSpec, net: ActorCriticSettings | None = None, encoder: nn.Module | None = None) -> None:
        super().__init__()
        if not isinstance(spec.action_space, (gym.spaces.Discrete, gym.spaces.Box)):
            raise ValueError(
                f"IMPALA supports Discrete and Box action spaces; {spec.env_id or 'this env'} has {spec.action_space}"
            )
        s = net if net is not None else ActorCriticSettings()
        self.spec = spec

        def built_in() -> ObservationEncoder:
            return ObservationEncoder(
                spec, s.hidden, s.layers, s.activation, s.conv, tuple(s.conv_channels), s.fc_size, s.pixel_range
            )

        if encoder is None:
            self.encoder: nn.Module = built_in()
            feat = self.encoder.out_dim
        else:
            if not s.share_encoder:
                raise ValueError(
                    "net.share_encoder: false builds a second built-in encoder for the value head; "
                    f"with an injected encoder ({type(encoder).__name__}) leave it true"
                )
            self.encoder = encoder
            feat = encoder_out_dim(encoder, spec)
        # the value head's own encoder (share_encoder: false), else the policy's features
        self.value_encoder: ObservationEncoder | None = None if s.share_encoder else built_in()
        self.lstm_size = int(s.lstm_size)
        self.core = nn.LSTMCell(feat, self.lstm_size) if self.lstm_size > 0 else None
        if self.core is not None:
            feat = self.lstm_size
        if spec.discrete:
            self.head: CategoricalHead | GaussianHead = CategoricalHead(feat, spec.action_dim)
        else:
            self.head = GaussianHead(feat, spec.action_space, s.sigma_type, s.bound_type, s.init_sigma)
        self.value = nn.Linear(feat, 1)

    # -- core -------------------------------------------------------------------------------
    def initial_state(self, batch_size: int) -> CoreState:
        """``None`` (feed-forward) or zero LSTM state ``(h, c)``, each ``[B, lstm_size]``."""
        if self.core is None:
            return None
        device = self.value.weight.device
        zeros = torch.zeros(batch_size, self.lstm_size, device=device)
        return zeros, zeros.clone()

    def unroll(
        self, obs: Obs, is_first: Tensor, state: CoreState = None
    ) -> tuple[dict[str, Tensor], Tensor, CoreState]:
        """Run the net over time-major ``obs [T, B, ...]`` from ``state`` (zeros if None);
        the core restarts from zeros where ``is_first [T, B]``.

        Returns the policy parameters ``{name: [T, B, ...]}``, ``value [T, B]`` and the state
        after the last step.
        """
        flat_obs, features, state = self._policy_features(obs, is_first, state)
        T, B = is_first.shape
        params = {k: v.view(T, B, *v.shape[1:]) for k, v in self.head(features).items()}
        value_features = features if self.value_encoder is None else self.value_encoder(flat_obs).flatten(1)
        return params, self.value(value_features).view(T, B), state

    def _policy_features(self, obs: Obs, is_first: Tensor, state: CoreState) -> tuple[Obs, Tensor, CoreState]:
        """``obs [T, B, ...]`` -> ``(obs [T * B, ...], features [T * B, F], state)``: the encoder
        and the core (restarted where ``is_first [T, B]``) under the policy head."""
        T, B = is_first.shape
        flat_obs = obs.flatten(0, 1) if isinstance(obs, Tensor) else {k: v.flatten(0, 1) for k, v in obs.items()}
        flat = self.encoder(flat_obs).flatten(1)
        if self.core is not None:
            h, c = state if state is not None else self.initial_state(B)
            keep = (~is_first.bool()).to(flat.dtype).unsqueeze(-1)  # [T, B, 1]
            feats = flat.view(T, B, -1)
            outs = []
            for t in range(T):
                h, c = self.core(feats[t], (h * keep[t], c * keep[t]))
                outs.append(h)
            flat = torch.stack(outs).flatten(0, 1)
            state = (h, c)
        return flat_obs, flat, state

    # -- Agent protocol ------------------------------------------------------------------
    @torch.no_grad()
    def act(self, obs: Obs, state: CoreState, explore: bool) -> tuple[Tensor, CoreState, dict[str, Tensor]]:
        """``obs [B, ...]`` -> ``(action, state, extras)``: extras are the behaviour policy
        (``logits`` or ``mu`` / ``sigma``) and, with a core, the state it acted from
        (``core_h`` / ``core_c`` ``[B, lstm_size]``), so that learners start unrolls there."""
        single = obs.unsqueeze(0) if isinstance(obs, Tensor) else {k: v.unsqueeze(0) for k, v in obs.items()}
        first = obs if isinstance(obs, Tensor) else next(iter(obs.values()))
        batch = first.shape[0]
        if self.core is not None and state is None:
            state = self.initial_state(batch)
        is_first = torch.zeros(1, batch, dtype=torch.bool, device=first.device)  # the Collector resets states
        _, features, new_state = self._policy_features(single, is_first, state)  # no value: acting needs none
        params = {k: v.float().contiguous() for k, v in self.head(features).items()}
        extras = dict(params)
        if state is not None:
            extras["core_h"], extras["core_c"] = state[0].float(), state[1].float()
        return self.head.sample(params, explore), new_state, extras
