"""The :class:`MuZero` LightningModule: acting by tree search over the learned model, a K-step
unroll trained on replayed windows with n-step targets, prioritized replay feedback and
reanalyse with a target network; :class:`MuZeroPolicy` is its acting copy for actor processes.

Shapes: ``B`` batch, ``K`` unroll steps, ``W = K + td_steps + 1`` window rows from the sampled
position (``h = frame_stack - 1`` history rows before it), ``A`` actions.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_wm.agents.base import RLModule
from lightning_wm.agents.muzero.model import MuZeroModel
from lightning_wm.agents.muzero.targets import UnrollTargets, bootstrap_rows, muzero_targets
from lightning_wm.envs import EnvSpec
from lightning_wm.nn import dists
from lightning_wm.nn.blocks import scale_gradient, soft_update
from lightning_wm.optim import OptimSettings, build_optimizer, with_lr_schedule
from lightning_wm.search import SearchOutput, TemperatureSchedule, mcts

__all__ = [
    "MuZero",
    "MuZeroPolicy",
    "SearchSettings",
    "LossSettings",
    "unroll_losses",
    "unroll_step_weight",
    "push_frame",
    "window_stacks",
    "reanalyze_td_steps",
]


# -- frame stacks --------------------------------------------------------------------------------
def push_frame(stack: Tensor, frame: Tensor) -> Tensor:
    """``stack [B, K, ...]`` (oldest first) with ``frame [B, ...]`` appended and the oldest dropped."""
    return torch.cat([stack[:, 1:], frame.unsqueeze(1).to(stack.dtype)], 1)


def window_stacks(obs: Tensor, mask: Tensor, frames: int) -> Tensor:
    """Frame stacks of every row from ``frames - 1`` on: ``obs [B, L, ...]`` with ``mask [B, L]``
    -> ``[B, L - frames + 1, frames, ...]`` (oldest first); frames of masked rows (before the
    episode's first row, after its end) are zeros, as an acting stack starts from zeros."""
    obs = obs * mask.view(*mask.shape, *([1] * (obs.dim() - 2))).to(obs.dtype)
    return obs.unfold(1, frames, 1).movedim(-1, 2)


# -- acting ----------------------------------------------------------------------------------------
@dataclass
class SearchSettings:
    """The search options of :func:`lightning_wm.search.mcts` that acting and reanalyse share."""

    num_simulations: int = 50
    discount: float = 0.997
    pb_c_init: float = 1.25
    pb_c_base: float = 19652.0
    dirichlet_alpha: float = 0.25
    exploration_fraction: float = 0.25
    gumbel: bool = False
    max_num_considered_actions: int = 16
    unvisited_q: str = "mean"
    compile: bool = False


def search(
    model: MuZeroModel,
    settings: SearchSettings,
    obs: Tensor,
    explore: bool,
    temperature: float = 1.0,
    legal_actions_mask: Tensor | None = None,
) -> SearchOutput:
    """One batched search from observations ``obs [B, *obs_shape]`` with ``model`` in eval mode
    (BatchNorm statistics), no gradients."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            root = model.initial_inference(obs)
            return mcts(
                model.recurrent_fn,
                root["state"],
                root["policy_logits"],
                root["value"],
                explore=explore,
                temperature=temperature,
                legal_actions_mask=legal_actions_mask,
                **asdict(settings),
            )
    finally:
        model.train(was_training)


class SearchStats:
    """Running means of what the acting searches saw (logged as ``search/*``)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.count, self.root_value, self.entropy, self.depth, self.max_depth = 0, 0.0, 0.0, 0.0, 0

    def add(self, out: SearchOutput) -> None:
        probs = out.visit_probs.float()
        entropy = -(probs * torch.log(probs.clamp(min=1e-12))).sum(-1)
        n = int(out.root_value.numel())
        self.count += n
        self.root_value += float(out.root_value.float().sum())
        self.entropy += float(entropy.sum())
        self.depth += float(out.max_depth.float().sum())
        self.max_depth = max(self.max_depth, int(out.max_depth.max()))

    def means(self) -> dict[str, float]:
        n = max(1, self.count)
        return {
            "search/root_value": self.root_value / n,
            "search/visit_entropy": self.entropy / n,
            "search/depth": self.depth / n,
            "search/max_depth": float(self.max_depth),
        }


class MuZeroPolicy(nn.Module):
    """MuZero's acting: the observation (pushed onto the acting state's frame stack when
    ``frame_stack > 1``) is represented, searched from, and the action taken by visit counts.

    The acting copy of :class:`MuZero` (:meth:`MuZero.acting_copy`) is one of these holding a
    copy of the model; :meth:`MuZero.act` runs the same code on the module's own model. The
    current visit-count ``temperature`` is a buffer, so it travels with the published weights.

    ``act`` returns extras ``root_value [B]`` and ``visit_probs [B, A]``: the rows' search
    value and policy target.
    """

    def __init__(self, model: MuZeroModel, settings: SearchSettings, temperature: float = 1.0) -> None:
        super().__init__()
        self.model, self.settings = model, settings
        self.register_buffer("temperature", torch.tensor(float(temperature)))
        self.stats = SearchStats()

    @property
    def device(self) -> torch.device:
        return self.temperature.device

    def initial_state(self, batch_size: int) -> Tensor | None:
        return initial_frames(self.model, batch_size, self.device)

    @torch.no_grad()
    def act(self, obs: Tensor, state: Tensor | None, explore: bool) -> tuple[Tensor, Any, dict[str, Tensor]]:
        return act_with_search(self.model, self.settings, float(self.temperature), obs, state, explore, self.stats)


def initial_frames(model: MuZeroModel, batch_size: int, device: torch.device) -> Tensor | None:
    """The acting state before an episode: ``None``, or a zero frame stack ``[B, K, H, W, C]``."""
    if model.frame_stack == 1:
        return None
    return torch.zeros(batch_size, *model.obs_shape, dtype=torch.uint8, device=device)


def act_with_search(
    model: MuZeroModel,
    settings: SearchSettings,
    temperature: float,
    obs: Tensor,
    state: Tensor | None,
    explore: bool,
    stats: SearchStats | None = None,
) -> tuple[Tensor, Any, dict[str, Tensor]]:
    """The one acting step of :class:`MuZero` and :class:`MuZeroPolicy`: ``(action [B], state,
    {"root_value": [B], "visit_probs": [B, A]})``; search statistics of exploring steps go to ``stats``."""
    if model.frame_stack > 1:
        if state is None:
            state = initial_frames(model, obs.shape[0], obs.device)
        state = push_frame(state, obs)
        obs = state
    out = search(model, settings, obs, explore, temperature)
    if explore and stats is not None:
        stats.add(out)
    return out.action, state, {"root_value": out.root_value.float(), "visit_probs": out.visit_probs.float()}


# -- reanalyse horizon -------------------------------------------------------------------------------
def reanalyze_td_steps(age: Tensor, td_steps: int, schedule: tuple[int, int] | None) -> Tensor:
    """Reanalyse's n per sample ``[B]`` (int64): ``td_steps``, or with ``schedule = (max_age,
    min_td_steps)`` (ALF's ``LinearTdStepFunc``, EfficientZero's "dynamic horizon")
    ``ceil(min + (td_steps - min) * max(0, 1 - age / max_age))``: fresh rows bootstrap
    ``td_steps`` ahead, rows ``max_age`` or more rows old ``min_td_steps``."""
    if schedule is None:
        return torch.full_like(age, td_steps, dtype=torch.long)
    max_age, low = schedule
    frac = (1.0 - age.double() / float(max_age)).clamp(min=0.0)
    return torch.ceil(low + (td_steps - low) * frac).long()


# -- the unroll losses -------------------------------------------------------------------------------
@dataclass
class LossSettings:
    """What :func:`unroll_losses` trains and how much each part weighs (ALF's switches)."""

    recurrent_gradient_scaling_factor: float = 0.5
    value_loss_weight: float = 0.25
    reward_loss_weight: float = 1.0
    policy_loss_weight: float = 1.0
    game_over_loss_weight: float = 1.0
    repr_loss_weight: float = 1.0
    train_reward_function: bool = True
    train_policy: bool = True
    train_game_over_function: bool = False
    train_repr_prediction: bool = False
    unroll_step_weights: str = "pseudocode"


def unroll_step_weight(num_unroll_steps: int, rule: str) -> Tensor:
    """Weights ``[K + 1]`` of the unroll's steps in the loss: ``pseudocode`` (the MuZero pseudocode,
    ALF): step 0 weighs 1 and every unrolled step ``1 / K``; ``equal`` (EfficientZero, LightZero):
    every step weighs ``1 / K``, so the K unrolled steps together weigh K times step 0."""
    K = num_unroll_steps
    if rule == "pseudocode":
        return torch.tensor([1.0] + [1.0 / K] * K)
    if rule == "equal":
        return torch.full((K + 1,), 1.0 / K)
    raise ValueError(f"unroll_step_weights must be 'pseudocode' or 'equal', got {rule!r}")


def unroll_losses(
    model: MuZeroModel, obs: Tensor, t: UnrollTargets, valid: Tensor, settings: LossSettings
) -> tuple[dict[str, Tensor], Tensor]:
    """Per-sample losses ``{name: [B]}`` of the K-step unroll of ``model`` from ``obs [B, W, ...]``
    (row 0 the position; rows ``1..K`` for latent consistency) along ``t.actions`` (steps
    weighted by :func:`unroll_step_weight`; the hidden state's gradient scaled at every step), and the
    network's value at the position ``[B]`` (no gradient). ``valid [B, W]``: the window's mask."""
    K = t.actions.shape[1]
    root = model.initial_inference(obs[:, 0])
    state = root["state"]
    policy_logits, value_logits = [root["policy_logits"]], [root["value_logits"]]
    reward_logits, states = [], [state]
    for k in range(K):
        r_logits, state = model.dynamics(state, t.actions[:, k])
        p_logits, v_logits = model.prediction(state)
        reward_logits.append(r_logits)
        policy_logits.append(p_logits)
        value_logits.append(v_logits)
        states.append(state)
        state = scale_gradient(state, settings.recurrent_gradient_scaling_factor)
    step_weight = unroll_step_weight(K, settings.unroll_step_weights).to(obs.device)  # [K + 1]

    def total(per_step: Tensor, mask: Tensor) -> Tensor:  # [B, K + 1] -> [B]
        return (per_step * mask.float() * step_weight).sum(1)

    values = torch.stack(value_logits, 1).float()  # [B, K + 1, bins]
    losses = {
        "value": settings.value_loss_weight
        * total(dists.h_twohot_loss(values, t.value, model.value_bins, model.value_eps), t.value_mask)
    }
    if settings.train_reward_function:
        rewards = torch.stack(reward_logits, 1).float()  # [B, K, bins]
        per_step = dists.h_twohot_loss(rewards, t.reward[:, 1:], model.reward_bins, model.value_eps)
        losses["reward"] = settings.reward_loss_weight * total(F.pad(per_step, (1, 0)), t.reward_mask)
    if settings.train_policy:
        logp = torch.log_softmax(torch.stack(policy_logits, 1).float(), -1)  # [B, K + 1, A]
        losses["policy"] = settings.policy_loss_weight * total(-(t.policy * logp).sum(-1), t.policy_mask)
    if settings.train_game_over_function:
        logits = torch.stack([model.game_over_logit(s) for s in states], 1).float()  # [B, K + 1]
        bce = F.binary_cross_entropy_with_logits(logits, t.game_over.float(), reduction="none")
        losses["game_over"] = settings.game_over_loss_weight * total(bce, t.game_over_mask)
    if settings.train_repr_prediction:
        B = obs.shape[0]
        with torch.no_grad():
            target = model.project(model.representation(obs[:, 1 : K + 1].flatten(0, 1))).view(B, K, -1)
        predicted = model.predict_projection(torch.stack(states[1:], 1).flatten(0, 1)).view(B, K, -1)
        cosine = F.cosine_similarity(predicted.float(), target.float(), dim=-1)
        losses["repr"] = settings.repr_loss_weight * total(
            F.pad(1.0 - cosine, (1, 0)), F.pad(valid[:, 1 : K + 1], (1, 0))
        )
    value0 = model.value(root["value_logits"].detach()).float()
    return losses, value0


# -- the LightningModule --------------------------------------------------------------------------
class MuZero(RLModule):
    """MuZero (Schrittwieser et al., 2020) with MuZero Reanalyse, trained online from a
    :class:`~lightning_wm.data.modules.ReplayDataModule` whose sampler is a
    :class:`~lightning_wm.data.samplers.WindowSampler` ``(num_unroll_steps, td_steps,
    history=frame_stack - 1)``.

    Acting (:meth:`act`) searches ``num_simulations`` times from the represented observation,
    with Dirichlet noise at the root and a visit-count action sampled at the scheduled
    temperature when exploring, the most visited action otherwise; rows carry ``root_value`` and
    ``visit_probs``.

    A training step unrolls the model ``K = num_unroll_steps`` steps from each sampled position
    along the actions taken (past the episode end: the last action again, or random ones with
    ``random_action_after_episode_end``), scaling the hidden state's gradient by
    ``recurrent_gradient_scaling_factor`` at every step, and sums per unroll step ``k``:
    value (categorical over the h-transformed support, weight ``value_loss_weight``) against
    the n-step target, reward (``k >= 1``), policy (cross-entropy to the stored or reanalysed
    ``visit_probs``), game over and latent consistency when trained; steps ``k >= 1`` weigh
    ``1 / K`` and step 0 weighs 1 or ``1 / K`` too (``unroll_step_weights``), and samples
    their importance weights. See :mod:`lightning_wm.agents.muzero.targets` for the targets at
    episode ends.

    Value targets bootstrap (the row ``min(k + td_steps, episode end)`` of unroll step ``k``)
    from the target network's value of that row's observation (``bootstrap_value:
    target_network``, EfficientZero's and LightZero's choice: stored values of old rows are as
    old as the network that searched them), or from the stored search value ``root_value``
    (``stored``, the MuZero paper's and ALF's), where rows without one (the last row of a
    truncated episode, where no action is taken; the random prefill) use the target network's;
    prefill rows have no policy target. With ``td_steps = -1`` the targets are Monte Carlo
    returns to the end of the window: size the sampler's ``td_steps`` to the episode limit (a
    window that still ends inside the episode bootstraps from its last row).

    Prioritized replay (ALF's ``priority_replay``, ``priority_replay_alpha``,
    ``priority_replay_beta`` are the datamodule's ``prioritized``, ``alpha``, ``beta``): when the
    batch carries importance ``weight`` the losses are weighted by it and ``training_step``
    returns ``priority = |v(s_0) - z_0| + 1e-6``, the distance of the network's value at the
    position from its n-step target, which the ``ReplayFeedback`` callback writes back.

    Reanalyse (MuZero Reanalyse; ALF's options): the first ``round(reanalyze_ratio * B)``
    samples of a batch get their policy and value targets from a fresh search (no noise) with
    the target network at unroll rows ``0..K`` (all rows with ``full_reanalyze``), the rows
    after ``K`` bootstrapping from the target network's value; their value targets look
    ``reanalyze_td_steps`` ahead (per sample by age with ``reanalyze_td_steps_schedule``). The
    new ``root_value`` / ``visit_probs`` are written back into those rows of the buffer through
    the feedback ``"write"`` channel (generation-checked: rows overwritten since are skipped).
    The target network follows the model by ``target <- (1 - tau) target + tau model`` every
    ``target_update_period`` optimizer steps.

    Args:
        env_spec: linked from the datamodule (Discrete actions; float vectors or uint8 frames).
        latent_dim, hidden, layers, head_hidden, channels, blocks, frame_stack, support_size,
            reward_support_size, value_eps, norm, act, state_norm, projection: :class:`MuZeroModel`
            options (``projection``: EfficientZero's / LightZero's projector and predictor heads
            for the latent consistency loss, ``[proj_hid, proj_out, pred_hid]``; LightZero's
            default ``[1024, 1024, 512]``).
        num_simulations, discount, pb_c_init, pb_c_base, dirichlet_alpha, exploration_fraction,
            gumbel, max_num_considered_actions, unvisited_q: the search
            (:func:`lightning_wm.search.mcts`); ``discount`` is also the targets' discount.
            ``unvisited_q``: an untried action's value in PUCT, ``mean`` (the mean Q of its tried
            siblings: EfficientZero's and LightZero's rule; the default: on CartPole 4 seeds of 5
            reached 475 with it, 1 of 5 with ``zero``) or ``zero`` (the MuZero pseudocode).
        compile_search: run the search's tree steps through ``torch.compile`` (``mcts(...,
            compile=True)``; the networks are not compiled). The same searches up to float
            rounding, 10-25% more simulations/s on CPU at batch 16-64 (``bench/mcts_speed.py``),
            after a one-time compilation per process and search shape (about 25 s the first time
            on a machine, about 3 s from the on-disk cache). Needs a C++ compiler on CPU.
        temperature_boundaries, temperature_values: visit-count temperature by training step
            (:class:`~lightning_wm.search.TemperatureSchedule`; MuZero: 1.0 / 0.5 / 0.25 at 500k
            and 750k steps).
        num_unroll_steps, td_steps, recurrent_gradient_scaling_factor: the unroll (ALF's names).
        unroll_step_weights: ``pseudocode`` (step 0 weighs 1, each unrolled step ``1 / K``: the
            MuZero pseudocode and ALF) or ``equal`` (every step ``1 / K``: EfficientZero and
            LightZero, whose unrolled steps weigh K times the first).
        value_loss_weight, reward_loss_weight, policy_loss_weight, game_over_loss_weight,
            repr_loss_weight: loss weights.
        train_reward_function, train_game_over_function, train_repr_prediction, train_policy:
            ALF's switches (game over adds a termination head; repr prediction is the negative
            cosine similarity of the unrolled state with the representation of the observation
            reached, gradient stopped on the latter; with ``projection`` the unrolled state goes
            through projector and predictor and the representation through the projector, as in
            EfficientZero).
        bootstrap_value: what value targets bootstrap from, ``target_network`` or ``stored`` (above).
        policy_after_end: policy target at and past a termination, ``uniform`` or ``mask``.
        random_action_after_episode_end: unroll past the episode end with random actions (ALF).
        reanalyze_ratio, full_reanalyze, reanalyze_td_steps, reanalyze_td_steps_schedule,
            reanalyze_batch_size: reanalyse (ALF's names; the schedule is ``[max_age,
            min_td_steps]`` of ALF's ``LinearTdStepFunc``, age in rows of the sample's env
            stream; ``reanalyze_batch_size`` roots per search call, all at once if None).
        target_update_tau, target_update_period: the target network (ALF's names).
        optimizer, lr, weight_decay, momentum: ``adam`` or ``sgd`` with momentum (MuZero's);
            ``weight_decay`` is an L2 penalty in both.
        lr_warmup_steps: linear learning-rate warm-up over these optimizer steps.
        lr_anneal_steps: anneal the learning rate linearly to 0 over this many optimizer steps
            (None: constant after the warm-up); the MuZero paper decays its learning rate too.
    """

    def __init__(
        self,
        env_spec: EnvSpec | None = None,
        *,
        latent_dim: int = 128,
        hidden: int = 128,
        layers: int = 2,
        head_hidden: int = 32,
        channels: int = 64,
        blocks: int = 1,
        frame_stack: int = 1,
        support_size: int = 300,
        reward_support_size: int | None = None,
        value_eps: float = 0.001,
        norm: Literal["layer", "batch", "none"] = "layer",
        act: str = "relu",
        state_norm: bool = True,
        projection: tuple[int, int, int] | None = None,
        num_simulations: int = 50,
        discount: float = 0.997,
        pb_c_init: float = 1.25,
        pb_c_base: float = 19652.0,
        dirichlet_alpha: float = 0.25,
        exploration_fraction: float = 0.25,
        gumbel: bool = False,
        max_num_considered_actions: int = 16,
        unvisited_q: Literal["zero", "mean"] = "mean",
        compile_search: bool = False,
        temperature_boundaries: tuple[int, ...] = (500_000, 750_000),
        temperature_values: tuple[float, ...] = (1.0, 0.5, 0.25),
        num_unroll_steps: int = 5,
        td_steps: int = 10,
        recurrent_gradient_scaling_factor: float = 0.5,
        unroll_step_weights: Literal["pseudocode", "equal"] = "pseudocode",
        value_loss_weight: float = 0.25,
        reward_loss_weight: float = 1.0,
        policy_loss_weight: float = 1.0,
        game_over_loss_weight: float = 1.0,
        repr_loss_weight: float = 1.0,
        train_reward_function: bool = True,
        train_game_over_function: bool = False,
        train_repr_prediction: bool = False,
        train_policy: bool = True,
        bootstrap_value: Literal["target_network", "stored"] = "target_network",
        policy_after_end: Literal["uniform", "mask"] = "uniform",
        random_action_after_episode_end: bool = False,
        reanalyze_ratio: float = 0.0,
        full_reanalyze: bool = False,
        reanalyze_td_steps: int = 5,
        reanalyze_td_steps_schedule: tuple[int, int] | None = None,
        reanalyze_batch_size: int | None = None,
        target_update_tau: float = 1.0,
        target_update_period: int = 1000,
        optimizer: Literal["adam", "sgd"] = "adam",
        lr: float = 3e-3,
        weight_decay: float = 1e-4,
        momentum: float = 0.9,
        lr_warmup_steps: int = 0,
        lr_anneal_steps: int | None = None,
    ) -> None:
        super().__init__(env_spec)
        self.save_hyperparameters(ignore=["env_spec"])
        if env_spec is None:
            raise ValueError("MuZero needs env_spec (linked from the datamodule by the CLI)")
        if not env_spec.discrete:
            raise ValueError(
                f"MuZero searches over discrete actions; {env_spec.env_id or 'this env'} has {env_spec.action_space}"
            )
        if env_spec.is_dict:
            raise ValueError("MuZero takes one observation array (float vector or uint8 frames), not a dict")
        if num_unroll_steps < 1:
            raise ValueError(f"num_unroll_steps must be >= 1, got {num_unroll_steps}")
        if td_steps == 0 or td_steps < -1 or reanalyze_td_steps < 1:
            raise ValueError(
                f"td_steps must be >= 1 or -1 and reanalyze_td_steps >= 1, got {td_steps}, {reanalyze_td_steps}"
            )
        if not 0.0 <= reanalyze_ratio <= 1.0:
            raise ValueError(f"reanalyze_ratio must be in [0, 1], got {reanalyze_ratio}")
        if reanalyze_td_steps_schedule is not None and (
            len(reanalyze_td_steps_schedule) != 2
            or reanalyze_td_steps_schedule[0] < 1
            or not 1 <= reanalyze_td_steps_schedule[1] <= reanalyze_td_steps
        ):
            raise ValueError(
                "reanalyze_td_steps_schedule is [max_age >= 1, min_td_steps in 1..reanalyze_td_steps], "
                f"got {reanalyze_td_steps_schedule}"
            )
        if not 0.0 < target_update_tau <= 1.0 or target_update_period < 1:
            raise ValueError(
                f"target_update_tau must be in (0, 1] and target_update_period >= 1, got "
                f"{target_update_tau}, {target_update_period}"
            )
        if bootstrap_value not in ("target_network", "stored"):
            raise ValueError(f"bootstrap_value must be 'target_network' or 'stored', got {bootstrap_value!r}")
        if lr_warmup_steps < 0 or (lr_anneal_steps is not None and lr_anneal_steps < 1):
            raise ValueError(
                f"lr_warmup_steps must be >= 0 and lr_anneal_steps >= 1 or null, got {lr_warmup_steps}, "
                f"{lr_anneal_steps}"
            )
        unroll_step_weight(num_unroll_steps, unroll_step_weights)  # a clear error for an unknown rule
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}")
        self.model = MuZeroModel(
            env_spec.observation_space,
            env_spec.action_dim,
            latent_dim=latent_dim,
            hidden=hidden,
            layers=layers,
            head_hidden=head_hidden,
            channels=channels,
            blocks=blocks,
            frame_stack=frame_stack,
            support_size=support_size,
            reward_support_size=reward_support_size,
            value_eps=value_eps,
            norm=norm,
            act=act,
            game_over_head=train_game_over_function,
            state_norm=state_norm,
            projection=projection,
        )
        self.target_model = copy.deepcopy(self.model).requires_grad_(False)
        if unvisited_q not in ("zero", "mean"):
            raise ValueError(f"unvisited_q must be 'zero' or 'mean', got {unvisited_q!r}")
        self.settings = SearchSettings(
            num_simulations,
            discount,
            pb_c_init,
            pb_c_base,
            dirichlet_alpha,
            exploration_fraction,
            gumbel,
            max_num_considered_actions,
            unvisited_q,
            compile_search,
        )
        self.temperature = TemperatureSchedule(tuple(temperature_boundaries), tuple(temperature_values))
        self.search_stats = SearchStats()
        self.hp = self.hparams
        self._warned_long_window = False

    # -- acting (Agent protocol) ------------------------------------------------------------
    def initial_state(self, batch_size: int) -> Tensor | None:
        return initial_frames(self.model, batch_size, self.device)

    @torch.no_grad()
    def act(self, obs: Tensor, state: Tensor | None, explore: bool) -> tuple[Tensor, Any, dict[str, Tensor]]:
        return act_with_search(
            self.model, self.settings, self.temperature(self.global_step), obs, state, explore, self.search_stats
        )

    def acting_copy(self) -> MuZeroPolicy:
        """A CPU copy of the model with the search settings and the current temperature."""
        model = copy.deepcopy(self.model).cpu().eval().requires_grad_(False)
        return MuZeroPolicy(model, self.settings, self.temperature(self.global_step)).eval()

    # -- training ---------------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        hp = self.hp
        settings = OptimSettings(
            name=hp.optimizer,
            lr=hp.lr,
            momentum=hp.momentum if hp.optimizer == "sgd" else 0.0,
            weight_decay=hp.weight_decay,
            lr_warmup_steps=hp.lr_warmup_steps,
            lr_anneal_steps=hp.lr_anneal_steps,
        )
        return with_lr_schedule(build_optimizer(self.model.parameters(), settings), settings)

    def _check_batch(self, batch: dict[str, Tensor]) -> int:
        """The window's history length ``h``; a clear error for a sampler that does not fit."""
        hp = self.hp
        needed = {"obs", "action", "reward", "is_last", "is_terminal", "mask"}
        missing = needed - set(batch)
        if missing:
            raise ValueError(
                f"MuZero trains on WindowSampler batches; the batch lacks {sorted(missing)} "
                "(set data.init_args.sampler to a WindowSampler)"
            )
        if "visit_probs" not in batch:  # only random-prefill rows so far: no search has run yet
            batch["visit_probs"] = torch.zeros(*batch["mask"].shape, self.model.num_actions, device=self.device)
            batch["root_value"] = torch.zeros(batch["mask"].shape, device=self.device)
        h = hp.frame_stack - 1
        width = batch["mask"].shape[1] - h
        td = max(hp.td_steps, hp.reanalyze_td_steps if hp.reanalyze_ratio > 0 else 1)
        monte_carlo = hp.td_steps == -1
        rows = hp.num_unroll_steps + 1 + (1 if monte_carlo else td)  # the window rows training reads

        def fitting_sampler() -> str:
            return (
                f"WindowSampler(num_unroll_steps={hp.num_unroll_steps}, "
                f"td_steps={'<episode limit>' if monte_carlo else td}, history={h})"
            )

        if not monte_carlo and width > rows and not self._warned_long_window:
            self._warned_long_window = True
            warnings.warn(
                f"the sampler's windows ({width} rows after the history) are longer than num_unroll_steps "
                f"{hp.num_unroll_steps} and td_steps {td} use ({rows}): the extra "
                "rows are sampled and never read (or, if the sampler's history is longer than frame_stack "
                f"- 1 = {h}, every row is shifted); use {fitting_sampler()} (the model's td_steps and "
                "frame_stack and the sampler's go together)",
                UserWarning,
                stacklevel=2,
            )
        if width < rows:
            raise ValueError(
                f"the sampler's windows ({batch['mask'].shape[1]} rows) are too short for num_unroll_steps "
                f"{hp.num_unroll_steps}, td_steps {hp.td_steps}"
                + (f", reanalyze_td_steps {hp.reanalyze_td_steps}" if hp.reanalyze_ratio > 0 else "")
                + f" and frame_stack {hp.frame_stack}: use {fitting_sampler()}"
            )
        return h

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Any]:
        hp = self.hp
        h = self._check_batch(batch)
        K = hp.num_unroll_steps
        B = batch["mask"].shape[0]
        mask = batch["mask"].bool()
        obs = self._observations(batch["obs"], mask)  # [B, W, *obs_shape]: the stack at each window row
        fwd = {k: batch[k][:, h:] for k in ("reward", "is_last", "is_terminal", "action", "visit_probs", "mask")}
        valid = mask[:, h:]
        value = batch["root_value"][:, h:].float().clone()
        td = torch.full((B,), hp.td_steps, dtype=torch.long, device=self.device)
        reanalysed = round(hp.reanalyze_ratio * B)
        write = None
        if reanalysed > 0:
            write = self._reanalyse(batch, obs, fwd, value, td, reanalysed, h)
        # the rows the value targets bootstrap from get the target network's value where no
        # (fresh) search value is at hand; the reanalysed samples have theirs already
        rest = slice(reanalysed, None)
        boot = bootstrap_rows(valid[rest], td[rest], K + 1) & ~fwd["is_terminal"][rest].bool()
        if hp.bootstrap_value == "stored":  # only rows without a search: truncated last rows, the random prefill
            boot &= fwd["is_last"][rest].bool() | (fwd["visit_probs"][rest].sum(-1) <= 0)
        if boot.any():
            value[rest][boot] = self._target_values(obs[rest][boot])
        targets = muzero_targets(
            {**fwd, "root_value": value},
            num_unroll_steps=K,
            td_steps=td,
            discount=hp.discount,
            policy_after_end=hp.policy_after_end,
            random_action_after_episode_end=hp.random_action_after_episode_end,
        )
        losses, value0 = self._unroll_losses(obs, targets, valid)
        weight = batch["weight"].float() if "weight" in batch else None
        per_sample = sum(losses.values())  # [B]
        loss = (per_sample * weight).mean() if weight is not None else per_sample.mean()
        out: dict[str, Any] = {"loss": loss}
        log = dict(on_step=True, batch_size=B)
        self.log("loss/total", loss.detach(), prog_bar=True, **log)
        for name, part in losses.items():
            self.log(f"loss/{name}", part.detach().mean(), **log)
        self.log("train/value_target", targets.value[:, 0].mean(), **log)
        self.log("train/value_pred", value0.mean(), **log)
        if "age" in batch:
            self.log("replay/age", batch["age"].float().mean(), **log)
        if weight is not None:
            priority = (value0 - targets.value[:, 0]).abs() + 1e-6
            out["priority"] = priority.detach().cpu()
            self.log("replay/priority_mean", priority.mean(), **log)
            self.log("replay/priority_max", priority.max(), **log)
            self.log("replay/weight_mean", weight.mean(), **log)
        if hp.reanalyze_ratio > 0:
            self.log("reanalyse/fraction", reanalysed / B, **log)
        if write is not None:
            out["write"] = write
            self.log("reanalyse/rows", float(len(write["index"])), **log)
        if self.search_stats.count:
            for name, v in self.search_stats.means().items():
                self.log(name, v, **log)
            self.search_stats.reset()
        self.log("search/temperature", self.temperature(self.global_step), **log)
        return out

    def _observations(self, obs: Tensor, mask: Tensor) -> Tensor:
        """The model's input at every window row from the position on: ``obs [B, h + W, ...]``
        -> ``[B, W, *obs_shape]`` (frame stacks of ``h + 1`` frames when ``frame_stack > 1``)."""
        if self.hp.frame_stack == 1:
            return obs
        return window_stacks(obs, mask, self.hp.frame_stack)

    @torch.no_grad()
    def _target_values(self, obs: Tensor) -> Tensor:
        """The target network's values ``[N]`` of observations ``[N, ...]``."""
        if obs.shape[0] == 0:
            return obs.new_zeros(0, dtype=torch.float32)
        self.target_model.eval()
        return self.target_model.initial_inference(obs)["value"].float()

    def _reanalyse(
        self,
        batch: dict[str, Tensor],
        obs: Tensor,
        fwd: dict[str, Tensor],
        value: Tensor,
        td: Tensor,
        count: int,
        h: int,
    ) -> dict[str, Any] | None:
        """New targets for the first ``count`` samples, in place: ``fwd["visit_probs"]`` and
        ``value`` at the searched rows, ``value`` from the target network at the later rows,
        ``td`` their reanalyse horizon. Returns the buffer write of the searched rows."""
        hp = self.hp
        K = hp.num_unroll_steps
        W = value.shape[1]
        age = batch["age"][:count] if "age" in batch else torch.zeros(count, dtype=torch.long, device=td.device)
        td[:count] = reanalyze_td_steps(age, hp.reanalyze_td_steps, hp.reanalyze_td_steps_schedule).to(td.device)
        valid = fwd["mask"][:count].bool()
        acted = valid & ~fwd["is_last"][:count].bool()  # rows where a search decides something
        searched = acted.clone()
        if not hp.full_reanalyze:
            searched[:, K + 1 :] = False
        # bootstrap rows without a fresh search value: valued by the target network directly
        later = bootstrap_rows(valid, td[:count], K + 1) & ~searched & ~fwd["is_terminal"][:count].bool()
        if searched.any():
            roots = obs[:count][searched]
            outs = [
                search(self.target_model, self.settings, chunk, explore=False)
                for chunk in roots.split(hp.reanalyze_batch_size or roots.shape[0])
            ]
            root_value = torch.cat([o.root_value for o in outs]).float()
            probs = torch.cat([o.visit_probs for o in outs]).to(fwd["visit_probs"].dtype)
            value[:count][searched] = root_value
            fwd["visit_probs"] = fwd["visit_probs"].clone()
            fwd["visit_probs"][:count][searched] = probs
        if later.any():
            value[:count][later] = self._target_values(obs[:count][later])
        if not searched.any():
            return None
        rows = batch["row_index"][:count, h : h + W][searched]
        generation = batch["row_generation"][:count, h : h + W][searched]
        return {
            "index": rows.cpu(),
            "generation": generation.cpu(),
            "columns": {"root_value": root_value.cpu(), "visit_probs": probs.float().cpu()},
        }

    def _unroll_losses(self, obs: Tensor, t: UnrollTargets, valid: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        hp = self.hp
        return unroll_losses(
            self.model,
            obs,
            t,
            valid,
            LossSettings(
                hp.recurrent_gradient_scaling_factor,
                hp.value_loss_weight,
                hp.reward_loss_weight,
                hp.policy_loss_weight,
                hp.game_over_loss_weight,
                hp.repr_loss_weight,
                hp.train_reward_function,
                hp.train_policy,
                hp.train_game_over_function,
                hp.train_repr_prediction,
                hp.unroll_step_weights,
            ),
        )

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.update_target(self.global_step)

    def update_target(self, step: int) -> bool:
        """``target <- (1 - tau) target + tau model`` when ``step`` (optimizer steps taken) is a
        multiple of ``target_update_period``; returns whether it updated."""
        if step % self.hp.target_update_period != 0:
            return False
        soft_update(self.target_model, self.model, self.hp.target_update_tau)
        return True
