"""The learner's side of acting in actors: chunks from an :class:`ActorPool` become replay rows
at a target replay ratio (:class:`ReplayFeed`) or batches of unrolls (:class:`UnrollBatcher`),
and what the learner saw of the actors becomes gauges (:class:`ActorMetrics`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from lightning_wm.data.actors import RANDOM_POLICY_VERSION, ActorPool, Chunk
from lightning_wm.tree import first_leaf, tree_map

__all__ = ["ActorMetrics", "ReplayFeed", "UnrollBatcher", "add_chunk"]


class _Rows(Protocol):
    """What a feed needs of a replay buffer (``ReplayBuffer.add_many``)."""

    def add_many(self, chunk: dict[str, Any], streams: Any = None, priority: Any = None) -> None: ...

    def __len__(self) -> int: ...


def add_chunk(buffer: _Rows, chunk: Chunk, streams: np.ndarray) -> None:
    """Write ``chunk``'s rows ``[T, N, ...]`` to ``streams`` ``[N]`` of ``buffer``."""
    buffer.add_many(chunk.rows, streams=streams)


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
        self._frames: deque[tuple[float, int]] = deque()
        self._lags: deque[tuple[float, int]] = deque()
        self._waits: deque[tuple[float, float]] = deque()
        self.episodes: list[dict[str, float]] = []
        self.queue_depth = 0

    def _trim(self, now: float) -> None:
        for window in (self._frames, self._lags, self._waits):
            while window and window[0][0] < now - self.window_s:
                window.popleft()

    def chunk(self, chunk: Chunk, learner_version: int) -> None:
        """A chunk reached the learner (its rows are in, its episodes count)."""
        now = self.clock()
        self._frames.append((now, chunk.env_steps))
        if chunk.version != RANDOM_POLICY_VERSION:
            self._lags.append((now, learner_version - chunk.version))
        self.episodes.extend(chunk.episodes)

    def waited(self, seconds: float) -> None:
        """The learner waited ``seconds`` for rows before one batch."""
        self._waits.append((self.clock(), seconds))

    def pop_episodes(self) -> list[dict[str, float]]:
        out, self.episodes = self.episodes, []
        return out

    def gauges(self) -> dict[str, float]:
        now = self.clock()
        self._trim(now)
        span = max(1e-6, min(self.window_s, now - self._start))
        out = {
            "actors/frames_per_s": sum(n for _, n in self._frames) / span,
            "actors/queue_depth": float(self.queue_depth),
        }
        if self._lags:
            out["actors/policy_lag"] = float(np.mean([lag for _, lag in self._lags]))
        if self._waits:
            waited = sum(w for _, w in self._waits)
            out["actors/wait_fraction"] = min(1.0, waited / span)
            out["actors/batch_wait_ms"] = 1000.0 * waited / len(self._waits)
        return out


