"""Learning from imagination (DI-engine's ``DynaWorldModel`` and ``HybridWorldModel``).

* :class:`DynaWorldModel` — fills an *imagination buffer* (a second
  :class:`~lightning_wm.data.replay.ReplayBuffer`, not checkpointed) by rolling the current
  policy through the model from real starting rows, and draws policy batches from the real and
  the imagined buffer at ``real_ratio`` (:class:`~lightning_wm.data.samplers.MixedSampler`).
* :class:`HybridWorldModel` — both that and :class:`~lightning_wm.world_model.DreamWorldModel`'s
  on-the-fly rollouts for backprop through the model.

Imagined rows follow the row convention (DESIGN.md): each rollout is one episode whose first
row is the real observation it branched from (``is_first``, reward 0), then one row per
imagined step with the decoded observation (:meth:`~lightning_wm.world_model.WorldModel.decode`)
and the model's reward; a step whose termination probability exceeds ``terminal_threshold``
(``terminal_mode="sample"``: a Bernoulli draw of it) is the episode's ``is_terminal`` and
``is_last`` row and nothing is imagined after it; a
rollout that reaches its length without terminating ends with ``is_last`` (a truncation). The
action and the agent's extras (e.g. behaviour ``logits``) are those of the policy that acted,
zeroed on last rows as the Collector does. Rollouts are written one after another into the
buffer's single stream (``is_first`` marks where each begins).

Buffer size (DI-engine's buffer-size scheduler): ``rollout_retain`` fills of
``rollout_batch_size`` rollouts of the scheduled length. DI-engine counts transitions
(``length * rollout_batch_size * rollout_retain``); a row-convention episode of ``length``
transitions has ``length + 1`` rows, so the buffer holds ``(length + 1) * rollout_batch_size *
rollout_retain`` rows. When the scheduled length changes the buffer is rebuilt at the new size
(empty, then filled by the rollouts of the current model).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor

from lightning_wm.actions import ActionCodec
from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.data.samplers import MixedSampler, RowSampler, Sampler
from lightning_wm.envs import EnvSpec
from lightning_wm.protocols import Agent
from lightning_wm.tree import first_leaf, stack, tree_map
from lightning_wm.world_model import (
    DreamWorldModel,
    LearnedModel,
    RolloutSchedule,
    State,
    WorldModel,
    check_done_mode,
    episode_ends,
)

__all__ = ["DynaWorldModel", "HybridWorldModel", "imagine_episodes"]


def _device(model: Any) -> torch.device:
    param = next(iter(model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


@torch.no_grad()
def imagine_episodes(
    model: WorldModel,
    agent: Agent,
    codec: ActionCodec,
    obs: Any,
    horizon: int,
    terminal_threshold: float = 0.5,
    generator: torch.Generator | None = None,
    start: State | None = None,
    terminal_mode: str = "threshold",
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Roll ``agent`` through ``model`` for ``horizon`` steps from real observations.

    Args:
        model: the world model (``initial_state``, ``step``, ``decode``).
        agent: acts on observations (``act(obs, state, explore=True)``, env-format actions).
        codec: converts the agent's env-format actions to the model's format.
        obs: real observations ``[B, ...]`` (torch, env format): the branch points.
        horizon: imagined steps ``H`` (>= 1).
        terminal_threshold: a step whose termination probability is above it terminates.
        generator: randomness of the model's transitions (and of sampled terminations).
        start: the model's state at ``obs`` (e.g. filtered over the rows before it); default
            ``model.initial_state(obs)``.
        terminal_mode: ``"threshold"`` (above) or ``"sample"``: a step terminates with the
            model's termination probability (a Bernoulli draw), so imagined episodes end as often
            as the done head predicts even where it never exceeds a threshold.
    Returns:
        ``(rows, alive)``: rows in the row convention, time-major numpy ``[H+1, B, ...]``
        (``obs``, ``reward``, ``is_first``, ``is_last``, ``is_terminal``, ``action`` and the
        agent's extras), and ``alive`` bool ``[H+1, B]``: the rows that exist (none after a
        termination).
    """
    if horizon < 1:
        raise ValueError(f"imagined episodes need a horizon >= 1, got {horizon}")
    check_done_mode(terminal_mode, "terminal_mode")
    device = _device(model)
    obs = tree_map(lambda x: torch.as_tensor(x).to(device), obs)
    state = model.initial_state(obs) if start is None else start
    batch = first_leaf(obs).shape[0]
    agent_state = agent.initial_state(batch)
    steps: list[dict[str, Any]] = []
    reward = torch.zeros(batch, device=device)
    terminal = torch.zeros(batch, dtype=torch.bool, device=device)
    for t in range(horizon + 1):
        action, agent_state, extras = agent.act(obs, agent_state, True)
        steps.append({"obs": obs, "reward": reward, "is_terminal": terminal, "action": action, **extras})
        if t == horizon:
            break
        reward, state, done = model.step(state, codec.encode(action.to(device)), generator=generator)
        terminal = episode_ends(done, terminal_mode, terminal_threshold, generator)
        obs = model.decode(state)
    rows = tree_map(lambda x: x.detach().cpu().numpy(), stack(steps))
    term = rows["is_terminal"].astype(bool)
    alive = np.ones_like(term)
    alive[1:] = ~np.logical_or.accumulate(term[:-1], axis=0)  # nothing after a termination
    is_last = term.copy()
    is_last[-1] = True
    is_first = np.zeros_like(term)
    is_first[0] = True
    rows.update(reward=rows["reward"].astype(np.float32), is_terminal=term, is_last=is_last, is_first=is_first)
    for key in [k for k in rows if k not in ("obs", "reward", "is_first", "is_last", "is_terminal")]:
        value = np.array(rows[key], copy=True)  # the action and extras: no action on a last row
        value[is_last] = 0
        rows[key] = value
    return rows, alive


