"""Batched inference for central acting: one thread acts for every env group with one agent call.

Each env group's thread runs an ordinary :class:`~lightning_wm.data.collector.Collector` whose agent
is an :class:`InferenceClient`: its ``act`` hands ``(obs [B_g, ...], state, explore)`` to the
:class:`BatchedInference` server and blocks for the answer. The server waits until every group
that is acting has asked, or until ``deadline_s`` after the first request, concatenates the
requests' observations and recurrent states along the batch (pytrees, on the agent's device),
calls the agent's ``act`` once under ``torch.no_grad()`` and splits actions, states and extras
back, so a slow group never stalls the others.

The agent is the module being trained, seen through :func:`acting_view`: its parameters and
buffers are the live tensors (no copy, no publishing), its train/eval flags its own, so the
learner's mode toggles (Lightning's validation) and the acting code's (MuZero's search runs the
model in eval mode) never reach each other across threads.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_wm.tree import first_leaf, tree_map

__all__ = ["BatchedInference", "InferenceClient", "InferenceStopped", "acting_view"]


class InferenceStopped(RuntimeError):
    """The inference server was closed while a group waited for its actions."""


def acting_view(module: nn.Module) -> nn.Module:
    """A module tree with ``module``'s parameters and buffers (the very tensors: optimizer steps
    show at once) but its own ``training`` flags: each submodule shallow-copied, children replaced
    by their views."""
    view = copy.copy(module)
    view._modules = {name: None if child is None else acting_view(child) for name, child in module._modules.items()}
    return view


@dataclass
class _Request:
    obs: Any
    state: Any
    explore: bool
    answer: tuple[Tensor, Any, dict[str, Tensor], int] | None = None
    error: BaseException | None = None
    done: bool = False


def _cat(trees: list[Any]) -> Any:
    """Concatenate matching tensor leaves of ``trees`` along the batch (``None`` stays ``None``)."""
    return tree_map(lambda *xs: torch.cat(xs, 0), trees[0], *trees[1:])


def _rows(tree: Any, start: int, stop: int) -> Any:
    return tree_map(lambda x: x[start:stop], tree)


class BatchedInference:
    """The server: answers the act requests of ``num_groups`` groups, batched.

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
        self._cond = threading.Condition()
        self._pending: dict[int, _Request] = {}
        self._acting: set[int] = set(groups)  # groups whose next request the server waits for
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="lightning_wm-inference", daemon=True)
        self._thread.start()

    # -- the groups' side ----------------------------------------------------------------------
    def act(self, group: int, obs: Any, state: Any, explore: bool) -> tuple[Tensor, Any, dict[str, Tensor], int]:
        """``group``'s ``(action, state, extras, version)`` for ``obs [B_g, ...]`` (blocks).

        Raises:
            InferenceStopped: the server was closed meanwhile.
            Exception: what the agent's ``act`` raised for this batch.
        """
        request = _Request(obs, state, bool(explore))
        with self._cond:
            if self._closed:
                raise InferenceStopped("the inference server is closed")
            self._acting.add(group)
            self._pending[group] = request
            self._cond.notify_all()
            while not request.done:
                if self._closed:
                    raise InferenceStopped("the inference server is closed")
                self._cond.wait(0.25)
        if request.error is not None:
            raise request.error
        assert request.answer is not None
        return request.answer

    def pause(self, group: int) -> None:
        """``group`` will not ask for a while (it waits for room in the chunk queue): do not wait for it."""
        with self._cond:
            self._acting.discard(group)
            self._cond.notify_all()

    # -- the server's side ---------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait(0.25)
                if self._closed:
                    return
                deadline = time.monotonic() + self.deadline_s
                while not self._closed and not self._acting <= self._pending.keys():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                batch, self._pending = self._pending, {}
            for explore in (True, False):
                part = {g: r for g, r in sorted(batch.items()) if r.explore == explore}
                if part:
                    self._answer(part, explore)
            with self._cond:
                for request in batch.values():
                    request.done = True
                self._cond.notify_all()

    def _answer(self, requests: dict[int, _Request], explore: bool) -> None:
        """One agent call for ``requests`` (sorted by group); answers or errors set in place."""
        try:
            sizes = [first_leaf(r.obs).shape[0] for r in requests.values()]
            obs = _cat([r.obs for r in requests.values()])
            states = [r.state for r in requests.values()]
            state = None if all(s is None for s in states) else _cat(states)
            version = int(self.version())
            with torch.no_grad():
                action, new_state, extras = self.agent.act(obs, state, explore)
            self.calls += 1
            self.requests += len(requests)
            start = 0
            for request, size in zip(requests.values(), sizes):
                stop = start + size
                request.answer = (
                    action[start:stop],
                    _rows(new_state, start, stop),
                    {k: v[start:stop] for k, v in extras.items()},
                    version,
                )
                start = stop
        except BaseException as error:  # noqa: BLE001 - handed to every group of the batch
            for request in requests.values():
                request.error = error

    def close(self) -> None:
        """Stop the server; waiting groups get :class:`InferenceStopped` (idempotent)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class InferenceClient:
    """The agent of group ``group``'s Collector: ``initial_state`` from the agent itself, ``act``
    through the server. ``on_act(version)`` is called with the weights' version of every answer
    (the group sets its rows' ``policy_version`` from it)."""

    def __init__(
        self, server: BatchedInference, group: int, on_act: Callable[[int], None] = lambda version: None
    ) -> None:
        self.server, self.group, self.on_act = server, group, on_act

    @property
    def device(self) -> torch.device:
        device = getattr(self.server.agent, "device", None)
        return device if isinstance(device, torch.device) else torch.device("cpu")

    def initial_state(self, batch_size: int) -> Any:
        return self.server.agent.initial_state(batch_size)

    def act(self, obs: Any, state: Any, explore: bool) -> tuple[Tensor, Any, dict[str, Tensor]]:
        action, state, extras, version = self.server.act(self.group, obs, state, explore)
        self.on_act(version)
        return action, state, extras
