"""Dreamer: an RSSM world model learned from replayed sequences, and an actor-critic learned in
its imagination (DreamerV1 Gaussian latents or DreamerV2/V3 categorical latents, with the
DreamerV3 options symlog, two-hot, return normalisation, LayerNorm/SiLU).

Shapes: ``B`` batch, ``L`` sequence length, ``H`` imagination horizon, ``N = B*L`` imagined
trajectories, ``D`` deterministic size, ``S`` stochastic size (``stoch*classes`` for
categorical latents), ``F = D + S`` features, ``A`` action size, ``K`` bins.

The hot path avoids ``torch.distributions``: the observe loop precomputes every input that
does not depend on the recurrent state (encoder, action and embedding projections, sampling
noise) for the whole ``[B, L]`` sequence, and the prior, decoder and heads run once on all
``[B, L]`` features after the loop. Categorical latents are sampled by inverting the CDF (one
uniform per group). In imagination, where no gradient flows into the latent, the first layer of
every network that reads ``[h, z]`` multiplies the one-hot ``z`` by summing the weight columns
of its ``stoch`` ones (``onehot_linear``) instead of a dense ``S``-wide matmul.

Numerics are bf16-autocast safe (``--trainer.precision bf16-mixed``, what DreamerV3 uses on
accelerators): distributions, two-hot decoding and losses are computed in float32.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_wm.agents.base import RLModule
from lightning_wm.tree import first_leaf, tree_map
from lightning_wm.envs import EnvSpec
from lightning_wm.nn import dists
from lightning_wm.nn.blocks import MLP, activation
from lightning_wm.nn.codec import Obs, ObservationCodec
from lightning_wm.returns import lambda_return
from lightning_wm.world_model import RolloutSchedule, WorldModel, frozen, rollout

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


class _OneHotLinear(torch.autograd.Function):
    """``z @ weight.T`` for ``z [N, G*C]`` holding at most one 1 per group of ``C`` (one-hot
    latent samples), given the flat indices ``index [N, G]`` of those ones: a sum of ``G``
    weight columns (``embedding_bag``) instead of an ``[N, G*C] x [G*C, out]`` matmul.
    Gradient only for ``weight`` (dense ``grad.T @ z``)."""

    @staticmethod
    def forward(ctx: Any, index: Tensor, z: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(z)
        return F.embedding_bag(index, weight.t().contiguous(), mode="sum")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, Tensor | None]:
        (z,) = ctx.saved_tensors
        return None, None, grad.t().mm(z) if ctx.needs_input_grad[2] else None


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
    one first observation, ``step`` imagines with the prior and returns the predicted reward
    and termination probability, ``features`` is ``[h, z]``.
    """

    def __init__(
        self,
        spec: EnvSpec,
        deter: int,
        stoch: int,
        classes: int,
        hidden: int,
        layers: int,
        latent: str,
        act: str,
        norm: bool,
        unimix: float,
        symlog_obs: bool,
        twohot: bool,
        bins: int,
        cnn_depth: int,
        min_std: float = 0.1,
    ) -> None:
        super().__init__()
        if latent not in ("categorical", "gaussian"):
            raise ValueError(f"latent must be 'categorical' or 'gaussian', got {latent!r}")
        self.spec = spec
        self.deter, self.stoch, self.classes, self.latent = deter, stoch, classes, latent
        self.unimix, self.symlog_obs, self.twohot, self.min_std = unimix, symlog_obs, twohot, min_std
        self.action_dim = spec.action_dim
        categorical = latent == "categorical"
        self.stoch_dim = stoch * classes if categorical else stoch
        stoch_params = stoch * classes if categorical else 2 * stoch
        self.feat_dim = deter + self.stoch_dim
        self.act_fn = activation(act)()

        # encoder / decoder chosen from the observation space (one part per key of a dict)
        self.codec = ObservationCodec(spec.observation_space, self.feat_dim, hidden, layers, act, norm, cnn_depth,
                                      symlog_obs)
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

        out = bins if twohot else 1
        self.reward_head = MLP(self.feat_dim, out, hidden, layers, act, norm, zero_init_output=True)
        self.cont_head = MLP(self.feat_dim, 1, hidden, layers, act, norm)
        self.register_buffer("bins", dists.symexp_bins(bins), persistent=False)
        self.register_buffer("group_offsets", torch.arange(stoch) * classes, persistent=False)

    # -- encoding / decoding ---------------------------------------------------------------
    def encode(self, obs: Obs) -> Tensor:
        """Observations ``[..., *]`` (uint8 frames, float vectors, or a dict of both) -> ``[..., E]``."""
        return self.codec.encode(obs)

    def decoder_loss(self, feat: Tensor, obs: Obs) -> Tensor:
        """Reconstruction loss ``[...]`` of ``obs`` from ``feat [..., F]`` (see :meth:`ObservationCodec.loss`)."""
        return self.codec.loss(feat, obs)

    def decode(self, feat: Tensor) -> Obs:
        """Predicted observations in the env's format (uint8 frames, float vectors, or a dict)."""
        return self.codec.decode(feat)

    # -- heads -----------------------------------------------------------------------------
    def head_mean(self, out: Tensor) -> Tensor:
        """Scalar prediction ``[...]`` of a reward/critic head output ``[..., K or 1]``."""
        out = out.float()
        if self.twohot:
            return dists.twohot_mean(out, self.bins)
        out = out.squeeze(-1)
        return dists.symexp(out) if self.symlog_obs else out

    def head_loss(self, out: Tensor, target: Tensor) -> Tensor:
        """Negative log-likelihood ``[...]`` of ``target [...]`` under a head output ``[..., K or 1]``."""
        out = out.float()
        if self.twohot:
            return dists.twohot_loss(out, target, self.bins)
        target = target.detach()
        return (out.squeeze(-1) - (dists.symlog(target) if self.symlog_obs else target)).square()

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

    def _noise(self, shape: tuple[int, ...], device: torch.device) -> Tensor:
        """Sampling noise for many steps at once: uniforms ``[*shape, stoch]`` (categorical) or
        standard normals."""
        if self.latent == "categorical":
            return torch.rand(*shape, self.stoch, device=device)
        return torch.randn(*shape, self.stoch, device=device)

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

    def img_step(self, state: State, action: Tensor, mode: bool = False) -> State:
        """Imagine one step with the prior: ``state``, ``action [B, A]`` -> next state."""
        h = self._recurrent(state, self.img_in_a(action))
        return {"h": h, **self._sample(self.prior_stats(h), None, mode)}

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
        resets = is_first.any(0).tolist()  # steps where some sequence restarts
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
        return {"h": torch.zeros(batch_size, self.deter, device=device),
                "z": torch.zeros(batch_size, self.stoch_dim, device=device)}

    def initial_state(self, obs: Tensor) -> State:
        """Posterior state after the first observation ``obs [B, ...]`` of an episode."""
        leaf = first_leaf(obs)
        zero = self.zero_state(leaf.shape[0], leaf.device)
        return self.obs_step(zero, leaf.new_zeros(leaf.shape[0], self.action_dim, dtype=torch.float32), self.encode(obs))

    def step(self, state: State, action: Tensor) -> tuple[Tensor, State, Tensor]:
        """Prior step; returns ``(reward [B], next_state, termination probability [B])``."""
        nxt = self.img_step(state, action)
        reward = self.head_mean(self.first_layer(self.reward_head, nxt))
        done = torch.sigmoid(-self.first_layer(self.cont_head, nxt).squeeze(-1).float())  # 1 - P(continue)
        return reward, nxt, done

    def features(self, state: State) -> Tensor:
        """``[..., F] = [h, z]``."""
        return torch.cat([state["h"], state["z"]], -1)

    def onehot_index(self, z: Tensor) -> Tensor:
        """Flat indices ``[..., stoch]`` of the ones of a one-hot latent ``z [..., S]``."""
        return z.unflatten(-1, (self.stoch, self.classes)).argmax(-1) + self.group_offsets


