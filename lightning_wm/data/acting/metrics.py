"""What the learner sees of its actors, as gauges (``actors/*``, logged by ``EnvStatsLogger``)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from lightning_wm.data.acting.base import RANDOM_POLICY_VERSION, Chunk

__all__ = ["ActorMetrics"]


class ActorMetrics:
    """Gauges of the actors as the learner sees them, over a sliding window of ``window_s`` seconds.

    * ``actors/frames_per_s``: env steps received per second;
    * ``actors/policy_lag``: learner version minus the version that made the rows (mean over the
      window's chunks; rows of the random prefill policy are not counted);
    * ``actors/queue_depth``: chunks waiting for the learner (latest);
    * ``actors/wait_fraction``: share of the learner's wall time spent waiting for rows;
    * ``actors/batch_wait_ms``: mean wait per batch.
    """

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self.clock = window_s, clock
        self._start = clock()
        # (time, value) per event in the window, with each window's running sum: reading the gauges
        # (twice per learner step) costs O(1), not a pass over the window's thousands of chunks
        self._windows: dict[str, deque[tuple[float, float]]] = {"frames": deque(), "lags": deque(), "waits": deque()}
        self._sums = dict.fromkeys(self._windows, 0.0)
        self.episodes: list[dict[str, float]] = []
        self.queue_depth = 0

    def _add(self, window: str, now: float, value: float) -> None:
        self._windows[window].append((now, value))
        self._sums[window] += value

    def _trim(self, now: float) -> None:
        for name, window in self._windows.items():
            while window and window[0][0] < now - self.window_s:
                self._sums[name] -= window.popleft()[1]
            if not window:
                self._sums[name] = 0.0  # no rounding left over from the values that left

    def chunk(self, chunk: Chunk, learner_version: int) -> None:
        """A chunk reached the learner (its rows are in, its episodes count)."""
        now = self.clock()
        self._add("frames", now, chunk.env_steps)
        if chunk.version != RANDOM_POLICY_VERSION:
            self._add("lags", now, learner_version - chunk.version)
        self.episodes.extend(chunk.episodes)

    def waited(self, seconds: float) -> None:
        """The learner waited ``seconds`` for rows before one batch."""
        self._add("waits", self.clock(), seconds)

    def pop_episodes(self) -> list[dict[str, float]]:
        out, self.episodes = self.episodes, []
        return out

    def gauges(self) -> dict[str, float]:
        now = self.clock()
        self._trim(now)
        span = max(1e-6, min(self.window_s, now - self._start))
        out = {
            "actors/frames_per_s": self._sums["frames"] / span,
            "actors/queue_depth": float(self.queue_depth),
        }
        if lags := len(self._windows["lags"]):
            out["actors/policy_lag"] = self._sums["lags"] / lags
        if waits := len(self._windows["waits"]):
            waited = self._sums["waits"]
            out["actors/wait_fraction"] = min(1.0, waited / span)
            out["actors/batch_wait_ms"] = 1000.0 * waited / waits
        return out
