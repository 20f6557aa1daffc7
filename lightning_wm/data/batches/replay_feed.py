"""The replay ratio when rows arrive from elsewhere (actors): :class:`ReplayFeed` throttles either
side, so that the learner trains ``replay_ratio`` gradient steps per env row whichever is faster."""

from __future__ import annotations

import time
from typing import Any, Protocol

from lightning_wm.data.acting.base import Acting, Chunk

__all__ = ["ReplayFeed"]


class _Rows(Protocol):
    """What a feed needs of a replay buffer (``ReplayBuffer.add_many``)."""

    def add_many(self, chunk: dict[str, Any], streams: Any = None, priority: Any = None) -> None: ...

    def __len__(self) -> int: ...


class ReplayFeed:
    """Chunks from an acting part into a replay buffer at a target replay ratio.

    After ``b`` batches the replay ratio ``r`` (gradient steps per env row) calls for
    ``owed(b) = prefill + b / r`` rows. With ``slack`` rows of tolerance:

    * before batch ``b`` the learner **waits** for rows while ``rows < owed(b) - slack``, or
      while the buffer holds fewer than ``prefill`` rows (actors too slow: the learner waits);
    * a chunk of ``c`` rows is **ingested** only while ``rows + c <= owed(b) + slack`` (or the
      buffer still holds fewer than ``prefill`` rows, e.g. one actor's streams wrapped); otherwise
      it stays with the learner (one chunk) and in the bounded queue, and the actors block on
      the full queue (learner too slow: the actors wait).

    So ``|rows - owed(b)| <= slack + c`` at every batch, whichever side is faster. ``slack``
    must be at least ``c`` (a chunk always fits between the two bounds). ``rows`` are the env
    steps the acting part counted for the chunks ingested (:meth:`Acting.received`).

    Args:
        acting: where chunks come from (a chunk's envs are streams ``acting.streams(chunk)``).
        buffer: anything with ``add_many(chunk [T, N, ...], streams)`` and ``len``.
        replay_ratio: gradient steps per env row.
        prefill: rows before the first batch.
        slack: rows of tolerance; default one chunk per concurrent source (actor).
    """

    def __init__(
        self, acting: Acting, buffer: _Rows, replay_ratio: float, prefill: int, slack: int | None = None
    ) -> None:
        chunk_rows = acting.chunk_rows
        self.slack = int(slack if slack is not None else acting.concurrent_sources * chunk_rows)
        if self.slack < chunk_rows:
            raise ValueError(
                f"replay ratio slack ({self.slack} rows) must be at least one chunk "
                f"({acting.chunk_length} steps x {acting.chunk_streams} envs = {chunk_rows} rows)"
            )
        if replay_ratio <= 0:
            raise ValueError(f"replay_ratio must be > 0, got {replay_ratio}")
        self.acting, self.buffer, self.replay_ratio, self.prefill = acting, buffer, replay_ratio, prefill
        self.batches = 0  # batches served
        self._held: Chunk | None = None  # taken from the queue, waiting to be ingested

    @property
    def rows(self) -> int:
        """Rows ingested so far (the acting part's env steps)."""
        return self.acting.env_steps

    def owed(self, batches: int) -> float:
        """Rows the replay ratio calls for after ``batches`` batches."""
        return self.prefill + batches / self.replay_ratio

    def _take(self, timeout: float) -> Chunk | None:
        if self._held is None:
            self._held = self.acting.next_chunk(timeout=timeout)
        else:
            self.acting.check()  # holding back chunks: still notice a failed actor
        return self._held

    def _ingest(self, chunk: Chunk) -> None:
        self.buffer.add_many(chunk.rows, streams=self.acting.streams(chunk))
        self.acting.received(chunk)
        self._held = None

    def before_batch(self) -> float:
        """Ingest and wait as the rule says before the next batch; returns seconds waited."""
        self.batches += 1
        owed = self.owed(self.batches)
        waited = 0.0
        while True:
            chunk = self._take(timeout=0.0)
            prefilled = len(self.buffer) >= self.prefill  # (a full ring per stream can hold it back)
            if chunk is not None and (self.rows + chunk.env_steps <= owed + self.slack or not prefilled):
                self._ingest(chunk)
                continue
            if self.rows >= owed - self.slack and prefilled:
                break
            start = time.monotonic()
            self._take(timeout=0.5)  # the rule needs rows: wait for the actors
            waited += time.monotonic() - start
        self.acting.batch_done(waited, held=int(self._held is not None))
        return waited

    def drop_held(self) -> None:
        """Forget the chunk held back (its actors were stopped; a later fit starts new ones)."""
        self._held = None
