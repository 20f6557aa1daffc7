"""Batched inference for central acting: one thread acts for every env group with one agent call.

Each env group's thread runs an ordinary :class:`~lightning_wm.data.collector.Collector` whose agent
is an :class:`InferenceClient`: its ``act`` hands ``(obs [B_g, ...], state, explore)`` to
:class:`BatchedInference` and blocks for the answer. A round of requests closes when every group
that is acting has asked, or ``deadline_s`` after its first request; then the requests'
observations and recurrent states are concatenated along the batch (pytrees, on the agent's
device), the agent's ``act`` is called once under ``torch.no_grad()`` and actions, states and
extras are split back, so a slow group never stalls the others.

The agent is the module being trained, seen through :func:`acting_view`: its parameters and
buffers are the live tensors (no copy, no publishing), its train/eval flags its own, so the
learner's mode toggles (Lightning's validation) and the acting code's (MuZero's search runs the
model in eval mode) never reach each other across threads.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_wm.data.collector import agent_device
from lightning_wm.tree import concat, first_leaf, tree_map

# The interpreter's thread switch interval while central acting serves: a thread woken by an env, a
# request or an answer waits for the GIL until the learner's thread drops it, at most this long
# (Python's default, 5 ms, would be paid at nearly every env step while the learner computes).
SWITCH_INTERVAL_S = 0.0002


def shorten_switch_interval() -> Callable[[], None]:
    """Make the interpreter's switch interval at most :data:`SWITCH_INTERVAL_S`; returns what restores it."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, SWITCH_INTERVAL_S))
    return lambda: sys.setswitchinterval(before)


__all__ = [
    "BatchedInference",
    "InferenceClient",
    "InferenceStopped",
    "SWITCH_INTERVAL_S",
    "acting_view",
    "shorten_switch_interval",
    "tree_rows",
]


class InferenceStopped(RuntimeError):
    """Central acting was closed while a group waited for its actions."""


def acting_view(module: nn.Module) -> nn.Module:
    """A module tree with ``module``'s parameters and buffers (the very tensors: optimizer steps
    show at once) and attributes (a LightningModule's trainer: ``global_step``, schedules) but its
    own ``training`` flags: each submodule's ``__dict__`` copied, children replaced by their views,
    ``torch.compile`` wrappers (bound to the originals) left out."""
    view = module.__class__.__new__(module.__class__)
    view.__dict__.update(module.__dict__)  # not copy.copy: a LightningModule pickles without its trainer
    view._modules = {name: None if child is None else acting_view(child) for name, child in module._modules.items()}
    view.__dict__.pop("_compiled_call_impl", None)
    return view


@dataclass
class _Request:
    obs: Any
    state: Any
    explore: bool
    answer: tuple[Tensor, Any, dict[str, Tensor]] | None = None
    version: int = 0
    error: BaseException | None = None
    taken: bool = False  # in a round that a group's thread is answering
    done: threading.Event = field(default_factory=threading.Event)


