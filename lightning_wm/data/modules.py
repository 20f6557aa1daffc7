"""LightningDataModules.

* :class:`ReplayDataModule` — online RL (Dreamer, MuZero): owns a replay buffer and either a
  collector (its train stream interleaves acting with the current module and sampling) or actor
  processes that fill the buffer while the learner samples (``num_actors > 0``).
* :class:`UnrollDataModule` — unrolls of ``T+1`` rows straight to the learner (IMPALA).
* :class:`EpisodeDataModule` — offline: frames or sequences from an :class:`EpisodeStore`
  (World Models V and M); also where ``record`` writes.
"""

from __future__ import annotations

import math
import os
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_wm.data.collector import Collector, run_evaluation
from lightning_wm.data.episodes import CorruptEpisodeError, EpisodeStore, check_layout, row_layout
from lightning_wm.data.feeds import ActorLink, ReplayFeed, UnrollBatcher
from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.data.samplers import MixedSampler, RowSampler, Sampler, SequenceSampler
from lightning_wm.envs import EnvConfig, EnvSpec, env_spec, make_vector_env
from lightning_wm.io import check_writable
from lightning_wm.policies import RandomAgent
from lightning_wm.protocols import Agent, EnvStats, EvaluationRequest
from lightning_wm.seeding import derive_seed, env_seeds
from lightning_wm.tree import tree_map


def _rank_and_world(trainer: pl.Trainer | None) -> tuple[int, int]:
    if trainer is None:
        return 0, 1
    return trainer.global_rank, trainer.world_size


def _learner_version(trainer: pl.Trainer | None) -> int:
    """The learner's weight version: its optimizer steps so far (0 outside a Trainer)."""
    return int(trainer.global_step) if trainer is not None else 0


def evaluation_loader(evaluate: Callable[[Agent, int | None], list[dict[str, float]]]) -> DataLoader:
    """The validation loader of an online datamodule: ONE batch, an :class:`EvaluationRequest`
    around ``evaluate(agent, episodes)`` (the model's ``validation_step`` calls ``batch.run(self)``)."""
    return DataLoader([EvaluationRequest(evaluate)], batch_size=None, num_workers=0)


class _ReplayStream(IterableDataset):
    """Infinite stream: before each batch, act for the env steps the replay ratio calls for."""

    def __init__(self, datamodule: ReplayDataModule) -> None:
        self.datamodule = datamodule

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        dm = self.datamodule
        while True:
            dm.collect_for_batch()
            yield dm.sample_batch()