class Dreamer(RLModule):
    """Dreamer agent (world model + actor + critic), trained online with manual optimization.

    Each ``training_step`` on a replay batch ``[B, L, ...]``: (1) world-model losses
    (reconstruction, reward, continue, balanced KL with free bits); (2) an
    imagined rollout of ``horizon`` steps from all ``B*L`` posterior states with
    :func:`~lightning_wm.world_model.rollout`; lambda returns; actor loss (REINFORCE for
    discrete actions, dynamics backprop for continuous by default) and critic loss (two-hot
    regression on the returns plus a regulariser towards the slow EMA critic).

    The three losses touch disjoint parameters and are summed into ONE backward per step (as
    DistributedDataParallel requires); each network's gradient norm is clipped separately and
    the three Adam optimizers step. Only the world-model optimizer steps through Lightning (so
    ``trainer.global_step`` counts gradient steps, not three per batch); the actor and critic
    optimizers step directly. Under DDP the return-normalisation percentiles are averaged
    across ranks, so every rank uses the same scale.

    Args:
        env_spec: linked from the datamodule (Discrete or Box actions; vector or 64x64 pixels).
        deter, stoch, classes: RSSM sizes (``stoch`` groups of ``classes`` for categorical
            latents; ``stoch`` Gaussian dims otherwise).
        hidden, layers: MLP width and hidden layers (encoder, decoder, heads, actor, critic).
        latent: ``categorical`` (DreamerV2/V3) or ``gaussian`` (DreamerV1).
        act, norm: activation and LayerNorm (DreamerV3: ``silu``, True).
        cnn_depth: conv encoder/decoder width for pixels.
        unimix: uniform mix of categorical latents and discrete actions.
        symlog_obs: symlog vector observations (encoder input, decoder target) and scalar targets
            when ``twohot`` is off.
        twohot, bins: reward and critic as categoricals over ``bins`` symexp-spaced bins.
        horizon, gamma, lambda_: imagination and returns.
        horizon_schedule: ``[start_step, min_horizon, end_step]``: imagine ``min_horizon`` steps
            until ``start_step`` env steps (this rank's), then linearly more, ``horizon`` from
            ``end_step`` on (:class:`~lightning_wm.world_model.RolloutSchedule`); None: always ``horizon``.
        kl_dyn, kl_rep, free_nats: KL balancing and free bits.
        loss_decoder, loss_reward, loss_cont: world-model loss scales.
        lr_*, clip_*, eps_*: Adam learning rates, gradient-norm clips and epsilons.
        entropy: actor entropy coefficient.
        actor_grad: ``auto`` (REINFORCE for discrete, dynamics backprop for continuous),
            ``reinforce`` or ``dynamics``.
        actor_dist: continuous actions as ``bounded_normal`` (DreamerV3) or ``tanh_normal``.
        action_min_std, action_max_std: bounds of the continuous action std.
        slow_critic, slow_critic_every, slow_reg: EMA fraction and period of the slow critic,
            weight of the regulariser towards it.
        return_norm, return_norm_decay, return_norm_low, return_norm_high: normalise advantages
            by ``max(1, EMA(P_high) - EMA(P_low))`` of the returns.
        openloop_context, openloop_sequences: open-loop video at validation (steps filtered
            with the posterior, sequences shown).
        compile: ``torch.compile`` the per-step RSSM cell and the networks' dense forwards (off
            by default: ~40 s warm-up on CPU and no measurable gain at the CartPole sizes).
    """

    def __init__(
        self,
        env_spec: EnvSpec | None = None,
        *,
        deter: int = 256,
        stoch: int = 32,
        classes: int = 32,
        hidden: int = 256,
        layers: int = 1,
        latent: Literal["categorical", "gaussian"] = "categorical",
        act: str = "silu",
        norm: bool = True,
        cnn_depth: int = 32,
        unimix: float = 0.01,
        symlog_obs: bool = True,
        twohot: bool = True,
        bins: int = 255,
        horizon: int = 15,
        horizon_schedule: tuple[int, int, int] | None = None,
        gamma: float = 0.997,
        lambda_: float = 0.95,
        kl_dyn: float = 0.5,
        kl_rep: float = 0.1,
        free_nats: float = 1.0,
        loss_decoder: float = 1.0,
        loss_reward: float = 1.0,
        loss_cont: float = 1.0,
        lr_model: float = 1e-4,
        lr_actor: float = 3e-5,
        lr_critic: float = 3e-5,
        eps_model: float = 1e-8,
        eps_actor: float = 1e-5,
        eps_critic: float = 1e-5,
        clip_model: float = 1000.0,
        clip_actor: float = 100.0,
        clip_critic: float = 100.0,
        entropy: float = 3e-4,
        actor_grad: Literal["auto", "reinforce", "dynamics"] = "auto",
        actor_dist: Literal["bounded_normal", "tanh_normal"] = "bounded_normal",
        action_min_std: float = 0.1,
        action_max_std: float = 1.0,
        slow_critic: float = 0.02,
        slow_critic_every: int = 1,
        slow_reg: float = 1.0,
        return_norm: bool = True,
        return_norm_decay: float = 0.99,
        return_norm_low: float = 0.05,
        return_norm_high: float = 0.95,
        openloop_context: int = 5,
        openloop_sequences: int = 4,
        compile: bool = False,
    ) -> None:
        super().__init__(env_spec)
        if env_spec is None:
            raise ValueError(
                "Dreamer needs env_spec (the CLI links it from the datamodule's spec; in code pass "
                "env_spec=lightning_wm.envs.env_spec(EnvConfig(...)))"
            )
        if actor_grad not in ("auto", "reinforce", "dynamics"):
            raise ValueError(f"actor_grad must be auto, reinforce or dynamics, got {actor_grad!r}")
        if actor_dist not in ("bounded_normal", "tanh_normal"):
            raise ValueError(f"actor_dist must be bounded_normal or tanh_normal, got {actor_dist!r}")
        self.save_hyperparameters(ignore=["env_spec"])
        self.automatic_optimization = False
        self.discrete = env_spec.discrete
        if actor_grad == "auto":
            actor_grad = "reinforce" if self.discrete else "dynamics"
        if actor_grad == "dynamics" and self.discrete:
            raise ValueError("actor_grad='dynamics' needs continuous actions; use 'reinforce' for Discrete")
        self.actor_grad = actor_grad
        self.horizon_schedule: RolloutSchedule | None = None
        if horizon_schedule is not None:
            start, min_horizon, end = (int(v) for v in horizon_schedule)
            if not (1 <= min_horizon <= horizon and 0 <= start <= end):
                raise ValueError(f"horizon_schedule [start_step, min_horizon, end_step] needs 1 <= min_horizon <= "
                                 f"horizon ({horizon}) and 0 <= start_step <= end_step; got {list(horizon_schedule)}")
            self.horizon_schedule = RolloutSchedule(min_horizon, horizon, start, end)

        self.wm = DreamerWorldModel(
            env_spec, deter, stoch, classes, hidden, layers, latent, act, norm, unimix, symlog_obs, twohot, bins,
            cnn_depth,
        )
        feat, A = self.wm.feat_dim, env_spec.action_dim
        self.actor = MLP(feat, A if self.discrete else 2 * A, hidden, layers, act, norm)
        self.critic = MLP(feat, bins if twohot else 1, hidden, layers, act, norm, zero_init_output=True)
        self.slow_critic = copy.deepcopy(self.critic).requires_grad_(False)
        # return-normalisation state (EMA of the low/high return percentiles), saved in checkpoints
        self.register_buffer("ret_low", torch.zeros(()))
        self.register_buffer("ret_high", torch.zeros(()))
        if not self.discrete:
            self.register_buffer("action_low", torch.as_tensor(env_spec.action_low).flatten(), persistent=False)
            self.register_buffer("action_high", torch.as_tensor(env_spec.action_high).flatten(), persistent=False)
        self._openloop_batch: dict[str, Tensor] | None = None
        if compile:
            self.wm._recurrent = torch.compile(self.wm._recurrent, dynamic=False)  # type: ignore[method-assign]
            self.wm.reward_head.compile(dynamic=False)
            self.wm.cont_head.compile(dynamic=False)
            self.critic.compile(dynamic=False)
            self.actor.compile(dynamic=False)

    # -- actions -------------------------------------------------------------------------------
    def _action_input(self, action: Tensor) -> Tensor:
        """Replay actions -> model input ``[..., A]``: one-hot for discrete indices, scaled to
        ``[-1, 1]`` for continuous env actions."""
        if self.discrete:
            return F.one_hot(action.long(), self.wm.action_dim).float()
        action = action.float().reshape(*action.shape[: action.dim() - len(self.env_spec.action_space.shape)], -1)
        return (2.0 * (action - self.action_low) / (self.action_high - self.action_low) - 1.0).clamp(-1.0, 1.0)

    def _continuous(self, raw: Tensor) -> tuple[Tensor, Tensor]:
        if self.hparams.actor_dist == "bounded_normal":
            return dists.bounded_normal(raw, self.hparams.action_min_std, self.hparams.action_max_std)
        return dists.tanh_normal(raw, self.hparams.action_min_std, self.hparams.action_max_std)

    def policy(self, feat: Tensor, explore: bool = True, onehot_latent: bool = False) -> tuple[Tensor, Tensor]:
        """Action ``[B, A]`` (one-hot, or in ``[-1, 1]``) from features; returns ``(action, raw)``
        with ``raw`` the actor output. Continuous samples are reparameterised.
        ``onehot_latent``: the latent part of ``feat`` is an exact one-hot (imagined states), so
        the actor's first layer may use its indices."""
        if onehot_latent and self.wm.latent == "categorical" and not feat.requires_grad:
            D = self.wm.deter
            z = feat[..., D:]
            raw = self.wm.first_layer(self.actor, {"h": feat[..., :D], "z": z, "idx": self.wm.onehot_index(z)})
        else:
            raw = self.actor(feat)
        raw = raw.float()
        if self.discrete:
            probs = dists.unimix_probs(raw, self.hparams.unimix)
            action = dists.sample_onehot(probs.detach()) if explore else dists.onehot_argmax(raw)
            return action, raw
        mean, std = self._continuous(raw)
        if not explore:
            return (mean if self.hparams.actor_dist == "bounded_normal" else torch.tanh(mean)), raw
        if self.hparams.actor_dist == "bounded_normal":
            action, _ = dists.bounded_normal_sample(mean, std)
        else:
            action, _ = dists.tanh_normal_sample(mean, std)
        return action, raw

    # -- Agent protocol ------------------------------------------------------------------------
    def initial_state(self, batch_size: int) -> State:
        """``{"h": [B, D], "z": [B, S], "action": [B, A]}`` zeros on the module's device."""
        state = self.wm.zero_state(batch_size, self.device)
        state["action"] = torch.zeros(batch_size, self.wm.action_dim, device=self.device)
        return state

    @torch.no_grad()
    def act(self, obs: Tensor, state: State | None, explore: bool) -> tuple[Tensor, State, dict[str, Tensor]]:
        """Filter ``obs [B, ...]`` with the posterior and act: a sample of the actor
        (``explore``) or its mode."""
        if state is None:
            state = self.initial_state(first_leaf(obs).shape[0])
        post = self.wm.obs_step(state, state["action"], self.wm.encode(obs))
        action, _ = self.policy(self.wm.features(post), explore)
        post = {"h": post["h"], "z": post["z"], "action": action}
        if self.discrete:
            env_action = action.argmax(-1)
        else:
            env_action = self.action_low + (action + 1.0) * 0.5 * (self.action_high - self.action_low)
            env_action = env_action.reshape(action.shape[0], *self.env_spec.action_space.shape)
        return env_action, post, {}

    # -- training ------------------------------------------------------------------------------
    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        hp = self.hparams
        return [
            torch.optim.Adam(self.wm.parameters(), lr=hp.lr_model, eps=hp.eps_model),
            torch.optim.Adam(self.actor.parameters(), lr=hp.lr_actor, eps=hp.eps_actor),
            torch.optim.Adam(self.critic.parameters(), lr=hp.lr_critic, eps=hp.eps_critic),
        ]

    def world_model_loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor], dict[str, Any]]:
        """World-model loss (scalar), its logged parts and the posterior ``observe`` output."""
        hp = self.hparams
        wm = self.wm
        obs, is_first = batch["obs"], batch["is_first"].bool()
        action = self._action_input(batch["action"])
        out = wm.observe(wm.encode(obs), action, is_first)
        feat = torch.cat([out["h"], out["z"]], -1)  # [B, L, F]
        rec = wm.decoder_loss(feat, obs)
        rew = wm.head_loss(wm.reward_head(feat), batch["reward"].float())
        cont_target = 1.0 - batch["is_terminal"].float()
        cont_logit = wm.cont_head(feat).squeeze(-1).float()
        cont = dists.bernoulli_nll(cont_logit, cont_target)
        kl_loss, kl_parts = dists.kl_balance(out["post"], out["prior"], hp.kl_dyn, hp.kl_rep, hp.free_nats)
        loss = (hp.loss_decoder * rec + hp.loss_reward * rew + hp.loss_cont * cont + kl_loss).mean()
        logs = {
            "train/loss_model": loss.detach(),
            "train/loss_recon": rec.mean().detach(),
            "train/loss_reward": rew.mean().detach(),
            "train/loss_cont": cont.mean().detach(),
            "train/loss_kl_dyn": kl_parts["dyn"].mean().detach(),
            "train/loss_kl_rep": kl_parts["rep"].mean().detach(),
            "train/kl": kl_parts["kl"].mean().detach(),
        }
        with torch.no_grad():  # how well the continue head sees the (rare) real terminations
            terminal = batch["is_terminal"].bool()
            p_end = torch.sigmoid(-cont_logit)
            logs["train/terminal_frac"] = terminal.float().mean()
            if terminal.any():
                logs["train/p_end_at_terminal"] = p_end[terminal].mean()
            logs["train/p_end_elsewhere"] = p_end[~terminal].mean()
        return loss, logs, out

    def current_horizon(self) -> int:
        """Imagination length now: ``horizon``, or the schedule's value at this rank's env steps."""
        if self.horizon_schedule is None:
            return self.hparams.horizon
        return self.horizon_schedule(self.env_steps)

    def imagine(self, start: State, start_cont: Tensor) -> dict[str, Tensor]:
        """Imagine ``horizon`` steps from ``start`` (``[N, ...]``, detached) with the actor;
        returns the trajectory, the lambda returns and the weights of every imagined step."""
        hp = self.hparams
        raws: list[Tensor] = []
        dynamics = self.actor_grad == "dynamics"

        def actor_fn(feat: Tensor) -> Tensor:
            action, raw = self.policy(feat if dynamics else feat.detach(), explore=True, onehot_latent=True)
            raws.append(raw)
            return action if dynamics else action.detach()

        traj = rollout(self.wm, start, actor_fn, self.current_horizon())
        traj["raw"] = torch.stack(raws)  # [H, N, *]
        feats = traj["features"]  # [H+1, N, F]
        cont = 1.0 - traj["dones"]  # [H, N]
        discount = hp.gamma * cont
        # weight of step t: the probability the episode is still running at imagined state t
        weight = torch.cat([start_cont[None], start_cont[None] * torch.cumprod(cont, 0)]).detach()  # [H+1, N]
        states = {k: v.detach() for k, v in traj["states"].items()}
        critic_out = self.wm.first_layer(self.critic, states)  # [H+1, N, K]
        if dynamics:
            with frozen(self.critic):
                value = self.wm.head_mean(self.critic(feats))
        else:
            value = self.wm.head_mean(critic_out).detach()
        returns = lambda_return(traj["rewards"], value, discount, hp.lambda_)  # [H, N]
        traj.update(critic_out=critic_out, value=value, returns=returns, weight=weight)
        return traj

    def _update_return_norm(self, returns: Tensor) -> Tensor:
        """EMA of the return percentiles; returns the scale ``max(1, high - low)``."""
        hp = self.hparams
        if not hp.return_norm:
            return returns.new_ones(())
        flat = returns.detach().flatten().float()
        q = torch.quantile(flat, torch.tensor([hp.return_norm_low, hp.return_norm_high], device=flat.device))
        trainer = self._trainer
        if trainer is not None and trainer.world_size > 1:  # the same scale (and buffers) on every rank
            q = trainer.strategy.reduce(q, reduce_op="mean")
        decay = hp.return_norm_decay
        self.ret_low.mul_(decay).add_((1 - decay) * q[0])
        self.ret_high.mul_(decay).add_((1 - decay) * q[1])
        return torch.clamp(self.ret_high - self.ret_low, min=1.0)

    def behaviour_losses(self, traj: dict[str, Tensor]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Actor and critic losses (scalars) and logged values from :meth:`imagine`'s output."""
        hp = self.hparams
        weight, returns, value = traj["weight"], traj["returns"], traj["value"]
        scale = self._update_return_norm(returns)
        raw = traj["raw"]
        if self.discrete:
            logits = dists.unimix_logits(raw, hp.unimix)
            ent = -(logits.exp() * logits).sum(-1)
            logp = (logits * traj["actions"]).sum(-1)
        else:
            mean, std = self._continuous(raw)
            # for tanh_normal this is the entropy of the pre-tanh Gaussian (no closed form after tanh)
            ent = dists.normal_entropy(std)
            logp = None
        if self.actor_grad == "reinforce":
            if logp is None:  # continuous REINFORCE: log-density of the (detached) sampled action
                a = traj["actions"].detach()
                if hp.actor_dist == "tanh_normal":
                    u = torch.atanh(a.clamp(-0.999999, 0.999999))
                    logp = dists.normal_log_prob(u, mean, std) - torch.log1p(-a.square() + 1e-6).sum(-1)
                else:
                    logp = dists.normal_log_prob(a, mean, std)
            adv = ((returns - value[:-1]) / scale).detach()
            objective = logp * adv
        else:
            objective = returns / scale
        actor_loss = -(weight[:-1] * (objective + hp.entropy * ent)).mean()

        critic_logits = traj["critic_out"][:-1]
        with torch.no_grad():
            states = {k: v[:-1].detach() for k, v in traj["states"].items()}
            slow_target = self.wm.head_mean(self.wm.first_layer(self.slow_critic, states))
        if self.wm.twohot:
            # one cross-entropy against the mixed target: CE(p, t1) + c CE(p, t2) = CE(p, t1 + c t2)
            bins = self.wm.bins
            target = dists.twohot_encode(returns, bins) + hp.slow_reg * dists.twohot_encode(slow_target, bins)
            critic_terms = -(target * torch.log_softmax(critic_logits.float(), -1)).sum(-1)
        else:
            critic_terms = self.wm.head_loss(critic_logits, returns)
            critic_terms = critic_terms + hp.slow_reg * self.wm.head_loss(critic_logits, slow_target)
        critic_loss = (weight[:-1] * critic_terms).mean()
        logs = {
            "train/loss_actor": actor_loss.detach(),
            "train/loss_critic": critic_loss.detach(),
            "train/entropy": ent.mean().detach(),
            "train/imag_return": returns.mean().detach(),
            "train/imag_reward": traj["rewards"].mean().detach(),
            "train/imag_value": value.mean().detach(),
            "train/return_scale": scale.detach(),
            "train/return_low": self.ret_low.detach().clone(),
            "train/return_high": self.ret_high.detach().clone(),
            "train/imag_end": traj["dones"].mean().detach(),
            "train/adv_abs": ((returns - value[:-1]).abs() / scale).mean().detach(),
            "train/horizon": torch.tensor(float(traj["rewards"].shape[0])),
        }
        return actor_loss, critic_loss, logs

    def losses(self, batch: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The three losses of one gradient step on a replay batch ``[B, L, ...]`` and the logged values.

        ``{"model", "actor", "critic"}``: the world-model loss; then an imagined rollout from
        every (detached) posterior state with the world model frozen, and the actor and critic
        losses on it. Each loss reaches only its own network's parameters (the actor's never the
        world model's or the critic's, the critic's never the actor's or the world model's), so
        one backward of their sum gives every network exactly its own loss's gradient.
        """
        B, L = batch["is_first"].shape[:2]
        model_loss, logs, post = self.world_model_loss(batch)
        start = {k: post[k].detach().flatten(0, 1) for k in ("h", "z", "idx") if k in post}
        start_cont = 1.0 - batch["is_terminal"].reshape(B * L).float()
        traj = self.imagine(start, start_cont)
        actor_loss, critic_loss, behaviour_logs = self.behaviour_losses(traj)
        logs.update(behaviour_logs)
        return {"model": model_loss, "actor": actor_loss, "critic": critic_loss}, logs

    def clip_and_step(self, optimizers: list[Any]) -> dict[str, Tensor]:
        """After the backward: clip each network's gradient norm separately (``clip_model``,
        ``clip_actor``, ``clip_critic``), step the three optimizers (world model, actor, critic)
        and move the slow critic. Returns the pre-clip gradient norms.

        Only the world model's optimizer steps through Lightning (a ``LightningOptimizer`` step
        advances ``trainer.global_step``: one per gradient step, which the replay ratio and the
        checkpoint schedule count on); the actor's and critic's step their plain optimizer.
        """
        hp = self.hparams
        norms = {}
        for name, module, clip in (("model", self.wm, hp.clip_model), ("actor", self.actor, hp.clip_actor),
                                   ("critic", self.critic, hp.clip_critic)):
            norms[f"grad_norm/{name}"] = torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt_model, opt_actor, opt_critic = optimizers
        opt_model.step()
        for opt in (opt_actor, opt_critic):
            getattr(opt, "optimizer", opt).step()
        self._update_slow_critic()
        return norms

    def _update_slow_critic(self) -> None:
        hp = self.hparams
        if self.global_step % max(1, hp.slow_critic_every) == 0:
            with torch.no_grad():
                for slow, fast in zip(self.slow_critic.parameters(), self.critic.parameters()):
                    slow.lerp_(fast, hp.slow_critic)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """One gradient step: :meth:`losses`, ONE backward of their sum, :meth:`clip_and_step`.

        A single backward per ``training_step`` is what DistributedDataParallel needs (it wraps
        ``training_step`` as its forward and all-reduces the gradients of every parameter during
        the one backward that follows); the losses touch disjoint parameter sets, so the sum
        gives the same gradients as three separate backwards.
        """
        hp = self.hparams
        optimizers = self.optimizers()
        B = batch["is_first"].shape[0]
        self._openloop_batch = tree_map(lambda v: v[: hp.openloop_sequences].detach().clone(), batch)
        losses, logs = self.losses(batch)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        self.manual_backward(losses["model"] + losses["actor"] + losses["critic"])
        logs.update(self.clip_and_step(optimizers))
        self.log_dict(logs, on_step=True, on_epoch=False, batch_size=B)
        self.log("train/loss", losses["model"].detach(), prog_bar=True, batch_size=B)

    # -- validation: open-loop prediction --------------------------------------------------------
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        if batch_idx == 0:
            self.log_openloop()

    @torch.no_grad()
    def openloop(self, batch: dict[str, Tensor], context: int) -> tuple[Tensor, Tensor]:
        """Real observations and the model's: posterior (reconstruction) for the first
        ``context`` steps, then the prior under the same actions. Returns ``(real, pred)``, both
        ``[B, L, ...]`` in observation format."""
        wm = self.wm
        obs, is_first = batch["obs"], batch["is_first"].bool()
        action = self._action_input(batch["action"])
        L = first_leaf(obs).shape[1]
        context = max(1, min(context, L))
        observed = tree_map(lambda x: x[:, :context], obs)
        out = wm.observe(wm.encode(observed), action[:, :context], is_first[:, :context])
        feats = [torch.cat([out["h"], out["z"]], -1)]
        state = {k: out[k][:, -1] for k in ("h", "z", "idx") if k in out}
        for t in range(context, L):
            state = wm.img_step(state, action[:, t - 1], mode=True)
            feats.append(wm.features(state)[:, None])
        return obs, wm.decode(torch.cat(feats, 1))

    def log_openloop(self) -> None:
        """Log the open-loop error of the last training batch's first sequences; for pixels also
        an image grid (real / model / difference rows, time along the columns) to TensorBoard and
        an animated GIF ``<log_dir>/openloop/step_<N>.gif`` (real | model side by side per frame,
        one row per sequence, a green bar over the model frames filtered with the posterior and
        a red one over those it imagines open-loop). For vector observations the image is a plot
        per dimension of the first sequence: the real values and the model's over time."""
        batch = self._openloop_batch
        if batch is None:
            return
        context = self.hparams.openloop_context
        real, pred = self.openloop(batch, context)
        err_open = self.wm.codec.openloop_error(real, pred)[:, context:]  # [B, L - context]
        if err_open.numel():
            self.log("val/openloop_mse", err_open.mean(), batch_size=err_open.shape[0])
        logger = self.logger
        if logger is None or not self.trainer.is_global_zero:
            return
        experiment = getattr(logger, "experiment", None)
        if not self.wm.pixels:
            if hasattr(experiment, "add_image"):
                plot = openloop_curves(real[0], pred[0], context)
                experiment.add_image("val/openloop", plot, self.global_step, dataformats="HWC")
            return
        real, pred = self.wm.codec.image(real), self.wm.codec.image(pred)
        if hasattr(experiment, "add_image"):
            grid = openloop_grid(real[:, : context + 24], pred[:, : context + 24])
            experiment.add_image("val/openloop", grid, self.global_step, dataformats="HWC")
        log_dir = getattr(logger, "log_dir", None)
        if log_dir:
            write_openloop_gif(real, pred, context, os.path.join(log_dir, "openloop", f"step_{self.global_step}.gif"))


