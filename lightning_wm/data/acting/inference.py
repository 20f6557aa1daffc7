"""Central inference: one batched policy call per round acts for every env group (SEED RL's split:
only observations, actions and per-step extras cross; the policy and its recurrent state stay here).
A group's :class:`InferenceClient` asks through the :class:`SharedSlots`; :class:`Rounds` answers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor, nn

from lightning_wm.data.collector import agent_device
from lightning_wm.tree import concat, tree_map, where

__all__ = ["InferenceClient", "InferenceStopped", "Rounds", "SharedSlots", "acting_view", "make_slots"]


class InferenceStopped(RuntimeError):
    """Central acting was closed while a group waited for its actions."""


def acting_view(module: nn.Module) -> nn.Module:
    """A module tree with ``module``'s parameters and buffers (the very tensors: optimizer steps
    show at once) and attributes (a LightningModule's trainer: ``global_step``, schedules) but its
    own ``training`` flags: each submodule's ``__dict__`` copied, children replaced by their views,
    ``torch.compile`` wrappers (bound to the originals) left out. So the learner's mode toggles
    (Lightning's validation) and the acting code's (MuZero's search) never reach each other."""
    view = module.__class__.__new__(module.__class__)
    view.__dict__.update(module.__dict__)  # not copy.copy: a LightningModule pickles without its trainer
    view._modules = {name: None if child is None else acting_view(child) for name, child in module._modules.items()}
    view.__dict__.pop("_compiled_call_impl", None)
    return view


@dataclass
class SharedSlots:
    """The exchange of ``G`` groups of ``B`` envs (picklable). ``obs`` leaves ``[G, B, ...]``;
    ``starts`` bool ``[G, B]`` (the env's episode starts: its state restarts); ``action`` and each
    of ``extras`` ``[G, B, ...]``; ``explore``, ``active`` (groups a round waits for: a group pauses
    while it waits for the learner) bool ``[G]``; ``asked`` (requests made) and ``version`` (weights
    of the last answer) int64 ``[G]``; ``served`` int64 ``[2]``: agent calls, requests answered;
    ``stateful``: the agent is recurrent; semaphores ``requests`` (released at every request) and
    ``ready[g]`` (at group ``g``'s answer)."""

    obs: Any
    starts: Tensor
    action: Tensor
    extras: dict[str, Tensor]
    explore: Tensor
    active: Tensor
    asked: Tensor
    version: Tensor
    served: Tensor
    stateful: bool
    requests: Any
    ready: list[Any]


def _zeros(space: gym.spaces.Space, batch: int) -> Any:
    """A batch of zero observations of ``space`` as the Collector hands them to an agent."""
    if isinstance(space, gym.spaces.Dict):
        return {key: _zeros(sub, batch) for key, sub in space.spaces.items()}
    return torch.from_numpy(np.zeros((batch, *space.shape), space.dtype))


def _shared(like: Tensor, groups: int) -> Tensor:
    return torch.zeros((groups, *like.shape), dtype=like.dtype).share_memory_()


def make_slots(
    agent: Any, space: gym.spaces.Space, groups: int, envs: int, semaphore: Callable[[int], Any]
) -> SharedSlots:
    """Slots for ``groups`` groups of ``envs`` envs acting with ``agent`` (observations of ``space``);
    ``semaphore(0)`` makes the semaphores (``threading.Semaphore`` or a spawn context's). One probe
    call of the agent on zero observations gives the answer's layout."""
    device = agent_device(agent)
    obs = _zeros(space, envs)
    state = agent.initial_state(envs)
    with torch.no_grad():
        action, _, extras = agent.act(tree_map(lambda x: x.to(device), obs), state, True)
    return SharedSlots(
        obs=tree_map(lambda x: _shared(x, groups), obs),
        starts=torch.zeros(groups, envs, dtype=torch.bool).share_memory_(),
        action=_shared(action.detach().cpu(), groups),
        extras={key: _shared(value.detach().cpu(), groups) for key, value in extras.items()},
        explore=torch.zeros(groups, dtype=torch.bool).share_memory_(),
        active=torch.ones(groups, dtype=torch.bool).share_memory_(),  # waited for from the start
        asked=torch.zeros(groups, dtype=torch.int64).share_memory_(),
        version=torch.zeros(groups, dtype=torch.int64).share_memory_(),
        served=torch.zeros(2, dtype=torch.int64).share_memory_(),
        stateful=state is not None,
        requests=semaphore(0),
        ready=[semaphore(0) for _ in range(groups)],
    )


class Rounds:
    """Answers the groups' requests in ``slots`` in rounds: a round starts with the first request seen
    and closes when every active group has asked, or ``deadline_s`` later; then one agent call per
    explore flag acts for all that asked (observations gathered on the agent's device; each group's
    recurrent state kept here, restarted where its episode starts). :meth:`step` runs in one thread
    at a time (group threads take :attr:`lock`; the inference process is one thread).

    Args:
        agent: anything with ``act(obs, state, explore)`` and ``initial_state`` (batched over the
            first dimension; its ``device``).
        slots: the exchange (:func:`make_slots` with this agent).
        deadline_s: after a round's first request, wait at most this long for the other active groups.
        version: called just before each agent call: the version of the weights it acts with
            (handed back with every answer; the inference process pulls newer weights in it).
    """

    def __init__(self, agent: Any, slots: SharedSlots, deadline_s: float, version: Callable[[], int]) -> None:
        self.agent, self.slots, self.deadline_s, self.version = agent, slots, float(deadline_s), version
        self.device = agent_device(agent)
        self.lock = threading.Lock()
        # numpy views of the shared flags: an element read or write costs far less than a tensor's
        self._asked, self._active, self._explore = slots.asked.numpy(), slots.active.numpy(), slots.explore.numpy()
        self._starts, self._version, self._served = slots.starts.numpy(), slots.version.numpy(), slots.served.numpy()
        flat = lambda x: x.flatten(0, 1)  # noqa: E731 - [G * B, ...] views: a round of consecutive groups is a slice
        self._obs, self._action = tree_map(flat, slots.obs), flat(slots.action)
        self._extras = {key: flat(value) for key, value in slots.extras.items()}
        self._answered = np.zeros(len(slots.ready), np.int64)
        self._states: list[Any] = [None] * len(slots.ready)
        self._since: float | None = None  # when the round's first request was seen

    def step(self) -> float | None:
        """Answer every group that asked if the round may close (each active group asked, or its
        deadline passed); else the seconds left to its deadline (``None``: nothing to wait for)."""
        asked = self._asked.copy()
        pending = asked != self._answered
        if not pending.any():
            return None
        now = time.monotonic()
        if self._since is None:
            self._since = now
        left = self._since + self.deadline_s - now
        if left > 0 and (self._active & ~pending).any():
            return left
        self._since = None
        groups = np.flatnonzero(pending)
        explore = self._explore[groups]
        if explore.all() or not explore.any():  # one flag: one call (most rounds)
            self._call(groups, bool(explore[0]))
        else:
            for flag in (True, False):
                self._call(groups[explore == flag], flag)
        self._answered[groups] = asked[groups]
        for g in groups:
            self.slots.ready[g].release()
        return None

    def serve(self, stop: Any, beat: Callable[[], None] = lambda: None) -> None:
        """Answer rounds until ``stop`` is set, calling ``beat`` at least every 0.1 s while idle."""
        left = None
        while not stop.is_set():
            beat()
            self.slots.requests.acquire(timeout=0.1 if left is None else min(left, 0.1))
            left = self.step()

    def _call(self, groups: np.ndarray, explore: bool) -> None:
        """One agent call for ``groups``; their answers written into the slots."""
        slots, agent, size = self.slots, self.agent, self.slots.starts.shape[1]
        lo, hi = int(groups[0]), int(groups[-1]) + 1
        if hi - lo == len(groups):  # consecutive groups (most rounds): slices of the flat views, no gather
            rows: slice | Tensor = slice(lo * size, hi * size)
        else:
            rows = (torch.from_numpy(groups)[:, None] * size + torch.arange(size)).flatten()
        obs = tree_map(lambda x: x[rows].to(self.device, copy=True), self._obs)  # a copy: the groups write on
        state = None
        if slots.stateful:
            for g in groups:
                if self._states[g] is None:
                    self._states[g] = agent.initial_state(size)
                elif self._starts[g].any():  # a fresh state only where an episode starts (most steps: none)
                    starts = slots.starts[g].to(self.device)
                    self._states[g] = where(starts, agent.initial_state(size), self._states[g])
            state = concat([self._states[g] for g in groups])
        version = int(self.version())
        with torch.no_grad():
            action, new_state, extras = agent.act(obs, state, explore)
        if extras.keys() != slots.extras.keys():
            raise RuntimeError(
                f"the agent's extras changed keys between calls ({sorted(slots.extras)} -> {sorted(extras)}): "
                "central acting's slots are laid out from the first call"
            )
        for target, value in [(self._action, action), *((self._extras[k], v) for k, v in extras.items())]:
            target[rows] = value.detach()
        self._version[groups] = version
        if slots.stateful:
            for i, g in enumerate(groups):
                self._states[g] = tree_map(lambda x: x[i * size : (i + 1) * size], new_state)  # noqa: B023
        self._served += (1, len(groups))


class InferenceClient:
    """The agent of group ``group``'s Collector: asks through ``slots``. Its recurrent "state" is a flag
    per env, ``True`` where an episode starts (the Collector resets it); :class:`Rounds` keeps the real one.

    Args:
        slots: the exchange.
        group: this group's slot.
        stop: an event; set, a waiting ``act`` raises :class:`InferenceStopped`.
        beat: called while waiting (the group's heartbeat).
        rounds: groups as threads: the :class:`Rounds` this group drives itself; ``None``: another
            process answers.

    Attributes:
        on_act: called with the weights' version of every answer.
    """

    device = torch.device("cpu")

    def __init__(
        self,
        slots: SharedSlots,
        group: int,
        stop: Any,
        beat: Callable[[], None] = lambda: None,
        rounds: Rounds | None = None,
    ) -> None:
        self.slots, self.group, self.stop, self.beat, self.rounds = slots, group, stop, beat, rounds
        self.on_act: Callable[[int], None] = lambda version: None
        self.asked = 0
        # this group's slot, as views made once (numpy for the flags: cheaper element access)
        self._obs, self._starts = tree_map(lambda x: x[group], slots.obs), slots.starts[group]
        self._action, self._extras = slots.action[group], {k: v[group] for k, v in slots.extras.items()}
        self._flags = (slots.explore.numpy(), slots.active.numpy(), slots.asked.numpy(), slots.version.numpy())

    def initial_state(self, batch_size: int) -> Tensor | None:
        """``True`` per env (an episode starts) when the agent is recurrent, else ``None``."""
        return torch.ones(batch_size, dtype=torch.bool) if self.slots.stateful else None

    def _drive(self) -> float | None:
        """Groups as threads: step the rounds (maybe answering one in this thread)."""
        if self.rounds is None or not self.rounds.lock.acquire(timeout=0.25):
            return None
        try:
            return self.rounds.step()
        finally:
            self.rounds.lock.release()

    def pause(self) -> None:
        """This group will not ask for a while: rounds stop waiting for it."""
        self._flags[1][self.group] = False
        self._drive()

    def act(self, obs: Any, state: Tensor | None, explore: bool) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
        """Actions ``[B, ...]`` and extras for ``obs [B, ...]``; ``state`` is the episode-start flags."""
        g, (explores, active, asked, version) = self.group, self._flags
        self.beat()
        tree_map(lambda slot, x: slot.copy_(x), self._obs, obs)
        if state is not None:
            self._starts.copy_(state)
        explores[g], active[g] = bool(explore), True
        self.asked += 1
        asked[g] = self.asked  # last: the request is complete
        if self.rounds is None:
            self.slots.requests.release()
        left = self._drive()
        while not self.slots.ready[g].acquire(timeout=0.25 if left is None else min(left, 0.25)):
            self.beat()
            if self.stop.is_set():
                raise InferenceStopped("central acting is stopping")
            left = self._drive()
        self.on_act(int(version[g]))
        started = None if state is None else torch.zeros_like(state)
        return self._action.clone(), started, {key: value.clone() for key, value in self._extras.items()}
