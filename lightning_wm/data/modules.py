"""The online datamodules: an acting part plus a batch part (:class:`~lightning_wm.data.online.OnlineDataModule`).

* :class:`ReplayDataModule` — replay learners (Dreamer, MuZero): rows into a replay buffer at a
  replay ratio, batches drawn by a sampler.
* :class:`UnrollDataModule` — unrolls of ``T+1`` rows straight to the learner (IMPALA, Dyna).

Offline episodes are :class:`~lightning_wm.data.offline.EpisodeDataModule`'s; an evolution
strategy's generations :class:`~lightning_wm.data.generations.GenerationDataModule`'s.
"""

from __future__ import annotations

from typing import Any

from lightning_wm.data.acting.in_process import InProcessActing
from lightning_wm.data.batches.replay import ReplayBatches
from lightning_wm.data.batches.unroll import UnrollBatches
from lightning_wm.data.batches.unroll_batcher import UnrollBatcher
from lightning_wm.data.collector import Collector
from lightning_wm.data.online import OnlineDataModule
from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.data.samplers import Sampler
from lightning_wm.data.settings import (
    ActingSettings,
    EvalSettings,
    ModelReplaySettings,
    ReplaySettings,
    UnrollReplaySettings,
)
from lightning_wm.envs import EnvConfig
from lightning_wm.io import check_writable
from lightning_wm.settings import as_settings

__all__ = ["ReplayDataModule", "UnrollDataModule"]

REPLAY_CHUNK_LENGTH = 64  # env steps per actor chunk of a replay datamodule, unless acting.chunk_length says