class ReplayFeed:
    """Rows from an actor pool into a replay buffer at a target replay ratio.

    After ``b`` batches the replay ratio ``r`` (gradient steps per env row) calls for
    ``owed(b) = prefill + b / r`` rows. With ``slack`` rows of tolerance:

    * before batch ``b`` the learner **waits** for rows while ``rows < owed(b) - slack``, or
      while the buffer holds fewer than ``prefill`` rows (actors too slow: the learner waits);
    * a chunk of ``c`` rows is **ingested** only while ``rows + c <= owed(b) + slack`` (or the
      buffer still holds fewer than ``prefill`` rows, e.g. one actor's streams wrapped); otherwise
      it stays with the learner (one chunk) and in the bounded queue, and the actors block on
      the full queue (learner too slow: the actors wait).

    So ``|rows - owed(b)| <= slack + c`` at every batch, whichever side is faster. ``slack``
    must be at least ``c`` (a chunk always fits between the two bounds).

    Args:
        pool: the actors (chunks carry their actor; actor ``a``'s envs are streams
            ``pool.streams(a)`` of the buffer).
        buffer: anything with ``add_many(chunk [T, N, ...], streams)`` and ``len``.
        replay_ratio: gradient steps per env row.
        prefill: rows before the first batch.
        slack: rows of tolerance; default one chunk per actor.
        metrics: where gauges go.
    """

    def __init__(
        self,
        pool: ActorPool,
        buffer: _Rows,
        replay_ratio: float,
        prefill: int,
        slack: int | None = None,
        metrics: ActorMetrics | None = None,
    ) -> None:
        chunk_rows = pool.chunk_length * pool.envs_per_actor
        self.slack = int(slack if slack is not None else pool.num_actors * chunk_rows)
        if self.slack < chunk_rows:
            raise ValueError(
                f"replay ratio slack ({self.slack} rows) must be at least one chunk "
                f"({pool.chunk_length} steps x {pool.envs_per_actor} envs = {chunk_rows} rows)"
            )
        if replay_ratio <= 0:
            raise ValueError(f"replay_ratio must be > 0, got {replay_ratio}")
        self.pool, self.buffer, self.replay_ratio, self.prefill = pool, buffer, replay_ratio, prefill
        self.metrics = metrics or ActorMetrics()
        self.rows = 0  # rows ingested
        self.batches = 0  # batches served
        self._held: Chunk | None = None  # taken from the queue, waiting to be ingested

    def owed(self, batches: int) -> float:
        """Rows the replay ratio calls for after ``batches`` batches."""
        return self.prefill + batches / self.replay_ratio

    def _take(self, timeout: float) -> Chunk | None:
        if self._held is None:
            self._held = self.pool.get(timeout=timeout)
        else:
            self.pool.check()  # holding back chunks: still notice a failed actor
        return self._held

    def _ingest(self, chunk: Chunk, learner_version: int) -> None:
        add_chunk(self.buffer, chunk, self.pool.streams(chunk.actor))
        self.rows += chunk.env_steps
        self.metrics.chunk(chunk, learner_version)
        self._held = None

    def before_batch(self, learner_version: int = 0) -> float:
        """Ingest and wait as the rule says before the next batch; returns seconds waited."""
        self.batches += 1
        owed = self.owed(self.batches)
        waited = 0.0
        while True:
            chunk = self._take(timeout=0.0)
            prefilled = len(self.buffer) >= self.prefill  # (a full ring per stream can hold it back)
            if chunk is not None and (self.rows + chunk.env_steps <= owed + self.slack or not prefilled):
                self._ingest(chunk, learner_version)
                continue
            if self.rows >= owed - self.slack and prefilled:
                break
            start = time.monotonic()
            self._take(timeout=0.5)  # the rule needs rows: wait for the actors
            waited += time.monotonic() - start
        self.metrics.queue_depth = self.pool.qsize() + (self._held is not None)
        self.metrics.waited(waited)
        return waited


