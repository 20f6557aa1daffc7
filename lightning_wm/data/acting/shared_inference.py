"""Batched inference across processes: env-group processes hand observations to one inference loop
in the learner's process through shared memory (SEED RL's split: only observations, actions and
the per-step extras cross; the policy and its recurrent state never leave the learner's device).

* :class:`SharedSlots` — per group ``g`` a slot of the batch ``[G, B, ...]`` shared tensors: the
  observations and episode-start flags a group writes, the actions and extras the loop writes
  back, request/answer counters, the weights' version of each answer, and two kinds of semaphore
  (``requests``: some group asked; ``ready[g]``: group ``g``'s answer is written). The answer's
  layout (action and extras: keys, shapes, dtypes) comes from one probe call of the agent.
* :class:`SharedMemoryClient` — the agent of a group's Collector (in the group process): ``act``
  writes its slot, wakes the loop and waits for its answer. Its recurrent "state" is only a flag
  per env, ``True`` where an episode starts (the Collector resets it from ``initial_state``);
  the loop keeps the real state per group on the device and restarts it where the flag is set.
* :class:`InferenceLoop` — a thread of the learner (or the body of the inference process,
  :mod:`~lightning_wm.data.acting.inference_process`): a round starts with the first request and
  closes when every acting group has asked or ``deadline_s`` later; then one agent call acts for
  all of them (the observations gathered into one batch on the agent's device) and every group
  of the round is answered. A group that waits for the learner (its chunk is not taken yet)
  marks itself inactive, so rounds do not wait for it.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.multiprocessing as tmp
from torch import Tensor

from lightning_wm.data.acting.inference import InferenceStopped, tree_rows
from lightning_wm.data.collector import agent_device
from lightning_wm.tree import concat, tree_map, where

__all__ = ["InferenceLoop", "ServedCounts", "SharedMemoryClient", "SharedSlots", "make_slots"]


@dataclass
class SharedSlots:
    """The shared-memory exchange of ``G`` groups of ``B`` envs (picklable: it travels to the groups).

    Attributes:
        obs: observation leaves ``[G, B, ...]`` (a dict of them for dict observations).
        starts: bool ``[G, B]``, envs whose episode starts at this request (their state restarts).
        action: ``[G, B, ...]``; ``extras``: each ``[G, B, ...]``.
        explore: bool ``[G]``; ``active``: bool ``[G]``, groups a round waits for (all at first; a
            group pauses while it waits for the learner and is active again at its next request).
        asked: int64 ``[G]``, requests made; ``version``: int64 ``[G]``, weights of the last answer.
        served: int64 ``[2]``, agent calls made and group requests answered (read by the learner
            wherever the loop runs).
        stateful: the agent has a recurrent state (``initial_state`` is not ``None``).
        requests: a semaphore released at every request; ``ready``: one per group, released at its answer.
    """

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

    @property
    def num_groups(self) -> int:
        return int(self.asked.shape[0])

    @property
    def envs_per_group(self) -> int:
        return int(self.starts.shape[1])


def _zeros(space: gym.spaces.Space, batch: int) -> Any:
    """A batch of zero observations of ``space`` as the Collector hands them to an agent."""
    if isinstance(space, gym.spaces.Dict):
        return {key: _zeros(sub, batch) for key, sub in space.spaces.items()}
    return torch.from_numpy(np.zeros((batch, *space.shape), space.dtype))


def _shared(like: Tensor, groups: int) -> Tensor:
    return torch.zeros((groups, *like.shape), dtype=like.dtype).share_memory_()


def make_slots(agent: Any, observation_space: gym.spaces.Space, groups: int, envs: int, explore: bool) -> SharedSlots:
    """Slots for ``groups`` groups of ``envs`` envs acting with ``agent``; one probe call of the
    agent on zero observations gives the answer's layout."""
    device = agent_device(agent)
    obs = _zeros(observation_space, envs)
    state = agent.initial_state(envs)
    with torch.no_grad():
        action, _, extras = agent.act(tree_map(lambda x: x.to(device), obs), state, explore)
    ctx = tmp.get_context("spawn")
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
        requests=ctx.Semaphore(0),
        ready=[ctx.Semaphore(0) for _ in range(groups)],
    )