def openloop_curves(real: Tensor, pred: Tensor, context: int, max_dims: int = 8, height: int = 60,
                    step_px: int = 6) -> np.ndarray:
    """Vector observations ``[T, D]`` (real and model) -> a uint8 RGB plot ``[P*height, T*step_px, 3]``:
    one panel per dimension (the first ``max_dims``), the real values in white and the model's
    in red, each panel scaled to its own range; a grey line where the model stops filtering
    (``context``) and starts imagining."""
    from PIL import Image, ImageDraw

    real, pred = real.float().cpu().numpy(), pred.float().cpu().numpy()
    T, D = real.shape
    dims = min(D, max_dims)
    width = max(2, T * step_px)
    image = Image.new("RGB", (width, dims * height), (20, 20, 20))
    draw = ImageDraw.Draw(image)
    for d in range(dims):
        top = d * height
        both = np.concatenate([real[:, d], pred[:, d]])
        low, high = float(both.min()), float(both.max())
        span = max(high - low, 1e-6)

        def y(v: float) -> float:
            return top + 3 + (height - 6) * (1 - (v - low) / span)

        draw.line([(0, top), (width, top)], fill=(60, 60, 60))
        draw.line([(context * step_px, top), (context * step_px, top + height)], fill=(110, 110, 110))
        for series, color in ((real[:, d], (235, 235, 235)), (pred[:, d], (230, 60, 60))):
            draw.line([(t * step_px, y(float(v))) for t, v in enumerate(series)], fill=color, width=2)
    return np.asarray(image)


