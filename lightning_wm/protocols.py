"""The small protocols through which agents, datamodules, actors and callbacks meet.

Nothing here imports ``data/`` or ``agents/``: models, datamodules and callbacks all import
*this* module, so none of them needs to know the others' classes.

* :class:`Agent` — what a Collector needs to act (``initial_state``, ``act``);
  :class:`ActingAgent` adds ``acting_copy()`` for actor processes.
* :class:`EnvStats` / :class:`EnvStatsSource` — env statistics a datamodule hands to the
  ``EnvStatsLogger`` callback (which logs ``env/*``); :class:`EnvStepCounter` — the env steps
  so far, which agents with env-step schedules read.
* :class:`AgentSink` — a datamodule that acts with the module being trained: the
  ``AgentPublisher`` callback attaches it (the one way the acting part gets its agent).
* :class:`FeedbackSink`, :class:`ReplayHolder` — what the feedback and buffer-checkpoint
  callbacks look for on a datamodule.
* :class:`EnvHolder` — a datamodule that names its environment (``record`` / ``evaluate``).
* :class:`EvaluationRequest` — the one validation "batch" of an online datamodule: the model's
  ``validation_step`` calls ``batch.run(self)`` to play evaluation episodes.
* :class:`GenerationTask` — the training batch of an evolution-strategy learner (which
  generation, in which env).

A callback whose datamodule does not implement its protocol does nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

from lightning_wm.envs import EnvConfig

__all__ = [
    "Agent",
    "ActingAgent",
    "EnvStats",
    "EnvStepCounter",
    "EnvStatsSource",
    "FeedbackSink",
    "ReplayHolder",
    "ImaginationHost",
    "SamplerSource",
    "AgentSink",
    "EnvHolder",
    "EvaluationRequest",
    "GenerationTask",
    "acting_weights",
]


@runtime_checkable
class Agent(Protocol):
    """What a Collector needs: batched acting with a recurrent state.

    ``state`` is ``None`` or a pytree of tensors whose first dimension is the batch; the
    Collector resets entries where a new episode begins by taking them from
    ``initial_state``.
    """

    def initial_state(self, batch_size: int) -> Any:
        """``None`` or a pytree of tensors ``[batch_size, ...]``."""
        ...

    def act(self, obs: Any, state: Any, explore: bool) -> tuple[Tensor, Any, dict[str, Tensor]]:
        """``obs [B, ...]`` (a tensor or a dict of tensors) -> ``(action, state, extras)``:
        action ``int64 [B]`` (discrete) or ``float32 [B, A]`` (continuous, within the env
        bounds), the new state, and extras ``{name: [B, ...]}`` stored as row columns."""
        ...


@runtime_checkable
class ActingAgent(Agent, Protocol):
    """An :class:`Agent` that can ship a copy of itself to actor processes."""

    def acting_copy(self) -> nn.Module:
        """A CPU, eval-mode, ``requires_grad=False`` module implementing :class:`Agent`,
        picklable for ``spawn``; its ``state_dict()`` (keys stable across calls) is what a
        weight store publishes."""
        ...


def acting_weights(agent: Any) -> Mapping[str, Tensor]:
    """What a publish sends: ``agent.acting_weights()`` where the agent has it (its acting copy's
    ``state_dict`` keys, read from the live tensors on any device, so no copy of the module is
    made at every publish), else ``agent.acting_copy().state_dict()``."""
    read = getattr(agent, "acting_weights", None)
    return read() if callable(read) else agent.acting_copy().state_dict()


@dataclass
class EnvStats:
    """A datamodule's env statistics since the last :meth:`EnvStatsSource.pop_env_stats`.

    Attributes:
        env_steps: total env steps (agent steps over all envs) of this rank so far.
        episodes: episodes finished since the last pop: ``{"return", "length"}`` (+ anything).
        metrics: gauges such as ``"actors/policy_lag"``, ``"actors/frames_per_s"``,
            ``"actors/queue_depth"`` (their latest values are logged, averaged over ranks).
    """

    env_steps: int = 0
    episodes: list[dict[str, float]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class EnvStepCounter(Protocol):
    """Counts this rank's env steps so far (an online datamodule); an agent whose schedules run
    in env steps reads it through :attr:`lightning_wm.agents.base.RLModule.env_steps`."""

    @property
    def env_steps(self) -> int: ...


@runtime_checkable
class EnvStatsSource(Protocol):
    """A datamodule that acts in envs and reports what happened there."""

    def pop_env_stats(self) -> EnvStats: ...


@runtime_checkable
class FeedbackSink(Protocol):
    """A datamodule that takes a learner's per-sample feedback (priorities, new columns)."""

    def apply_feedback(self, batch: dict, feedback: dict) -> dict[str, int]:
        """Returns ``{"applied", "stale"}`` row counts (rows overwritten since sampling are stale)."""
        ...


