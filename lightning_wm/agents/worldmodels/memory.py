"""World Models memory (M): an MDN-RNN over V's latents.

An LSTM reads ``[z_t, a_t]`` and its output ``h_{t+1}`` predicts a mixture of ``K`` diagonal
Gaussians for ``z_{t+1}``, the reward ``r_{t+1}`` received on arriving there and whether the
episode terminated there (row convention: ``reward[t+1]``, ``is_terminal[t+1]``).

Training sequences come from a latent store (``EpisodeDataModule(mode='sequences')`` over the
output of ``convert``): ``mu``, ``logvar`` ``[B, L, Z]``, ``action``, ``reward``, ``is_first``,
``is_terminal`` ``[B, L]``; ``z`` is drawn from ``N(mu, exp(logvar))`` every batch as in the
reference. Sequences may cross episode borders: the LSTM state is reset where ``is_first`` and
no prediction target crosses a border. The loss is
:func:`~lightning_wm.agents.worldmodels.losses.mdn_rnn_loss`.

Mixture layout (``net.mixture``): ``per_dim`` (default, the reference implementation: every
latent dimension has its own ``K``-component 1-D mixture) or ``joint`` (``K`` components over
the whole ``z``). Both go through :func:`lightning_wm.nn.mdn.mdn_log_prob`.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor, nn

from lightning_wm.actions import ActionCodec
from lightning_wm.agents.worldmodels.figures import frames_figure, open_loop_error_figure
from lightning_wm.agents.worldmodels.losses import episode_forward_mean, mdn_rnn_loss
from lightning_wm.agents.worldmodels.offline import OfflineModel, check_patience
from lightning_wm.agents.worldmodels.settings import MemoryDreamSettings, MemoryLossSettings, MemoryNetSettings
from lightning_wm.agents.worldmodels.vision import Vision
from lightning_wm.checkpoints import load_module
from lightning_wm.envs import EnvSpec
from lightning_wm.logging import log_figure
from lightning_wm.nn.mdn import mdn_log_prob, mdn_mean, mdn_sample, per_dim_layout
from lightning_wm.optim import OptimSettings
from lightning_wm.settings import as_settings

LSTMState = tuple[Tensor, Tensor]


class Memory(OfflineModel):
    """MDN-RNN (World Models' M).

    Args:
        env_spec: spec of the env the latents were recorded in (linked by the CLI); gives
            the action space.
        net: the network (:class:`~lightning_wm.agents.worldmodels.settings.MemoryNetSettings`).
        loss: the loss weights and the open-loop loss
            (:class:`~lightning_wm.agents.worldmodels.settings.MemoryLossSettings`).
        dream: sampling temperature and the validation dream
            (:class:`~lightning_wm.agents.worldmodels.settings.MemoryDreamSettings`).
        optim: the optimizer (Adam, learning rate 1e-3 as in the reference, which clips the
            gradient norm at 1.0: ``optim.clip: {type: clip_norm, value: 1.0}``).
        sample_z: draw ``z`` from ``mu``/``logvar`` per batch (reference); else use ``mu``.
        vision_ckpt: V's checkpoint; when given, validation logs M's open-loop dream decoded by V.
        patience: stop training after this many validations (epochs) without a lower
            ``val/loss`` (HumbleRL's ``rnn_training.patience``, 10); None trains for
            ``max_epochs``. The best model by ``val/loss`` is kept as ``best.ckpt`` beside ``last.ckpt``.
        action_dim: number of actions (discrete) or action size when no ``env_spec`` is given.
        discrete: whether those actions are discrete (when no ``env_spec`` is given).
    """

    def __init__(
        self,
        env_spec: EnvSpec | None = None,
        net: MemoryNetSettings = MemoryNetSettings(),
        loss: MemoryLossSettings = MemoryLossSettings(),
        dream: MemoryDreamSettings = MemoryDreamSettings(),
        optim: OptimSettings = OptimSettings(lr=1e-3),
        sample_z: bool = True,
        vision_ckpt: str | None = None,
        patience: int | None = 10,
        action_dim: int | None = None,
        discrete: bool | None = None,
    ) -> None:
        super().__init__(env_spec)
        if env_spec is not None:
            action_dim, discrete = env_spec.action_dim, env_spec.discrete
        if action_dim is None or discrete is None:
            raise ValueError(
                "Memory needs the action space and the data names no env: the episode folder has no meta.json "
                "(record and convert write it; copy it beside episodes merged by hand), or set "
                "data.init_args.env, or pass action_dim and discrete"
            )
        check_patience(patience)
        self.net = as_settings(MemoryNetSettings, net, "net")
        self.loss = as_settings(MemoryLossSettings, loss, "loss")
        self.dream = as_settings(MemoryDreamSettings, dream, "dream")
        self.optim = as_settings(OptimSettings, optim, "optim")
        self.save_settings()
        self.hparams["action_dim"], self.hparams["discrete"] = int(action_dim), bool(discrete)
        self.action_dim, self.discrete = int(action_dim), bool(discrete)
        self.sample_z, self.vision_ckpt, self.patience = sample_z, vision_ckpt, patience
        space = (
            env_spec.action_space
            if env_spec is not None
            else (
                gym.spaces.Discrete(self.action_dim)
                if self.discrete
                else gym.spaces.Box(-np.inf, np.inf, (self.action_dim,))
            )
        )
        self.actions = ActionCodec(space)
        k, d, hidden = self.net.num_mixtures, self.net.latent_dim, self.net.hidden
        self.lstm = nn.LSTM(d + self.action_dim, hidden, batch_first=True)
        self.mdn_out = 3 * k * d if self.net.mixture == "per_dim" else k + 2 * k * d
        self.mdn_head = nn.Linear(hidden, self.mdn_out)
        self.reward_head = nn.Linear(hidden, 1)
        self.done_head = (
            nn.Linear(hidden, 1)
            if self.net.done_input == "hidden"
            else nn.Sequential(nn.Linear(d, 64), nn.ELU(), nn.Linear(64, 1))
        )
        self._vision: list[Any] = []  # V, loaded lazily for dream images (not a submodule)

    @property
    def latent_dim(self) -> int:
        return self.net.latent_dim

    @property
    def hidden(self) -> int:
        return self.net.hidden

    @property
    def temperature(self) -> float:
        """The sampling temperature (``dream.temperature``)."""
        return self.dream.temperature

    # -- pieces -----------------------------------------------------------------------
    def action_input(self, action: Tensor) -> Tensor:
        """Env actions -> LSTM input ``[..., A]``: int64 ``[...]`` -> one-hot; float ``[..., A]``
        (continuous, or already one-hot) as is (see :meth:`ActionCodec.encode`)."""
        return self.actions.encode(action)

    def initial_state(self, batch_size: int, device: torch.device | None = None) -> LSTMState:
        """Zero LSTM state ``(h, c)``, each ``[B, hidden]``."""
        device = device if device is not None else self.device
        zeros = torch.zeros(batch_size, self.hidden, device=device)
        return zeros, zeros.clone()

    def step(self, z: Tensor, action_in: Tensor, state: LSTMState) -> tuple[Tensor, LSTMState]:
        """One LSTM step: ``z [B, Z]``, ``action_in [B, A]`` -> ``(h' [B, H], (h', c'))``."""
        x = torch.cat([z, action_in], -1).unsqueeze(1)
        out, (h, c) = self.lstm(x, (state[0].unsqueeze(0).contiguous(), state[1].unsqueeze(0).contiguous()))
        return out[:, 0], (h[0], c[0])

    def unroll(
        self, z: Tensor, action_in: Tensor, is_first: Tensor | None = None, state: LSTMState | None = None
    ) -> tuple[Tensor, LSTMState]:
        """Run the LSTM over ``[B, L]`` steps, resetting the state to zero where ``is_first``.

        Args:
            z: ``[B, L, Z]``; action_in: ``[B, L, A]``; is_first: bool ``[B, L]`` or None.
            state: ``(h, c)`` ``[B, H]`` before the first step (zeros if None).
        Returns:
            ``(out [B, L, H], final state)``; ``out[:, t]`` has read ``z_t, a_t`` and predicts ``t+1``.
        """
        b, length = z.shape[:2]
        x = torch.cat([z, action_in], -1)
        h, c = state if state is not None else self.initial_state(b, z.device)
        if is_first is None:
            is_first = torch.zeros(b, length, dtype=torch.bool, device=z.device)
        # split the window where any sequence starts a new episode; reset the state there
        starts = [0] + [t for t in range(1, length) if bool(is_first[:, t].any())]
        outs = []
        for i, t0 in enumerate(starts):
            t1 = starts[i + 1] if i + 1 < len(starts) else length
            keep = (~is_first[:, t0]).float().unsqueeze(-1)
            h, c = h * keep, c * keep
            out, (hn, cn) = self.lstm(x[:, t0:t1], (h.unsqueeze(0).contiguous(), c.unsqueeze(0).contiguous()))
            h, c = hn[0], cn[0]
            outs.append(out)
        return torch.cat(outs, 1), (h, c)

    def heads(self, out: Tensor) -> dict[str, Tensor]:
        """``out [..., H]`` -> mixture parameters in :func:`mdn_log_prob` layout, ``reward [...]``,
        and (``done_input: hidden``) ``done_logit [...]``; read the end with :meth:`next_done_logit`.
        ``per_dim``: ``logit_pi [..., Z, K]``, ``mu/log_sigma [..., Z, K, 1]``; ``joint``:
        ``logit_pi [..., K]``, ``mu/log_sigma [..., K, Z]``."""
        p = self.mdn_head(out)
        k, d = self.net.num_mixtures, self.net.latent_dim
        if self.net.mixture == "per_dim":
            logit_pi, mu, log_sigma = p.unflatten(-1, (d, 3 * k)).split(k, -1)
            logit_pi, mu, log_sigma = per_dim_layout(logit_pi, mu, log_sigma)
        else:
            logit_pi = p[..., :k]
            mu, log_sigma = p[..., k:].unflatten(-1, (2, k, d)).unbind(-3)
        log_sigma = log_sigma.clamp(-7.0, 3.0)
        heads = {"logit_pi": logit_pi, "mu": mu, "log_sigma": log_sigma, "reward": self.reward_head(out).squeeze(-1)}
        if self.net.done_input == "hidden":
            heads["done_logit"] = self.done_head(out).squeeze(-1)
        return heads

    def next_done_logit(self, heads: dict[str, Tensor], z_next: Tensor) -> Tensor:
        """Logit ``[...]`` that the episode ends at ``t+1``: from M's heads at ``t``
        (``done_input: hidden``) or from the next latent ``z_next [..., Z]`` (``latent``)."""
        return heads["done_logit"] if self.net.done_input == "hidden" else self.done_head(z_next).squeeze(-1)

    def log_prob(self, heads: dict[str, Tensor], z: Tensor) -> Tensor:
        """``log p(z [..., Z])`` under the predicted mixture -> ``[...]`` (summed over dimensions)."""
        if self.net.mixture == "per_dim":
            return mdn_log_prob(heads["logit_pi"], heads["mu"], heads["log_sigma"], z.unsqueeze(-1)).sum(-1)
        return mdn_log_prob(heads["logit_pi"], heads["mu"], heads["log_sigma"], z)

    def sample_next(
        self, heads: dict[str, Tensor], temperature: float | None = None, generator: torch.Generator | None = None
    ) -> Tensor:
        """Draw ``z_{t+1} [..., Z]`` from the predicted mixture at ``temperature``."""
        tau = self.temperature if temperature is None else temperature
        z = mdn_sample(heads["logit_pi"], heads["mu"], heads["log_sigma"], tau, generator)
        return z.squeeze(-1) if self.net.mixture == "per_dim" else z

    def mean_next(self, heads: dict[str, Tensor]) -> Tensor:
        """The predicted mixture's mean ``[..., Z]`` for ``z_{t+1}``."""
        z = mdn_mean(heads["logit_pi"], heads["mu"])
        return z.squeeze(-1) if self.net.mixture == "per_dim" else z

    # -- training ---------------------------------------------------------------------
    def losses(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """:func:`mdn_rnn_loss` on a ``[B, L, ...]`` batch of the latent store.

        The output at ``t`` is scored on row ``t+1`` unless ``is_first[t+1]`` (new episode) or
        ``t < loss.burn_in``. Returns ``loss``, ``nll`` (per latent dimension), ``reward_loss``
        (squared error; its target the forward mean of ``loss.reward_horizon`` rewards),
        ``done_loss`` (BCE on ``is_terminal``) and ``done_acc``; with
        ``loss.open_loop_weight > 0`` also ``open_loop_nll``, ``open_loop_reward_loss``,
        ``open_loop_done_loss`` (see :meth:`open_loop_heads`), added to ``loss`` with that weight.
        """
        if self.loss.reward_horizon > 1:  # the reward head's target, once for both passes
            reward = episode_forward_mean(batch["reward"].float(), batch["is_first"].bool(), self.loss.reward_horizon)
            batch = {**batch, "reward": reward}
        mu, logvar = batch["mu"].float(), batch["logvar"].float()
        z = mu + (0.5 * logvar).exp() * torch.randn_like(mu) if self.sample_z else mu
        is_first = batch["is_first"].bool()
        out, _ = self.unroll(z, self.action_input(batch["action"]), is_first)
        heads = self.heads(out[:, :-1])
        valid = ~is_first[:, 1:]
        if self.loss.burn_in > 0:
            valid[:, : self.loss.burn_in] = False
        losses = self.target_losses(heads, z, batch, valid)
        if self.loss.open_loop_weight > 0:
            ol_heads, fed_back = self.open_loop_heads(z, batch["action"], is_first)
            ol = self.target_losses(ol_heads, z, batch, valid & fed_back)
            losses["loss"] = losses["loss"] + self.loss.open_loop_weight * ol["loss"]
            losses.update({f"open_loop_{k}": v for k, v in ol.items() if k not in ("loss", "done_acc")})
        return losses

    def target_losses(
        self, heads: dict[str, Tensor], z: Tensor, batch: dict[str, Tensor], valid: Tensor
    ) -> dict[str, Tensor]:
        """:func:`mdn_rnn_loss` of the predictions ``heads`` ``[B, L-1, ...]`` (made at ``t``)
        against rows ``t+1`` of ``z [B, L, Z]`` and ``batch``, where ``valid [B, L-1]``."""
        log_prob = self.log_prob(heads, z[:, 1:])
        return mdn_rnn_loss(
            log_prob,
            heads["reward"],
            batch["reward"][:, 1:].float(),
            self.next_done_logit(heads, z[:, 1:]),
            batch["is_terminal"][:, 1:].float(),
            valid,
            self.net.latent_dim,
            self.loss.reward_weight,
            self.loss.done_weight,
            self.loss.done_pos_weight,
        )

    def open_loop_heads(self, z: Tensor, action: Tensor, is_first: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        """M over a window reading its own predictions, as in a dream.

        From each window start and each ``is_first`` row (where the LSTM state resets) M reads
        ``loss.open_loop_warmup`` real latents; after that its input ``z_t`` is what it predicted
        for ``t`` (``loss.open_loop_input``), with the real actions.

        Args:
            z: ``[B, L, Z]`` real latents; action: ``[B, L(, A)]``; is_first: bool ``[B, L]``.
        Returns:
            ``(heads, fed_back)``: the predictions made at ``t`` for ``t+1`` (``heads`` layout,
            ``[B, L-1, ...]``) and bool ``[B, L-1]``, true where the input at ``t`` was M's own.
        """
        b, length = z.shape[:2]
        actions = self.action_input(action)
        state = self.initial_state(b, z.device)
        since_start = torch.zeros(b, dtype=torch.long, device=z.device)
        step_heads, fed_back = [], []
        prediction: Tensor | None = None
        for t in range(length - 1):
            first = is_first[:, t] if t else torch.ones(b, dtype=torch.bool, device=z.device)
            since_start = torch.where(first, torch.zeros_like(since_start), since_start + 1)
            own = since_start >= self.loss.open_loop_warmup
            keep = (~first).float().unsqueeze(-1)
            state = (state[0] * keep, state[1] * keep)
            z_in = z[:, t] if prediction is None else torch.where(own.unsqueeze(-1), prediction, z[:, t])
            out, state = self.step(z_in, actions[:, t], state)
            heads = self.heads(out)
            prediction = self.sample_next(heads) if self.loss.open_loop_input == "sample" else self.mean_next(heads)
            step_heads.append(heads)
            fed_back.append(own)
        return {k: torch.stack([h[k] for h in step_heads], 1) for k in step_heads[0]}, torch.stack(fed_back, 1)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.report("val", self.losses(batch), batch_size=batch["mu"].shape[0])
        if batch_idx == 0 and self.vision_ckpt:
            self.log_dream(batch)

    test_step = validation_step

    # -- dreams -----------------------------------------------------------------------
    def vision(self) -> Vision:
        """V from ``vision_ckpt`` (loaded once, frozen, on this module's device)."""
        if not self._vision:
            if not self.vision_ckpt:
                raise ValueError("Memory.vision_ckpt is not set")
            self._vision.append(load_module(Vision, self.vision_ckpt, self.device))
        vision = self._vision[0]
        if vision.device != self.device:
            vision.to(self.device)
        return vision

    @torch.no_grad()
    def open_loop_dream(
        self, mu: Tensor, action: Tensor, is_first: Tensor, length: int, temperature: float | None = None
    ) -> tuple[Tensor, Tensor]:
        """Roll M out from the real ``z_0 = mu[:, 0]`` under the recorded actions (open loop).

        Args:
            mu: ``[B, L, Z]`` real latents; action: ``[B, L(, A)]``; is_first: ``[B, L]``.
        Returns:
            ``(dream [B, T, Z], valid [B, T])``, ``T = min(length, L)``; ``valid`` is false from
            the first episode border after ``t = 0`` on.
        """
        steps = min(length, mu.shape[1])
        actions = self.action_input(action)
        valid = (~is_first[:, 1:steps].bool()).cumprod(1).bool()
        valid = torch.cat([torch.ones_like(valid[:, :1]), valid], 1)
        z, state, dream = mu[:, 0], self.initial_state(mu.shape[0], mu.device), [mu[:, 0]]
        for t in range(steps - 1):
            out, state = self.step(z, actions[:, t], state)
            z = self.sample_next(self.heads(out), temperature)
            dream.append(z)
        return torch.stack(dream, 1), valid

    @torch.no_grad()
    def log_dream(self, batch: dict[str, Tensor]) -> None:
        """M's open-loop dream of the first ``dream.sequences`` sequences of ``batch``
        (:meth:`open_loop_dream`, ``dream.length`` steps) as two figures: V's decoding of the
        real latents above the decoded dream (black past an episode border,
        ``val/real_vs_dream``) and the dream's squared latent error per step
        (``val/dream_latent_error``)."""
        n = min(self.dream.sequences, batch["mu"].shape[0])
        mu = batch["mu"][:n].float()
        dream, valid = self.open_loop_dream(mu, batch["action"][:n], batch["is_first"][:n], self.dream.length)
        vision = self.vision()
        steps = dream.shape[1]
        mask = valid.view(n, steps, 1, 1, 1)
        real = vision.decode_frames(mu[:, :steps]) * mask
        fake = vision.decode_frames(dream) * mask
        rows = [row for i in range(n) for row in ((f"real {i}", real[i]), (f"dream {i}", fake[i]))]
        title = f"M's open-loop dream under the recorded actions, decoded by V (step {self.global_step})"
        log_figure(self, "val/real_vs_dream", lambda: frames_figure(rows, title, column_label="t="))
        error = (dream - mu[:, :steps]).square().mean(-1)
        log_figure(self, "val/dream_latent_error", lambda: open_loop_error_figure(error, valid))