class SharedMemoryClient:
    """The agent of group ``group``'s Collector in its process: asks the learner's
    :class:`InferenceLoop` through ``slots``.

    Args:
        slots: the shared exchange.
        group: this group's slot.
        stop: an event; set, a waiting ``act`` raises :class:`InferenceStopped`.
        beat: called while waiting (the group's heartbeat).
        on_act: called with the weights' version of every answer.
    """

    device = torch.device("cpu")

    def __init__(
        self,
        slots: SharedSlots,
        group: int,
        stop: Any,
        beat: Callable[[], None] = lambda: None,
        on_act: Callable[[int], None] = lambda version: None,
    ) -> None:
        self.slots, self.group, self.stop, self.beat, self.on_act = slots, group, stop, beat, on_act
        self.asked = 0

    def initial_state(self, batch_size: int) -> Tensor | None:
        """``True`` per env (an episode starts) when the agent is recurrent, else ``None``."""
        return torch.ones(batch_size, dtype=torch.bool) if self.slots.stateful else None

    def pause(self) -> None:
        """This group will not ask for a while: rounds stop waiting for it."""
        self.slots.active[self.group] = False

    def act(self, obs: Any, state: Tensor | None, explore: bool) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
        """Actions ``[B, ...]`` and extras for ``obs [B, ...]``; ``state`` is the episode-start flags."""
        slots, g = self.slots, self.group
        self.beat()
        tree_map(lambda slot, x: slot[g].copy_(x), slots.obs, obs)
        if state is not None:
            slots.starts[g].copy_(state)
        slots.explore[g] = bool(explore)
        slots.active[g] = True
        self.asked += 1
        slots.asked[g] = self.asked
        slots.requests.release()
        while not slots.ready[g].acquire(timeout=0.25):
            self.beat()
            if self.stop.is_set():
                raise InferenceStopped("central acting is stopping")
        self.on_act(int(slots.version[g]))
        extras = {key: value[g].clone() for key, value in slots.extras.items()}
        started = None if state is None else torch.zeros_like(state)
        return slots.action[g].clone(), started, extras


class ServedCounts:
    """``calls`` and ``requests`` of whatever serves ``self.slots`` (a thread or the inference
    process): read from the slots' shared ``served`` counters, so the learner sees them either way."""

    slots: SharedSlots

    @property
    def calls(self) -> int:
        """Agent calls made."""
        return int(self.slots.served[0])

    @property
    def requests(self) -> int:
        """Group requests answered."""
        return int(self.slots.served[1])