@runtime_checkable
class ReplayHolder(Protocol):
    """A datamodule that owns replay buffers: name -> :class:`lightning_wm.data.replay.ReplayBuffer`
    (typed ``Any`` here so that this module does not import ``data/``); a buffer's
    ``.checkpoint`` says whether it is written beside the checkpoints."""

    def replay_buffers(self) -> dict[str, Any]: ...


@runtime_checkable
class ImaginationHost(Protocol):
    """A datamodule that can mix imagined data into its batches (Dyna): ``real_buffer()`` is
    where imagination starts from; after ``set_imagination(buffer, real_ratio)`` batches take
    ``real_ratio`` of their items from the real data and the rest from ``buffer`` (buffers typed
    ``Any`` so that this module does not import ``data/``)."""

    def real_buffer(self) -> Any: ...

    def set_imagination(self, buffer: Any, real_ratio: float) -> None: ...


@runtime_checkable
class AgentSink(Protocol):
    """A datamodule that acts with the module being trained. ``attach_agent(agent, version)`` is
    called when fit starts (before the first batch is fetched), when training starts (the
    restored step of a resumed run) and after optimizer steps, with ``version`` the learner's
    optimizer steps: acting in process keeps the live module; actors act with
    ``agent.acting_copy()`` (an :class:`ActingAgent`), sent as the datamodule's cadence says.
    A datamodule never takes the module from the trainer itself."""

    def attach_agent(self, agent: nn.Module, version: int) -> None: ...


@runtime_checkable
class SamplerSource(Protocol):
    """An agent that knows how its replay batches must be read (e.g. MuZero's unroll windows):
    a replay datamodule whose ``sampler`` is unset samples with ``replay_sampler()``, so a value
    the model and the sampler both need is set once, in the model (typed ``Any`` so that this
    module does not import ``data/``)."""

    def replay_sampler(self) -> Any: ...


@runtime_checkable
class EnvHolder(Protocol):
    """A datamodule that names the environment its data comes from (``None``: it has none)."""

    env: EnvConfig | None


class EvaluationRequest:
    """The validation batch of an online datamodule: a request to play evaluation episodes.

    ``run(agent, episodes=None)`` plays ``episodes`` episodes (the datamodule's default when
    ``None``) of ``agent`` with ``explore=False`` in fresh envs of the datamodule's evaluation
    config and returns one ``{"return", "length", ...}`` dict per episode. The datamodule builds
    it around its own evaluation function, so the model never reaches into the datamodule.
    """

    def __init__(self, run: Callable[[Agent, int | None], list[dict[str, float]]]) -> None:
        self._run = run

    def run(self, agent: Agent, episodes: int | None = None) -> list[dict[str, float]]:
        return self._run(agent, episodes)

    def __repr__(self) -> str:
        return f"EvaluationRequest({getattr(self._run, '__qualname__', self._run)!r})"


class GenerationTask:
    """A training batch of an evolution-strategy learner: run generation ``index``, evaluating
    the population in the real env ``env`` (``None`` when the datamodule has none, e.g. a
    learner that evaluates only inside a dream)."""

    __slots__ = ("index", "env")

    def __init__(self, index: int, env: EnvConfig | None) -> None:
        self.index, self.env = index, env

    def __repr__(self) -> str:
        return f"GenerationTask({self.index}, {self.env!r})"