def _episodes_in_order(rows: dict[str, Any], alive: np.ndarray) -> dict[str, Any]:
    """Rows ``[H+1, B, ...]`` with ``alive [H+1, B]`` -> the living rows of episode 0, then of
    episode 1, ...: leaves ``[N, 1, ...]`` (one stream, for ``add_many``)."""
    keep = alive.T  # [B, H+1]: episode-major
    return tree_map(lambda x: np.swapaxes(x, 0, 1)[keep][:, None], rows)


class DynaWorldModel(LearnedModel):
    """Dyna-style use of a world model: imagined rollouts stored and reused (DI-engine's names
    and defaults).

    Args:
        model: the :class:`~lightning_wm.world_model.WorldModel` (an ``nn.Module`` that can
            ``decode`` its states into observations).
        action_space: the env's action space (or its :class:`~lightning_wm.envs.EnvSpec`, or an
            :class:`~lightning_wm.actions.ActionCodec`): how the agent's actions reach the model.
        train_freq, eval_freq: model cadence in env steps (:class:`~lightning_wm.world_model.Cadence`).
        rollout_length_scheduler: rollout length per env step.
        real_ratio: share of real items in a policy batch (the rest imagined).
        rollout_batch_size: real starting rows per fill of the imagination buffer.
        rollout_retain: fills (model versions) whose rollouts the buffer keeps.
        terminal_threshold: termination probability above which an imagined step terminates.
        burn_in: 0 starts each rollout from ``model.initial_state(obs)`` of its real row (right
            for a Markov observation); ``k > 0`` filters the ``k`` real rows before it first
            (``zero_state`` + ``observe_step``, resetting at ``is_first``), so a recurrent model
            starts from the posterior it would have there.
        seed: seed of the imagination's randomness (model transitions, the buffer's draws).
        terminal_mode: ``"threshold"`` (``terminal_threshold``) or ``"sample"`` (a step
            terminates with the done head's probability).
    """

    def __init__(
        self,
        model: WorldModel,
        action_space: gym.Space | EnvSpec | ActionCodec,
        train_freq: int = 250,
        eval_freq: int = 250,
        rollout_length_scheduler: RolloutSchedule | None = None,
        real_ratio: float = 0.05,
        rollout_batch_size: int = 100_000,
        rollout_retain: int = 4,
        terminal_threshold: float = 0.5,
        burn_in: int = 0,
        seed: int | None = None,
        terminal_mode: str = "threshold",
    ) -> None:
        super().__init__(model, train_freq, eval_freq, rollout_length_scheduler)
        if rollout_batch_size < 1 or rollout_retain < 1:
            raise ValueError(
                f"rollout_batch_size and rollout_retain must be >= 1, got {rollout_batch_size} and {rollout_retain}"
            )
        self.codec = action_space if isinstance(action_space, ActionCodec) else ActionCodec(action_space)
        self.codec = self.codec.to(_device(model))
        self.mixer = MixedSampler(RowSampler(), real_ratio)  # checks real_ratio
        self.real_ratio = float(real_ratio)
        self.rollout_batch_size, self.rollout_retain = int(rollout_batch_size), int(rollout_retain)
        self.terminal_threshold = float(terminal_threshold)
        check_done_mode(terminal_mode, "terminal_mode")
        self.terminal_mode = terminal_mode
        if burn_in < 0:
            raise ValueError(f"burn_in must be >= 0 rows, got {burn_in}")
        self.burn_in = int(burn_in)
        self.generator = torch.Generator(device=_device(model))
        self.reseed(seed)
        self.fills = 0

    def reseed(self, seed: int | None) -> None:
        """Seed the imagination's randomness: model transitions, sampled terminations and the
        imagination buffers' draws (``None``: the buffers draw from fresh entropy)."""
        self.seed = None if seed is None else int(seed) % 2**63
        if self.seed is not None:
            self.generator.manual_seed(self.seed)

    def buffer_size(self, envstep: int) -> int:
        """Rows the imagination buffer holds at ``envstep`` (see the module docstring)."""
        return (self.rollout_length_scheduler(envstep) + 1) * self.rollout_batch_size * self.rollout_retain

    def fill_img_buffer(
        self,
        agent: Agent,
        env_buffer: ReplayBuffer,
        img_buffer: ReplayBuffer | None,
        envstep: int,
        policy_version: int | None = None,
    ) -> ReplayBuffer | None:
        """Roll ``agent`` through the model from ``rollout_batch_size`` real rows of ``env_buffer``
        (drawn with replacement among rows that are not an episode's last row) and append the
        imagined episodes to ``img_buffer``.

        Returns the imagination buffer: ``img_buffer``, or a new one (not checkpointed) when
        there was none or the scheduled length changed its size; ``img_buffer`` unchanged when
        the scheduled length is 0. Keys of the real rows the imagination does not make are
        filled with zeros (``policy_version`` with ``policy_version`` when given), so batches of
        both buffers have the same keys.
        """
        horizon = self.rollout_length_scheduler(envstep)
        if horizon == 0:
            return img_buffer
        self.codec = self.codec.to(_device(self.model))  # the learner may have moved the model
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                obs, start = self._starts(env_buffer)
            rows, alive = imagine_episodes(
                self.model,
                agent,
                self.codec,
                obs,
                horizon,
                self.terminal_threshold,
                self.generator,
                start,
                self.terminal_mode,
            )
        finally:
            self.model.train(was_training)
        chunk = _episodes_in_order(rows, alive)
        n = len(chunk["is_first"])
        for key in env_buffer.keys:
            if "/" in key or key in chunk:
                continue
            column = env_buffer.column(key)
            fill = policy_version if key == "policy_version" and policy_version is not None else 0
            chunk[key] = np.full((n, 1, *column.shape[2:]), fill, column.dtype)
        size = self.buffer_size(envstep)
        if img_buffer is None or img_buffer.capacity != size:
            seed = None if self.seed is None else (self.seed + 1 + self.fills) % 2**63
            img_buffer = ReplayBuffer(size, 1, seed=seed, checkpoint=False)
        img_buffer.add_many(chunk)
        self.fills += 1
        return img_buffer

    def _starts(self, env_buffer: ReplayBuffer) -> tuple[Any, State]:
        """``rollout_batch_size`` real rows that are not an episode's last row (drawn with
        replacement) -> their observations ``[N, ...]`` and the model's states there."""
        n, span, cap = self.rollout_batch_size, self.burn_in + 1, env_buffer.cap_per_stream
        is_last = env_buffer.column("is_last")
        stream, first = env_buffer.draw(
            n,
            span=span,
            accept=lambda s, t: ~is_last[s, (t + span - 1) % cap],
            what="imagination starts (rows that are not an episode's last row)",
        )
        slot = (first[:, None] + np.arange(span)) % cap
        device = _device(self.model)
        rows = tree_map(
            lambda x: x.to(device), env_buffer.gather(stream[:, None], slot, keys=("obs", "action", "is_first"))
        )
        obs = tree_map(lambda x: x[:, -1], rows["obs"])
        if span == 1:
            return obs, self.model.initial_state(obs)
        state = self.model.zero_state(n, device)
        action = self.codec.zeros(n, device)
        for k in range(span):
            is_first = rows["is_first"][:, k].bool() | (k == 0)
            state = self.model.observe_step(state, action, tree_map(lambda x: x[:, k], rows["obs"]), is_first)
            action = self.codec.encode(rows["action"][:, k])
        return obs, state

    def sample(
        self, env_buffer: ReplayBuffer, img_buffer: ReplayBuffer | None, batch_size: int, sampler: Sampler | None = None
    ) -> dict[str, Tensor]:
        """A policy batch: ``round(real_ratio * batch_size)`` items from ``env_buffer``, the rest
        from ``img_buffer`` (all real while it is empty), drawn with ``sampler`` (single rows by
        default); ``is_real`` ``[B]`` tells them apart."""
        mixer = self.mixer if sampler is None else MixedSampler(sampler, self.real_ratio)
        return mixer.sample(env_buffer, img_buffer, batch_size)


class HybridWorldModel(DynaWorldModel, DreamWorldModel):
    """Both uses of one model (DI-engine's ``HybridWorldModel``): reused rollouts through the
    imagination buffer (:meth:`fill_img_buffer`, :meth:`sample`) and on-the-fly rollouts with
    gradients into the actor (:meth:`rollout`), under one cadence and one rollout-length
    scheduler. Arguments as :class:`DynaWorldModel`'s."""