def openloop_grid(real: Tensor, pred: Tensor) -> Tensor:
    """uint8 frames ``[B, T, H, W, C]`` -> one uint8 image ``[B*3*H, T*W, C]``: for each
    sequence a row of real frames, a row of model frames and a row of absolute differences."""
    B, T, H, W, C = real.shape
    diff = (real.float() - pred.float()).abs().to(torch.uint8)
    rows = torch.stack([real, pred, diff], 1)  # [B, 3, T, H, W, C]
    return rows.permute(0, 1, 3, 2, 4, 5).reshape(B * 3 * H, T * W, C).cpu()


def openloop_frames(real: Tensor, pred: Tensor, context: int, gap: int = 2, bar: int = 3) -> Tensor:
    """uint8 frames ``[B, T, H, W, C]`` (real and model) -> video ``[T, B*(bar+H+gap), 2*W+gap, 3]``:
    per frame one row per sequence, the real frame left and the model's right, with a bar over
    the model frame: green where it is filtered with the posterior (``t < context``), red where it
    is imagined open-loop."""
    B, T, H, W, C = real.shape
    real, pred = real.cpu(), pred.cpu()
    if C == 1:
        real, pred = real.expand(-1, -1, -1, -1, 3), pred.expand(-1, -1, -1, -1, 3)
    elif C != 3:
        real, pred = real[..., :3], pred[..., :3]
    video = torch.full((T, B, bar + H + gap, 2 * W + gap, 3), 255, dtype=torch.uint8)
    video[:, :, bar : bar + H, :W] = real.transpose(0, 1)
    video[:, :, bar : bar + H, W + gap :] = pred.transpose(0, 1)
    color = torch.tensor([[40, 170, 40] if t < context else [210, 40, 40] for t in range(T)], dtype=torch.uint8)
    video[:, :, :bar, W + gap :] = color[:, None, None, None]
    return video.reshape(T, B * (bar + H + gap), 2 * W + gap, 3)


def write_openloop_gif(real: Tensor, pred: Tensor, context: int, path: str, fps: int = 8) -> str:
    """Write :func:`openloop_frames` as an animated GIF at ``path`` (folders created); returns it."""
    from lightning_wm.video import write_gif

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_gif(list(openloop_frames(real, pred, context).numpy()), path, fps=fps)
    return path
