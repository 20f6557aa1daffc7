"""The one acting interface every way of making rows implements (:class:`Acting`: start, publish
weights, take rows, health, stop; the modes are listed in :mod:`lightning_wm.data.acting`), the
:class:`Pool` of sources that act while the learner trains, and the :class:`Chunk` they send.
"""

from __future__ import annotations

import queue as queue_lib
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import Tensor, nn

from lightning_wm.data.replay import RANDOM_POLICY_VERSION
from lightning_wm.signals import ActorError, check_stop  # ActorError: defined with the other ways a run ends

NO_AGENT = (
    "no agent to act with: the AgentPublisher callback (lightning_wm.callbacks.AgentPublisher, in "
    "default_callbacks() and the CLI's Trainer) attaches the module being trained when fit starts; add it to "
    "your Trainer's callbacks, or call datamodule.attach_agent(module, version)"
)

__all__ = ["Acting", "ActorError", "Chunk", "Pool", "RANDOM_POLICY_VERSION"]


@dataclass
class Chunk:
    """Rows of ``T`` consecutive steps of each of ``N`` envs, made by source ``actor`` (0 in process)
    with weights ``version`` (``-1``: the random prefill policy): row-convention leaves ``rows``
    ``[T, N, ...]`` (numpy, ``policy_version`` included), the ``episodes`` finished in it (``{"return",
    "length", "env"}``), ``env_steps`` rows made anew (an overlap row was counted before) and
    ``collect_s`` seconds of acting."""

    actor: int
    version: int
    rows: dict[str, Any]
    episodes: list[dict[str, float]] = field(default_factory=list)
    env_steps: int = 0
    collect_s: float = 0.0


class Acting(ABC):
    """How rows are made (chunks of ``chunk_length`` steps per env; ``overlap``: ``+ 1`` row shared
    with the next chunk, the unrolls an IMPALA learner bootstraps from). The datamodule calls:

    1. start: :meth:`setup` ``(rank, rows)`` when Lightning sets it up (again after :meth:`close`: a
       later fit acts in fresh envs and continues the counts), then :meth:`attach_agent` when fit starts;
    2. publish weights: :meth:`attach_agent` ``(agent, version)`` after optimizer steps (the
       ``AgentPublisher`` callback, the one way the acting part gets its agent);
    3. take rows: per batch, :meth:`next_chunk` until the batch side has enough, :meth:`received` for
       each chunk it uses and :meth:`batch_done` once; health: :meth:`check` while it holds chunks back;
    4. stop: :meth:`close` at teardown or on an exception.
    """

    def __init__(self, chunk_length: int, overlap: bool) -> None:
        self.chunk_length, self.overlap = int(chunk_length), bool(overlap)

    @property
    @abstractmethod
    def num_streams(self) -> int:
        """Env streams rows come from, over all sources (the replay's streams)."""

    @property
    def concurrent_sources(self) -> int:
        """Sources that make rows while the learner trains (0 in process): the batch side may
        take up to one chunk of each without waiting, so fresh rows keep coming."""
        return 0

    @property
    def chunk_streams(self) -> int:
        """Env streams of one source, the columns (unrolls) of its chunks."""
        return self.num_streams // max(1, self.concurrent_sources)

    @property
    def chunk_rows(self) -> int:
        """New rows of one chunk: ``chunk_length`` steps of each env of one source."""
        return self.chunk_length * self.chunk_streams

    @abstractmethod
    def setup(self, rank: int, rows: Any = None) -> None:
        """Get ready to act as DDP rank ``rank``; ``rows``: a buffer every row made in this
        process is also added to (``add(row)``), or ``None``."""

    @abstractmethod
    def attach_agent(self, agent: Any, version: int, random_rows: int = 0) -> None:
        """Act with ``agent`` (weights version ``version``, the learner's optimizer steps) from
        now on. ``random_rows``: rows the random policy makes first, all streams together, where
        a mode starts its sources with them (actors); in process the batch side asks for them
        itself (:meth:`~lightning_wm.data.acting.in_process.InProcessActing.collect_random`)."""

    @abstractmethod
    def next_chunk(self, timeout: float = 0.0) -> Chunk | None:
        """The next chunk, waiting up to ``timeout`` seconds; ``None`` if none came."""

    def streams(self, chunk: Chunk) -> np.ndarray:
        """The replay streams of ``chunk``'s envs (int ``[N]``); one source: all of them."""
        return np.arange(self.num_streams)

    def check(self) -> None:  # noqa: B027 - an optional hook (nothing to do in process)
        """Raise if a source failed (called while the batch side holds chunks back)."""

    def received(self, chunk: Chunk) -> None:  # noqa: B027 - an optional hook (nothing to do in process)
        """The batch side used ``chunk``'s rows (they count as env steps from now)."""

    def batch_done(self, waited_s: float, held: int = 0) -> None:  # noqa: B027 - an optional hook (nothing to do in process)
        """A batch is complete: the learner waited ``waited_s`` seconds for rows and holds
        ``held`` chunks it has not used yet."""

    @property
    @abstractmethod
    def env_steps(self) -> int:
        """Env steps (rows) of this rank so far."""

    @abstractmethod
    def pop_episodes(self) -> list[dict[str, float]]:
        """Episodes finished since the last call, ``{"return", "length", ...}``."""

    def metrics(self) -> dict[str, float]:
        """Gauges of the sources (``actors/*``); none in process."""
        return {}

    @abstractmethod
    def close(self) -> None:
        """Stop acting (envs closed, sources stopped); idempotent."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The counts a checkpoint keeps (merged into the datamodule's state: keys must be unique)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counts of :meth:`state_dict` (keys it does not know are ignored)."""


