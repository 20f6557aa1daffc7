"""Dreamer's world model: encoder/decoder, RSSM (DreamerV1 Gaussian or DreamerV2/V3 categorical
latents), reward and continue heads.

Shapes: ``B`` batch, ``L`` sequence length, ``D`` deterministic size, ``S`` stochastic size
(``stoch*classes`` for categorical latents), ``F = D + S`` features, ``A`` action size, ``K`` bins.

The hot path avoids ``torch.distributions``: the observe loop precomputes every input that
does not depend on the recurrent state (encoder, action and embedding projections, sampling
noise) for the whole ``[B, L]`` sequence, and the prior, decoder and heads run once on all
``[B, L]`` features after the loop. Categorical latents are sampled by inverting the CDF (one
uniform per group). In imagination, where no gradient flows into the latent, the first layer of
every network that reads ``[h, z]`` multiplies the one-hot ``z`` by summing the weight columns
of its ``stoch`` ones (``onehot_linear``) instead of a dense ``S``-wide matmul.

Numerics are bf16-autocast safe: distributions, two-hot decoding and losses are computed in float32.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_wm.actions import ActionCodec
from lightning_wm.agents.dreamer.losses import head_nll
from lightning_wm.agents.dreamer.settings import DreamerNet
from lightning_wm.envs import EnvSpec
from lightning_wm.graph_capture import static_control_flow
from lightning_wm.nn import dists
from lightning_wm.nn.blocks import MLP, activation
from lightning_wm.nn.codec import Obs, ObservationCodec
from lightning_wm.settings import as_settings
from lightning_wm.tree import first_leaf, tree_map
from lightning_wm.world_model import WorldModel

State = dict[str, Tensor]


class GRUCell(nn.Module):
    """DreamerV3's GRU: one linear layer on ``[x, h]``, LayerNorm over the three gate
    pre-activations, reset gate applied to the candidate, update gate biased by -1.

    ``x [B, I], h [B, D] -> h' [B, D]``.
    """

    def __init__(self, in_dim: int, size: int, norm: bool = True, update_bias: float = -1.0) -> None:
        super().__init__()
        self.linear = nn.Linear(in_dim + size, 3 * size, bias=not norm)
        self.norm = nn.LayerNorm(3 * size, eps=1e-3) if norm else nn.Identity()
        self.update_bias = update_bias

    def forward(self, x: Tensor, h: Tensor) -> Tensor:
        parts = self.norm(self.linear(torch.cat([x.to(h.dtype), h], -1))).to(h.dtype)
        reset, cand, update = parts.chunk(3, -1)
        cand = torch.tanh(torch.sigmoid(reset) * cand)
        update = torch.sigmoid(update + self.update_bias)
        return torch.lerp(h, cand, update)


#: bytes of ``grad`` rows one chunk of ``_OneHotLinear``'s CPU backward scatters: small enough to
#: stay in cache for its ``G`` scatters
_SCATTER_CHUNK_BYTES = 2 << 20


class _OneHotLinear(torch.autograd.Function):
    """``z @ weight.T`` for ``z [N, G*C]`` holding at most one 1 per group of ``C`` (one-hot
    latent samples), given the flat indices ``index [N, G]`` of those ones: a sum of ``G``
    weight columns (``embedding_bag``) instead of an ``[N, G*C] x [G*C, out]`` matmul.
    Gradient only for ``weight``: eager on the CPU, ``G`` scatters of ``grad [N, out]`` into the
    columns the ones picked (``index_add_``, in row chunks that stay in cache: a third of the dense
    product's time over a Dreamer XS step, ``bench/dreamer_log.md``); compiled or on a GPU the
    dense ``grad.T @ z`` (one kernel, and deterministic where CUDA's ``index_add_`` is not)."""

    @staticmethod
    def forward(ctx: Any, index: Tensor, z: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(index, z)
        return F.embedding_bag(index, weight.t().contiguous(), mode="sum")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, Tensor | None]:
        if not ctx.needs_input_grad[2]:
            return None, None, None
        index, z = ctx.saved_tensors
        if grad.device.type != "cpu" or torch.compiler.is_compiling():
            return None, None, grad.t().mm(z)
        grad_t = grad.new_zeros(z.shape[-1], grad.shape[-1])  # [G*C, out]
        rows = max(256, _SCATTER_CHUNK_BYTES // (grad.shape[-1] * grad.element_size()))
        for start in range(0, grad.shape[0], rows):
            chunk, chunk_index = grad[start : start + rows], index[start : start + rows]
            for group in range(index.shape[-1]):
                grad_t.index_add_(0, chunk_index[:, group], chunk)
        return None, None, grad_t.t()


def onehot_linear(index: Tensor, z: Tensor, weight: Tensor) -> Tensor:
    """``z [..., G*C] @ weight[out, G*C].T`` for one-hot groups with flat indices ``index [..., G]``
    (no gradient into ``z``) -> ``[..., out]``."""
    lead = index.shape[:-1]
    out = _OneHotLinear.apply(index.reshape(-1, index.shape[-1]), z.reshape(-1, z.shape[-1]), weight)
    return out.reshape(*lead, weight.shape[0])


class DreamerWorldModel(nn.Module, WorldModel):
    """Encoder, RSSM, decoder, reward and continue heads.

    RSSM: ``h_t = GRU(img_in([z_{t-1}, a_{t-1}]), h_{t-1})``; prior ``p(z_t | h_t)``;
    posterior ``q(z_t | h_t, e_t)`` with ``e_t`` the embedded observation. Where ``is_first``
    (and at the start of every sequence) ``h``, ``z`` and the previous action are replaced by
    the initial state (zeros). A model state is ``{"h": [B, D], "z": [B, S]}``.

    Implements :class:`~lightning_wm.world_model.WorldModel`: ``initial_state(obs)`` filters
    one first observation, ``observe_step`` every later one, ``step`` imagines with the prior
    and returns the predicted reward and termination probability, ``features`` is ``[h, z]``,
    ``decode`` predicts the observation of a state, ``posterior_states`` filters a recorded
    episode (dream starts). Actions in and out of these are the model's format
    (``actions``: one-hot, or continuous actions mapped onto ``[-1, 1]``).

    Args:
        spec: the env's spaces (observation parts, action size).
        net: sizes and style (:class:`~lightning_wm.agents.dreamer.settings.DreamerNet`).
        min_std: lower bound of the std of Gaussian latents.
    """

    def __init__(self, spec: EnvSpec, net: DreamerNet | None = None, min_std: float = 0.1) -> None:
        super().__init__()
        net = as_settings(DreamerNet, net, "net")
        deter, stoch, classes, hidden, layers = net.deter, net.stoch, net.classes, net.hidden, net.layers
        act, norm, latent = net.activation, net.norm, net.latent
        self.spec, self.net = spec, net
        self.deter, self.stoch, self.classes, self.latent = deter, stoch, classes, latent
        self.unimix, self.symlog_obs, self.twohot, self.min_std = net.unimix, net.symlog_obs, net.twohot, min_std
        self.action_dim = spec.action_dim
        self.actions = ActionCodec(spec, normalize=True)  # env actions <-> one-hot / [-1, 1]
        categorical = latent == "categorical"
        self.stoch_dim = stoch * classes if categorical else stoch
        stoch_params = stoch * classes if categorical else 2 * stoch
        self.feat_dim = deter + self.stoch_dim
        self.act_fn = activation(act)()

        # encoder / decoder chosen from the observation space (one part per key of a dict)
        self.codec = ObservationCodec(
            spec.observation_space, self.feat_dim, hidden, layers, act, norm, net.cnn_depth, net.symlog_obs, net.conv
        )
        self.pixels = self.codec.has_image
        self.embed_dim = embed_dim = self.codec.embed_dim

        # RSSM; the input projections are split so that the parts that do not depend on the
        # recurrent state can be computed for a whole sequence at once
        self.img_in_z = nn.Linear(self.stoch_dim, hidden, bias=False)
        self.img_in_a = nn.Linear(self.action_dim, hidden, bias=not norm)
        self.img_norm = nn.LayerNorm(hidden, eps=1e-3) if norm else nn.Identity()
        self.gru = GRUCell(hidden, deter, norm=norm)
        self.prior_net = MLP(deter, stoch_params, hidden, 1, act, norm)
        self.post_h = nn.Linear(deter, hidden, bias=False)
        self.post_e = nn.Linear(embed_dim, hidden, bias=not norm)
        self.post_norm = nn.LayerNorm(hidden, eps=1e-3) if norm else nn.Identity()
        self.post_out = nn.Linear(hidden, stoch_params)

        out = net.bins if net.twohot else 1
        self.reward_head = MLP(self.feat_dim, out, hidden, layers, act, norm, zero_init_output=True)
        self.cont_head = MLP(self.feat_dim, 1, hidden, layers, act, norm)
        self.register_buffer("bins", dists.symexp_bins(net.bins), persistent=False)
        self.register_buffer("group_offsets", torch.arange(stoch) * classes, persistent=False)

    # -- encoding / decoding ---------------------------------------------------------------
    def encode(self, obs: Obs) -> Tensor:
        """Observations ``[..., *]`` (uint8 frames, float vectors, or a dict of both) -> ``[..., E]``."""
        return self.codec.encode(obs)

    def decoder_loss(self, feat: Tensor, obs: Obs) -> Tensor:
        """Reconstruction loss ``[...]`` of ``obs`` from ``feat [..., F]`` (see :meth:`ObservationCodec.loss`)."""
        return self.codec.loss(feat, obs)

    def decode_features(self, feat: Tensor) -> Obs:
        """Predicted observations ``[..., *]`` in the env's format (uint8 frames, float vectors,
        or a dict) from features ``[..., F]``."""
        return self.codec.decode(feat)

    def decode(self, state: State) -> Obs:
        """The observation the decoder predicts for ``state`` (``[B, ...]``, env format)."""
        return self.codec.decode(self.features(state))

    # -- heads -----------------------------------------------------------------------------
    def head_mean(self, out: Tensor) -> Tensor:
        """Scalar prediction ``[...]`` of a reward/critic head output ``[..., K or 1]``."""
        out = out.float()
        if self.twohot:
            return dists.twohot_mean(out, self.bins)
        out = out.squeeze(-1)
        return dists.symexp(out) if self.symlog_obs else out

    def head_loss(self, out: Tensor, target: Tensor) -> Tensor:
        """Negative log-likelihood ``[...]`` of ``target [...]`` under a head output ``[..., K or 1]``
        (:func:`~lightning_wm.agents.dreamer.losses.head_nll`)."""
        return head_nll(out, target, self.bins if self.twohot else None, self.symlog_obs)

    # -- latent distributions ----------------------------------------------------------------
    def _stats(self, raw: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        """Raw posterior/prior output ``[..., P]`` -> unimixed probs ``[..., stoch, classes]`` or
        ``(mean, std) [..., stoch]``."""
        raw = raw.float()  # distributions in float32 (also under bf16 autocast)
        if self.latent == "categorical":
            return dists.unimix_probs(raw.unflatten(-1, (self.stoch, self.classes)), self.unimix)
        mean, std = raw.chunk(2, -1)
        return mean, F.softplus(std) + self.min_std

    def _sample(self, stats: Any, noise: Tensor | None, mode: bool = False, offsets: bool = True) -> State:
        """A latent from :meth:`_stats`: ``{"z": [..., S]}`` (straight-through one-hot /
        reparameterised), plus ``"idx" [..., stoch]`` (flat indices of the ones; class indices
        without ``offsets``) for categorical latents."""
        if self.latent == "categorical":
            index = stats.argmax(-1) if mode else dists.sample_index(stats, noise)
            z = dists.onehot_st(index, stats).flatten(-2)
            return {"z": z, "idx": index + self.group_offsets if offsets else index}
        mean, std = stats
        if mode:
            return {"z": mean}
        return {"z": mean + std * (torch.randn_like(mean) if noise is None else noise)}

    def _noise(self, shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None = None) -> Tensor:
        """Sampling noise for many steps at once: uniforms ``[*shape, stoch]`` (categorical) or
        standard normals."""
        if self.latent == "categorical":
            return torch.rand(*shape, self.stoch, device=device, generator=generator)
        return torch.randn(*shape, self.stoch, device=device, generator=generator)

    def dist_params(self, stats: Any) -> Any:
        """What :func:`~lightning_wm.nn.dists.kl_balance` takes: log-probs ``[..., stoch, classes]``
        or ``(mean, std)``."""
        return torch.log(stats) if self.latent == "categorical" else stats

    def prior_stats(self, h: Tensor) -> Any:
        return self._stats(self.prior_net(h))

    def _sparse(self, state: State) -> bool:
        """Whether ``state["z"]`` can be multiplied as one-hot indices (no gradient needed into it)."""
        return "idx" in state and not state["z"].requires_grad

    def first_layer(self, mlp: nn.Sequential, state: State) -> Tensor:
        """Apply ``mlp`` (whose input is ``features(state)``) to a state ``[..., *]``.

        For one-hot latents that need no gradient the first layer is split into a dense part
        on ``h`` and a sum of weight columns picked by ``idx`` (exactly the same value, about
        5x fewer multiply-adds for 32x32 latents).
        """
        if not self._sparse(state):
            return mlp(self.features(state))
        first = mlp[0]
        x = F.linear(state["h"], first.weight[:, : self.deter], first.bias)
        x = x + onehot_linear(state["idx"], state["z"], first.weight[:, self.deter :]).to(x.dtype)
        for layer in list(mlp)[1:]:
            x = layer(x)
        return x

    # -- RSSM steps ----------------------------------------------------------------------------
    def _recurrent(self, state: State, action_in: Tensor) -> Tensor:
        """``h' = GRU(act(norm(W_z z + action_in)), h)`` with ``action_in = img_in_a(a)``."""
        if self._sparse(state):
            zin = onehot_linear(state["idx"], state["z"], self.img_in_z.weight).to(action_in.dtype) + action_in
        else:
            zin = torch.addmm(action_in, state["z"], self.img_in_z.weight.t())
        return self.gru(self.act_fn(self.img_norm(zin)), state["h"])

    def _posterior(self, h: Tensor, embed_in: Tensor) -> Tensor:
        """Raw posterior output from ``h`` and ``embed_in = post_e(e)``."""
        return self.post_out(self.act_fn(self.post_norm(torch.addmm(embed_in, h, self.post_h.weight.t()))))

    def obs_step(self, state: State, action: Tensor, embed: Tensor, mode: bool = False) -> State:
        """Filter one real step: previous ``state``, previous ``action [B, A]``, embedded
        observation ``embed [B, E]`` -> posterior state."""
        h = self._recurrent(state, self.img_in_a(action))
        stats = self._stats(self._posterior(h, self.post_e(embed)))
        return {"h": h, **self._sample(stats, None, mode)}

    @torch.no_grad()
    def openloop(self, obs: Obs, action: Tensor, is_first: Tensor, context: int) -> Obs:
        """The model's observations ``[B, L, ...]`` of replayed rows (``obs``, ``action [B, L, A]``
        in the model's format, ``is_first [B, L]`` bool): the posterior's reconstruction for the
        first ``context`` steps (at least 1, at most ``L``), then the prior's prediction under the
        same actions (open-loop)."""
        length = first_leaf(obs).shape[1]
        context = max(1, min(context, length))
        observed = tree_map(lambda x: x[:, :context], obs)
        out = self.observe(self.encode(observed), action[:, :context], is_first[:, :context])
        feats = [torch.cat([out["h"], out["z"]], -1)]
        state = {k: out[k][:, -1] for k in ("h", "z", "idx") if k in out}
        for t in range(context, length):
            state = self.img_step(state, action[:, t - 1], mode=True)
            feats.append(self.features(state)[:, None])
        return self.decode_features(torch.cat(feats, 1))

    def img_step(
        self, state: State, action: Tensor, mode: bool = False, generator: torch.Generator | None = None
    ) -> State:
        """Imagine one step with the prior: ``state``, ``action [B, A]`` -> next state (the
        sample's randomness from ``generator`` when given)."""
        h = self._recurrent(state, self.img_in_a(action))
        noise = None if generator is None or mode else self._noise((h.shape[0],), h.device, generator)
        return {"h": h, **self._sample(self.prior_stats(h), noise, mode)}

    def observe(self, embed: Tensor, action: Tensor, is_first: Tensor) -> dict[str, Any]:
        """Posterior states over real sequences.

        Args:
            embed: ``[B, L, E]`` encoded observations.
            action: ``[B, L, A]`` float actions, ``action[:, t]`` taken at step ``t``.
            is_first: ``[B, L]`` bool; the state is reset there and at ``t = 0``.
        Returns:
            ``h [B, L, D]``, ``z [B, L, S]``, ``idx [B, L, stoch]`` (categorical), ``post`` and
            ``prior`` (``dist_params``).
        """
        B, L = is_first.shape
        keep = (~is_first).to(embed.dtype)
        keep[:, 0] = 0.0
        keep = keep.unsqueeze(-1)
        prev_action = torch.cat([action.new_zeros(B, 1, action.shape[-1]), action[:, :-1]], 1) * keep
        action_in = self.img_in_a(prev_action)  # [B, L, hidden]
        embed_in = self.post_e(embed)  # [B, L, hidden]
        noise = self._noise((L, B), embed.device)
        # steps where some sequence restarts; compiled or recorded: every step (no data-dependent
        # branch, no host sync; x * 1 == x)
        resets = [True] * L if static_control_flow() else is_first.any(0).tolist()
        state = {"h": embed.new_zeros(B, self.deter), "z": embed.new_zeros(B, self.stoch_dim)}
        hs, zs, idxs, stats = [], [], [], []
        for t in range(L):
            if t > 0 and resets[t]:
                k = keep[:, t]
                state = {"h": state["h"] * k, "z": state["z"] * k}  # dense: zeros are not one-hot
            h = self._recurrent(state, action_in[:, t])
            st = self._stats(self._posterior(h, embed_in[:, t]))
            sample = self._sample(st, noise[t], offsets=False)
            state = {"h": h, "z": sample["z"]}
            hs.append(h)
            zs.append(sample["z"])
            idxs.append(sample.get("idx"))
            stats.append(st)
        out: dict[str, Any] = {"h": torch.stack(hs, 1), "z": torch.stack(zs, 1)}
        if self.latent == "categorical":
            out["idx"] = torch.stack(idxs, 1) + self.group_offsets
            out["post"] = torch.log(torch.stack(stats, 1))
        else:
            out["post"] = (torch.stack([s[0] for s in stats], 1), torch.stack([s[1] for s in stats], 1))
        out["prior"] = self.dist_params(self.prior_stats(out["h"]))
        return out

    # -- WorldModel interface ------------------------------------------------------------------
    def zero_state(self, batch_size: int, device: torch.device | None = None) -> State:
        """The initial (reset) state: zeros ``{"h": [B, D], "z": [B, S]}``."""
        device = device if device is not None else self.bins.device
        return {
            "h": torch.zeros(batch_size, self.deter, device=device),
            "z": torch.zeros(batch_size, self.stoch_dim, device=device),
        }

    def initial_state(self, obs: Tensor) -> State:
        """Posterior state after the first observation ``obs [B, ...]`` of an episode."""
        leaf = first_leaf(obs)
        zero = self.zero_state(leaf.shape[0], leaf.device)
        return self.obs_step(
            zero, leaf.new_zeros(leaf.shape[0], self.action_dim, dtype=torch.float32), self.encode(obs)
        )

    def step(
        self, state: State, action: Tensor, generator: torch.Generator | None = None
    ) -> tuple[Tensor, State, Tensor]:
        """Prior step; returns ``(reward [B], next_state, termination probability [B])``."""
        nxt = self.img_step(state, action, generator=generator)
        reward = self.head_mean(self.first_layer(self.reward_head, nxt))
        done = torch.sigmoid(-self.first_layer(self.cont_head, nxt).squeeze(-1).float())  # 1 - P(continue)
        return reward, nxt, done

    def features(self, state: State) -> Tensor:
        """``[..., F] = [h, z]``."""
        return torch.cat([state["h"], state["z"]], -1)

    def observe_step(self, state: State, action: Tensor, obs: Obs, is_first: Tensor | None = None) -> State:
        """Posterior ``{"h", "z"}`` after ``action [B, A]`` (model format) in ``state`` and then
        ``obs [B, ...]``; where ``is_first`` the state and action are reset (zeros) first, as
        in :meth:`observe`, so the result there is ``initial_state(obs)``."""
        prev = {"h": state["h"], "z": state["z"]}
        if is_first is not None:
            keep = (~is_first.bool()).to(state["h"].dtype).unsqueeze(-1)
            prev = {k: v * keep for k, v in prev.items()}
            action = action * keep
        post = self.obs_step(prev, action, self.encode(obs))
        return {"h": post["h"], "z": post["z"]}

    @torch.no_grad()
    def posterior_states(self, episode: dict[str, Any]) -> State:
        """Every row's posterior ``{"h", "z"(, "idx")} [T, ...]`` of one recorded episode
        (``obs``, env-format ``action``, ``is_first``; leaves ``[T, ...]``)."""
        device = self.bins.device

        def tensor(x: Any) -> Tensor:
            return torch.as_tensor(x.copy() if hasattr(x, "copy") else x, device=device)

        obs = (
            {k: tensor(v)[None] for k, v in episode["obs"].items()}
            if isinstance(episode["obs"], dict)
            else tensor(episode["obs"])[None]
        )
        action = self.actions.encode(tensor(episode["action"]))[None]
        length = action.shape[1]
        is_first = (
            tensor(episode["is_first"]).bool()[None]
            if "is_first" in episode
            else torch.zeros(1, length, dtype=torch.bool, device=device)
        )
        out = self.observe(self.encode(obs), action, is_first)
        return {k: out[k][0] for k in ("h", "z", "idx") if k in out}

    def acting_copy(self) -> DreamerWorldModel:
        """A copy with only what filtering real observations needs (the encoders and the RSSM's
        posterior path): the decoders, the prior and the reward/continue heads are left out
        (``None``), and ``torch.compile`` wrappers (bound to this instance) are dropped."""
        dropped = [self.codec.decoders, self.prior_net, self.reward_head, self.cont_head]
        clone = copy.deepcopy(self, memo={id(m): None for m in dropped})
        clone.__dict__.pop("_recurrent", None)
        for module in clone.modules():
            module._compiled_call_impl = None
        return clone

    def onehot_index(self, z: Tensor) -> Tensor:
        """Flat indices ``[..., stoch]`` of the ones of a one-hot latent ``z [..., S]``."""
        return z.unflatten(-1, (self.stoch, self.classes)).argmax(-1) + self.group_offsets
