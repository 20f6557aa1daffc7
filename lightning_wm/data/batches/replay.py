"""The batch side of replay learners (Dreamer, MuZero): rows into a
:class:`~lightning_wm.data.replay.ReplayBuffer`, batches out through a sampler.

:class:`ReplayBatches` owns the buffer, the sampler, the replay ratio (an exact credit of env
steps when acting in process, :class:`~lightning_wm.data.batches.replay_feed.ReplayFeed`'s
throttle when rows arrive from actors), the random prefill, the learner's feedback
(priorities, reanalysed columns) and the mixing of imagined rows (Dyna).
:class:`PrefetchedBatches` undoes the effect of Lightning's one-batch prefetch on a resume.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from lightning_wm.data.acting.base import Acting
from lightning_wm.data.acting.in_process import InProcessActing
from lightning_wm.data.batches.base import BatchSide
from lightning_wm.data.batches.replay_feed import ReplayFeed
from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.data.samplers import MixedSampler, Sampler, SequenceSampler
from lightning_wm.data.settings import ReplaySettings
from lightning_wm.protocols import SamplerSource

__all__ = ["PrefetchedBatches", "ReplayBatches", "refuse_uniform_priorities"]


def refuse_uniform_priorities(prioritized: bool, feedback: dict[str, Any]) -> bool:
    """Whether ``feedback`` carries priorities; a clear error when the replay is uniform (the
    learner computes priorities nobody uses: a config that contradicts itself)."""
    if feedback.get("priority") is None:
        return False
    if not prioritized:
        raise ValueError(
            "training_step returns priorities but the replay is uniform: set data.init_args.replay.prioritized: "
            "true, or configure the model not to return them"
        )
    return True


class PrefetchedBatches:
    """Lightning's data fetcher fetches one batch ahead of the step it trains on: when the
    checkpoint of step ``N`` is written, the rows of batch ``N + 1`` have been acted for already
    (they are in the buffer and in the env-step counts, and the checkpoint holds them), but no step
    trained on that batch. A resumed fit fetches batch ``N + 1`` again; acting for it a second time
    would take its env steps twice and shift the replay ratio's course. So the batches made are
    counted, the checkpoint records them beside the step (``batches_collected``, ``global_step``),
    and after a restore the ``batches_collected - global_step`` batches the checkpoint already
    holds are fetched without acting (:meth:`take` says so). Only in-process acting needs this:
    rows from actors are counted as they arrive. With ``acting.fetch_ahead: false`` a batch is made
    just before its step, the counts agree at every checkpoint and nothing is skipped.
    """

    def __init__(self) -> None:
        self.made = 0  # batches whose rows have been made
        self.ahead = 0  # after a restore: batches whose rows the checkpoint already holds

    def take(self) -> bool:
        """Whether the next batch's rows must be made (``False`` for one the checkpoint holds)."""
        if self.ahead > 0:
            self.ahead -= 1
            return False
        self.made += 1
        return True

    def state_dict(self, global_step: int) -> dict[str, int]:
        return {"batches_collected": self.made, "global_step": int(global_step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.made = int(state.get("batches_collected", 0))
        self.ahead = max(0, self.made - int(state.get("global_step", self.made)))


class ReplayBatches(BatchSide):
    """Rows into a replay buffer at ``replay_ratio`` gradient steps per env step; batches of
    ``batch_size`` items drawn with the sampler.

    Args:
        batch_size: items (sequences, windows, rows) per batch.
        sampler: how batches are read (:mod:`lightning_wm.data.samplers`); ``None``: the
            sampler of the agent attached if it is a :class:`~lightning_wm.protocols.SamplerSource`
            (a value the model and the sampler both need is set once, in the model), else
            ``SequenceSampler(64)``. An explicit sampler wins.
        prefill: rows made with a random policy before the first batch.
        replay_ratio: gradient steps per env step (row).
        replay: the buffer's settings.
        slack: rows of tolerance of the replay ratio with actors (:class:`ReplayFeed`).
    """

    def __init__(
        self,
        batch_size: int,
        sampler: Sampler | None,
        prefill: int,
        replay_ratio: float,
        replay: ReplaySettings,
        slack: int | None = None,
    ) -> None:
        self.batch_size, self.prefill, self.replay_ratio = batch_size, prefill, replay_ratio
        self.replay, self.slack = replay, slack
        self._sampler, self._explicit = sampler, sampler is not None
        self._sampler_agent: Any = None  # the agent the sampler came from
        self.buffer: ReplayBuffer | None = None
        self.imagination: ReplayBuffer | None = None  # imagined rows (Dyna), see set_imagination
        self._mixer: MixedSampler | None = None
        self.acting: Acting | None = None
        self._feed: ReplayFeed | None = None
        self._credit = 0.0  # env rows owed to the replay ratio (in process)
        self._feed_batches = 0  # batches the feed had served (restored before the feed exists)
        self.prefetched = PrefetchedBatches()

    # -- the sampler ----------------------------------------------------------------------
    @property
    def sampler(self) -> Sampler:
        """The explicit sampler, else the attached agent's, else ``SequenceSampler(64)``."""
        if self._sampler is None:
            self._sampler = SequenceSampler(64)
        return self._sampler

    @sampler.setter
    def sampler(self, sampler: Sampler) -> None:
        self._sampler, self._explicit = sampler, True

    def use_agent(self, agent: Any) -> None:
        """Take the sampler from ``agent`` (a new one) unless one was given."""
        if self._explicit or agent is self._sampler_agent:
            return
        self._sampler_agent = agent
        self._sampler = agent.replay_sampler() if isinstance(agent, SamplerSource) else SequenceSampler(64)

    # -- setup ----------------------------------------------------------------------------
    def setup(self, acting: Acting, rank: int, seed: int) -> None:
        """The buffer (``acting.num_streams`` streams; sampler RNG from ``seed``) and, for rows
        arriving from actors, the feed."""
        if self.buffer is not None:
            return
        replay = self.replay
        storage = os.path.join(replay.storage_dir, f"rank{rank}") if replay.storage_dir is not None else None
        self.buffer = ReplayBuffer(
            replay.capacity,
            acting.num_streams,
            prioritized=replay.prioritized,
            alpha=replay.alpha,
            beta=replay.beta,
            storage_dir=storage,
            seed=seed,
            checkpoint=replay.save,
        )
        self.acting = acting
        if not isinstance(acting, InProcessActing):
            self._feed = ReplayFeed(acting, self.buffer, self.replay_ratio, self.prefill, self.slack)
            self._feed.batches = self._feed_batches

    @property
    def rows(self) -> ReplayBuffer | None:
        """Where rows acted in this process go: the buffer."""
        return self.buffer

    def random_rows(self) -> int:
        """Rows the random prefill still owes."""
        return max(0, self.prefill - (len(self.buffer) if self.buffer is not None else 0))

    def close(self) -> None:
        if self._feed is not None:  # a later fit starts new actors; the counts go on
            self._feed.drop_held()

    # -- one batch ------------------------------------------------------------------------
    def make_rows(self) -> None:
        """Act (or take the actors' rows) for the next batch, as the replay ratio says."""
        if self._feed is not None:
            self._feed.before_batch()
            return
        acting = self.acting
        buffer = self.buffer
        if not isinstance(acting, InProcessActing) or buffer is None:
            raise RuntimeError("setup() was not called")
        if len(buffer) < self.prefill:  # a fresh run, or a resume without a saved buffer
            acting.collect_random(math.ceil((self.prefill - len(buffer)) / acting.num_streams))
        if not self.prefetched.take():
            return
        self._credit += 1.0 / self.replay_ratio
        steps = int(self._credit // acting.num_streams)
        if steps > 0:
            self._credit -= steps * acting.num_streams
        acting.collect(steps)

    def next_batch(self) -> dict[str, torch.Tensor]:
        self.make_rows()
        return self.sample()

    def sample(self) -> dict[str, torch.Tensor]:
        """A batch from the buffer; after :meth:`set_imagination`, real and imagined items at
        ``real_ratio`` (with ``is_real [B]``)."""
        if self.buffer is None:
            raise RuntimeError("setup() was not called")
        if self._mixer is not None:
            return self._mixer.sample(self.buffer, self.imagination, self.batch_size)
        return self.sampler.sample(self.buffer, self.batch_size)

    # -- feedback, imagination, buffers ---------------------------------------------------
    def apply_feedback(self, batch: dict[str, Any], feedback: dict[str, Any]) -> dict[str, int]:
        """Write a learner's feedback on ``batch`` back into the buffer.

        ``feedback["priority"]`` ``[B]``: new priorities of ``batch["index"]`` (an error for a
        uniform buffer); ``feedback["write"]``: ``{"index": [N], "generation": [N], "columns":
        {key: [N, ...]}}`` (e.g. reanalysed targets of rows ``batch["row_index"][mask]``). Rows
        overwritten since the batch was sampled are skipped (generations); for a batch with
        ``is_real`` (mixed real/imagined) priorities go to the real rows only.

        Returns:
            ``{"applied": rows written, "stale": rows skipped as overwritten}``.
        """
        if self.buffer is None:
            raise RuntimeError("setup() was not called")
        applied = stale = 0
        if refuse_uniform_priorities(self.buffer.prioritized, feedback):
            priority, index, generation = feedback["priority"], batch["index"], batch["generation"]
            if "is_real" in batch:
                real = batch["is_real"].bool()
                index, generation, priority = index[real], generation[real], priority[real]
            done = self.buffer.update_priorities(index, priority, generation)
            applied, stale = applied + done, stale + len(index) - done
        write = feedback.get("write")
        if write is not None:
            done = self.buffer.write(write["index"], write["columns"], write["generation"])
            applied, stale = applied + done, stale + len(write["index"]) - done
        return {"applied": applied, "stale": stale}

    def real_buffer(self) -> ReplayBuffer:
        """The buffer of real rows (where imagined rollouts start)."""
        if self.buffer is None:
            raise RuntimeError("setup() was not called")
        return self.buffer

    def set_imagination(self, buffer: ReplayBuffer | None, real_ratio: float) -> None:
        """From now on draw ``round(real_ratio * batch_size)`` items of every batch from the
        real buffer and the rest from ``buffer`` (imagined rows, same keys), with this sampler,
        through :class:`~lightning_wm.data.samplers.MixedSampler`; all real while ``buffer`` is
        None or cannot give a sample."""
        self.imagination = buffer
        self._mixer = MixedSampler(self.sampler, real_ratio)

    def replay_buffers(self) -> dict[str, ReplayBuffer]:
        """``replay`` and ``imagination`` where they exist (``BufferCheckpoint`` saves those with
        ``checkpoint`` set, i.e. the replay with ``replay.save: true``)."""
        return {k: v for k, v in (("replay", self.buffer), ("imagination", self.imagination)) if v is not None}

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self, global_step: int) -> dict[str, Any]:
        """The replay ratio's progress (credit, batches made, batches served from actors). The
        buffer itself is saved beside the checkpoint by ``BufferCheckpoint``."""
        state: dict[str, Any] = {"credit": self._credit, **self.prefetched.state_dict(global_step)}
        if self._feed is not None:
            state["actor_batches"] = self._feed.batches
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._credit = float(state.get("credit", 0.0))
        self.prefetched.load_state_dict(state)
        if "actor_batches" in state:
            self._feed_batches = int(state["actor_batches"])
            if self._feed is not None:
                self._feed.batches = self._feed_batches
        if "buffer" in state and self.buffer is not None:  # before BufferCheckpoint: rank 0's buffer inline
            self.buffer.load_state_dict(state["buffer"])
            self.buffer.mark_episode_end()