class Pool(ABC):
    """Sources that act while the learner trains (actors, env groups), started by the constructor.
    :meth:`get` and :meth:`check` are shared (a failure closes the pool and raises :class:`ActorError`);
    each mode gives :meth:`publish`; :meth:`take`, :meth:`failure`, :meth:`qsize`, :meth:`pids` and
    :meth:`stop` work over :attr:`sources` unless a mode gives its own (Ray's actors).

    Attributes:
        copies_weights: the sources act with copies, published every ``acting.publish_every`` steps;
            ``False``: with the live module, so :meth:`publish` only moves the version on (every step).
        timeout_s: a source silent this long is reported as hung.
        sources: sets of workers (:class:`~lightning_wm.data.acting.spawned.SpawnedWorkers`, central
            acting's group threads), each with a ``chunks`` queue, ``failure(timeout_s)``, ``pids()``
            and ``close()``; the first set sends the chunks.
    """

    copies_weights = True

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s, self.closed, self._last_check = float(timeout_s), False, 0.0
        self.sources: list[Any] = []

    def take(self, timeout: float) -> Chunk | None:
        """The next chunk within ``timeout`` seconds, or ``None`` (may raise :class:`ActorError`)."""
        try:
            return self.sources[0].chunks.get(timeout=timeout)
        except queue_lib.Empty:
            return None

    def failure(self) -> str | None:
        """A description (traceback included) of the first source that raised, died or hung, or ``None``."""
        return next((f for source in self.sources if (f := source.failure(self.timeout_s)) is not None), None)

    @abstractmethod
    def publish(self, weights: Mapping[str, Tensor] | nn.Module | None, version: int) -> None:
        """Make ``weights`` (an acting copy's ``state_dict`` or the copy; ``None`` without
        :attr:`copies_weights`) the newest, as ``version``."""

    def qsize(self) -> int:
        """Chunks waiting for the learner (``-1`` where the queue cannot tell)."""
        try:
            return self.sources[0].chunks.qsize()
        except NotImplementedError:  # a process queue on macOS
            return -1

    def pids(self) -> list[int | None]:
        """Process ids of the sources (or of their env workers), set after set."""
        return [pid for source in self.sources for pid in source.pids()]

    def stop(self) -> None:
        """Stop every source (once, from :meth:`close`)."""
        for source in self.sources:
            source.close()

    def taken(self, chunk: Chunk) -> None:  # noqa: B027 - an optional hook
        """The learner took ``chunk``."""

    def get(self, timeout: float = 0.0) -> Chunk | None:
        """The next chunk, waiting up to ``timeout`` seconds in slices of at most 0.1 s, checking the
        sources and a stop request before each; ``None`` if none came.

        Raises:
            ActorError: a source raised (its traceback in the message), died or hung (the pool is closed).
            RunStopped: a stop was requested (a scheduler's signal) while waiting.
        """
        deadline = time.monotonic() + timeout
        while True:
            check_stop()
            self.check()
            try:
                chunk = self.take(min(0.1, max(0.0, deadline - time.monotonic())))
            except ActorError:
                self.close()
                raise
            if chunk is not None:
                self.taken(chunk)
            if chunk is not None or time.monotonic() >= deadline:
                return chunk

    def check(self, every_s: float = 0.25) -> None:
        """Raise :class:`ActorError` (after closing the pool) if a source raised, died or hung; looks at
        most every ``every_s`` seconds (a learner that holds back chunks calls it itself)."""
        if self.closed:
            raise RuntimeError("the acting pool is closed")
        now = time.monotonic()
        if now - self._last_check >= every_s:
            self._last_check = now
            if (failure := self.failure()) is not None:
                self.close()
                raise ActorError(failure)

    def close(self) -> None:
        """Stop every source (idempotent)."""
        if not self.closed:
            self.closed = True
            self.stop()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
