"""Learning from imagination (DI-engine's ``DynaWorldModel`` and ``HybridWorldModel``).

* :class:`ImaginationSettings` — the imagination's settings group (Dyna's ``imagination``).
* :class:`DynaWorldModel` — fills an *imagination buffer* (a second
  :class:`~lightning_wm.data.replay.ReplayBuffer`, not checkpointed) by rolling the current
  policy through the model from real starting rows, and draws policy batches from the real and
  the imagined buffer at ``real_ratio`` (:class:`~lightning_wm.data.samplers.MixedSampler`);
  :meth:`DynaWorldModel.evaluate` measures the model's one-step prediction error on real rows.
* :class:`HybridWorldModel` — both that and :class:`~lightning_wm.world_model.DreamWorldModel`'s
  on-the-fly rollouts for backprop through the model.

Imagined rows follow the row convention (``docs/architecture.md``): each rollout is one episode whose first
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

from dataclasses import dataclass
from typing import Any, Literal

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

__all__ = ["DynaWorldModel", "HybridWorldModel", "ImaginationSettings", "imagine_episodes"]


@dataclass(frozen=True)
class ImaginationSettings:
    """The imagination buffer and how batches mix it with real data (Dyna's ``imagination``
    group; DI-engine's ``other.*`` defaults).

    Attributes:
        real_ratio: share of real items in a policy batch, in [0, 1] (the rest imagined).
        rollout_batch_size: real starting rows per fill of the imagination buffer.
        rollout_retain: fills (model versions) whose rollouts the buffer keeps.
        terminal_mode: ``threshold`` (an imagined step terminates where the model's termination
            probability exceeds ``terminal_threshold``) or ``sample`` (it terminates with that
            probability, a Bernoulli draw: imagined episodes end as often as the model predicts
            even where the probability never exceeds a threshold).
        terminal_threshold: the threshold of ``terminal_mode: threshold``, in [0, 1].
        burn_in: 0 starts each rollout from ``model.initial_state(obs)`` of its real row (right
            for a Markov observation); ``k > 0`` filters the ``k`` real rows before it first
            (``zero_state`` + ``observe_step``, resetting at ``is_first``), so a recurrent model
            starts from the posterior it would have there.
    """

    real_ratio: float = 0.05
    rollout_batch_size: int = 100_000
    rollout_retain: int = 4
    terminal_mode: Literal["threshold", "sample"] = "threshold"
    terminal_threshold: float = 0.5
    burn_in: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.real_ratio <= 1.0:
            raise ValueError(f"imagination.real_ratio must be in [0, 1], got {self.real_ratio}")
        if self.rollout_batch_size < 1 or self.rollout_retain < 1:
            raise ValueError(
                f"imagination.rollout_batch_size and rollout_retain must be >= 1, got {self.rollout_batch_size} "
                f"and {self.rollout_retain}"
            )
        check_done_mode(self.terminal_mode, "terminal_mode")
        if not 0.0 <= self.terminal_threshold <= 1.0:
            raise ValueError(f"imagination.terminal_threshold must be in [0, 1], got {self.terminal_threshold}")
        if self.burn_in < 0:
            raise ValueError(f"imagination.burn_in must be >= 0 rows, got {self.burn_in}")


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
        imagination: the buffer and the mix (:class:`ImaginationSettings`; its defaults if None).
        rollout: rollout length per env step (:class:`~lightning_wm.world_model.RolloutSchedule`).
        train_freq, eval_freq: model cadence in env steps (:class:`~lightning_wm.world_model.Cadence`).
        seed: seed of the imagination's randomness (model transitions, the buffer's draws).
    """

    def __init__(
        self,
        model: WorldModel,
        action_space: gym.Space | EnvSpec | ActionCodec,
        imagination: ImaginationSettings | None = None,
        rollout: RolloutSchedule | None = None,
        train_freq: int = 250,
        eval_freq: int = 250,
        seed: int | None = None,
    ) -> None:
        super().__init__(model, train_freq, eval_freq, rollout)
        self.settings = imagination if imagination is not None else ImaginationSettings()
        s = self.settings
        self.codec = action_space if isinstance(action_space, ActionCodec) else ActionCodec(action_space)
        self.codec = self.codec.to(_device(model))
        self.mixer = MixedSampler(RowSampler(), s.real_ratio)
        self.real_ratio = float(s.real_ratio)
        self.rollout_batch_size, self.rollout_retain = int(s.rollout_batch_size), int(s.rollout_retain)
        self.terminal_threshold, self.terminal_mode = float(s.terminal_threshold), s.terminal_mode
        self.burn_in = int(s.burn_in)
        self.generator = torch.Generator(device=_device(model))
        self.reseed(seed)
        self.fills = 0

    def reseed(self, seed: int | None) -> None:
        """Seed the imagination's randomness: model transitions, sampled terminations and the
        imagination buffers' draws (``None``: the buffers draw from fresh entropy)."""
        self.seed = None if seed is None else int(seed) % 2**63
        if self.seed is not None:
            self.generator.manual_seed(self.seed)

    def _generator_on(self, device: torch.device) -> None:
        """Keep the generator on the model's device: the learner moves the model (e.g. to a GPU)
        after this was built, and a generator cannot follow it, so a new one is seeded there."""
        if self.generator.device.type != device.type:
            self.generator = torch.Generator(device=device)
            if self.seed is not None:
                self.generator.manual_seed(self.seed + self.fills)
            else:
                self.generator.seed()

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
        self._generator_on(_device(self.model))
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
        return self.filtered_states(env_buffer.gather(stream[:, None], slot, keys=("obs", "action", "is_first")))

    def filtered_states(self, rows: dict[str, Any]) -> tuple[Any, State]:
        """Windows of ``burn_in + 1`` real rows ``[N, burn_in + 1, ...]`` (``obs``, ``action``,
        ``is_first``) -> the observations of their last rows ``[N, ...]`` and the model's states
        there (``initial_state`` of the observation, or the filtered state after ``burn_in`` rows)."""
        device = _device(self.model)
        rows = tree_map(lambda x: x.to(device), rows)
        span = rows["is_first"].shape[1]
        obs = tree_map(lambda x: x[:, -1], rows["obs"])
        if span == 1:
            return obs, self.model.initial_state(obs)
        n = rows["is_first"].shape[0]
        state = self.model.zero_state(n, device)
        action = self.codec.zeros(n, device)
        for k in range(span):
            is_first = rows["is_first"][:, k].bool() | (k == 0)
            state = self.model.observe_step(state, action, tree_map(lambda x: x[:, k], rows["obs"]), is_first)
            action = self.codec.encode(rows["action"][:, k])
        return obs, state

    def evaluate(self, env_buffer: ReplayBuffer) -> dict[str, float]:
        """DI-engine's ``eval``: the model's one-step prediction error on real transitions.

        Takes up to ``rollout_batch_size`` of the newest real rows that are not an episode's
        last row (their next row is stored; ``burn_in`` rows before them), the model's state
        there (as for imagination starts), one :meth:`~lightning_wm.world_model.WorldModel.step`
        with the real action, and compares it with the next real row. No draws from the buffer
        and the global RNG restored afterwards: evaluating changes nothing about training.

        Returns ``{name: value}`` (empty while no stream holds ``burn_in + 2`` rows):
        ``world_model/eval_reward_mse`` (predicted vs real reward), ``world_model/eval_termination_bce``
        (binary cross-entropy of the termination probability against ``is_terminal``),
        ``world_model/eval_obs_mse`` (decoded vs real observation, frames scaled to [0, 1]; for
        array observations) and ``world_model/eval_rows``.
        """
        stream, slot = self._newest_transitions(env_buffer)
        if len(stream) == 0:
            return {}
        keys = ("obs", "action", "is_first", "reward", "is_terminal")
        rows = env_buffer.gather(stream[:, None], slot, keys=keys)
        device = _device(self.model)
        was_training = self.model.training
        self.model.eval()
        self.codec = self.codec.to(device)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
                history = {k: tree_map(lambda x: x[:, :-1], rows[k]) for k in ("obs", "action", "is_first")}
                _, state = self.filtered_states(history)
                action = self.codec.encode(rows["action"][:, -2].to(device))
                reward, next_state, done = self.model.step(state, action)
                real = tree_map(lambda x: x[:, -1].to(device), {k: rows[k] for k in ("obs", "reward", "is_terminal")})
                terminal = real["is_terminal"].float()
                out = {
                    "world_model/eval_reward_mse": float((reward.float() - real["reward"].float()).square().mean()),
                    "world_model/eval_termination_bce": float(
                        torch.nn.functional.binary_cross_entropy(done.float().clamp(1e-6, 1 - 1e-6), terminal)
                    ),
                    "world_model/eval_rows": float(len(stream)),
                }
                decoded = self.model.decode(next_state)
                if isinstance(decoded, Tensor) and isinstance(real["obs"], Tensor):
                    scale = 255.0 if real["obs"].dtype == torch.uint8 else 1.0
                    error = (decoded.float() - real["obs"].float()) / scale
                    out["world_model/eval_obs_mse"] = float(error.square().mean())
        finally:
            self.model.train(was_training)
        return out

    def _newest_transitions(self, env_buffer: ReplayBuffer) -> tuple[np.ndarray, np.ndarray]:
        """``(stream [N], slots [N, burn_in + 2])``: windows over the newest real rows, about as
        many from every stream, at most ``rollout_batch_size`` in all, whose second-to-last row
        (the transition's start) is not an episode's last row; newest first."""
        span, cap = self.burn_in + 2, env_buffer.cap_per_stream
        counts, newest = env_buffer.rows_per_stream, env_buffer.newest
        full = np.flatnonzero(counts >= span)
        streams, ends = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        is_last = env_buffer.column("is_last") if len(full) else None
        per = -(-self.rollout_batch_size // max(1, len(full)))
        for s in full:
            end = (newest[s] - np.arange(counts[s] - span + 1)) % cap
            end = end[~is_last[s, (end - 1) % cap].astype(bool)][:per]
            streams.append(np.full(len(end), s, np.int64))
            ends.append(end)
        stream, end = (
            np.concatenate(streams)[: self.rollout_batch_size],
            np.concatenate(ends)[: self.rollout_batch_size],
        )
        return stream, (end[:, None] - span + 1 + np.arange(span)) % cap

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
    gradients into the actor (:meth:`rollout`), under one cadence and one rollout schedule.
    Arguments as :class:`DynaWorldModel`'s."""
