"""The :class:`MuZero` LightningModule: acting by tree search over the learned model, a K-step
unroll trained on replayed windows with n-step targets, prioritized replay feedback and
reanalyse with a target network.

A training step is targets -> loss -> report: :func:`~.windows.read_window` (the batch as
unroll windows), :func:`~.reanalyse.reanalyse` and :func:`~.reanalyse.bootstrap_values` (the
values the targets bootstrap from), :func:`~.targets.muzero_targets`, then
:func:`~.losses.unroll_model` and :func:`~.losses.muzero_loss`, and :meth:`MuZero.report`.

Shapes: ``B`` batch, ``K`` unroll steps, ``W = K + td_steps + 1`` window rows from the sampled
position (``h = frame_stack - 1`` history rows before it), ``A`` actions.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_wm.agents.base import RLModule
from lightning_wm.agents.muzero.losses import Supports, UnrollOutput, muzero_loss, priority, unroll_model
from lightning_wm.agents.muzero.model import MuZeroModel
from lightning_wm.agents.muzero.reanalyse import Reanalysed, bootstrap_values, reanalyse
from lightning_wm.agents.muzero.search_policy import MuZeroPolicy, SearchStats, act_with_search, initial_frames
from lightning_wm.agents.muzero.settings import (
    MuZeroLossSettings,
    MuZeroNet,
    ReanalyseSettings,
    TargetSettings,
    UnrollSettings,
)
from lightning_wm.agents.muzero.targets import UnrollTargets, muzero_targets
from lightning_wm.agents.muzero.windows import Window, read_window, window_fit, window_rows
from lightning_wm.compiling import CompileSettings, ShapeCompiled, as_compile_settings
from lightning_wm.data.samplers import WindowSampler
from lightning_wm.envs import EnvSpec
from lightning_wm.nn.blocks import soft_update
from lightning_wm.optim import GradClipper, OptimSettings, build_optimizer, optimizer_beta, with_lr_schedule
from lightning_wm.search import SearchSettings
from lightning_wm.settings import as_settings, plain

__all__ = ["MuZero", "DEFAULT_OPTIM"]

DEFAULT_OPTIM = OptimSettings(name="adam", lr=3e-3, momentum=0.9, weight_decay=1e-4)
"""MuZero's optimizer defaults: Adam at 3e-3 with an L2 penalty of 1e-4 (``momentum`` is SGD's)."""


class MuZero(RLModule):
    """MuZero (Schrittwieser et al., 2020) with MuZero Reanalyse, trained online from a
    :class:`~lightning_wm.data.modules.ReplayDataModule` sampling unroll windows
    (:meth:`replay_sampler`). ``docs/muzero.md`` describes every option.

    Acting (:meth:`act`) searches from the represented observation (Dirichlet noise at the root
    and an action sampled from the visit counts at the scheduled temperature when exploring, the
    most visited action otherwise); rows carry ``root_value`` and ``visit_probs``.

    A training step unrolls the model ``K = unroll.num_unroll_steps`` steps from each sampled
    position along the actions taken and minimises :func:`~.losses.muzero_loss` against n-step
    value targets bootstrapping from the target network (``unroll.bootstrap_value``), the stored
    or reanalysed search policies and the rewards (:mod:`~lightning_wm.agents.muzero.targets`),
    weighted by the batch's importance weights when it has them; it then returns ``priority =
    |v(s_0) - z_0| + 1e-6`` per sample (prioritized replay) and the reanalysed rows' new
    ``root_value`` / ``visit_probs`` as a buffer ``"write"`` (generation-checked by the
    ``ReplayFeedback`` callback). The target network follows the model every
    ``target.update_period`` optimizer steps.

    Args:
        env_spec: linked from the datamodule (Discrete actions; float vectors or uint8 frames).
        net: the networks (``MuZeroNet``).
        search: the tree search of acting and reanalyse (``lightning_wm.search.SearchSettings``).
        unroll: the unroll and its targets (``UnrollSettings``).
        loss: loss weights and switches (``MuZeroLossSettings``).
        reanalyse: MuZero Reanalyse (``ReanalyseSettings``).
        target: the target network (``TargetSettings``).
        optim: optimizer, learning-rate schedule and gradient clipping (``lightning_wm.optim.OptimSettings``;
            MuZero's defaults: Adam, lr 3e-3, weight decay 1e-4, SGD momentum 0.9).
        discount: γ of the search and of the value targets.
        compile: ``torch.compile`` of the learner (:class:`~lightning_wm.compiling.CompileSettings`):
            ``mode: step`` compiles the unroll of the model and the loss (and its backward) as
            one graph (CUDA graphs on CUDA with ``cuda_graphs``); the targets' reanalysing search
            has its own switch, ``search.compile``; ``cells`` is not available here.
    """

    def __init__(
        self,
        env_spec: EnvSpec | None = None,
        *,
        net: MuZeroNet = MuZeroNet(),
        search: SearchSettings = SearchSettings(),
        unroll: UnrollSettings = UnrollSettings(),
        loss: MuZeroLossSettings = MuZeroLossSettings(),
        reanalyse: ReanalyseSettings = ReanalyseSettings(),
        target: TargetSettings = TargetSettings(),
        optim: OptimSettings = DEFAULT_OPTIM,
        discount: float = 0.997,
        compile: CompileSettings = CompileSettings(),
    ) -> None:
        net = as_settings(MuZeroNet, net, "net")
        search = as_settings(SearchSettings, search, "search")
        unroll = as_settings(UnrollSettings, unroll, "unroll")
        loss = as_settings(MuZeroLossSettings, loss, "loss")
        reanalyse = as_settings(ReanalyseSettings, reanalyse, "reanalyse")
        target = as_settings(TargetSettings, target, "target")
        if isinstance(optim, Mapping):  # a partial mapping fills in MuZero's defaults, as the command line does
            optim = {**plain(DEFAULT_OPTIM), **optim}
        optim = as_settings(OptimSettings, optim, "optim")
        super().__init__(env_spec)
        self.save_settings()
        if env_spec is None:
            raise ValueError("MuZero needs env_spec (linked from the datamodule by the CLI)")
        if not env_spec.discrete:
            raise ValueError(
                f"MuZero searches over discrete actions; {env_spec.env_id or 'this env'} has {env_spec.action_space}"
            )
        if env_spec.is_dict:
            raise ValueError("MuZero takes one observation array (float vectors or uint8 frames), not a dict")
        if not 0.0 <= discount <= 1.0:
            raise ValueError(f"discount must be in [0, 1], got {discount}")
        if loss.train_repr_prediction and net.projection is None:
            warnings.warn(
                "loss.train_repr_prediction without net.projection: the consistency of raw hidden states can "
                "collapse the representation to a constant (SimSiam without a predictor; MuZero on MinAtar "
                "Breakout scored 0 that way); set net.projection, e.g. [256, 256, 128] (EfficientZero's heads)",
                UserWarning,
                stacklevel=2,
            )
        self.net, self.search, self.unroll, self.loss = net, search, unroll, loss
        self.reanalyse, self.target, self.optim, self.discount = reanalyse, target, optim, float(discount)
        game_over_head = loss.train_game_over_function
        self.model = MuZeroModel(env_spec.observation_space, env_spec.action_dim, net, game_over_head=game_over_head)
        self.target_model = copy.deepcopy(self.model).requires_grad_(False)
        self.search_stats = SearchStats()
        self.clipper = GradClipper.from_settings(optim.clip)
        self._warned_long_window = False
        self.compile_settings = compile = as_compile_settings(compile)
        if compile.mode in ("cells", "graph"):
            raise ValueError(
                f"MuZero's compile.mode is none or step (the unroll and the loss, CUDA graphs with "
                f"compile.cuda_graphs), not {compile.mode}; the search's simulations compile with search.compile"
            )
        self._unroll_loss = self.unroll_loss
        if compile.mode == "step":
            self._unroll_loss = ShapeCompiled(self.unroll_loss, compile.max_shapes, compile.cuda_graphs)

    # -- acting (Agent protocol) ------------------------------------------------------------
    def initial_state(self, batch_size: int) -> Tensor | None:
        return initial_frames(self.model, batch_size, self.device)

    @torch.no_grad()
    def act(self, obs: Tensor, state: Tensor | None, explore: bool) -> tuple[Tensor, Any, dict[str, Tensor]]:
        temperature = self.search.temperature(self.global_step)
        return act_with_search(
            self.model, self.search, self.discount, temperature, obs, state, explore, self.search_stats
        )

    def acting_copy(self) -> MuZeroPolicy:
        """A CPU copy of the model with the search settings and the current temperature."""
        model = copy.deepcopy(self.model).cpu().eval().requires_grad_(False)
        return MuZeroPolicy(model, self.search, self.discount, self.search.temperature(self.global_step)).eval()

    def acting_weights(self) -> dict[str, Tensor]:
        """:meth:`acting_copy`'s ``state_dict`` (the model's live tensors and the current
        temperature) without copying the model: what a publish sends."""
        temperature = torch.tensor(float(self.search.temperature(self.global_step)))
        return {"temperature": temperature, **{f"model.{k}": v for k, v in self.model.state_dict().items()}}

    # -- data (SamplerSource) ---------------------------------------------------------------
    def replay_sampler(self) -> WindowSampler:
        """The sampler this model's training reads: windows of ``num_unroll_steps`` and the larger
        of ``td_steps`` and (with reanalyse) reanalyse's ``td_steps``, with ``frame_stack - 1``
        rows of history."""
        rows, td = window_rows(self.unroll, self.reanalyse)
        if td == -1:
            raise ValueError(
                "unroll.td_steps is -1 (Monte Carlo to the end of the window): the window's length is the "
                "episode limit, which the model does not know; set data.init_args.sampler to "
                f"WindowSampler(num_unroll_steps={self.unroll.num_unroll_steps}, td_steps=<episode limit>, "
                f"history={self.net.frame_stack - 1})"
            )
        return WindowSampler(self.unroll.num_unroll_steps, td, history=self.net.frame_stack - 1)

    def check_window_length(self, length: int) -> None:
        """Refuse windows of ``length`` rows (history included) too short for the settings; warn
        once about longer ones."""
        fit = window_fit(length, self.net.frame_stack, self.unroll, self.reanalyse)
        if fit is None:
            return
        kind, message = fit
        if kind == "short":
            raise ValueError(message)
        if not self._warned_long_window:
            self._warned_long_window = True
            warnings.warn(message, UserWarning, stacklevel=3)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        sampler = getattr(getattr(self.trainer, "datamodule", None), "sampler", None)
        if isinstance(sampler, WindowSampler):  # an explicit sampler that does not fit: say so now
            self.check_window_length(sampler.history + sampler.window)

    # -- training ---------------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        optimizer = build_optimizer(self.model.parameters(), self.optim)
        if self.clipper.uses_momentum:
            self.clipper.beta = optimizer_beta(optimizer)
        return with_lr_schedule(optimizer, self.optim)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        """Lightning's ``gradient_clip_val``, then ``optim.clip`` (after DDP's all-reduce)."""
        if gradient_clip_val:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if self.optim.clip.type is not None:
            self.clipper(self.model.parameters())

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Any]:
        window = read_window(batch, self.net.frame_stack, self.model.num_actions)
        self.check_window_length(batch["mask"].shape[1])
        targets, reanalysed = self.unroll_targets(window)
        out, loss, parts = self._unroll_loss(window.obs, targets, window.mask, window.weight)
        return self.report(loss, parts, out, targets, window, reanalysed)

    def unroll_loss(
        self, obs: Tensor, targets: UnrollTargets, mask: Tensor, weight: Tensor | None
    ) -> tuple[UnrollOutput, Tensor, dict[str, Tensor]]:
        """The model unrolled from the windows' observations ``obs`` along ``targets.actions``
        (:func:`~.losses.unroll_model`) and :func:`~.losses.muzero_loss` against ``targets``
        (``mask [B, K+1]``, importance weights ``weight [B]`` or None): ``(out, loss, parts)``.
        What ``compile.mode: step`` compiles."""
        out = unroll_model(self.model, obs, targets.actions, self.loss)
        loss, parts = muzero_loss(out, targets, mask, self.loss, Supports.of(self.model), weight)
        return out, loss, parts

    def unroll_targets(self, window: Window) -> tuple[UnrollTargets, Reanalysed]:
        """The targets of ``window``: reanalyse, bootstrap values from the target network, then
        :func:`~.targets.muzero_targets`."""
        reanalysed = reanalyse(self.target_model, self.search, self.discount, window, self.unroll, self.reanalyse)
        value = bootstrap_values(self.target_model, window, reanalysed, self.unroll)
        columns = {**window.columns(), "visit_probs": reanalysed.visit_probs, "root_value": value}
        targets = muzero_targets(
            columns,
            num_unroll_steps=self.unroll.num_unroll_steps,
            td_steps=reanalysed.td_steps,
            discount=self.discount,
            policy_after_end=self.unroll.policy_after_end,
            random_action_after_episode_end=self.unroll.random_action_after_episode_end,
        )
        return targets, reanalysed

    def report(
        self,
        loss: Tensor,
        parts: Mapping[str, Tensor],
        out: UnrollOutput,
        targets: UnrollTargets,
        window: Window,
        reanalysed: Reanalysed,
    ) -> dict[str, Any]:
        """Return what Lightning and the feedback callback take: ``loss``, ``priority [B]`` (with
        importance weights), ``write`` (reanalysed rows); log the step (``loss/*``, ``train/*``,
        ``replay/*``, ``reanalyse/*``, ``search/*``) on the steps the logger writes (each
        ``self.log`` call costs ~1-2 ms of Lightning's bookkeeping on this CPU: 14% of a MinAtar
        step when all 16 were logged every step)."""
        B = window.mask.shape[0]
        result: dict[str, Any] = {"loss": loss}
        new_priority = priority(out, targets) if window.weight is not None else None
        if new_priority is not None:
            result["priority"] = new_priority.detach().cpu()
        if reanalysed.write is not None:
            result["write"] = reanalysed.write
        if not self.logs_step(self.global_step + 1):
            return result
        logs: dict[str, Any] = {f"loss/{name}": part.detach().mean() for name, part in parts.items()}
        logs["train/value_target"] = targets.value[:, 0].mean()
        logs["train/value_pred"] = out.value0.mean()
        if window.age is not None:
            logs["replay/age"] = window.age.float().mean()
        if new_priority is not None:
            logs["replay/priority_mean"] = new_priority.mean()
            logs["replay/priority_max"] = new_priority.max()
            logs["replay/weight_mean"] = window.weight.mean()
        if self.reanalyse.ratio > 0:
            logs["reanalyse/fraction"] = reanalysed.count / B
        if reanalysed.write is not None:
            logs["reanalyse/rows"] = float(len(reanalysed.write["index"]))
        if self.search_stats.count:
            logs.update(self.search_stats.means())
            self.search_stats.reset()
        logs["search/temperature"] = self.search.temperature(self.global_step)
        self.log("loss/total", loss.detach(), prog_bar=True, on_step=True, batch_size=B)
        self.log_dict(logs, on_step=True, batch_size=B)
        return result

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.update_target(self.global_step)

    def update_target(self, step: int) -> bool:
        """``target <- (1 - tau) target + tau model`` when ``step`` (optimizer steps taken) is a
        multiple of ``target.update_period``; returns whether it updated."""
        if step % self.target.update_period != 0:
            return False
        soft_update(self.target_model, self.model, self.target.update_tau)
        return True