class InferenceLoop(ServedCounts):
    """Answers the groups' requests in rounds, one agent call each: in a thread of its own (the
    learner's, ``thread=True``) or, with :meth:`serve`, in the calling one (the inference process).

    Args:
        agent: the acting module (``act(obs, state, explore)``, ``initial_state``; its ``device``).
        slots: the shared exchange (:func:`make_slots` with this agent).
        deadline_s: after a round's first request, wait at most this long for the other active groups.
        version: called just before each agent call; the version of the weights it acts with
            (handed back with every answer; the inference process pulls newer weights in it).
        stop: an event (``threading`` or ``multiprocessing``); set, the loop ends after its round.
        thread: start a thread that serves until :meth:`close`.

    Attributes:
        error: what the agent raised (the thread has stopped), with its traceback in ``traceback``.
        busy_since: when the agent call in progress started (``None`` between calls).
    """

    def __init__(
        self,
        agent: Any,
        slots: SharedSlots,
        deadline_s: float,
        version: Callable[[], int],
        stop: Any = None,
        thread: bool = True,
    ) -> None:
        self.agent, self.slots, self.deadline_s, self.version = agent, slots, float(deadline_s), version
        self.device = agent_device(agent)
        self.error: BaseException | None = None
        self.traceback = ""
        self.busy_since: float | None = None
        self._answered = np.zeros(slots.num_groups, np.int64)
        self._states: list[Any] = [None] * slots.num_groups
        self._stop = threading.Event() if stop is None else stop
        self._thread: threading.Thread | None = None
        if thread:
            self._thread = threading.Thread(target=self._run, name="lightning_wm-inference", daemon=True)
            self._thread.start()

    def serve(self, beat: Callable[[], None] = lambda: None) -> None:
        """Answer rounds until the stop event is set, calling ``beat`` at least every 0.1 s while idle."""
        while not self._stop.is_set():
            beat()
            if self.slots.requests.acquire(timeout=0.1):
                self._round()

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":  # a thread starts on the first GPU: the one of this rank instead
                torch.cuda.set_device(self.device)
            self.serve()
        except BaseException as error:  # noqa: BLE001 - reported to the learner by the pool's check
            self.traceback = "".join(traceback.format_exception(error)).rstrip()
            self.error = error

    def failure(self, timeout_s: float) -> str | None:
        """What went wrong, in one description: the agent raised, or one call has run ``timeout_s``."""
        busy = self.busy_since
        if self.error is not None:
            return f"central inference (the learner's policy acting for the env groups) raised:\n{self.traceback}"
        if busy is not None and time.monotonic() - busy > timeout_s:
            return (
                f"central inference hung: one policy call has run for {time.monotonic() - busy:.1f} s "
                f"(acting.timeout_s={timeout_s:g})"
            )
        return None

    def _round(self) -> None:
        """Wait for the active groups (up to the deadline), then answer every group that asked."""
        slots = self.slots
        if not (slots.asked.numpy() != self._answered).any():
            return  # a count left by a request an earlier round answered: the deadline starts at a request
        end = time.monotonic() + self.deadline_s
        while True:
            asked = slots.asked.numpy().copy()
            pending = asked != self._answered
            waited_for = slots.active.numpy() & ~pending
            left = end - time.monotonic()
            if not waited_for.any() or left <= 0 or self._stop.is_set():
                break
            slots.requests.acquire(timeout=left)  # a count may be left over: a later round finds nothing
        groups = np.flatnonzero(pending)
        if len(groups) == 0:
            return
        explore = slots.explore.numpy()[groups]
        for flag in (True, False):
            part = groups[explore == flag]
            if len(part):
                self._call(part, flag)
        self._answered[groups] = asked[groups]
        for g in groups:
            slots.ready[g].release()

    def _call(self, groups: np.ndarray, explore: bool) -> None:
        """One agent call for ``groups``; their answers written into the slots."""
        slots, agent = self.slots, self.agent
        index = torch.from_numpy(groups)
        obs = tree_map(lambda x: x[index].flatten(0, 1).to(self.device), slots.obs)
        state = None
        if slots.stateful:
            size = slots.envs_per_group
            for g, starts in zip(groups, slots.starts[index]):
                if self._states[g] is None:
                    self._states[g] = agent.initial_state(size)
                elif starts.any():  # a fresh state only where an episode starts (most steps: none)
                    self._states[g] = where(starts, agent.initial_state(size), self._states[g])
            state = concat([self._states[g] for g in groups])
        version = int(self.version())
        self.busy_since = time.monotonic()
        try:
            with torch.no_grad():
                action, new_state, extras = agent.act(obs, state, explore)
        finally:
            self.busy_since = None
        if extras.keys() != slots.extras.keys():
            raise RuntimeError(
                f"the agent's extras changed keys between calls ({sorted(slots.extras)} -> {sorted(extras)}): "
                "central acting's shared slots are laid out from the first call"
            )
        shape = (len(groups), slots.envs_per_group)
        slots.action[index] = action.detach().reshape(*shape, *action.shape[1:]).to("cpu", slots.action.dtype)
        for key, value in extras.items():
            slots.extras[key][index] = (
                value.detach().reshape(*shape, *value.shape[1:]).to("cpu", slots.extras[key].dtype)
            )
        slots.version[index] = version
        if slots.stateful:
            for i, g in enumerate(groups):
                self._states[g] = tree_rows(new_state, i * shape[1], (i + 1) * shape[1])
        slots.served[0] += 1
        slots.served[1] += len(groups)

    @property
    def running(self) -> bool:
        """The loop's thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Stop the loop (a call in progress finishes first, unless it has hung; idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30.0 if self.busy_since is None else 1.0)