class ReplayDataModule(pl.LightningDataModule):
    """Online data: env -> Collector -> ReplayBuffer -> batches.

    Args:
        env: the training environment; its ``seed`` is the root of this module's seeds
            (:mod:`lightning_wm.seeding` roles ``train``, ``prefill``, ``replay``, ``eval``, per DDP rank).
        capacity: replay rows kept (all env streams together; each of the ``num_envs`` streams
            keeps ``capacity // num_envs``).
        batch_size: items (sequences, windows, rows) per batch.
        sampler: how batches are read from the buffer (:mod:`lightning_wm.data.samplers`):
            ``SequenceSampler`` (``[B, L, ...]``, the default), ``WindowSampler`` (K-step
            unrolls with n-step targets), ``RowSampler`` or ``TransitionSampler``; in YAML a
            ``class_path`` with ``init_args``.
        sequence_length, sample, cross_episodes: shorthand for the sampler, kept for existing
            configs: ``sample: sequences`` (default) is ``SequenceSampler(sequence_length
            [64], cross_episodes [true])``, ``sample: transitions`` is ``RowSampler()``
            (single rows ``[B, ...]``; ``sequence_length`` is ignored). Not together with ``sampler``.
        prefill: env steps (rows) taken with a random policy before training starts; at most the
            usable capacity ``num_envs * (capacity // num_envs)``.
        replay_ratio: gradient steps per env step (rows): 0.5 collects 2 rows per batch.
        prioritized, alpha, beta: proportional prioritized replay; the learner's
            ``training_step`` returns new priorities as ``{"loss": ..., "priority": [B]}``
            (written back by the ``ReplayFeedback`` callback).
        storage_dir: memory-map the buffer here (for buffers larger than RAM).
        save_buffer: the ``BufferCheckpoint`` callback saves the buffer beside every checkpoint
            so that ``fit --ckpt_path last`` resumes with the same contents.
        eval_episodes: episodes per validation, run in ``eval_envs`` separate envs.
        num_actors: 0 acts in this process inside the data fetch (deterministic); ``N`` runs N
            actor processes (``actor_backend: local``) or Ray actors (``ray``) that fill the
            buffer while the learner samples. The replay ratio is then a target enforced by
            throttling either side (:class:`~lightning_wm.data.feeds.ReplayFeed`): after ``b``
            batches ``prefill + b / replay_ratio`` rows are owed; the learner waits for rows while
            it has ``ratio_slack`` fewer, and leaves chunks in the (bounded) queue, so that actors
            block, while it has ``ratio_slack`` more. Rows still in the queue when a checkpoint is
            taken are not in it: a resumed run starts its actors afresh (new episodes).
        actor_backend: ``local`` (spawned processes) or ``ray`` (``pip install -e ".[ray]"``).
        ray_address: ``None`` starts a local Ray instance; ``auto`` or ``host:port`` joins a cluster.
        envs_per_actor: envs in each actor's vector env (default ``env.num_envs``); the buffer
            then has ``num_actors * envs_per_actor`` streams.
        chunk_length: env steps per chunk an actor sends (``chunk_length * envs_per_actor`` rows).
        publish_every: optimizer steps between the weight versions sent to the actors.
        actor_timeout_s: an actor silent this long is reported as hung.
        ratio_slack: rows of tolerance of the replay ratio (default: one chunk per actor).
    """

    def __init__(
        self,
        env: EnvConfig = EnvConfig(),
        capacity: int = 100_000,
        batch_size: int = 16,
        sampler: Sampler | None = None,
        sequence_length: int | None = None,
        sample: Literal["sequences", "transitions"] | None = None,
        cross_episodes: bool | None = None,
        prefill: int = 1000,
        replay_ratio: float = 0.5,
        prioritized: bool = False,
        alpha: float = 0.6,
        beta: float = 0.4,
        storage_dir: str | None = None,
        save_buffer: bool = False,
        eval_episodes: int = 5,
        eval_envs: int = 5,
        num_actors: int = 0,
        actor_backend: Literal["local", "ray"] = "local",
        ray_address: str | None = None,
        envs_per_actor: int | None = None,
        chunk_length: int = 64,
        publish_every: int = 1,
        actor_timeout_s: float = 60.0,
        ratio_slack: int | None = None,
    ) -> None:
        super().__init__()
        if replay_ratio <= 0:
            raise ValueError(f"replay_ratio (gradient steps per env step) must be > 0, got {replay_ratio}")
        for name, value, least in (
            ("prefill", prefill, 0),
            ("batch_size", batch_size, 1),
            ("sequence_length", sequence_length, 1),
            ("capacity", capacity, 1),
        ):
            if value is not None and value < least:
                raise ValueError(f"data.init_args.{name} must be >= {least}, got {value}")
        if storage_dir is not None:
            check_writable(storage_dir, "replay storage_dir")
        streams = env.num_envs
        usable = streams * (capacity // streams)  # one ring of capacity // num_envs rows per env stream
        if prefill > usable:
            split = f": {streams} env streams of {capacity // streams} rows" if usable != capacity else ""
            raise ValueError(
                f"prefill ({prefill} rows) exceeds the replay capacity ({usable} rows{split}): the buffer "
                "could never hold it and the random policy would act before every batch; raise "
                f"data.init_args.capacity or lower prefill to at most {usable}"
            )
        self.env = env
        self.spec: EnvSpec = env_spec(env)
        self.capacity, self.batch_size, self.prefill = capacity, batch_size, prefill
        self.sampler = self._sampler(sampler, sequence_length, sample, cross_episodes)
        self.replay_ratio, self.prioritized, self.alpha, self.beta = replay_ratio, prioritized, alpha, beta
        self.storage_dir, self.save_buffer = storage_dir, save_buffer
        self.eval_episodes, self.eval_envs = eval_episodes, eval_envs
        self.buffer: ReplayBuffer | None = None
        self.imagination: ReplayBuffer | None = None  # imagined rows (Dyna), see set_imagination
        self._mixer: MixedSampler | None = None
        self.collector: Collector | None = None
        self._credit = 0.0  # env rows owed to the replay ratio
        self._batches_collected = 0  # batches whose env steps have been taken
        self._collected_ahead = 0  # after a resume: batches whose env steps the checkpoint already holds
        self._pending_state: dict[str, Any] | None = None
        self._warned_priorities = False

        if num_actors < 0:
            raise ValueError(f"num_actors must be >= 0, got {num_actors}")
        self.num_actors, self.ratio_slack = num_actors, ratio_slack
        self._actors = (
            ActorLink(
                env,
                num_actors,
                envs_per_actor or env.num_envs,
                chunk_length,
                actor_backend,
                ray_address,
                actor_timeout_s,
                publish_every,
            )
            if num_actors > 0
            else None
        )
        self._feed: ReplayFeed | None = None
        self._actor_counts = (0, 0)  # (rows, batches) of the feed restored from a checkpoint

    @staticmethod
    def _sampler(
        sampler: Sampler | None, sequence_length: int | None, sample: str | None, cross_episodes: bool | None
    ) -> Sampler:
        """``sampler``, or the one the shorthand options describe."""
        shorthand = {
            k: v
            for k, v in (("sequence_length", sequence_length), ("sample", sample), ("cross_episodes", cross_episodes))
            if v is not None
        }
        if sampler is not None:
            if shorthand:
                raise ValueError(
                    f"data.init_args.sampler is given, so {sorted(shorthand)} must not be: set them in "
                    "the sampler's init_args instead"
                )
            return sampler
        if sample == "transitions":
            return RowSampler()
        return SequenceSampler(
            64 if sequence_length is None else sequence_length, True if cross_episodes is None else cross_episodes
        )

    # -- setup ------------------------------------------------------------------------
    def pop_env_stats(self) -> EnvStats:
        """Env steps so far and the episodes finished since the last call (:class:`EnvStatsSource`);
        with actors also their gauges (``actors/*``)."""
        if self._actors is not None:
            metrics = self._actors.metrics
            rows = self._feed.rows if self._feed is not None else self._actor_counts[0]
            return EnvStats(env_steps=rows, episodes=metrics.pop_episodes(), metrics=metrics.gauges())
        if self.collector is None:
            return EnvStats()
        stats = self.collector.stats
        return EnvStats(env_steps=stats.env_steps, episodes=stats.pop_finished())

    @property
    def env_steps(self) -> int:
        """This rank's env steps so far (:class:`~lightning_wm.protocols.EnvStepCounter`)."""
        if self._actors is not None:
            return self._feed.rows if self._feed is not None else self._actor_counts[0]
        return self.collector.stats.env_steps if self.collector is not None else 0

    def _seed(self, role: str) -> int:
        """This rank's seed for ``role`` (``lightning_wm.seeding``)."""
        rank, _ = _rank_and_world(getattr(self, "trainer", None))
        return derive_seed(self.env.seed, role, rank)

    def train_env_seeds(self) -> list[int]:
        """The first-reset seeds of this rank's training envs (one per env)."""
        rank, _ = _rank_and_world(getattr(self, "trainer", None))
        return env_seeds(self.env.seed, self.env.num_envs, "train", rank)

    def setup(self, stage: str) -> None:
        if self.buffer is not None:
            return
        storage = None
        if self.storage_dir is not None:
            rank, _ = _rank_and_world(getattr(self, "trainer", None))
            storage = os.path.join(self.storage_dir, f"rank{rank}")
        streams = self._actors.num_streams if self._actors is not None else self.env.num_envs
        self.buffer = ReplayBuffer(
            self.capacity,
            streams,
            prioritized=self.prioritized,
            alpha=self.alpha,
            beta=self.beta,
            storage_dir=storage,
            seed=self._seed("replay"),
            checkpoint=self.save_buffer,
        )
        if self._actors is None:
            self.collector = Collector(
                make_vector_env(self.env),
                RandomAgent(self.spec, seed=self._seed("prefill")),
                self.buffer,
                seeds=self.train_env_seeds(),
                spec=self.spec,
            )
        if self._pending_state is not None:
            self._restore(self._pending_state)
            self._pending_state = None

    def teardown(self, stage: str) -> None:
        if self.collector is not None:
            self.collector.env.close()
        self._stop_actors()

    def on_exception(self, exception: BaseException) -> None:
        """Stop the actors on Ctrl-C or an error (Lightning skips ``teardown`` then)."""
        self._stop_actors()

    def _stop_actors(self) -> None:
        if self._actors is not None:
            self._actors.close()
        if self._feed is not None:  # a later fit starts new actors and continues the counts
            self._actor_counts = (self._feed.rows, self._feed.batches)
            self._feed = None

    # -- actors -----------------------------------------------------------------------
    def publish_weights(self, module: Any, version: int) -> None:
        """:class:`~lightning_wm.protocols.WeightSink`: the first call starts the actors with
        ``module.acting_copy()``; later ones send a new version every ``publish_every`` steps."""
        if self._actors is None:
            return  # in-process acting uses the live module
        rank, _ = _rank_and_world(getattr(self, "trainer", None))
        owed = max(0, self.prefill - (len(self.buffer) if self.buffer is not None else 0))
        random_steps = math.ceil(owed / self._actors.num_streams)  # each actor's share of the random prefill
        self._actors.publish(module, version, rank=rank, random_steps=random_steps)
        if self._feed is None:
            assert self.buffer is not None, "setup() was not called"
            self._feed = ReplayFeed(
                self._actors.require_pool(),
                self.buffer,
                self.replay_ratio,
                self.prefill,
                self.ratio_slack,
                self._actors.metrics,
            )
            self._feed.rows, self._feed.batches = self._actor_counts

    # -- the stream -------------------------------------------------------------------
    def _agent(self) -> Any:
        trainer = getattr(self, "trainer", None)
        module = trainer.lightning_module if trainer is not None else None
        return module if module is not None else self.collector.agent

    def collect_for_batch(self) -> None:
        """Prefill with random actions if the buffer is short, then act for this batch's rows."""
        if self._actors is not None:
            if self._feed is None:
                self._actors.require_pool()
            self._feed.before_batch(_learner_version(getattr(self, "trainer", None)))
            return
        collector = self.collector
        assert collector is not None, "setup() was not called"
        if len(self.buffer) < self.prefill:  # a fresh run, or a resume without a saved buffer
            collector.set_agent(RandomAgent(self.spec, seed=self._seed("prefill")))
            collector.collect(math.ceil((self.prefill - len(self.buffer)) / collector.num_envs))
        if self._collected_ahead > 0:
            # Lightning fetches one batch ahead of the step it trains, so a checkpoint holds the env
            # steps of a batch that was never trained on; this batch is that one: do not act again
            self._collected_ahead -= 1
            return
        agent = self._agent()
        if collector.agent is not agent:
            collector.set_agent(agent)
        self._batches_collected += 1
        self._credit += 1.0 / self.replay_ratio
        steps = int(self._credit // collector.num_envs)
        if steps > 0:
            self._credit -= steps * collector.num_envs
            collector.collect(steps, explore=True)

    def sample_batch(self) -> dict[str, torch.Tensor]:
        """A batch from the replay buffer; after :meth:`set_imagination`, real and imagined items
        at ``real_ratio`` (with ``is_real [B]``)."""
        assert self.buffer is not None, "setup() was not called"
        if self._mixer is not None:
            return self._mixer.sample(self.buffer, self.imagination, self.batch_size)
        return self.sampler.sample(self.buffer, self.batch_size)

    # -- imagination (ImaginationHost) ----------------------------------------------------
    def real_buffer(self) -> ReplayBuffer:
        """The buffer of real rows (where imagined rollouts start)."""
        assert self.buffer is not None, "setup() was not called"
        return self.buffer

    def set_imagination(self, buffer: ReplayBuffer | None, real_ratio: float) -> None:
        """From now on draw ``round(real_ratio * batch_size)`` items of every batch from the
        real buffer and the rest from ``buffer`` (imagined rows, same keys), with this module's
        sampler, through :class:`~lightning_wm.data.samplers.MixedSampler`; all real while
        ``buffer`` is None or cannot give a sample."""
        self.imagination = buffer
        self._mixer = MixedSampler(self.sampler, real_ratio)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_ReplayStream(self), batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        return evaluation_loader(self.evaluate)

    test_dataloader = val_dataloader

    # -- evaluation -------------------------------------------------------------------
    def evaluate(self, agent: Any, episodes: int | None = None) -> list[dict[str, float]]:
        """Run ``episodes`` episodes with ``explore=False`` in fresh envs; return their stats."""
        return run_evaluation(
            self.env, agent, episodes or self.eval_episodes, self.eval_envs, self._seed("eval"), spec=self.spec
        )

    # -- feedback (FeedbackSink) and buffers (ReplayHolder) --------------------------------
    def replay_buffers(self) -> dict[str, ReplayBuffer]:
        """The buffers this datamodule holds, by name (``BufferCheckpoint`` saves those with
        ``checkpoint`` set, i.e. ``save_buffer: true``)."""
        buffers = {} if self.buffer is None else {"replay": self.buffer}
        if self.imagination is not None:
            buffers["imagination"] = self.imagination
        return buffers

    def apply_feedback(self, batch: dict[str, Any], feedback: dict[str, Any]) -> dict[str, int]:
        """Write a learner's feedback on ``batch`` back into the buffer.

        ``feedback["priority"]`` ``[B]``: new priorities of ``batch["index"]``;
        ``feedback["write"]``: ``{"index": [N], "generation": [N], "columns": {key: [N, ...]}}``
        (e.g. reanalysed targets of rows ``batch["row_index"][mask]``). Rows overwritten since
        the batch was sampled are skipped (generations); for a batch with ``is_real`` (mixed
        real/imagined) priorities go to the real rows only.

        Returns:
            ``{"applied": rows written, "stale": rows skipped as overwritten}``.
        """
        assert self.buffer is not None, "setup() was not called"
        applied = stale = 0
        priority = feedback.get("priority")
        if priority is not None and not self.buffer.prioritized:
            if not self._warned_priorities:
                warnings.warn(
                    "training_step returns priorities but the replay buffer is uniform "
                    "(data.init_args.prioritized: false); they are ignored",
                    stacklevel=2,
                )
                self._warned_priorities = True
        elif priority is not None:
            index, generation = batch["index"], batch["generation"]
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

    # -- checkpointing ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Acting progress (replay-ratio credit, batches collected, env statistics). The buffer
        itself is saved beside the checkpoint by ``BufferCheckpoint``."""
        trainer = getattr(self, "trainer", None)
        state: dict[str, Any] = {
            "credit": self._credit,
            "batches_collected": self._batches_collected,
            "global_step": int(getattr(trainer, "global_step", 0) or 0),
        }
        if self.collector is not None:
            state["stats"] = self.collector.stats.state_dict()
        if self._feed is not None:
            state["actor_rows"], state["actor_batches"] = self._feed.rows, self._feed.batches
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.buffer is None:
            self._pending_state = state  # restored in setup()
        else:
            self._restore(state)

    def _restore(self, state: dict[str, Any]) -> None:
        self._credit = float(state.get("credit", 0.0))
        self._batches_collected = int(state.get("batches_collected", 0))
        self._collected_ahead = max(0, self._batches_collected - int(state.get("global_step", self._batches_collected)))
        if "stats" in state and self.collector is not None:
            self.collector.stats.load_state_dict(state["stats"])
        if "actor_rows" in state:  # the rows actors had sent; chunks still queued then are lost
            self._actor_counts = (int(state["actor_rows"]), int(state["actor_batches"]))
        if "buffer" in state:  # a checkpoint from before BufferCheckpoint kept rank 0's buffer inline
            self.buffer.load_state_dict(state["buffer"])
            self.buffer.mark_episode_end()


# ---------------------------------------------------------------------------------------
# Offline data from an episode store
# ---------------------------------------------------------------------------------------


def split_episodes(paths: list[Path], val_fraction: float) -> tuple[list[Path], list[Path]]:
    """Deterministic train/val split by episode (a hash of the file name)."""
    if val_fraction <= 0 or len(paths) < 2:
        return list(paths), []
    val = [p for p in paths if (zlib.crc32(p.name.encode()) % 10_000) < val_fraction * 10_000]
    if not val:
        val = [paths[-1]]
    if len(val) == len(paths):
        val = val[:1]
    chosen = set(val)
    return [p for p in paths if p not in chosen], val


class _EpisodeStream(IterableDataset):
    """Batches from a list of episode files, sharded by DDP rank and DataLoader worker.

    ``frames``: random frames from a shuffle pool of episodes. ``sequences``: windows of
    ``sequence_length`` consecutive rows of the episodes laid end to end (``is_first`` marks
    the borders) or, with ``cross_episodes=False``, inside one episode.
    Every rank yields the same number of batches (``batches``), so DDP stays in step.
    """

    def __init__(
        self,
        store: EpisodeStore,
        paths: list[Path],
        mode: str,
        batch_size: int,
        sequence_length: int,
        batches: int,
        seed: int,
        shuffle: bool,
        rank: int,
        world: int,
        keys: list[str] | None,
        cross_episodes: bool,
        skip_corrupt: bool,
        pool_episodes: int,
    ) -> None:
        self.store, self.paths, self.mode = store, paths, mode
        self.batch_size, self.sequence_length, self.batches = batch_size, sequence_length, batches
        self.seed, self.shuffle, self.rank, self.world, self.keys = seed, shuffle, rank, world, keys
        self.cross_episodes, self.skip_corrupt, self.pool_episodes = cross_episodes, skip_corrupt, pool_episodes
        self.epoch = 0
        self._layout: dict[str, tuple[tuple[int, ...], str]] | None = None

    def _load(self, path: Path) -> dict[str, np.ndarray] | None:
        episode = self.store.load(path, skip_corrupt=self.skip_corrupt)
        if episode is not None and self.keys is not None:
            episode = {k: episode[k] for k in self.keys}
        if episode is None:
            return None
        if self._layout is None:  # the first episode read defines the rows every other one must have
            self._layout = row_layout(episode)
        try:
            check_layout(episode, self._layout, path)
        except CorruptEpisodeError as err:
            if not self.skip_corrupt:
                raise
            warnings.warn(f"skipping {err}", RuntimeWarning, stacklevel=2)
            return None
        return episode

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        shard = self.rank * workers + worker
        shards = self.world * workers
        rng = np.random.default_rng([self.seed, self.epoch, shard] if self.shuffle else [self.seed, shard])
        self.epoch += 1
        paths = self.paths[shard::shards] or self.paths  # tiny stores: every shard reads all
        count = self.batches // workers + (1 if worker < self.batches % workers else 0)
        pool: list[dict[str, np.ndarray]] = []
        order = list(rng.permutation(len(paths))) if self.shuffle else list(range(len(paths)))
        cursor = 0
        for _ in range(count):
            while len(pool) < min(self.pool_episodes, len(paths)):
                if cursor >= len(order):
                    order = list(rng.permutation(len(paths))) if self.shuffle else list(range(len(paths)))
                    cursor = 0
                episode = self._load(paths[order[cursor]])
                cursor += 1
                if episode is not None:
                    pool.append(episode)
            if not pool:
                raise RuntimeError("no readable episodes in this shard")
            yield self._batch(pool, rng)
            if self.shuffle and len(paths) > len(pool):
                pool.pop(int(rng.integers(len(pool))))  # rotate one episode out of the pool

    def _batch(self, pool: list[dict[str, np.ndarray]], rng: np.random.Generator) -> dict[str, torch.Tensor]:
        if self.mode == "frames":
            lengths = np.array([len(e["obs"]) for e in pool])
            which = rng.choice(len(pool), self.batch_size, p=lengths / lengths.sum())
            frames = np.stack([pool[i]["obs"][rng.integers(lengths[i])] for i in which])
            return {"obs": torch.from_numpy(frames)}
        length = self.sequence_length
        if self.cross_episodes:
            joined = {k: np.concatenate([e[k] for e in pool]) for k in pool[0]}
            total = len(joined["is_first"])
            if total < length:
                raise ValueError(f"sequence_length {length} exceeds the {total} rows available; record more episodes")
            starts = rng.integers(0, total - length + 1, self.batch_size)
            idx = starts[:, None] + np.arange(length)
            return {k: torch.from_numpy(v[idx]) for k, v in joined.items()}
        long = [e for e in pool if len(e["is_first"]) >= length]
        if not long:
            raise ValueError(f"no episode in the pool has sequence_length={length} rows; use cross_episodes=True")
        picks = rng.integers(0, len(long), self.batch_size)
        out: dict[str, list[np.ndarray]] = {k: [] for k in long[0]}
        for i in picks:
            start = rng.integers(0, len(long[i]["is_first"]) - length + 1)
            for k in out:
                out[k].append(long[i][k][start : start + length])
        return {k: torch.from_numpy(np.stack(v)) for k, v in out.items()}


class EpisodeDataModule(pl.LightningDataModule):
    """Frames or sequences from an episode store, split into train/val by episode.

    Args:
        directory: the episode store (``record`` writes here).
        mode: ``frames`` (``obs [B, H, W, C]``) or ``sequences`` (every key ``[B, L, ...]``).
        batch_size, sequence_length: batch shape.
        val_fraction: share of episodes held out for validation.
        keys: keys to load (all if None).
        train_batches: batches per training epoch (all ranks together); default: one pass
            over the stored rows (frames) or windows (sequences).
        val_batches: batches per validation.
        num_workers: DataLoader worker processes.
        env: environment the episodes come from; ``record`` rolls out here. Defaults to the
            one named in the store's metadata.
        cross_episodes: sequences may span episode borders (``is_first`` marks resets).
        skip_corrupt: warn about and skip unreadable episode files instead of failing.
        pool_episodes: episodes held in memory per worker for shuffling.
    """

    def __init__(
        self,
        directory: str = "episodes",
        mode: Literal["frames", "sequences"] = "frames",
        batch_size: int = 32,
        sequence_length: int = 32,
        val_fraction: float = 0.1,
        keys: list[str] | None = None,
        train_batches: int | None = None,
        val_batches: int = 4,
        num_workers: int = 0,
        seed: int = 0,
        env: EnvConfig | None = None,
        cross_episodes: bool = True,
        skip_corrupt: bool = False,
        pool_episodes: int = 64,
    ) -> None:
        super().__init__()
        self.directory, self.mode = directory, mode
        self.batch_size, self.sequence_length, self.val_fraction = batch_size, sequence_length, val_fraction
        self.keys, self.train_batches, self.val_batches = keys, train_batches, val_batches
        self.num_workers, self.seed, self.cross_episodes = num_workers, seed, cross_episodes
        self.skip_corrupt, self.pool_episodes = skip_corrupt, pool_episodes
        self.store = EpisodeStore(directory)
        if env is None:
            meta = self.store.read_metadata()
            if "env" in meta:
                env = EnvConfig(**{**meta["env"], "size": tuple(meta["env"].get("size", (64, 64)))})
        self.env = env
        self.spec: EnvSpec | None = env_spec(env) if env is not None else None

    def _stream(self, paths: list[Path], batches: int, shuffle: bool) -> DataLoader:
        rank, world = _rank_and_world(getattr(self, "trainer", None))
        ds = _EpisodeStream(
            self.store,
            paths,
            self.mode,
            self.batch_size,
            self.sequence_length,
            batches,
            derive_seed(self.seed, "episodes", rank),
            shuffle,
            rank,
            world,
            self.keys,
            self.cross_episodes,
            self.skip_corrupt,
            self.pool_episodes,
        )
        return DataLoader(ds, batch_size=None, num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def _split(self) -> tuple[list[Path], list[Path]]:
        paths = self.store.paths()
        if not paths:
            raise FileNotFoundError(
                f"episode store {self.directory!r} holds no episodes; fill it first with "
                f"`python main.py record --config <record.yaml>`"
            )
        return split_episodes(paths, self.val_fraction)

    def train_dataloader(self) -> DataLoader:
        train, _ = self._split()
        _, world = _rank_and_world(getattr(self, "trainer", None))
        batches = self.train_batches
        if batches is None:
            rows = self.store.total_steps() * (1 - self.val_fraction)
            per_batch = self.batch_size * (1 if self.mode == "frames" else self.sequence_length)
            batches = max(1, int(rows // per_batch))
        return self._stream(train, max(1, batches // world), shuffle=True)

    def val_dataloader(self) -> DataLoader:
        _, val = self._split()
        if not val:
            return []  # type: ignore[return-value]
        return self._stream(val, self.val_batches, shuffle=False)


# ---------------------------------------------------------------------------------------
# Unrolls straight to the learner (IMPALA)
# ---------------------------------------------------------------------------------------


class _UnrollStream(IterableDataset):
    """Infinite stream of unroll batches ``[B, T+1, ...]``."""

    def __init__(self, datamodule: UnrollDataModule) -> None:
        self.datamodule = datamodule

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.datamodule.next_batch()


class UnrollDataModule(pl.LightningDataModule):
    """Online data for on-policy-ish learners: batches of unrolls ``[B, T+1, ...]``.

    Each env's rows are cut into unrolls of ``T + 1`` rows overlapping by one (unroll ``k``
    holds rows ``kT .. kT+T``: the last row of one is the first of the next, so a learner can
    bootstrap from it), with every row-convention key, the agent's extras (e.g. behaviour
    ``logits``) and ``policy_version``. Batches are batch-major; V-trace and other pure math
    are time-major, so learners transpose.

    Args:
        env: the training environment.
        unroll_length: ``T``, steps per unroll (an unroll has ``T + 1`` rows).
        batch_size: unrolls per batch.
        num_actors: 0 acts in this process with the learner's module, just before a batch
            needs unrolls (on-policy, deterministic); ``N`` runs N actor processes (or Ray
            actors) that act with published weights (``policy_version`` says which).
        actor_backend, ray_address, envs_per_actor, publish_every, actor_timeout_s: as in
            :class:`ReplayDataModule`; ``envs_per_actor`` defaults to ``env.num_envs``.
        replay_size: 0 uses each unroll once, oldest first; ``> 0`` keeps the newest
            ``replay_size`` unrolls and draws each batch uniformly among those used fewer than
            ``max_use`` times.
        max_use: uses of an unroll at most (with replay).
        queue_size: chunks that may wait for the learner before the actors block (local
            backend; default 2 per actor). Fewer keep the policy lag lower when the learner is
            the slower side: each waiting chunk was made by older weights.
        prioritized: draw replayed unrolls in proportion to ``priority ** alpha`` (needs
            ``replay_size > 0``); batches then carry the importance weights ``weight [B]``
            (exponent ``beta``) and the learner's ``"priority"`` outputs come back through
            :meth:`apply_feedback` (the ``ReplayFeedback`` callback).
        alpha, beta: prioritization and importance-weight exponents.
        eval_episodes, eval_envs: validation episodes and their envs.
        eval_env: play the validation (and ``evaluate``) episodes in this env instead of ``env``,
            e.g. the real ``CartPole-v1`` while ``env`` is a dream (``lightning_wm/Dream-v0``).
            Its action space and observation shape must be ``env``'s.
        model_replay_size: > 0 also keeps the newest real rows (all envs together) in a
            :class:`~lightning_wm.data.replay.ReplayBuffer` for a world model trained beside the
            policy (``DynaLearner``): every batch then carries ``"model"``, sequences
            ``[model_batch_size, model_sequence_length, ...]`` of it (once it holds that many
            rows per env), and it is where imagined rollouts start (``ImaginationHost``). Acting
            in process only (``num_actors: 0``).
        model_batch_size, model_sequence_length: the shape of the ``"model"`` sequences.

    Imagination (Dyna): after :meth:`set_imagination` with a non-empty buffer, a batch holds
    ``max(1, round(real_ratio * batch_size))`` real unrolls and, for the rest, windows of ``T+1``
    consecutive imagined rows (which may span imagined episodes, as real unrolls span real
    ones); ``is_real [B]`` tells them apart. So a gradient step costs ``real_ratio`` times the
    env steps it costs without imagination.
    """

    def __init__(
        self,
        env: EnvConfig = EnvConfig(),
        unroll_length: int = 32,
        batch_size: int = 16,
        num_actors: int = 0,
        actor_backend: Literal["local", "ray"] = "local",
        ray_address: str | None = None,
        envs_per_actor: int | None = None,
        publish_every: int = 1,
        actor_timeout_s: float = 60.0,
        queue_size: int | None = None,
        replay_size: int = 0,
        max_use: int = 1,
        prioritized: bool = False,
        alpha: float = 0.6,
        beta: float = 0.4,
        eval_episodes: int = 5,
        eval_envs: int = 5,
        eval_env: EnvConfig | None = None,
        model_replay_size: int = 0,
        model_batch_size: int = 16,
        model_sequence_length: int = 32,
    ) -> None:
        super().__init__()
        if unroll_length < 1:
            raise ValueError(f"unroll_length must be >= 1, got {unroll_length}")
        if num_actors < 0:
            raise ValueError(f"num_actors must be >= 0, got {num_actors}")
        if model_replay_size < 0 or model_batch_size < 1 or model_sequence_length < 1:
            raise ValueError(
                "model_replay_size must be >= 0, model_batch_size and model_sequence_length >= 1, got "
                f"{model_replay_size}, {model_batch_size}, {model_sequence_length}"
            )
        if model_replay_size > 0 and num_actors > 0:
            raise ValueError(
                "model_replay_size (real rows for a world model) works with acting in process only: set "
                "data.init_args.num_actors: 0"
            )
        if model_replay_size and model_replay_size < env.num_envs * model_sequence_length:
            raise ValueError(
                f"model_replay_size ({model_replay_size}) must hold model_sequence_length "
                f"({model_sequence_length}) rows for each of the {env.num_envs} envs"
            )
        self.model_replay_size = model_replay_size
        self.model_sampler = SequenceSampler(model_sequence_length)
        self.model_batch_size = model_batch_size
        self.model_buffer: ReplayBuffer | None = None
        self.imagination: ReplayBuffer | None = None
        self.real_ratio = 1.0
        self.env = env
        self.spec: EnvSpec = env_spec(env)
        self.unroll_length, self.batch_size, self.num_actors = unroll_length, batch_size, num_actors
        self.replay_size, self.max_use = replay_size, max_use
        self.eval_episodes, self.eval_envs = eval_episodes, eval_envs
        self.eval_env = eval_env
        if eval_env is not None:
            other = env_spec(eval_env)
            if other.action_space != self.spec.action_space or other.obs_shape != self.spec.obs_shape:
                raise ValueError(
                    f"eval_env {eval_env.id} (actions {other.action_space}, observations {other.obs_shape}) "
                    f"does not fit env {env.id} (actions {self.spec.action_space}, observations "
                    f"{self.spec.obs_shape}): the policy trained in one must act in the other"
                )
        self.batcher = UnrollBatcher(
            batch_size, replay_size, max_use, seed=env.seed, prioritized=prioritized, alpha=alpha, beta=beta
        )
        self._actors = (
            ActorLink(
                env,
                num_actors,
                envs_per_actor or env.num_envs,
                unroll_length,
                actor_backend,
                ray_address,
                actor_timeout_s,
                publish_every,
                overlap=True,
                queue_size=queue_size,
            )
            if num_actors > 0
            else None
        )
        self.collector: Collector | None = None
        self._actor_steps = 0  # env steps the actors' chunks brought

    def setup(self, stage: str) -> None:
        if self._actors is None and self.collector is None:
            rank, _ = _rank_and_world(getattr(self, "trainer", None))
            # acts with the learner's module (set at the first batch); seeds as ReplayDataModule's envs
            if self.model_replay_size > 0:
                self.model_buffer = ReplayBuffer(
                    self.model_replay_size,
                    self.env.num_envs,
                    checkpoint=False,
                    seed=derive_seed(self.env.seed, "replay", rank),
                )
            self.collector = Collector(
                make_vector_env(self.env),
                RandomAgent(self.spec, seed=0),
                self.model_buffer,
                seeds=env_seeds(self.env.seed, self.env.num_envs, "train", rank),
                spec=self.spec,
            )

    def teardown(self, stage: str) -> None:
        if self.collector is not None:
            self.collector.env.close()
            self.collector = None
        if self._actors is not None:
            self._actors.close()

    def on_exception(self, exception: BaseException) -> None:
        if self._actors is not None:
            self._actors.close()

    def publish_weights(self, module: Any, version: int) -> None:
        """:class:`~lightning_wm.protocols.WeightSink`: the first call starts the actors."""
        if self._actors is not None:
            rank, _ = _rank_and_world(getattr(self, "trainer", None))
            self._actors.publish(module, version, rank=rank)

    def apply_feedback(self, batch: dict, feedback: dict) -> dict[str, int]:
        """:class:`~lightning_wm.protocols.FeedbackSink`: the learner's ``"priority" [B]`` for the
        unrolls ``batch["index"]``; unrolls that left the replay since are skipped. Returns
        ``{"applied", "stale"}`` counts."""
        if "priority" not in feedback:
            return {"applied": 0, "stale": 0}
        if not self.batcher.prioritized:
            raise ValueError(
                "the learner returns priorities but the unroll replay is not prioritized: set "
                "data.init_args.prioritized: true (and replay_size > 0), or the model's priority: false"
            )
        priority = feedback["priority"]
        priority = priority.detach().cpu().numpy() if isinstance(priority, torch.Tensor) else priority
        return self.batcher.update_priorities(batch["index"].cpu().numpy(), priority)

    @property
    def env_steps(self) -> int:
        """This rank's env steps so far (:class:`~lightning_wm.protocols.EnvStepCounter`)."""
        if self._actors is not None:
            return self._actor_steps
        return self.collector.stats.env_steps if self.collector is not None else 0

    def pop_env_stats(self) -> EnvStats:
        """:class:`~lightning_wm.protocols.EnvStatsSource`: env steps, finished episodes, actor gauges."""
        if self._actors is not None:
            metrics = self._actors.metrics
            return EnvStats(env_steps=self._actor_steps, episodes=metrics.pop_episodes(), metrics=metrics.gauges())
        if self.collector is None:
            return EnvStats()
        return EnvStats(env_steps=self.collector.stats.env_steps, episodes=self.collector.stats.pop_finished())

    def _learner(self) -> tuple[Any, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is None or trainer.lightning_module is None:
            raise RuntimeError("UnrollDataModule acts with the module being trained; use it inside Trainer.fit")
        return trainer.lightning_module, int(trainer.global_step)

    def next_batch(self) -> dict[str, torch.Tensor]:
        """Unrolls for one batch: acted in process, or taken from the actors (waiting if needed)."""
        if self._actors is None:
            collector = self.collector
            assert collector is not None, "setup() was not called"
            module, version = self._learner()
            if collector.agent is not module:
                collector.set_agent(module)
            imagined = self._imagination_ready()
            self.batcher.batch_size = max(1, round(self.real_ratio * self.batch_size)) if imagined else self.batch_size
            while not self.batcher.ready():
                collector.policy_version = version
                self.batcher.add(collector.collect_chunk(self.unroll_length, explore=True, overlap=True))
            return self._with_model_data(self._mix(self.batcher.batch(), imagined))
        pool = self._actors.require_pool()
        pool.check()
        metrics, version = self._actors.metrics, _learner_version(getattr(self, "trainer", None))
        # wait while the batch lacks unrolls; with replay also take (without waiting) up to one
        # chunk per actor, so fresh unrolls keep coming while old ones are reused
        taken, waited = 0, 0.0
        while not self.batcher.ready() or (self.replay_size > 0 and taken < pool.num_actors):
            start = time.monotonic()
            chunk = pool.get(timeout=0.5 if not self.batcher.ready() else 0.0)
            if not self.batcher.ready():
                waited += time.monotonic() - start
            if chunk is None:
                if self.batcher.ready():
                    break
                continue
            self.batcher.add(chunk.rows)
            self._actor_steps += chunk.env_steps
            metrics.chunk(chunk, version)
            taken += 1
        metrics.queue_depth = pool.qsize()
        metrics.waited(waited)
        return self.batcher.batch()

    # -- a world model beside the policy, imagination (ImaginationHost) ----------------------
    def real_buffer(self) -> ReplayBuffer:
        """The real rows kept for the world model (``model_replay_size``): where imagination starts."""
        if self.model_buffer is None:
            raise ValueError(
                "imagination starts from real rows: set data.init_args.model_replay_size > 0 (and num_actors: 0)"
            )
        return self.model_buffer

    def set_imagination(self, buffer: ReplayBuffer | None, real_ratio: float) -> None:
        """Mix imagined unrolls from ``buffer`` into the batches at ``real_ratio`` (see the class docstring)."""
        if not 0.0 <= real_ratio <= 1.0:
            raise ValueError(f"real_ratio must be in [0, 1], got {real_ratio}")
        if buffer is not None and self.batcher.prioritized:
            raise ValueError("imagined unrolls have no priorities: use data.init_args.prioritized: false with Dyna")
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
            batch["model"] = self.model_sampler.sample(self.model_buffer, self.model_batch_size)
        return batch

    def replay_buffers(self) -> dict[str, ReplayBuffer]:
        """:class:`~lightning_wm.protocols.ReplayHolder`: the world model's real rows and the
        imagination (neither is checkpointed)."""
        return {k: v for k, v in (("model", self.model_buffer), ("imagination", self.imagination)) if v is not None}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_UnrollStream(self), batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        return evaluation_loader(self.evaluate)

    test_dataloader = val_dataloader

    def evaluate(self, agent: Any, episodes: int | None = None) -> list[dict[str, float]]:
        """Run ``episodes`` episodes with ``explore=False`` in fresh envs; return their stats."""
        rank, _ = _rank_and_world(getattr(self, "trainer", None))
        config = self.eval_env or self.env
        seed = derive_seed(config.seed, "eval", rank)
        return run_evaluation(
            config,
            agent,
            episodes or self.eval_episodes,
            self.eval_envs,
            seed,
            spec=self.spec if self.eval_env is None else env_spec(config),
        )
