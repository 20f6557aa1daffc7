"""Dreamer: an RSSM world model learned from replayed sequences, and an actor-critic learned in
its imagination (DreamerV1 Gaussian or DreamerV2/V3 categorical latents, with the DreamerV3
options symlog, two-hot, return normalisation, LayerNorm/SiLU).

Shapes: ``B`` batch, ``L`` sequence length, ``H`` imagination horizon, ``N = B*L`` imagined
trajectories, ``F`` features, ``A`` action size, ``K`` bins. The world model is in
:mod:`.world_model`, the losses in :mod:`.losses`, the settings groups in :mod:`.settings`, the
actor's distribution and acting copy in :mod:`.policy`, the open-loop figures in :mod:`.plots`.

Numerics are bf16-autocast safe (``--trainer.precision bf16-mixed``, what DreamerV3 uses on
accelerators): distributions, two-hot decoding and losses are computed in float32.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_wm.actions import ActionCodec
from lightning_wm.agents.base import RLModule
from lightning_wm.agents.dreamer import losses as L
from lightning_wm.agents.dreamer.plots import openloop_curves, openloop_frames, openloop_grid
from lightning_wm.agents.dreamer.policy import ActorDistribution, DreamerPolicy, filter_and_act, initial_acting_state
from lightning_wm.agents.dreamer.settings import BehaviorSettings, DreamerNet, DreamerOptim, WorldModelLoss
from lightning_wm.agents.dreamer.world_model import DreamerWorldModel, State
from lightning_wm.compiling import CompileSettings, ShapeCompiled, as_compile_settings, drop_compiled
from lightning_wm.envs import EnvSpec
from lightning_wm.graph_capture import (
    CapturedStep,
    count_lightning_step,
    make_capturable,
    plain_optimizer_state,
    set_learning_rate,
)
from lightning_wm.logging import log_figure, log_gif, log_image
from lightning_wm.nn.blocks import MLP, soft_update
from lightning_wm.nn.codec import Obs
from lightning_wm.optim import GradClipper, build_optimizer, clip_groups, optimizer_beta
from lightning_wm.returns import lambda_return, replay_lambda_return
from lightning_wm.settings import as_settings
from lightning_wm.tree import first_leaf, tree_map
from lightning_wm.world_model import frozen, rollout

__all__ = ["Dreamer"]

NETWORKS = ("model", "actor", "critic")  # the three optimizers, in configure_optimizers' order
TERMINAL_P_END = "_terminal_p_end"  # the losses' [sum of p_end over terminal rows, their count]


class Dreamer(RLModule):
    """Dreamer agent (world model + actor + critic), trained online with manual optimization.

    Each ``training_step`` on a replay batch ``[B, L, ...]`` computes the targets (the posterior
    states of the replayed rows; an imagined rollout of ``behavior.horizon`` steps from each of
    them with :func:`~lightning_wm.world_model.rollout`; the λ-returns), then the three losses of
    :mod:`.losses` (world model, actor, critic), then reports them.

    The three losses touch disjoint parameters and are summed into ONE backward per step (as
    DistributedDataParallel requires); each network's gradients are clipped by its own
    ``optim.<network>.clip`` and the three optimizers step. Only the world model's optimizer
    steps through Lightning (so ``trainer.global_step`` counts gradient steps, not three per
    batch). Under DDP the return-normalisation percentiles are averaged across ranks, so every
    rank uses the same scale.

    Args:
        env_spec: linked from the datamodule (Discrete or Box actions; vector or 64x64 pixels).
        net: sizes and style of the networks (DreamerNet).
        loss: the world-model loss (WorldModelLoss).
        behavior: imagination, returns, actor and critic (BehaviorSettings).
        optim: one optimizer per network: model, actor, critic (DreamerOptim).
        eval_policy: how evaluation episodes act: ``mode`` (the actor's argmax / mean, as
            DreamerV2) or ``sample`` (the actor's samples, DreamerV3's ``eval`` mode: the policy
            that was trained and that made the replayed data). Training always samples.
        openloop_context: open-loop prediction at validation: steps filtered with the posterior
            before the model imagines the rest of the sequence under the replayed actions.
        openloop_sequences: replayed sequences shown in the open-loop figure and video.
        compile: what runs through ``torch.compile``
            (:class:`~lightning_wm.compiling.CompileSettings`): ``mode: cells`` the per-step RSSM
            cell and the networks' dense forwards, ``mode: step`` the three losses of a gradient
            step and their backward as one graph (CUDA graphs on CUDA with ``cuda_graphs``);
            ``true`` stands for ``cells``. Off by default: a long warm-up on CPU.
    """

    def __init__(
        self,
        env_spec: EnvSpec | None = None,
        *,
        net: DreamerNet = DreamerNet(),
        loss: WorldModelLoss = WorldModelLoss(),
        behavior: BehaviorSettings = BehaviorSettings(),
        optim: DreamerOptim = DreamerOptim(),
        eval_policy: Literal["mode", "sample"] = "mode",
        openloop_context: int = 5,
        openloop_sequences: int = 4,
        compile: CompileSettings | bool = CompileSettings(),
    ) -> None:
        super().__init__(env_spec)
        if env_spec is None:
            raise ValueError(
                "Dreamer needs env_spec (the CLI links it from the datamodule's spec; in code pass "
                "env_spec=lightning_wm.envs.env_spec(EnvConfig(...)))"
            )
        if eval_policy not in ("mode", "sample"):
            raise ValueError(f"eval_policy must be mode or sample, got {eval_policy!r}")
        if openloop_context < 1 or openloop_sequences < 1:
            raise ValueError(
                f"openloop_context and openloop_sequences must be >= 1, got {openloop_context} and {openloop_sequences}"
            )
        self.net = net = as_settings(DreamerNet, net, "net")
        self.loss = loss = as_settings(WorldModelLoss, loss, "loss")
        self.behavior = behavior = as_settings(BehaviorSettings, behavior, "behavior")
        self.optim = optim = as_settings(DreamerOptim, optim, "optim")
        self.save_settings()
        self.automatic_optimization = False
        self.eval_policy, self.openloop_context, self.openloop_sequences = (
            eval_policy,
            openloop_context,
            openloop_sequences,
        )
        self.discrete = env_spec.discrete
        # ρ, the REINFORCE loss's share of the actor's loss (1 reinforce, 0 dynamics, between: mix)
        self.reinforce_weight = behavior.gradient_weight(self.discrete)
        self.actor_grad = {1.0: "reinforce", 0.0: "dynamics"}.get(self.reinforce_weight, "mix")

        self.wm = DreamerWorldModel(env_spec, net)
        feat, A = self.wm.feat_dim, env_spec.action_dim
        hidden, layers, act, norm = net.hidden, net.layers, net.activation, net.norm
        self.actor = MLP(feat, A if self.discrete else 2 * A, hidden, layers, act, norm)
        self.critic = MLP(feat, net.bins if net.twohot else 1, hidden, layers, act, norm, zero_init_output=True)
        self.slow_critic = copy.deepcopy(self.critic).requires_grad_(False)
        # return-normalisation state (EMA of the low/high return percentiles), saved in checkpoints
        self.register_buffer("ret_low", torch.zeros(()))
        self.register_buffer("ret_high", torch.zeros(()))
        # env actions <-> the actor's one-hot / [-1, 1] actions (bounds: non-persistent buffers)
        self.actions = ActionCodec(env_spec, normalize=True)
        self.actor_distribution = ActorDistribution(
            self.discrete, net.unimix, behavior.actor_dist, behavior.action_min_std, behavior.action_max_std
        )
        self.clippers = {name: GradClipper.from_settings(getattr(optim, name).clip) for name in NETWORKS}
        self._terminal_p_end: Tensor | None = None  # since the last written log (log_p_end_at_terminal)
        self._openloop_batch: dict[str, Tensor] | None = None
        self.compile_settings = compile = as_compile_settings(compile)
        self._losses_fn = self.losses
        if compile.mode == "cells":
            self.wm._recurrent = torch.compile(self.wm._recurrent, dynamic=False)  # type: ignore[method-assign]
            self.wm.reward_head.compile(dynamic=False)
            self.wm.cont_head.compile(dynamic=False)
            self.critic.compile(dynamic=False)
            self.actor.compile(dynamic=False)
        elif compile.mode == "step":
            self._losses_fn = ShapeCompiled(self.losses, compile.max_shapes, compile.cuda_graphs)
        self._captured: CapturedStep | None = None  # compile.mode graph, made at the first CUDA step

    def _attached_trainer(self) -> Any:
        """The trainer, or None when the module is used without one (tests, benches)."""
        try:
            return self.trainer
        except RuntimeError:
            return None

    # -- actions -------------------------------------------------------------------------------
    def actor_output(self, feat: Tensor, onehot_latent: bool = False) -> Tensor:
        """The actor's raw output ``[..., A or 2A]`` (float32, what :class:`ActorDistribution`
        takes) on features ``feat [..., F]``. ``onehot_latent``: the latent part of ``feat`` is an
        exact one-hot (imagined states), so without gradient the actor's first layer may use its
        indices."""
        if onehot_latent and self.wm.latent == "categorical" and not feat.requires_grad:
            D = self.wm.deter
            z = feat[..., D:]
            return self.wm.first_layer(self.actor, {"h": feat[..., :D], "z": z, "idx": self.wm.onehot_index(z)}).float()
        return self.actor(feat).float()

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
        explore = explore or self.eval_policy == "sample"
        return filter_and_act(self.wm, self.actor, self.actor_distribution, self.actions, obs, state, explore)

    def acting_copy(self) -> DreamerPolicy:
        """What actor processes need: the encoders and the RSSM's posterior path, the actor and
        the action codec (no decoders, heads, critics or optimizer state), on the CPU, frozen."""
        actor = drop_compiled(copy.deepcopy(self.actor))  # torch.compile wrappers are bound to self.actor
        policy = DreamerPolicy(
            self.wm.acting_copy(), actor, copy.deepcopy(self.actions), self.actor_distribution, self.eval_policy
        )
        return policy.cpu().eval().requires_grad_(False)

    def acting_weights(self) -> dict[str, Tensor]:
        """:meth:`acting_copy`'s ``state_dict`` read from the live modules (what a publish sends):
        the copy's keys are found once, then every publish only gathers references."""
        keys = self.__dict__.get("_acting_keys")
        if keys is None:
            keys = self.__dict__["_acting_keys"] = list(self.acting_copy().state_dict())
        live = {
            f"{name}.{k}": v for name in ("wm", "actor", "actions") for k, v in getattr(self, name).state_dict().items()
        }
        return {k: live[k] for k in keys}

    # -- targets -------------------------------------------------------------------------------
    def world_model_loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor], dict[str, Any]]:
        """World-model loss (scalar, :func:`~.losses.world_model_loss`), its logged parts and the
        posterior ``observe`` output of the replayed rows ``[B, L, ...]``."""
        wm = self.wm
        obs, is_first = batch["obs"], batch["is_first"].bool()
        out = wm.observe(wm.encode(obs), self.actions.encode(batch["action"]), is_first)
        feat = torch.cat([out["h"], out["z"]], -1)  # [B, L, F]
        decoder_nll = wm.decoder_loss(feat, obs)
        reward_nll = wm.head_loss(wm.reward_head(feat), batch["reward"].float())
        cont_logit = wm.cont_head(feat).squeeze(-1).float()
        loss, parts = L.world_model_loss(
            decoder_nll, reward_nll, cont_logit, batch["is_terminal"], out["post"], out["prior"], self.loss
        )
        logs = {
            "train/loss_model": loss.detach(),
            "train/loss_recon": parts["decoder"].mean().detach(),
            "train/loss_reward": parts["reward"].mean().detach(),
            "train/loss_cont": parts["continue"].mean().detach(),
            "train/loss_kl_dyn": parts["kl_dyn"].mean().detach(),
            "train/loss_kl_rep": parts["kl_rep"].mean().detach(),
            "train/kl": parts["kl"].mean().detach(),
        }
        with torch.no_grad():  # how well the continue head sees the (rare) real terminations
            ends = batch["is_terminal"].float()
            p_end = torch.sigmoid(-cont_logit)
            logs["train/terminal_frac"] = ends.mean()
            logs["train/p_end_elsewhere"] = (p_end * (1 - ends)).sum() / (1 - ends).sum().clamp(min=1)
            # summed here, averaged over the steps between two written logs (gradient_step): no
            # data-dependent branch, no host sync per step
            logs[TERMINAL_P_END] = torch.stack([(p_end * ends).sum(), ends.sum()])
        return loss, logs, out

    def current_horizon(self) -> int:
        """Imagination length now: ``behavior.horizon``, or its schedule's at this rank's env steps."""
        return self.behavior.current_horizon(self.env_steps)

    def imagine(self, start: State, start_cont: Tensor) -> dict[str, Tensor]:
        """Imagine :meth:`current_horizon` steps from ``start`` (``[N, ...]``, detached) with the
        actor; returns the trajectory (:func:`~lightning_wm.world_model.rollout`) with ``raw``
        (the actor's outputs ``[H, N, *]``), ``draws [H, N, A]`` (:meth:`ActorDistribution.sample`),
        ``critic_out [H+1, N, K]``, ``value [H+1, N]`` (``behavior.bootstrap_critic``'s), the
        λ-returns ``returns [H, N]``, ``weight [H+1, N]`` (the probability that the episode still
        runs at each imagined state, ``start_cont [N]`` at the start), ``slow_values [H, N]`` and
        the actor's terms (:meth:`actor_terms`): what :func:`~.losses.behaviour_losses` takes.
        The gradient reaches the actor through the dynamics where ``reinforce_weight < 1``."""
        raws: list[Tensor] = []
        draws: list[Tensor] = []
        dynamics = self.reinforce_weight < 1

        def actor_fn(feat: Tensor) -> Tensor:
            raw = self.actor_output(feat if dynamics else feat.detach(), onehot_latent=True)
            action, draw = self.actor_distribution.sample(raw)
            raws.append(raw)
            draws.append(draw)
            return action if dynamics else action.detach()

        traj = rollout(self.wm, start, actor_fn, self.current_horizon())
        # the actor also chose an action in the last state (DI-engine's shapes); nothing uses it here
        traj["raw"] = torch.stack(raws[:-1])  # [H, N, *]
        traj["actions"] = traj["actions"][:-1]  # [H, N, A]
        traj["draws"] = traj["actions"] if self.discrete else torch.stack(draws[:-1]).detach()
        cont = 1.0 - traj["dones"]  # [H, N]
        discount = self.behavior.discount * cont
        weight = torch.cat([start_cont[None], start_cont[None] * torch.cumprod(cont, 0)]).detach()  # [H+1, N]
        states = {k: v.detach() for k, v in traj["states"].items()}
        critic_out = self.wm.first_layer(self.critic, states)  # [H+1, N, K]
        value, slow_values = self.critic_values(traj["features"], states, critic_out, dynamics)
        returns = lambda_return(traj["rewards"], value, discount, self.behavior.lambda_)  # [H, N]
        traj.update(critic_out=critic_out, value=value, returns=returns, weight=weight, slow_values=slow_values)
        traj.update(self.actor_terms(traj))
        return traj

    def critic_values(self, feats: Tensor, states: State, critic_out: Tensor, dynamics: bool) -> tuple[Tensor, Tensor]:
        """``(value [H+1, N], slow_values [H, N])`` of the imagined ``feats [H+1, N, F]`` (and
        their detached ``states``): the values the λ-returns bootstrap from
        (``behavior.bootstrap_critic``: the critic's, ``critic_out``, or the slow critic's), with
        the gradient through the features to the actor where ``dynamics`` (never into a
        critic's parameters), and the slow critic's values of every state but the last (the
        critic's regulariser target, no gradient)."""
        slow = self.behavior.bootstrap_critic == "slow_critic"
        if dynamics:
            if slow:  # the slow critic's parameters never require grad
                value = self.wm.head_mean(self.slow_critic(feats))
            else:
                with frozen(self.critic):
                    value = self.wm.head_mean(self.critic(feats))
        elif slow:
            with torch.no_grad():
                value = self.wm.head_mean(self.wm.first_layer(self.slow_critic, states))
        else:
            value = self.wm.head_mean(critic_out).detach()
        if slow:
            return value, value[:-1].detach()
        with torch.no_grad():
            slow_states = {k: v[:-1] for k, v in states.items()}
            slow_values = self.wm.head_mean(self.wm.first_layer(self.slow_critic, slow_states))
        return value, slow_values

    def actor_terms(self, traj: dict[str, Tensor]) -> dict[str, Tensor]:
        """The actor's terms ``[H, N]`` of :func:`~.losses.mixed_actor_loss` from :meth:`imagine`'s
        trajectory: ``log_prob`` and ``entropy_reinforce`` of the draws (where ``reinforce_weight
        > 0``; on features without gradient: the rollout's own outputs when the whole loss is
        REINFORCE, else the actor once more on the detached features) and ``entropy_dynamics``
        (where ``reinforce_weight < 1``: of the rollout's outputs, with the dynamics' gradient)."""
        rho, dist = self.reinforce_weight, self.actor_distribution
        terms = {}
        if rho > 0:
            raw = traj["raw"] if rho == 1 else self.actor_output(traj["features"][:-1].detach(), onehot_latent=True)
            terms["entropy_reinforce"], terms["log_prob"] = dist.entropy_and_log_prob(raw, traj["draws"], True)
        if rho < 1:
            terms["entropy_dynamics"] = dist.entropy_and_log_prob(traj["raw"], traj["draws"], False)[0]
        return terms

    def replay_critic_loss(self, batch: dict[str, Tensor], post: dict[str, Any]) -> Tensor:
        """Critic loss (scalar, :func:`~.losses.replay_critic_loss`) on the replayed posterior
        states ``post [B, L, ...]``: the λ-returns along the real rows (real rewards and
        terminations, bootstrapped with the critic, cut at episode borders;
        :func:`~lightning_wm.returns.replay_lambda_return`), so that real terminations reach the
        critic even where the continue head misses them in imagination."""
        b = self.behavior
        states = {k: post[k].detach().transpose(0, 1) for k in ("h", "z", "idx") if k in post}  # [L, B, ...]
        critic_out = self.wm.first_layer(self.critic, states)  # [L, B, K]
        value = self.wm.head_mean(critic_out).detach()

        def rows(key: str) -> Tensor:
            return batch[key].transpose(0, 1)

        targets, mask = replay_lambda_return(
            rows("reward").float(), value, rows("is_first"), rows("is_last"), rows("is_terminal"), b.discount, b.lambda_
        )
        bins = self.wm.bins if self.wm.twohot else None
        return L.replay_critic_loss(critic_out[:-1], targets, mask, bins, self.wm.symlog_obs)

    def losses(
        self, batch: dict[str, Tensor], return_range: L.ReturnRange
    ) -> tuple[dict[str, Tensor], dict[str, Tensor], L.ReturnRange]:
        """The three losses of one gradient step on a replay batch ``[B, L, ...]``, the logged
        values and the moved return range (``return_range`` in, the EMAs of the return
        percentiles: :func:`~.losses.update_return_range`; the module keeps them in ``ret_low``
        and ``ret_high``).

        ``{"model", "actor", "critic"}``: the world-model loss; then an imagined rollout from
        every (detached) posterior state with the world model frozen, and the actor and critic
        losses on it (:func:`~.losses.behaviour_losses`). Each loss reaches only its own
        network's parameters (the actor's never the world model's or the critic's, the critic's
        never the actor's or the world model's), so one backward of their sum gives every
        network exactly its own loss's gradient.
        """
        B, L_ = batch["is_first"].shape[:2]
        model_loss, logs, post = self.world_model_loss(batch)
        start = {k: post[k].detach().flatten(0, 1) for k in ("h", "z", "idx") if k in post}
        start_cont = 1.0 - batch["is_terminal"].reshape(B * L_).float()
        traj = self.imagine(start, start_cont)
        bins = self.wm.bins if self.wm.twohot else None
        actor_loss, critic_loss, return_range, behaviour_logs = L.behaviour_losses(
            traj, return_range, self.behavior, self.reinforce_weight, bins, self.wm.symlog_obs, self.rank_mean()
        )
        logs.update(behaviour_logs)
        if self.behavior.replay_critic_weight > 0:
            replay_loss = self.replay_critic_loss(batch, post)
            critic_loss = critic_loss + self.behavior.replay_critic_weight * replay_loss
            logs["train/loss_critic_replay"] = replay_loss.detach()
        return {"model": model_loss, "actor": actor_loss, "critic": critic_loss}, logs, return_range

    def rank_mean(self) -> Callable[[Tensor], Tensor] | None:
        """The mean over DDP ranks (the return percentiles': every rank keeps the same scale);
        None in one process."""
        trainer = self._attached_trainer()
        if trainer is None or trainer.world_size <= 1:
            return None
        return lambda x: trainer.strategy.reduce(x, reduce_op="mean")

    # -- optimization --------------------------------------------------------------------------
    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        """Three optimizers (:func:`~lightning_wm.optim.build_optimizer` of ``optim.model``,
        ``optim.actor``, ``optim.critic``) over the world model's, the actor's and the critic's parameters."""
        trainer = self._attached_trainer()
        if str(getattr(trainer, "precision", None)) in ("16-mixed", "16", "16-true"):
            raise ValueError(
                f"Dreamer does not support --trainer.precision {trainer.precision}: its actor and critic "
                "step on gradients fp16 loss scaling would leave scaled; use bf16-mixed (or 32-true)"
            )
        modules = {"model": self.wm, "actor": self.actor, "critic": self.critic}
        optimizers = [build_optimizer(modules[name].parameters(), getattr(self.optim, name)) for name in NETWORKS]
        for name, opt in zip(NETWORKS, optimizers):
            self.clippers[name].beta = optimizer_beta(opt)
        return optimizers

    def clip_gradients(self) -> dict[str, Tensor]:
        """Clip each network's gradients (``optim.<network>.clip``); their pre-clip norms."""
        modules = {"model": self.wm, "actor": self.actor, "critic": self.critic}
        norms = clip_groups([self.clippers[n] for n in NETWORKS], [modules[n].parameters() for n in NETWORKS])
        return {f"grad_norm/{name}": norm for name, norm in zip(NETWORKS, norms)}

    def set_learning_rates(self, optimizers: list[Any]) -> dict[str, Tensor]:
        """Each optimizer's learning rate for this step (logged where it is scheduled)."""
        logs = {}
        for name, opt in zip(NETWORKS, optimizers):
            settings = getattr(self.optim, name)
            lr = settings.lr * settings.lr_factor_at(self.global_step)
            for group in getattr(opt, "optimizer", opt).param_groups:
                set_learning_rate(group, lr)
            if settings.scheduled:
                logs[f"train/lr_{name}"] = torch.tensor(lr)
        return logs

    def move_slow_critic(self) -> None:
        """The slow critic's soft update, every ``behavior.slow_critic_every`` gradient steps."""
        if self.global_step % self.behavior.slow_critic_every == 0:
            soft_update(self.slow_critic, self.critic, self.behavior.slow_critic_tau)

    def log_p_end_at_terminal(self, logs: dict[str, Tensor], written: bool) -> None:
        """Take :meth:`world_model_loss`'s terminal rows out of its ``logs`` and add them to those
        since the last written log; where the logger writes this step (``written``), log
        ``train/p_end_at_terminal`` (their mean end probability; left out where there were none)
        and start again. Terminal rows are rare, so a per-step mean would be missing or noisy, and
        reading it per step would wait for the device every step."""
        p_end_sum_count = logs.pop(TERMINAL_P_END)
        if self._terminal_p_end is None or self._terminal_p_end.device != p_end_sum_count.device:
            self._terminal_p_end = torch.zeros_like(p_end_sum_count)
        self._terminal_p_end += p_end_sum_count
        if written:
            total, count = self._terminal_p_end.tolist()
            if count > 0:
                logs["train/p_end_at_terminal"] = torch.tensor(total / count)
            self._terminal_p_end.zero_()

    def gradient_step(
        self, batch: dict[str, Tensor], optimizers: list[Any], recorded: bool | None = None
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """One gradient step on a replay batch ``[B, L, ...]``; returns the losses and the logged
        values (without a trainer too: benches and tests). Every form of the step runs it:

        1. each optimizer's learning rate for this step (:meth:`set_learning_rates`; tensors
           written in place where the step is recorded);
        2. :meth:`update_networks`: :meth:`losses` (compiled with ``compile.mode: step``), ONE
           backward of their sum, :meth:`clip_gradients`, the three optimizers' steps -- eagerly,
           or (``recorded``; default: ``compile.mode: graph`` on CUDA) recorded once as a CUDA
           graph and replayed (:class:`~lightning_wm.graph_capture.CapturedStep`; off CUDA the
           recording protocol without a graph), Lightning's step count then advanced outside it;
        3. the slow critic's move (:meth:`move_slow_critic`) and the terminal log.

        Eagerly the world model's optimizer steps through Lightning (a ``LightningOptimizer``
        step advances ``trainer.global_step``: one per gradient step, which the replay ratio and
        the checkpoint schedule count on; its hooks and precision plugin run) and the backward is
        Lightning's ``manual_backward`` (DDP); the actor's and critic's step their plain optimizer.
        """
        if recorded is None:
            recorded = self.compile_settings.mode == "graph" and batch["is_first"].is_cuda
        written = self.logs_step(self.global_step + 1)
        captured = self.recorded_step(optimizers) if recorded else None
        lr_logs = self.set_learning_rates(optimizers)
        if captured is not None:
            losses, logs = captured(batch, key=self.current_horizon())
            count_lightning_step(optimizers[0])
        else:
            stepping = [optimizers[0], *(getattr(opt, "optimizer", opt) for opt in optimizers[1:])]
            losses, logs = self.update_networks(batch, stepping, self._losses_fn, self._backward)
        self.move_slow_critic()
        self.log_p_end_at_terminal(logs, written)
        logs.update(lr_logs)
        return losses, logs

    def update_networks(
        self,
        batch: dict[str, Tensor],
        optimizers: list[Any],
        losses_fn: Callable[..., Any],
        backward: Callable[[Tensor], None],
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The body of :meth:`gradient_step` (what ``compile.mode: graph`` records): the losses
        (``losses_fn``, :meth:`losses` or its compiled form) and the moved return range written
        into ``ret_low``/``ret_high``, ``backward`` of the losses' sum, :meth:`clip_gradients`,
        then every optimizer's step."""
        losses, logs, (low, high) = losses_fn(batch, (self.ret_low, self.ret_high))
        with torch.no_grad():
            self.ret_low.copy_(low)
            self.ret_high.copy_(high)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        backward(losses["model"] + losses["actor"] + losses["critic"])
        logs.update(self.clip_gradients())
        for opt in optimizers:
            opt.step()
        return losses, logs

    def _backward(self, loss: Tensor) -> None:
        """``loss.backward()``, through Lightning's ``manual_backward`` where a trainer is attached."""
        if self._attached_trainer() is None:
            loss.backward()
        else:
            self.manual_backward(loss)

    def recorded_step(self, optimizers: list[Any]) -> CapturedStep:
        """:meth:`update_networks` on the plain optimizers (made capturable) and plain backward,
        as a :class:`~lightning_wm.graph_capture.CapturedStep` (one graph per batch shape and
        imagination horizon), made at the first call."""
        if self._captured is None:
            plain = [getattr(opt, "optimizer", opt) for opt in optimizers]
            trainer = self._attached_trainer()
            if trainer is not None and trainer.world_size > 1:
                raise ValueError(
                    "compile.mode graph records the step on one device; with DDP use compile.mode step or none"
                )
            make_capturable(plain)
            step = partial(self.update_networks, optimizers=plain, losses_fn=self.losses, backward=Tensor.backward)
            self._captured = CapturedStep(step, max_shapes=self.compile_settings.max_shapes)
        return self._captured

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """One gradient step (:meth:`gradient_step`: targets and losses, ONE backward of their
        sum, clipping, the optimizers' steps), then the report (logged scalars).

        A single backward per ``training_step`` is what DistributedDataParallel needs (it wraps
        ``training_step`` as its forward and all-reduces the gradients of every parameter during
        the one backward that follows); the losses touch disjoint parameter sets, so the sum
        gives the same gradients as three separate backwards.
        """
        B = batch["is_first"].shape[0]
        self._openloop_batch = tree_map(lambda v: v[: self.openloop_sequences].detach().clone(), batch)
        losses, logs = self.gradient_step(batch, self.optimizers())
        self.log_dict(logs, on_step=True, on_epoch=False, batch_size=B)
        self.log("train/loss", losses["model"].detach(), prog_bar=True, batch_size=B)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["grad_clippers"] = {name: clipper.state_dict() for name, clipper in self.clippers.items()}
        if "optimizer_states" in checkpoint:  # a recorded run's (compile.mode graph) resume anywhere
            checkpoint["optimizer_states"] = [plain_optimizer_state(s) for s in checkpoint["optimizer_states"]]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        for name, state in checkpoint.get("grad_clippers", {}).items():
            self.clippers[name].load_state_dict(state)

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
        action = self.actions.encode(batch["action"])
        return batch["obs"], self.wm.openloop(batch["obs"], action, batch["is_first"].bool(), context)

    def log_openloop(self) -> None:
        """Log the open-loop error of the last training batch's first sequences and a picture of it.

        Vector observations: a figure of the first sequence, one panel per dimension with the
        real and the predicted values over time and a line where the model stops filtering
        (:func:`~.plots.openloop_curves`). Pixels: an image grid (real / model / difference
        rows, time along the columns) and an animated GIF ``<log_dir>/openloop/step_<N>.gif``
        (real | model side by side per frame, one row per sequence, a green bar over the model
        frames filtered with the posterior and a red one over those it imagines open-loop).
        """
        batch = self._openloop_batch
        if batch is None:
            return
        context = self.openloop_context
        real, pred = self.openloop(batch, context)
        err_open = self.wm.codec.openloop_error(real, pred)[:, context:]  # [B, L - context]
        if err_open.numel():
            self.log("val/openloop_mse", err_open.mean(), batch_size=err_open.shape[0])
        trainer = self._attached_trainer()
        if trainer is None or not trainer.is_global_zero:
            return
        if not self.wm.pixels:
            log_figure(self, "val/openloop", openloop_curves(real[0], pred[0], context))
            return
        real, pred = self.wm.codec.image(real), self.wm.codec.image(pred)
        log_image(
            self, "val/openloop", openloop_grid(real[:, : context + 24], pred[:, : context + 24]), dataformats="HWC"
        )
        log_gif(self, "openloop", openloop_frames(real, pred, context))