class UnrollBatcher:
    """Unrolls of ``T+1`` rows batched to ``[B, T+1, ...]``, optionally through a small replay.

    Chunks come time-major ``[T+1, N, ...]`` (``Collector.collect_chunk(T, overlap=True)``:
    consecutive chunks of one env share a row); each env's column becomes one unroll, with an
    id that is never reused.

    Without replay (``replay_size = 0``) every unroll is used once, oldest first. With
    ``replay_size > 0`` the newest ``replay_size`` unrolls are kept and a batch draws ``B``
    distinct ones among those used fewer than ``max_use`` times: uniformly, or with
    ``prioritized`` in proportion to ``priority ** alpha`` (a new unroll gets the largest
    priority seen so far; :meth:`update_priorities` sets them). An unroll leaves after its
    ``max_use``-th use (or when newer ones push it out).

    Every batch carries ``index`` and ``generation`` int64 ``[B]`` (both the unrolls' ids: an id
    names one unroll for ever, so it is its own generation) and, when prioritized, ``weight``
    float32 ``[B]``: the importance weights ``(n * P(i)) ** -beta`` over the ``n`` unrolls
    available, divided by the batch's largest.
    """

    def __init__(
        self,
        batch_size: int,
        replay_size: int = 0,
        max_use: int = 1,
        seed: int = 0,
        prioritized: bool = False,
        alpha: float = 0.6,
        beta: float = 0.4,
    ) -> None:
        if batch_size < 1 or max_use < 1 or replay_size < 0:
            raise ValueError(
                f"batch_size and max_use must be >= 1 and replay_size >= 0, got {batch_size}, {max_use}, {replay_size}"
            )
        if 0 < replay_size < batch_size:
            raise ValueError(f"replay_size ({replay_size}) must be 0 (no replay) or at least batch_size ({batch_size})")
        if prioritized and replay_size == 0:
            raise ValueError(
                "prioritized sampling draws from a replay: set replay_size > 0 (unrolls kept), or prioritized: false"
            )
        if alpha < 0 or beta < 0:
            raise ValueError(f"alpha and beta must be >= 0, got {alpha}, {beta}")
        self.batch_size, self.replay_size, self.max_use = batch_size, replay_size, max_use
        self.prioritized, self.alpha, self.beta = prioritized, alpha, beta
        self._unrolls: deque[dict[str, Any]] = deque()
        self._uses: deque[int] = deque()
        self._ids: deque[int] = deque()  # increasing along the deque
        self._priority: deque[float] = deque()
        self._next_id = 0
        self._max_priority = 1.0
        self._rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        """Unrolls that can still be used."""
        return len(self._unrolls)

    def add(self, rows: dict[str, Any]) -> None:
        """Add the unrolls of a chunk ``[T+1, N, ...]`` (one per env)."""
        envs = first_leaf(rows).shape[1]
        for j in range(envs):
            self._unrolls.append(tree_map(lambda x: np.ascontiguousarray(x[:, j]), rows))
            self._uses.append(0)
            self._ids.append(self._next_id)
            self._priority.append(self._max_priority)
            self._next_id += 1
        limit = self.replay_size or None
        while limit is not None and len(self._unrolls) > limit:
            self._drop(0)

    def _drop(self, i: int) -> None:
        for d in (self._unrolls, self._uses, self._ids, self._priority):
            del d[i]

    def ready(self) -> bool:
        return len(self._unrolls) >= self.batch_size

    def batch(self) -> dict[str, Any]:
        """``B`` unrolls stacked batch-major: every leaf a tensor ``[B, T+1, ...]``, plus ``index``,
        ``generation`` (and ``weight`` when prioritized) ``[B]``."""
        if not self.ready():
            raise ValueError(f"only {len(self._unrolls)} unrolls for a batch of {self.batch_size}")
        weight = None
        if self.replay_size == 0:
            which = np.arange(self.batch_size)
        elif self.prioritized:
            p = np.asarray(self._priority, np.float64) ** self.alpha
            p /= p.sum()
            which = np.sort(self._rng.choice(len(p), self.batch_size, replace=False, p=p))
            w = (len(p) * p[which]) ** -self.beta
            weight = (w / w.max()).astype(np.float32)
        else:
            which = np.sort(self._rng.choice(len(self._unrolls), self.batch_size, replace=False))
        picked = [self._unrolls[i] for i in which]
        ids = np.array([self._ids[i] for i in which], np.int64)
        for i in which:
            self._uses[i] += 1
        for i in sorted(
            (int(i) for i in which if self.replay_size == 0 or self._uses[i] >= self.max_use), reverse=True
        ):
            self._drop(i)
        out = tree_map(lambda *xs: torch.from_numpy(np.stack(xs)), picked[0], *picked[1:])
        out["index"], out["generation"] = torch.from_numpy(ids), torch.from_numpy(ids.copy())
        if weight is not None:
            out["weight"] = torch.from_numpy(weight)
        return out

    def update_priorities(self, index: Any, priority: Any) -> dict[str, int]:
        """Set the priorities ``[N]`` of the unrolls with ids ``index [N]``; unrolls that left
        the replay since they were sampled are skipped. Returns ``{"applied", "stale"}`` counts."""
        index = np.asarray(index, np.int64).reshape(-1)
        priority = np.asarray(priority, np.float64).reshape(-1)
        if index.shape != priority.shape:
            raise ValueError(f"{len(index)} unroll ids but {len(priority)} priorities")
        if not np.isfinite(priority).all() or (priority < 0).any():
            raise ValueError(f"priorities must be finite and >= 0, got {priority}")
        ids = np.fromiter(self._ids, np.int64, len(self._ids))
        pos = np.searchsorted(ids, index)
        found = (
            (pos < len(ids)) & (ids[np.minimum(pos, len(ids) - 1)] == index) if len(ids) else np.zeros_like(index, bool)
        )
        for i, value in zip(pos[found], priority[found]):
            value = float(value) + 1e-6  # never exactly 0: every unroll stays drawable
            self._priority[int(i)] = value
            self._max_priority = max(self._max_priority, value)
        return {"applied": int(found.sum()), "stale": int((~found).sum())}


