"""The interface every steppable learned model offers, and what is built on top of it.

A *state* is a model's own latent (RSSM ``h``/``z``, MDN-RNN ``h`` + VAE ``z``, MuZero hidden
state): any pytree (tensor, tuple, dict) of tensors whose first dimension is the batch.

* :class:`WorldModel` — ``initial_state(obs)``, ``step(state, action)``, ``features(state)``;
  where a model can: ``zero_state``, ``observe_step`` (filter real steps), ``decode`` (render a
  state; ``decode_features`` from its features), ``posterior_states`` (filter a recorded
  episode: where dreams start).
* :func:`rollout` — imagination: actor gradients flow through the model's computation but
  never into the model's parameters; entropy-augmented rewards when the actor returns them.
* :class:`RolloutSchedule` — rollout length linear in env steps (DI-engine's names and
  defaults).
* :class:`Cadence` — when to train / evaluate a model beside a policy, in env steps
  (``train_freq``, ``eval_freq``, ``should_train``, ``should_eval``).
* :class:`LearnedModel` — a model with its cadence and rollout-length scheduler;
  :class:`DreamWorldModel` adds ``rollout(start, actor_fn, envstep, horizon=None)``. The
  imagination buffer (Dyna) and both together (Hybrid) are in :mod:`lightning_wm.agents.dyna`.
* ``DreamEnv`` (in :mod:`lightning_wm.dream_env`) — a gymnasium vector env driven by a model.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_wm import tree

State = Any


class WorldModel(ABC):
    """Mixin for an ``nn.Module`` whose dynamics can be stepped on batches."""

    @abstractmethod
    def initial_state(self, obs: Tensor) -> State:
        """Latent state from real observations ``[B, ...]``."""

    @abstractmethod
    def step(
        self, state: State, action: Tensor, generator: torch.Generator | None = None
    ) -> tuple[Tensor, State, Tensor]:
        """One imagined transition.

        Args:
            state: latent of batch ``B``.
            action: ``[B, A]`` (one-hot for discrete actions) float.
            generator: source of the transition's randomness (reproducible dreams); the
                global RNG when None.
        Returns:
            ``(reward [B], next_state, done [B])``: the reward received on arriving at
            ``next_state`` and the probability (in ``[0, 1]``) that the episode terminated there.
        """

    @abstractmethod
    def features(self, state: State) -> Tensor:
        """``[B, F]`` vector an actor or critic reads from a state."""

    # -- optional: what a model offers where it can ------------------------------------------
    def zero_state(self, batch_size: int, device: torch.device | None = None) -> State:
        """The state before anything was observed (zeros), shaped like every other state."""
        raise NotImplementedError(f"{type(self).__name__} has no zero state")

    def observe_step(self, state: State, action: Tensor, obs: Any, is_first: Tensor | None = None) -> State:
        """Filter one real step: the state after taking ``action [B, A]`` (float; one-hot for
        discrete actions) in ``state`` and then observing ``obs [B, ...]``. Where ``is_first``
        (bool ``[B]``) the episode restarts and the result is ``initial_state(obs)`` there."""
        raise NotImplementedError(f"{type(self).__name__} cannot filter real observations")

    def decode(self, state: State) -> Any:
        """The observation a state stands for, in the env's format (``uint8 [B, H, W, C]``
        frames, float vectors, or a dict of both); for rendering dreams and imagined rows."""
        raise NotImplementedError(f"{type(self).__name__} cannot decode its states")

    def decode_features(self, features: Tensor) -> Any:
        """The observation that :meth:`features` ``[B, F]`` of a state stand for (as :meth:`decode`
        of that state), for an actor that reads observations inside a :func:`rollout`."""
        raise NotImplementedError(f"{type(self).__name__} cannot decode its features")

    def posterior_states(self, episode: dict[str, Any]) -> State:
        """The filtered state at every row of one real episode (row convention, leaves
        ``[T, ...]``) -> states ``[T, ...]``: row 0 is ``initial_state(obs[0])``, row ``t`` has
        read rows ``0..t`` and the actions before ``t``. Dreams start from these."""
        raise NotImplementedError(f"{type(self).__name__} cannot filter recorded episodes")


@contextlib.contextmanager
def frozen(module: nn.Module) -> Iterator[None]:
    """Within the block, ``module``'s parameters do not require grad (restored afterwards).

    Gradients still flow *through* the module's computation to whatever else requires grad
    (the actor), but the graph built inside holds no edges into these parameters. Within
    ``torch.compile`` (which cannot trace ``requires_grad_``) the parameters are swapped for
    detached views of themselves instead: the same values and the same missing edges.
    """
    if torch.compiler.is_compiling():
        detached = {name: p.detach() for name, p in module.named_parameters()}
        with torch.nn.utils.stateless._reparametrize_module(module, detached):
            yield
        return
    flags = [(p, p.requires_grad) for p in module.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def check_done_mode(mode: str, name: str = "done_mode") -> None:
    """Refuse a done mode other than ``threshold`` or ``sample`` (``name``: the option's name)."""
    if mode not in ("threshold", "sample"):
        raise ValueError(f"{name} must be 'threshold' or 'sample', got {mode!r}")


def episode_ends(
    done_prob: Tensor, mode: str, threshold: float = 0.5, generator: torch.Generator | None = None
) -> Tensor:
    """Which imagined steps end their episode, from the done head's probabilities ``[N]``: those
    above ``threshold`` (``mode="threshold"``) or a Bernoulli draw of each (``mode="sample"``,
    uniform float32 draws from ``generator``) -> bool ``[N]``."""
    if mode == "threshold":
        return done_prob > threshold
    return torch.rand(done_prob.shape, generator=generator, device=done_prob.device) < done_prob


ActorFn = Callable[[Tensor], Any]  # features [B, F] -> action [B, A] or (action, aug_reward [B])


def _split_actor_output(out: Any) -> tuple[Tensor, Tensor | None]:
    """``action`` or ``(action, aug_reward)`` -> ``(action, aug_reward or None)``."""
    if isinstance(out, (tuple, list)):
        if len(out) != 2:
            raise ValueError(f"actor_fn must return an action or (action, aug_reward), got {len(out)} values")
        return out[0], out[1]
    return out, None


def rollout(
    model: WorldModel,
    start: State,
    actor_fn: ActorFn,
    horizon: int,
) -> dict[str, Any]:
    """Imagine ``horizon`` (``N``) steps from ``start`` (batch ``B``) with the actor.

    ``actor_fn(features [B, F])`` returns the action ``[B, A]`` (model format: one-hot for
    discrete actions) or ``(action, aug_reward [B])``, where ``aug_reward`` is a bonus such as
    SAC's entropy term ``-temperature * log pi(a|s)``. The actor is called in every state,
    the last one included (DI-engine's shapes), so ``actions`` and ``aug_rewards`` have
    ``N + 1`` entries.

    Returns a dict with
        ``states``: the start and every imagined state: pytree of ``[N+1, B, ...]``;
        ``features``: ``[N+1, B, F]``;
        ``actions``: ``[N+1, B, A]`` (``actions[t]`` chosen in ``states[t]``; the last one is
        not taken);
        ``rewards``: ``[N, B]`` the model's reward on arriving at ``states[t+1]`` (without the
        bonus: DI-engine adds ``aug_rewards[:-1]`` into its ``rewards``, here the learner does);
        ``aug_rewards``: ``[N+1, B]`` the actor's bonus in ``states[t]`` (zeros when the actor
        returns only actions);
        ``dones``: ``[N, B]`` termination probability at ``states[t+1]``.
    ``horizon`` 0 gives the start alone: ``rewards`` and ``dones`` are empty ``[0, B]``. The
    model's parameters get no gradient from anything computed here; the actor's do.
    """
    if not isinstance(model, nn.Module):
        raise TypeError("rollout needs a WorldModel that is an nn.Module")
    if horizon < 0:
        raise ValueError(f"rollout horizon must be >= 0, got {horizon}")
    feat = model.features(start)
    states, feats, actions, rewards, dones, augs = [start], [feat], [], [], [], []
    state = start
    with frozen(model):
        for t in range(horizon + 1):
            action, aug = _split_actor_output(actor_fn(feats[-1]))
            actions.append(action)
            augs.append(aug if aug is not None else feat.new_zeros(feat.shape[0]))
            if t == horizon:
                break
            reward, state, done = model.step(state, action)
            states.append(state)
            feats.append(model.features(state))
            rewards.append(reward)
            dones.append(done)
    batch = feat.shape[0]
    return {
        "states": tree.stack(states),
        "features": torch.stack(feats),
        "actions": torch.stack(actions),
        "rewards": torch.stack(rewards) if rewards else feat.new_zeros(0, batch),
        "aug_rewards": torch.stack(augs),
        "dones": torch.stack(dones) if dones else feat.new_zeros(0, batch),
    }


@dataclass(frozen=True)
class RolloutSchedule:
    """The imagined rollout's length, linear in env steps (DI-engine's ``rollout_length_scheduler``
    of ``type: linear``, with its defaults; Dreamer's horizon schedule): ``min_length`` until
    ``start_step``, ``max_length`` from ``end_step`` on, and the linear interpolation (rounded
    down) in between. Call it with the env steps taken so far."""

    start_step: int = 20_000
    end_step: int = 150_000
    min_length: int = 1
    max_length: int = 25

    def __post_init__(self) -> None:
        if not 0 <= self.min_length <= self.max_length:
            raise ValueError(
                f"a rollout schedule needs 0 <= min_length <= max_length, got {self.min_length} and {self.max_length}"
            )
        if not 0 <= self.start_step <= self.end_step:
            raise ValueError(
                f"a rollout schedule needs 0 <= start_step <= end_step, got {self.start_step} and {self.end_step}"
            )

    def __call__(self, env_steps: int) -> int:
        if env_steps >= self.end_step:
            return self.max_length
        if env_steps <= self.start_step:
            return self.min_length
        frac = (env_steps - self.start_step) / (self.end_step - self.start_step)
        return int(self.min_length + frac * (self.max_length - self.min_length))


class Cadence:
    """When to train and evaluate a model beside a policy, counted in real env steps
    (DI-engine's ``train_freq`` / ``eval_freq``, default 250 each).

    ``should_train(envstep)``: at least ``train_freq`` env steps since the last
    :meth:`trained`; ``should_eval(envstep)``: at least ``eval_freq`` since the last
    :meth:`evaluated`, and only once the model was trained. A learner calls :meth:`trained` /
    :meth:`evaluated` with the env step at which it did so.
    """

    def __init__(self, train_freq: int = 250, eval_freq: int = 250) -> None:
        if train_freq < 0 or eval_freq < 0:
            raise ValueError(f"train_freq and eval_freq must be >= 0 env steps, got {train_freq} and {eval_freq}")
        self.train_freq, self.eval_freq = int(train_freq), int(eval_freq)
        self.last_train_step = 0
        self.last_eval_step = 0
        self.train_count = 0

    def should_train(self, envstep: int) -> bool:
        """Whether the model is due for training at ``envstep``."""
        return envstep - self.last_train_step >= self.train_freq

    def should_eval(self, envstep: int) -> bool:
        """Whether the model is due for evaluation at ``envstep`` (never before a first training)."""
        return self.train_count > 0 and envstep - self.last_eval_step >= self.eval_freq

    def trained(self, envstep: int) -> None:
        """Record a training of the model at ``envstep``."""
        self.last_train_step, self.train_count = int(envstep), self.train_count + 1

    def evaluated(self, envstep: int) -> None:
        """Record an evaluation of the model at ``envstep``."""
        self.last_eval_step = int(envstep)

    def state_dict(self) -> dict[str, int]:
        return {
            "last_train_step": self.last_train_step,
            "last_eval_step": self.last_eval_step,
            "train_count": self.train_count,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.last_train_step = int(state["last_train_step"])
        self.last_eval_step = int(state["last_eval_step"])
        self.train_count = int(state["train_count"])


class LearnedModel(Cadence):
    """A steppable model with DI-engine's cadence and rollout-length scheduler (what the seed's
    ``WorldModel`` base holds); :class:`DreamWorldModel` and the imagination classes of
    :mod:`lightning_wm.agents.dyna` build on it.

    Holds a reference to ``model`` (it is not a module itself: the learner that trains the
    model owns its parameters).

    Args:
        model: the :class:`WorldModel` (an ``nn.Module``).
        train_freq, eval_freq: see :class:`Cadence`.
        rollout_length_scheduler: rollout length per env step (default: DI-engine's defaults).
    """

    def __init__(
        self,
        model: WorldModel,
        train_freq: int = 250,
        eval_freq: int = 250,
        rollout_length_scheduler: RolloutSchedule | None = None,
    ) -> None:
        super().__init__(train_freq, eval_freq)
        if not (isinstance(model, WorldModel) and isinstance(model, nn.Module)):
            raise TypeError(f"{type(self).__name__} needs a WorldModel nn.Module, got {type(model).__name__}")
        self.model = model
        self.rollout_length_scheduler = rollout_length_scheduler or RolloutSchedule()


class DreamWorldModel(LearnedModel):
    """Dreamer-style use of a model: each rollout used once, with gradients through it into the
    actor (DI-engine's ``DreamWorldModel``)."""

    def rollout(self, start: State, actor_fn: ActorFn, envstep: int, horizon: int | None = None) -> dict[str, Any]:
        """:func:`rollout` of ``horizon`` steps (default: the scheduler's length at ``envstep``)."""
        if horizon is None:
            horizon = self.rollout_length_scheduler(envstep)
        return rollout(self.model, start, actor_fn, horizon)