def tree_rows(tree: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every tensor leaf of ``tree`` (``None`` stays ``None``)."""
    return tree_map(lambda x: x[start:stop], tree)


class BatchedInference:
    """Answers the act requests of env groups in rounds, one agent call per round.

    A round starts with its first request and closes when every acting group has asked, or
    ``deadline_s`` after the first request. The group whose request closes it (the last to ask,
    or the first to see the deadline pass) makes the agent call in its own thread and hands the
    others their answers: no thread of its own, no hand-off when every group is there (on a
    loaded machine each wake-up of another thread costs a scheduler slot). One call runs at a
    time.

    Args:
        agent: anything with ``act(obs, state, explore)`` (batched over the first dimension).
        deadline_s: after the first request of a round, wait at most this long for the other
            acting groups.
        version: returns the weights' version at act time (handed back with every answer).
        groups: the groups waited for from the start (a group is waited for from its first
            request on, until it :meth:`pause` s).

    Attributes:
        calls: agent calls made; ``requests``: group requests answered (their ratio is the mean
            number of groups per call).
    """

    def __init__(
        self, agent: Any, deadline_s: float, version: Callable[[], int] = lambda: 0, groups: Iterable[int] = ()
    ) -> None:
        self.agent, self.deadline_s, self.version = agent, float(deadline_s), version
        self.calls = self.requests = 0
        self._lock = threading.Lock()  # the round: pending requests, acting groups
        self._calling = threading.Lock()  # one agent call at a time
        self._pending: dict[int, _Request] = {}
        self._acting: set[int] = set(groups)  # groups whose next request a round waits for
        self._round_end = 0.0
        self._closed = False

    def act(self, group: int, obs: Any, state: Any, explore: bool) -> tuple[Tensor, Any, dict[str, Tensor], int]:
        """``group``'s ``(action, state, extras, version)`` for ``obs [B_g, ...]`` (blocks until
        its round is answered, maybe answering it).

        Raises:
            InferenceStopped: :meth:`close` was called meanwhile.
            Exception: what the agent's ``act`` raised for this round.
        """
        request = _Request(obs, state, bool(explore))
        with self._lock:
            self._check_open()
            self._acting.add(group)
            if not self._pending:
                self._round_end = time.monotonic() + self.deadline_s
            self._pending[group] = request
            round_ = self._close_round(self._acting <= self._pending.keys())
        if round_:
            self._answer(round_)
        while not request.done.is_set():
            left = self._round_end - time.monotonic() if not request.taken else 0.25
            if request.done.wait(min(max(left, 0.0), 0.25)):
                break
            with self._lock:
                self._check_open()
                round_ = self._close_round(not request.taken and time.monotonic() >= self._round_end)
            if round_:
                self._answer(round_)
        if request.error is not None:
            raise request.error
        assert request.answer is not None
        return (*request.answer, request.version)

    def pause(self, group: int) -> None:
        """``group`` will not ask for a while (it waits for room in the chunk queue): rounds stop
        waiting for it (one waiting only for it is answered now, in this thread)."""
        with self._lock:
            self._acting.discard(group)
            round_ = self._close_round(bool(self._pending) and self._acting <= self._pending.keys())
        if round_:
            self._answer(round_)

    @property
    def waiting(self) -> int:
        """Requests in the round not answered yet."""
        with self._lock:
            return len(self._pending)

    def _check_open(self) -> None:
        if self._closed:
            raise InferenceStopped("the inference server is closed")

    def _close_round(self, ready: bool) -> dict[int, _Request]:
        """The pending requests, taken out as a round, if ``ready`` (call with the lock held)."""
        if not ready or not self._pending:
            return {}
        round_, self._pending = self._pending, {}
        for request in round_.values():
            request.taken = True
        return round_

    def _answer(self, round_: dict[int, _Request]) -> None:
        with self._calling:
            for explore in (True, False):
                part = [r for _, r in sorted(round_.items()) if r.explore == explore]
                if part:
                    self._call(part, explore)
        for request in round_.values():
            request.done.set()

    def _call(self, requests: list[_Request], explore: bool) -> None:
        """One agent call for ``requests``; answers (or the error) set in place."""
        try:
            sizes = [first_leaf(r.obs).shape[0] for r in requests]
            obs = concat([r.obs for r in requests])
            states = [r.state for r in requests]
            state = None if all(s is None for s in states) else concat(states)
            version = int(self.version())
            with torch.no_grad():
                action, new_state, extras = self.agent.act(obs, state, explore)
            self.calls += 1
            self.requests += len(requests)
            start = 0
            for request, size in zip(requests, sizes):
                stop = start + size
                request.answer = (
                    action[start:stop],
                    tree_rows(new_state, start, stop),
                    {k: v[start:stop] for k, v in extras.items()},
                )
                request.version = version
                start = stop
        except BaseException as error:  # noqa: BLE001 - handed to every group of the call
            for request in requests:
                request.error = error

    def close(self) -> None:
        """Refuse new requests; groups waiting in an unanswered round get :class:`InferenceStopped`
        (idempotent)."""
        with self._lock:
            self._closed = True
            for request in self._pending.values():
                request.error = InferenceStopped("the inference server is closed")
                request.done.set()
            self._pending = {}


class InferenceClient:
    """The agent of group ``group``'s Collector: ``initial_state`` from the agent itself, ``act``
    through :class:`BatchedInference`. ``on_act(version)`` is called with the weights' version of every answer
    (the group sets its rows' ``policy_version`` from it)."""

    def __init__(
        self, server: BatchedInference, group: int, on_act: Callable[[int], None] = lambda version: None
    ) -> None:
        self.server, self.group, self.on_act = server, group, on_act

    @property
    def device(self) -> torch.device:
        return agent_device(self.server.agent)

    def initial_state(self, batch_size: int) -> Any:
        return self.server.agent.initial_state(batch_size)

    def act(self, obs: Any, state: Any, explore: bool) -> tuple[Tensor, Any, dict[str, Tensor]]:
        action, state, extras, version = self.server.act(self.group, obs, state, explore)
        self.on_act(version)
        return action, state, extras