class ActorLink:
    """A datamodule's handle on its actors: the pool starts at the first weights published (the
    ``WeightPublisher`` callback publishes when fit starts), later versions go out every
    ``publish_every`` versions, and :class:`ActorMetrics` gathers the gauges.

    Args:
        env: the env config of the actors (``num_envs`` is replaced by ``envs_per_actor``).
        num_actors, envs_per_actor, chunk_length, backend, ray_address, timeout_s: see
            :class:`ActorPool`.
        publish_every: optimizer steps between weight versions sent to the actors.
        overlap: unroll chunks (``chunk_length + 1`` rows, consecutive ones sharing a row).
        queue_size: chunks waiting for the learner before actors block (local backend);
            default ``2 * num_actors``.
    """

    def __init__(
        self,
        env: Any,
        num_actors: int,
        envs_per_actor: int,
        chunk_length: int,
        backend: str = "local",
        ray_address: str | None = None,
        timeout_s: float = 60.0,
        publish_every: int = 1,
        overlap: bool = False,
        queue_size: int | None = None,
    ) -> None:
        if publish_every < 1:
            raise ValueError(f"publish_every must be >= 1, got {publish_every}")
        if backend not in ("local", "ray"):
            raise ValueError(f"actor_backend must be 'local' or 'ray', got {backend!r}")
        self.env, self.num_actors = env, num_actors
        self.envs_per_actor, self.chunk_length = envs_per_actor, chunk_length
        self.backend, self.ray_address, self.timeout_s = backend, ray_address, timeout_s
        self.publish_every, self.overlap, self.queue_size = publish_every, overlap, queue_size
        self.pool: ActorPool | None = None
        self.version: int | None = None  # newest version sent to the actors
        self.metrics = ActorMetrics()

    @property
    def num_streams(self) -> int:
        return self.num_actors * self.envs_per_actor

    def publish(self, module: Any, version: int, rank: int = 0, random_steps: int = 0) -> bool:
        """Send ``module.acting_copy()`` as ``version`` if due (always the first time, which
        starts the actors with ``random_steps`` random vector steps each). Returns whether sent."""
        if self.pool is None:
            self.pool = ActorPool(
                self.env,
                module.acting_copy(),
                self.num_actors,
                self.envs_per_actor,
                self.chunk_length,
                seed=self.env.seed,
                rank=rank,
                backend=self.backend,
                ray_address=self.ray_address,
                timeout_s=self.timeout_s,
                overlap=self.overlap,
                random_steps=random_steps,
                initial_version=version,
                queue_size=self.queue_size,
            )
        elif self.version is None or version < self.version or version - self.version >= self.publish_every:
            self.pool.publish(module.acting_copy(), version)
        else:
            return False
        self.version = version
        return True

    def require_pool(self) -> ActorPool:
        if self.pool is None:
            raise RuntimeError(
                "num_actors > 0 but no weights were published, so no actor was started: the WeightPublisher "
                "callback (lightning_wm.callbacks.WeightPublisher, added by the CLI's Trainer) publishes them "
                "when fit starts; add it to your Trainer's callbacks"
            )
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
