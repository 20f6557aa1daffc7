"""How rows become batches: the batch side of an online datamodule (:class:`BatchSide`).

* :class:`ReplayBatches` — a replay buffer, a sampler and the replay ratio (Dreamer, MuZero);
* :class:`UnrollBatches` — unrolls of ``T+1`` rows straight to the learner (IMPALA, Dyna).
"""

from __future__ import annotations

from lightning_wm.data.batches.base import BatchSide
from lightning_wm.data.batches.replay import PrefetchedBatches, ReplayBatches
from lightning_wm.data.batches.replay_feed import ReplayFeed
from lightning_wm.data.batches.unroll import UnrollBatches
from lightning_wm.data.batches.unroll_batcher import UnrollBatcher

__all__ = ["BatchSide", "PrefetchedBatches", "ReplayBatches", "ReplayFeed", "UnrollBatcher", "UnrollBatches"]
