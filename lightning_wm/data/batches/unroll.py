"""The batch side of unroll learners (IMPALA, Dyna): unrolls of ``T+1`` rows straight to the learner.

:class:`UnrollBatches` cuts the acting part's chunks into unrolls
(:class:`~lightning_wm.data.batches.unroll_batcher.UnrollBatcher`, with its optional small
replay and ``max_use``), mixes imagined windows into the batches (Dyna) and adds ``"model"``
sequences of real rows for a world model trained beside the policy.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lightning_wm.data.acting.base import Acting
from lightning_wm.data.batches.base import BatchSide
from lightning_wm.data.batches.replay import refuse_uniform_priorities
from lightning_wm.data.batches.unroll_batcher import UnrollBatcher
from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.data.samplers import SequenceSampler
from lightning_wm.data.settings import ModelReplaySettings, UnrollReplaySettings
from lightning_wm.tree import tree_map

__all__ = ["UnrollBatches"]


class UnrollBatches(BatchSide):
    """Batches ``[B, T+1, ...]`` of unrolls; ``"model"`` sequences beside them when a world model
    trains on real rows; imagined unrolls mixed in after :meth:`set_imagination`.

    Args:
        unroll_length: ``T``, steps per unroll.
        batch_size: unrolls per batch.
        replay: the small replay of unrolls.
        model_replay: the real rows kept for a world model.
        seed: the replay's sampling seed.
    """

    def __init__(
        self,
        unroll_length: int,
        batch_size: int,
        replay: UnrollReplaySettings,
        model_replay: ModelReplaySettings,
        seed: int,
    ) -> None:
        self.unroll_length, self.batch_size = unroll_length, batch_size
        self.replay, self.model_replay = replay, model_replay
        self.batcher = UnrollBatcher(
            batch_size,
            replay.capacity,
            replay.max_use,
            seed=seed,
            prioritized=replay.prioritized,
            alpha=replay.alpha,
            beta=replay.beta,
        )
        self.model_sampler = SequenceSampler(model_replay.sequence_length)
        self.model_buffer: ReplayBuffer | None = None
        self.imagination: ReplayBuffer | None = None
        self.real_ratio = 1.0
        self.acting: Acting | None = None

    def setup(self, acting: Acting, rank: int, seed: int) -> None:
        """The model replay, if any (one stream per env; sampler RNG from ``seed``)."""
        self.acting = acting
        chunk_unrolls = acting.chunk_streams
        if self.replay.use_all and self.replay.capacity < self.batch_size - 1 + chunk_unrolls:
            raise ValueError(
                f"replay.use_all uses every unroll max_use times, so replay.capacity ({self.replay.capacity}) must "
                f"hold batch_size - 1 leftovers and a chunk's {chunk_unrolls} unrolls: set it to at least "
                f"{self.batch_size - 1 + chunk_unrolls}"
            )
        if self.model_replay.capacity > 0 and self.model_buffer is None:
            self.model_buffer = ReplayBuffer(
                self.model_replay.capacity, acting.num_streams, checkpoint=self.model_replay.save, seed=seed
            )

    @property
    def rows(self) -> ReplayBuffer | None:
        """Where rows acted in this process also go: the model replay."""
        return self.model_buffer

    # -- one batch ------------------------------------------------------------------------
    def make_rows(self) -> None:
        """Take chunks until the batch has its unrolls; with replay (unless ``replay.use_all``)
        also take (without waiting) up to one chunk per concurrent source, so fresh unrolls keep
        coming while old ones are reused."""
        acting, batcher = self.acting, self.batcher
        if acting is None:
            raise RuntimeError("setup() was not called")
        acting.check()
        eager = self.replay.capacity > 0 and not self.replay.use_all
        taken, waited = 0, 0.0
        while not batcher.ready() or (eager and taken < acting.concurrent_sources):
            start = time.monotonic()
            chunk = acting.next_chunk(timeout=0.5 if not batcher.ready() else 0.0)
            if not batcher.ready():
                waited += time.monotonic() - start
            if chunk is None:
                if batcher.ready():
                    break
                continue
            batcher.add(chunk.rows)
            acting.received(chunk)
            taken += 1
        acting.batch_done(waited)

    def next_batch(self) -> dict[str, Any]:
        """Unrolls for one batch (acting for them as needed), imagined ones and model rows added."""
        imagined = self._imagination_ready()
        self.batcher.batch_size = max(1, round(self.real_ratio * self.batch_size)) if imagined else self.batch_size
        self.make_rows()
        return self._with_model_data(self._mix(self.batcher.batch(), imagined))

    # -- feedback -------------------------------------------------------------------------
    def apply_feedback(self, batch: dict[str, Any], feedback: dict[str, Any]) -> dict[str, int]:
        """The learner's ``"priority" [B]`` for the unrolls ``batch["index"]`` (an error for a
        uniform replay); unrolls that left the replay since are skipped. Returns ``{"applied",
        "stale"}`` counts."""
        if not refuse_uniform_priorities(self.batcher.prioritized, feedback):
            return {"applied": 0, "stale": 0}
        priority = feedback["priority"]
        priority = priority.detach().cpu().numpy() if isinstance(priority, torch.Tensor) else priority
        return self.batcher.update_priorities(batch["index"].cpu().numpy(), priority)

    # -- a world model beside the policy, imagination -------------------------------------
    def real_buffer(self) -> ReplayBuffer:
        """The real rows kept for the world model (``model_replay``): where imagination starts."""
        if self.model_buffer is None:
            raise ValueError(
                "imagination starts from real rows: set data.init_args.model_replay.capacity > 0 "
                "(and acting.num_actors: 0)"
            )
        return self.model_buffer

    def set_imagination(self, buffer: ReplayBuffer | None, real_ratio: float) -> None:
        """Mix imagined unrolls from ``buffer`` into the batches at ``real_ratio``: a batch then
        holds ``max(1, round(real_ratio * batch_size))`` real unrolls and, for the rest, windows
        of ``T+1`` consecutive imagined rows; ``is_real [B]`` tells them apart."""
        if buffer is not None and self.batcher.prioritized:
            raise ValueError(
                "imagined unrolls have no priorities: use data.init_args.replay.prioritized: false with Dyna"
            )
        self.imagination, self.real_ratio = buffer, float(real_ratio)

    def _imagination_ready(self) -> bool:
        return (
            self.imagination is not None
            and self.real_ratio < 1.0
            and bool(self.imagination.rows_per_stream.max(initial=0) >= self.unroll_length + 1)
        )

    def _mix(self, real: dict[str, Any], imagined: bool) -> dict[str, Any]:
        """``real`` unrolls, completed to ``batch_size`` with imagined windows of ``T+1`` rows."""
        missing = self.batch_size - len(real["index"])
        if not imagined or missing <= 0:
            return real
        dream = SequenceSampler(self.unroll_length + 1).sample(self.imagination, missing)
        lacking = sorted(k for k in real if k not in dream)
        if lacking:
            raise ValueError(f"imagined rows lack the keys {lacking} of the real unrolls")
        out = {
            k: torch.cat([v, dream[k].to(v.dtype)])
            if isinstance(v, torch.Tensor)
            else tree_map(lambda a, b: torch.cat([a, b.to(a.dtype)]), v, dream[k])
            for k, v in real.items()
        }
        out["is_real"] = torch.arange(self.batch_size) < len(real["index"])
        return out

    def _with_model_data(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Add ``"model"`` sequences of real rows when the model replay can give them."""
        if self.model_buffer is not None and self.model_sampler.can_sample(self.model_buffer):
            batch["model"] = self.model_sampler.sample(self.model_buffer, self.model_replay.batch_size)
        return batch

    def replay_buffers(self) -> dict[str, ReplayBuffer]:
        """The world model's real rows (checkpointed with ``model_replay.save``) and the imagination (never)."""
        return {k: v for k, v in (("model", self.model_buffer), ("imagination", self.imagination)) if v is not None}
