"""Dreamer: an RSSM world model learned from replayed sequences, and an actor-critic learned in
its imagination (DreamerV1 Gaussian latents or DreamerV2/V3 categorical latents, with the
DreamerV3 options symlog, two-hot, return normalisation, LayerNorm/SiLU).

Shapes: ``B`` batch, ``L`` sequence length, ``H`` imagination horizon, ``N = B*L`` imagined
trajectories, ``F`` features, ``A`` action size, ``K`` bins. The world model is in
:mod:`.world_model`, the open-loop pictures in :mod:`.plots`.

Numerics are bf16-autocast safe (``--trainer.precision bf16-mixed``, what DreamerV3 uses on
accelerators): distributions, two-hot decoding and losses are computed in float32.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_wm.actions import ActionCodec
from lightning_wm.agents.base import RLModule
from lightning_wm.agents.dreamer.plots import openloop_curves, openloop_frames, openloop_grid
from lightning_wm.agents.dreamer.world_model import DreamerWorldModel, State
from lightning_wm.envs import EnvSpec
from lightning_wm.logging import log_gif, log_image
from lightning_wm.nn import dists
from lightning_wm.nn.blocks import MLP
from lightning_wm.nn.codec import Obs
from lightning_wm.optim import lr_factor
from lightning_wm.returns import lambda_return, replay_lambda_return
from lightning_wm.tree import first_leaf, tree_map
from lightning_wm.world_model import RolloutSchedule, frozen, rollout


@dataclass(frozen=True)
class ActorDistribution:
    """Dreamer's action distribution over the actor's raw output: ``[..., A]`` logits (discrete:
    one-hot categorical with ``unimix``) or ``[..., 2A]`` mean/std parameters (continuous:
    ``bounded_normal`` or ``tanh_normal`` with std in ``[min_std, max_std]``, actions in ``[-1, 1]``)."""

    discrete: bool
    unimix: float = 0.01
    kind: str = "bounded_normal"
    min_std: float = 0.1
    max_std: float = 1.0

    def continuous(self, raw: Tensor) -> tuple[Tensor, Tensor]:
        """``(mean, std) [..., A]`` of a continuous actor."""
        if self.kind == "bounded_normal":
            return dists.bounded_normal(raw, self.min_std, self.max_std)
        return dists.tanh_normal(raw, self.min_std, self.max_std)

    def action(self, raw: Tensor, explore: bool) -> Tensor:
        """A sample (``explore``; continuous samples reparameterised) or the mode: ``[..., A]``
        one-hot, or in ``[-1, 1]``. ``raw`` float32."""
        if self.discrete:
            probs = dists.unimix_probs(raw, self.unimix)
            return dists.sample_onehot(probs.detach()) if explore else dists.onehot_argmax(raw)
        mean, std = self.continuous(raw)
        if not explore:
            return mean if self.kind == "bounded_normal" else torch.tanh(mean)
        sample = dists.bounded_normal_sample if self.kind == "bounded_normal" else dists.tanh_normal_sample
        return sample(mean, std)[0]


def initial_acting_state(wm: DreamerWorldModel, actions: ActionCodec, batch_size: int, device: torch.device) -> State:
    """The state before an episode's first observation: zeros ``{"h", "z", "action"}``."""
    state = wm.zero_state(batch_size, device)
    state["action"] = actions.zeros(batch_size, device)
    return state


def filter_and_act(
    wm: DreamerWorldModel,
    actor: nn.Module,
    distribution: ActorDistribution,
    actions: ActionCodec,
    obs: Obs,
    state: State,
    explore: bool,
) -> tuple[Tensor, State, dict[str, Tensor]]:
    """One acting step: filter ``obs [B, ...]`` into the posterior after ``state`` (whose
    ``"action"`` is the previous action), act on its features, return ``(env action, state, {})``."""
    post = wm.obs_step(state, state["action"], wm.encode(obs))
    action = distribution.action(actor(wm.features(post)).float(), explore)
    return actions.decode(action), {"h": post["h"], "z": post["z"], "action": action}, {}


