"""The acting part of an online datamodule: what every way of making rows offers the batch side.

An online datamodule (:class:`~lightning_wm.data.online.OnlineDataModule`) is an acting part
(this interface) plus a batch part (:mod:`lightning_wm.data.batches`). The batch side never
asks *how* rows are made; it takes :class:`Chunk` s (``next_chunk``), says which it used
(``received``) and when a batch is complete (``batch_done``). Three modes exist:

* :class:`~lightning_wm.data.acting.in_process.InProcessActing` — a Collector in the learner's
  process acts with the live module inside the data fetch (deterministic); it also writes
  every row to the batch side's buffer as it is made and can act an exact number of steps.
* :class:`~lightning_wm.data.acting.actors.ActorActing` — actor processes or Ray actors act with
  published copies of the module and send chunks while the learner trains.
* :class:`~lightning_wm.data.acting.central.CentralActing` — env groups step envs (in worker
  processes) and one batched policy on the learner's device acts for all of them; the same
  chunks, counts and gauges as actors, and no batch code knows the difference.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_wm.data.replay import RANDOM_POLICY_VERSION
from lightning_wm.signals import check_stop

__all__ = ["Acting", "Chunk", "RANDOM_POLICY_VERSION", "wait_for_chunk"]


@dataclass
class Chunk:
    """Rows of ``T`` consecutive steps of each of ``N`` envs, made by one source.

    Attributes:
        actor: the index of the source (an actor in its pool; 0 in process).
        version: weight version the rows were made with (``-1``: the random prefill policy).
        rows: row-convention leaves ``[T, N, ...]`` (numpy), ``policy_version`` included.
        episodes: episodes finished in the chunk, ``{"return", "length", "env"}``.
        env_steps: rows made anew (``T * N``; an overlap row was counted in the chunk before).
        collect_s: seconds spent acting for it.
    """

    actor: int
    version: int
    rows: dict[str, Any]
    episodes: list[dict[str, float]] = field(default_factory=list)
    env_steps: int = 0
    collect_s: float = 0.0

    def date_by_oldest_row(self) -> None:
        """Set ``version`` to the oldest weights that acted in the chunk (central acting: rows carry
        the learner's version of the moment); a random-prefill chunk keeps its version."""
        if self.version != RANDOM_POLICY_VERSION:
            self.version = int(self.rows["policy_version"].min())


def wait_for_chunk(take: Callable[[float], Chunk | None], check: Callable[[], None], timeout: float) -> Chunk | None:
    """``take(seconds)`` in slices of at most 0.1 s until a chunk comes or ``timeout`` seconds pass
    (``None`` then), calling ``check()`` (raises when a source failed) and honouring a stop request
    (``RunStopped``) before each slice."""
    deadline = time.monotonic() + timeout
    while True:
        check_stop()
        check()
        chunk = take(min(0.1, max(0.0, deadline - time.monotonic())))
        if chunk is not None or time.monotonic() >= deadline:
            return chunk


class Acting(ABC):
    """How rows are made. The datamodule calls, in this order:

    1. :meth:`setup` ``(rank, rows)`` when Lightning sets the datamodule up (again after
       :meth:`close`: a later fit acts in fresh envs and continues the counts);
    2. :meth:`attach_agent` ``(agent, version)`` when fit starts and after optimizer steps
       (the ``AgentPublisher`` callback): the declared way the acting part gets its agent;
    3. per batch, :meth:`next_chunk` until the batch side has what it needs, :meth:`received`
       for each chunk it uses and :meth:`batch_done` once;
    4. :meth:`close` at teardown or on an exception.

    Attributes:
        chunk_length: env steps per chunk (per env).
        overlap: chunks of ``chunk_length + 1`` rows, consecutive ones of an env sharing a row
            (the unrolls an IMPALA learner bootstraps from).
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
    def chunk_rows(self) -> int:
        """New rows of one chunk: ``chunk_length`` steps of each env of one source."""
        return self.chunk_length * (self.num_streams // max(1, self.concurrent_sources))

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