class ReplayDataModule(OnlineDataModule):
    """Online data for replay learners: env -> acting -> :class:`~lightning_wm.data.replay.ReplayBuffer`
    -> sampler -> batches.

    Acting in process (``acting.num_actors: 0``), each batch first acts for the env steps the
    replay ratio owes (an exact credit, whole vector steps), then samples. With actors the replay
    ratio is a target enforced by throttling either side
    (:class:`~lightning_wm.data.batches.replay_feed.ReplayFeed`): after ``b`` batches
    ``prefill + b / replay_ratio`` rows are owed; the learner waits for rows while it has
    ``acting.ratio_slack`` fewer, and leaves chunks in the (bounded) queue, so that the actors
    block, while it has ``ratio_slack`` more. Rows still queued when a checkpoint is taken are
    not in it: a resumed run starts its actors afresh (new episodes).

    Args:
        env: the training environment; its ``seed`` is the root of this module's seeds.
        batch_size: items (sequences, windows, rows) per batch.
        sampler: how batches are read from the buffer (:mod:`lightning_wm.data.samplers`):
            ``SequenceSampler`` (``[B, L, ...]``), ``WindowSampler`` (K-step unrolls with n-step
            targets), ``RowSampler`` or ``TransitionSampler``; in YAML a ``class_path`` with
            ``init_args``. ``None`` (default): the sampler of the model being trained when it
            names one (a :class:`~lightning_wm.protocols.SamplerSource`, e.g. MuZero's windows
            from its own ``num_unroll_steps`` and ``td_steps``), else ``SequenceSampler(64)``.
        prefill: env steps (rows) taken with a random policy before training starts; at most the
            usable capacity ``S * (replay.capacity // S)`` of the ``S`` env streams.
        replay_ratio: gradient steps per env step (row): 0.5 acts 2 rows per batch.
        replay: the buffer (capacity, prioritized replay, memory mapping, saving with checkpoints).
        eval: the validation episodes.
        acting: how rows are made (in process, or actors and their options).
    """

    def __init__(
        self,
        env: EnvConfig = EnvConfig(),
        batch_size: int = 16,
        sampler: Sampler | None = None,
        prefill: int = 1000,
        replay_ratio: float = 0.5,
        replay: ReplaySettings = ReplaySettings(),
        eval: EvalSettings = EvalSettings(),
        acting: ActingSettings = ActingSettings(),
    ) -> None:
        if replay_ratio <= 0:
            raise ValueError(f"replay_ratio (gradient steps per env step) must be > 0, got {replay_ratio}")
        for name, value, least in (("prefill", prefill, 0), ("batch_size", batch_size, 1)):
            if value < least:
                raise ValueError(f"data.init_args.{name} must be >= {least}, got {value}")
        replay = as_settings(ReplaySettings, replay, "replay")
        acting = as_settings(ActingSettings, acting, "acting")
        if replay.storage_dir is not None:
            check_writable(replay.storage_dir, "replay storage_dir")
        batches = ReplayBatches(batch_size, sampler, prefill, replay_ratio, replay, acting.ratio_slack)
        super().__init__(env, eval, acting, batches, acting.chunk_length or REPLAY_CHUNK_LENGTH)
        streams = self.acting.num_streams
        usable = streams * (replay.capacity // streams)  # one ring of capacity // streams rows per stream
        if prefill > usable:
            split = f": {streams} env streams of {replay.capacity // streams} rows" if usable != replay.capacity else ""
            raise ValueError(
                f"prefill ({prefill} rows) exceeds the replay capacity ({usable} rows{split}): the buffer "
                "could never hold it and the random policy would act before every batch; raise "
                f"data.init_args.replay.capacity or lower prefill to at most {usable}"
            )
        self.batch_size, self.prefill, self.replay_ratio, self.replay = batch_size, prefill, replay_ratio, replay
        self.batches: ReplayBatches = batches

    @property
    def buffer(self) -> ReplayBuffer | None:
        """The replay buffer (built in ``setup``)."""
        return self.batches.buffer

    @buffer.setter
    def buffer(self, buffer: ReplayBuffer) -> None:
        self.batches.buffer = buffer

    @property
    def sampler(self) -> Sampler:
        """The sampler batches are drawn with (see the ``sampler`` argument)."""
        return self.batches.sampler

    @sampler.setter
    def sampler(self, sampler: Sampler) -> None:
        self.batches.sampler = sampler

    @property
    def collector(self) -> Collector | None:
        """The in-process acting's Collector (``None`` with actors or before ``setup``)."""
        return self.acting.collector if isinstance(self.acting, InProcessActing) else None

    def collect_for_batch(self) -> None:
        """Prefill if the buffer is short, then act (or take the actors' rows) for one batch."""
        self.batches.make_rows()

    def sample_batch(self) -> dict[str, Any]:
        """A batch from the buffer (real and imagined items after ``set_imagination``)."""
        return self.batches.sample()


class UnrollDataModule(OnlineDataModule):
    """Online data for on-policy-ish learners: batches of unrolls ``[B, T+1, ...]``.

    Each env's rows are cut into unrolls of ``T + 1`` rows overlapping by one (unroll ``k``
    holds rows ``kT .. kT+T``: the last row of one is the first of the next, so a learner can
    bootstrap from it), with every row-convention key, the agent's extras (e.g. behaviour
    ``logits``) and ``policy_version``. Batches are batch-major; V-trace and other pure math
    are time-major, so learners transpose. Acting in process, the module acts just before a
    batch needs unrolls (on-policy, deterministic); actors act with published weights
    (``policy_version`` says which).

    Imagination (Dyna): after ``set_imagination`` with a non-empty buffer, a batch holds
    ``max(1, round(real_ratio * batch_size))`` real unrolls and, for the rest, windows of ``T+1``
    consecutive imagined rows (which may span imagined episodes, as real unrolls span real
    ones); ``is_real [B]`` tells them apart. So a gradient step costs ``real_ratio`` times the
    env steps it costs without imagination.

    Args:
        env: the training environment.
        unroll_length: ``T``, steps per unroll (an unroll has ``T + 1`` rows); the actors' chunks.
        batch_size: unrolls per batch.
        replay: the optional small replay of unrolls (``capacity``, ``max_use``, priorities).
        model_replay: real rows kept for a world model trained beside the policy
            (``DynaLearner``): batches then carry ``"model"`` sequences, and imagined
            rollouts start from these rows.
        eval: the validation episodes (``eval.env``: e.g. the real env while ``env`` is a dream).
        acting: how rows are made (``chunk_length`` and ``ratio_slack`` do not apply).
    """

    def __init__(
        self,
        env: EnvConfig = EnvConfig(),
        unroll_length: int = 32,
        batch_size: int = 16,
        replay: UnrollReplaySettings = UnrollReplaySettings(),
        model_replay: ModelReplaySettings = ModelReplaySettings(),
        eval: EvalSettings = EvalSettings(),
        acting: ActingSettings = ActingSettings(),
    ) -> None:
        if unroll_length < 1:
            raise ValueError(f"unroll_length must be >= 1, got {unroll_length}")
        replay = as_settings(UnrollReplaySettings, replay, "replay")
        model_replay = as_settings(ModelReplaySettings, model_replay, "model_replay")
        acting = as_settings(ActingSettings, acting, "acting")
        for name in ("chunk_length", "ratio_slack"):
            if getattr(acting, name) is not None:
                raise ValueError(
                    f"acting.{name} does not apply to unrolls: the actors' chunks are the unrolls (unroll_length)"
                )
        if model_replay.capacity > 0 and acting.num_actors > 0:
            raise ValueError(
                "model_replay (real rows for a world model) works with acting in process only: set "
                "data.init_args.acting.num_actors: 0"
            )
        if 0 < model_replay.capacity < env.num_envs * model_replay.sequence_length:
            raise ValueError(
                f"model_replay.capacity ({model_replay.capacity}) must hold model_replay.sequence_length "
                f"({model_replay.sequence_length}) rows for each of the {env.num_envs} envs"
            )
        batches = UnrollBatches(unroll_length, batch_size, replay, model_replay, seed=env.seed)
        super().__init__(env, eval, acting, batches, unroll_length, overlap=True)
        self.unroll_length, self.batch_size = unroll_length, batch_size
        self.replay, self.model_replay = replay, model_replay
        self.batches: UnrollBatches = batches

    @property
    def batcher(self) -> UnrollBatcher:
        """The unrolls waiting to be batched (and the replay of them)."""
        return self.batches.batcher

    @property
    def model_buffer(self) -> ReplayBuffer | None:
        """The real rows kept for the world model (``model_replay.capacity > 0``, after ``setup``)."""
        return self.batches.model_buffer