class DreamerPolicy(nn.Module):
    """Dreamer's acting copy (:meth:`Dreamer.acting_copy`): the world model's encoders and RSSM
    posterior path, the actor and the action codec; acts exactly like :meth:`Dreamer.act`."""

    def __init__(
        self,
        wm: DreamerWorldModel,
        actor: nn.Module,
        actions: ActionCodec,
        distribution: ActorDistribution,
        eval_policy: str = "mode",
    ) -> None:
        super().__init__()
        self.wm, self.actor, self.actions, self.distribution = wm, actor, actions, distribution
        self.eval_policy = eval_policy

    def initial_state(self, batch_size: int) -> State:
        return initial_acting_state(self.wm, self.actions, batch_size, self.wm.bins.device)

    @torch.no_grad()
    def act(self, obs: Obs, state: State | None, explore: bool) -> tuple[Tensor, State, dict[str, Tensor]]:
        if state is None:
            state = self.initial_state(first_leaf(obs).shape[0])
        explore = explore or self.eval_policy == "sample"
        return filter_and_act(self.wm, self.actor, self.distribution, self.actions, obs, state, explore)


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

    The settings are flat init args on purpose (one YAML level; the size presets and every
    ``--model.init_args.<name>`` override address them by name, as DreamerV3's own configs do):
    grouping them into dataclasses would lengthen every override and move every config, preset,
    test and bench without making one of them clearer. The groups are the paragraphs below.

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
        cont_terminal_weight: weight of the continue head's loss on rows that end an episode
            (``is_terminal``) relative to the others (1: DreamerV3). Ends are rare in replay once
            the agent is good (one row in hundreds), so the head can stay blind to a kind of end
            it sees seldom, such as CartPole's track edge.
        loss_replay_critic: scale of a second critic loss on the replayed sequences themselves
            (lambda returns of the real rewards and terminations, :meth:`replay_critic_loss`;
            DreamerV3's later ``repval``, 0.3 there); 0 turns it off.
        lr_*, clip_*, eps_*: Adam learning rates, gradient-norm clips and epsilons.
        lr_anneal_steps: anneal the actor's and the critic's learning rates linearly to 0 over
            this many gradient steps (:func:`lightning_wm.optim.lr_factor`; the same option as
            IMPALA's and MuZero's), so the policy settles instead of drifting late in a run; the
            world model keeps ``lr_model`` and goes on fitting new data. None: constant rates.
        entropy: actor entropy coefficient.
        actor_grad: ``auto`` (REINFORCE for discrete, dynamics backprop for continuous),
            ``reinforce`` or ``dynamics``.
        actor_dist: continuous actions as ``bounded_normal`` (DreamerV3) or ``tanh_normal``.
        action_min_std, action_max_std: bounds of the continuous action std.
        slow_critic, slow_critic_every, slow_reg: EMA fraction and period of the slow critic,
            weight of the regulariser towards it.
        return_norm, return_norm_decay, return_norm_low, return_norm_high: normalise advantages
            by ``max(1, EMA(P_high) - EMA(P_low))`` of the returns.
        eval_policy: how evaluation episodes act: ``mode`` (the actor's argmax / mean, as
            DreamerV2) or ``sample`` (the actor's samples, DreamerV3's ``eval`` mode: the policy
            that was trained and that made the replayed data). Training always samples.
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
        cont_terminal_weight: float = 1.0,
        loss_replay_critic: float = 0.0,
        lr_model: float = 1e-4,
        lr_actor: float = 3e-5,
        lr_critic: float = 3e-5,
        eps_model: float = 1e-8,
        eps_actor: float = 1e-5,
        eps_critic: float = 1e-5,
        lr_anneal_steps: int | None = None,
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
        eval_policy: Literal["mode", "sample"] = "mode",
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
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon} (imagined steps per actor-critic update)")
        if actor_grad not in ("auto", "reinforce", "dynamics"):
            raise ValueError(f"actor_grad must be auto, reinforce or dynamics, got {actor_grad!r}")
        if cont_terminal_weight <= 0:
            raise ValueError(f"cont_terminal_weight must be > 0, got {cont_terminal_weight}")
        if lr_anneal_steps is not None and lr_anneal_steps < 1:
            raise ValueError(f"lr_anneal_steps must be >= 1 or null, got {lr_anneal_steps}")
        if eval_policy not in ("mode", "sample"):
            raise ValueError(f"eval_policy must be mode or sample, got {eval_policy!r}")
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
                raise ValueError(
                    f"horizon_schedule [start_step, min_horizon, end_step] needs 1 <= min_horizon <= "
                    f"horizon ({horizon}) and 0 <= start_step <= end_step; got {list(horizon_schedule)}"
                )
            self.horizon_schedule = RolloutSchedule(
                start_step=start,
                end_step=end,
                min_length=min_horizon,
                max_length=horizon,
            )

        self.wm = DreamerWorldModel(
            env_spec,
            deter,
            stoch,
            classes,
            hidden,
            layers,
            latent,
            act,
            norm,
            unimix,
            symlog_obs,
            twohot,
            bins,
            cnn_depth,
        )
        feat, A = self.wm.feat_dim, env_spec.action_dim
        self.actor = MLP(feat, A if self.discrete else 2 * A, hidden, layers, act, norm)
        self.critic = MLP(feat, bins if twohot else 1, hidden, layers, act, norm, zero_init_output=True)
        self.slow_critic = copy.deepcopy(self.critic).requires_grad_(False)
        # return-normalisation state (EMA of the low/high return percentiles), saved in checkpoints
        self.register_buffer("ret_low", torch.zeros(()))
        self.register_buffer("ret_high", torch.zeros(()))
        # env actions <-> the actor's one-hot / [-1, 1] actions (bounds: non-persistent buffers)
        self.actions = ActionCodec(env_spec, normalize=True)
        self.actor_distribution = ActorDistribution(self.discrete, unimix, actor_dist, action_min_std, action_max_std)
        self._openloop_batch: dict[str, Tensor] | None = None
        if compile:
            self.wm._recurrent = torch.compile(self.wm._recurrent, dynamic=False)  # type: ignore[method-assign]
            self.wm.reward_head.compile(dynamic=False)
            self.wm.cont_head.compile(dynamic=False)
            self.critic.compile(dynamic=False)
            self.actor.compile(dynamic=False)

    # -- actions -------------------------------------------------------------------------------
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
        return self.actor_distribution.action(raw, explore), raw

    # -- Agent protocol ------------------------------------------------------------------------
    def initial_state(self, batch_size: int) -> State:
        """``{"h": [B, D], "z": [B, S], "action": [B, A]}`` zeros on the module's device."""
        return initial_acting_state(self.wm, self.actions, batch_size, self.device)

    @torch.no_grad()
    def act(self, obs: Obs, state: State | None, explore: bool) -> tuple[Tensor, State, dict[str, Tensor]]:
        """Filter ``obs [B, ...]`` with the posterior and act: a sample of the actor
        (``explore``, or always with ``eval_policy: sample``) or its mode."""
        if state is None:
            state = self.initial_state(first_leaf(obs).shape[0])
        explore = explore or self.hparams.get("eval_policy", "mode") == "sample"
        return filter_and_act(self.wm, self.actor, self.actor_distribution, self.actions, obs, state, explore)

    def acting_copy(self) -> DreamerPolicy:
        """What actor processes need: the encoders and the RSSM's posterior path, the actor and
        the action codec (no decoders, heads, critics or optimizer state), on the CPU, frozen."""
        actor = copy.deepcopy(self.actor)
        for module in actor.modules():
            module._compiled_call_impl = None  # a torch.compile wrapper bound to self.actor
        policy = DreamerPolicy(
            self.wm.acting_copy(),
            actor,
            copy.deepcopy(self.actions),
            self.actor_distribution,
            self.hparams.get("eval_policy", "mode"),
        )
        return policy.cpu().eval().requires_grad_(False)

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
        action = self.actions.encode(batch["action"])
        out = wm.observe(wm.encode(obs), action, is_first)
        feat = torch.cat([out["h"], out["z"]], -1)  # [B, L, F]
        rec = wm.decoder_loss(feat, obs)
        rew = wm.head_loss(wm.reward_head(feat), batch["reward"].float())
        cont_target = 1.0 - batch["is_terminal"].float()
        cont_logit = wm.cont_head(feat).squeeze(-1).float()
        cont = dists.bernoulli_nll(cont_logit, cont_target)
        if hp.get("cont_terminal_weight", 1.0) != 1.0:  # rare real ends count more (torch's pos_weight)
            cont = torch.where(batch["is_terminal"].bool(), cont * hp.cont_terminal_weight, cont)
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
        # the actor also chose an action in the last state (DI-engine's shapes); nothing uses it here
        traj["raw"] = torch.stack(raws[:-1])  # [H, N, *]
        traj["actions"] = traj["actions"][:-1]  # [H, N, A]
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
            mean, std = self.actor_distribution.continuous(raw)
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

    def replay_critic_loss(self, batch: dict[str, Tensor], post: dict[str, Any]) -> Tensor:
        """Critic loss (scalar) on the replayed posterior states ``post [B, L, ...]``: the
        lambda returns along the real rows (real rewards and terminations, bootstrapped with the
        critic, cut at episode borders; :func:`~lightning_wm.returns.replay_lambda_return`).

        Real terminations reach the critic here even where the continue head misses them in
        imagination (rare ends, such as CartPole's track edges, which imagination alone never sees).
        """
        hp = self.hparams
        states = {k: post[k].detach().transpose(0, 1) for k in ("h", "z", "idx") if k in post}  # [L, B, ...]
        critic_out = self.wm.first_layer(self.critic, states)  # [L, B, K]
        value = self.wm.head_mean(critic_out).detach()

        def rows(key: str) -> Tensor:
            return batch[key].transpose(0, 1)

        targets, mask = replay_lambda_return(
            rows("reward").float(), value, rows("is_first"), rows("is_last"), rows("is_terminal"), hp.gamma, hp.lambda_
        )
        return (mask.to(targets.dtype) * self.wm.head_loss(critic_out[:-1], targets)).mean()

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
        if self.hparams.loss_replay_critic > 0:
            replay_loss = self.replay_critic_loss(batch, post)
            critic_loss = critic_loss + self.hparams.loss_replay_critic * replay_loss
            logs["train/loss_critic_replay"] = replay_loss.detach()
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
        for name, module, clip in (
            ("model", self.wm, hp.clip_model),
            ("actor", self.actor, hp.clip_actor),
            ("critic", self.critic, hp.clip_critic),
        ):
            norms[f"grad_norm/{name}"] = torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt_model, opt_actor, opt_critic = optimizers
        factor = lr_factor(self.global_step, 0, hp.get("lr_anneal_steps"))
        for opt, base in ((opt_actor, hp.lr_actor), (opt_critic, hp.lr_critic)):
            for group in getattr(opt, "optimizer", opt).param_groups:
                group["lr"] = base * factor  # a function of the step alone: resumes need no scheduler state
        opt_model.step()
        for opt in (opt_actor, opt_critic):
            getattr(opt, "optimizer", opt).step()
        if hp.get("lr_anneal_steps") is not None:
            norms["train/lr_actor"] = torch.tensor(hp.lr_actor * factor)
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
        action = self.actions.encode(batch["action"])
        L = first_leaf(obs).shape[1]
        context = max(1, min(context, L))
        observed = tree_map(lambda x: x[:, :context], obs)
        out = wm.observe(wm.encode(observed), action[:, :context], is_first[:, :context])
        feats = [torch.cat([out["h"], out["z"]], -1)]
        state = {k: out[k][:, -1] for k in ("h", "z", "idx") if k in out}
        for t in range(context, L):
            state = wm.img_step(state, action[:, t - 1], mode=True)
            feats.append(wm.features(state)[:, None])
        return obs, wm.decode_features(torch.cat(feats, 1))

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
        if self._trainer is None or not self.trainer.is_global_zero:
            return
        if not self.wm.pixels:
            log_image(self, "val/openloop", openloop_curves(real[0], pred[0], context), dataformats="HWC")
            return
        real, pred = self.wm.codec.image(real), self.wm.codec.image(pred)
        log_image(
            self, "val/openloop", openloop_grid(real[:, : context + 24], pred[:, : context + 24]), dataformats="HWC"
        )
        log_gif(self, "openloop", openloop_frames(real, pred, context))
