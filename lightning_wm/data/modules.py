"""LightningDataModules.

* :class:`ReplayDataModule` — online RL (Dreamer, MuZero): owns a vector env, a replay buffer
  and a collector; its train stream interleaves acting with the current module and sampling.
* :class:`EpisodeDataModule` — offline: frames or sequences from an :class:`EpisodeStore`
  (World Models V and M); also where ``record`` writes.
"""

from __future__ import annotations

import math
import os
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_wm.data.collector import Collector, RandomAgent, run_evaluation
from lightning_wm.data.episodes import EpisodeStore
from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.envs import EnvConfig, EnvSpec, env_spec, make_vector_env
from lightning_wm.protocols import Agent, EnvStats, EvaluationRequest


def _rank_and_world(trainer: pl.Trainer | None) -> tuple[int, int]:
    if trainer is None:
        return 0, 1
    return trainer.global_rank, trainer.world_size


def evaluation_loader(evaluate: Callable[[Agent, int | None], list[dict[str, float]]]) -> DataLoader:
    """The validation loader of an online datamodule: ONE batch, an :class:`EvaluationRequest`
    around ``evaluate(agent, episodes)`` (the model's ``validation_step`` calls ``batch.run(self)``)."""
    return DataLoader([EvaluationRequest(evaluate)], batch_size=None, num_workers=0)


class _ReplayStream(IterableDataset):
    """Infinite stream: before each batch, act for the env steps the replay ratio calls for."""

    def __init__(self, datamodule: "ReplayDataModule") -> None:
        self.datamodule = datamodule

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        dm = self.datamodule
        while True:
            dm.collect_for_batch()
            yield dm.sample_batch()


class ReplayDataModule(pl.LightningDataModule):
    """Online data: env -> Collector -> ReplayBuffer -> batches.

    Args:
        env: the training environment (``env.seed + 1000 * global_rank`` per DDP rank).
        capacity: replay rows kept (all env streams together).
        batch_size: sequences (or transitions) per batch.
        sequence_length: rows per sequence; 1 with ``sample="transitions"``.
        sample: ``sequences`` (``[B, L, ...]``) or ``transitions`` (``[B, ...]``).
        cross_episodes: sequences may cross episode borders (``is_first`` marks resets).
        prefill: env steps (rows) taken with a random policy before training starts.
        replay_ratio: gradient steps per env step (rows): 0.5 collects 2 rows per batch.
        prioritized, alpha, beta: proportional prioritized replay.
        storage_dir: memory-map the buffer here (for buffers larger than RAM).
        save_buffer: put the buffer into checkpoints so ``fit --ckpt_path last`` resumes
            with the same contents.
        eval_episodes: episodes per validation, run in ``eval_envs`` separate envs.
    """

    def __init__(
        self,
        env: EnvConfig = EnvConfig(),
        capacity: int = 100_000,
        batch_size: int = 16,
        sequence_length: int = 64,
        sample: Literal["sequences", "transitions"] = "sequences",
        cross_episodes: bool = True,
        prefill: int = 1000,
        replay_ratio: float = 0.5,
        prioritized: bool = False,
        alpha: float = 0.6,
        beta: float = 0.4,
        storage_dir: str | None = None,
        save_buffer: bool = False,
        eval_episodes: int = 5,
        eval_envs: int = 5,
    ) -> None:
        super().__init__()
        if replay_ratio <= 0:
            raise ValueError(f"replay_ratio (gradient steps per env step) must be > 0, got {replay_ratio}")
        if prefill > capacity:
            raise ValueError(f"prefill ({prefill} rows) exceeds the replay capacity ({capacity} rows): the buffer "
                             "could never hold it; raise data.init_args.capacity or lower prefill")
        self.env = env
        self.spec: EnvSpec = env_spec(env)
        self.capacity, self.batch_size, self.sequence_length = capacity, batch_size, sequence_length
        self.sample, self.cross_episodes, self.prefill = sample, cross_episodes, prefill
        self.replay_ratio, self.prioritized, self.alpha, self.beta = replay_ratio, prioritized, alpha, beta
        self.storage_dir, self.save_buffer = storage_dir, save_buffer
        self.eval_episodes, self.eval_envs = eval_episodes, eval_envs
        self.buffer: ReplayBuffer | None = None
        self.collector: Collector | None = None
        self._credit = 0.0  # env rows owed to the replay ratio
        self._batches_collected = 0  # batches whose env steps have been taken
        self._collected_ahead = 0  # after a resume: batches whose env steps the checkpoint already holds
        self._pending_state: dict[str, Any] | None = None

    # -- setup ------------------------------------------------------------------------
    def pop_env_stats(self) -> EnvStats:
        """Env steps so far and the episodes finished since the last call (:class:`EnvStatsSource`)."""
        if self.collector is None:
            return EnvStats()
        stats = self.collector.stats
        return EnvStats(env_steps=stats.env_steps, episodes=stats.pop_finished())

    def _rank_env(self, offset: int = 0) -> EnvConfig:
        rank, _ = _rank_and_world(getattr(self, "trainer", None))
        cfg = EnvConfig(**{**vars(self.env)})
        cfg.seed = self.env.seed + 1000 * rank + offset
        return cfg

    def setup(self, stage: str) -> None:
        if self.buffer is not None:
            return
        cfg = self._rank_env()
        storage = None
        if self.storage_dir is not None:
            rank, _ = _rank_and_world(getattr(self, "trainer", None))
            storage = os.path.join(self.storage_dir, f"rank{rank}")
        self.buffer = ReplayBuffer(
            self.capacity, cfg.num_envs, prioritized=self.prioritized, alpha=self.alpha, beta=self.beta,
            storage_dir=storage, seed=cfg.seed,
        )
        self.collector = Collector(make_vector_env(cfg), RandomAgent(self.spec, seed=cfg.seed), self.buffer,
                                   seed=cfg.seed, spec=self.spec)
        if self._pending_state is not None:
            self._restore(self._pending_state)
            self._pending_state = None

    def teardown(self, stage: str) -> None:
        if self.collector is not None:
            self.collector.env.close()

    # -- the stream -------------------------------------------------------------------
    def _agent(self) -> Any:
        trainer = getattr(self, "trainer", None)
        module = trainer.lightning_module if trainer is not None else None
        return module if module is not None else self.collector.agent

    def collect_for_batch(self) -> None:
        """Prefill with random actions if the buffer is short, then act for this batch's rows."""
        collector = self.collector
        assert collector is not None, "setup() was not called"
        if len(self.buffer) < self.prefill:  # a fresh run, or a resume without a saved buffer
            collector.set_agent(RandomAgent(self.spec, seed=self._rank_env().seed))
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
        assert self.buffer is not None
        if self.sample == "transitions":
            return self.buffer.sample(self.batch_size)
        return self.buffer.sample_sequences(self.batch_size, self.sequence_length, self.cross_episodes)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_ReplayStream(self), batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        return evaluation_loader(self.evaluate)

    test_dataloader = val_dataloader

    # -- evaluation -------------------------------------------------------------------
    def evaluate(self, agent: Any, episodes: int | None = None) -> list[dict[str, float]]:
        """Run ``episodes`` episodes with ``explore=False`` in fresh envs; return their stats."""
        cfg = self._rank_env(offset=500_000)
        return run_evaluation(cfg, agent, episodes or self.eval_episodes, self.eval_envs, cfg.seed, spec=self.spec)

    # -- checkpointing ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        trainer = getattr(self, "trainer", None)
        state: dict[str, Any] = {"credit": self._credit, "batches_collected": self._batches_collected,
                                 "global_step": int(getattr(trainer, "global_step", 0) or 0)}
        if self.collector is not None:
            state["stats"] = self.collector.stats.state_dict()
        if self.save_buffer and self.buffer is not None:
            rank, _ = _rank_and_world(trainer)
            step = state["global_step"]
            state["buffer_step"] = step
            if rank == 0:
                state["buffer"] = self.buffer.state_dict()
            else:  # Lightning saves the datamodule state of rank 0 only: other ranks keep side files
                torch.save(self.buffer.state_dict(), self._side_file(rank, step))
                self._prune_side_files(rank, keep=self.keep_side_files)
        return state

    keep_side_files = 2  # the newest side files per rank (the last checkpoint and the one before)

    def _side_dir(self) -> str:
        directory = getattr(getattr(self, "trainer", None), "checkpoint_dir", None) or "."
        os.makedirs(directory, exist_ok=True)
        return directory

    def _side_file(self, rank: int, step: int) -> str:
        """The buffer of DDP rank ``rank > 0`` as of global step ``step`` (a checkpoint of that step
        names the step in ``buffer_step``, so resuming an older checkpoint finds the matching file)."""
        return os.path.join(self._side_dir(), f"replay_rank{rank}_step{step}.pt")

    def _prune_side_files(self, rank: int, keep: int) -> None:
        prefix, directory = f"replay_rank{rank}_step", self._side_dir()
        files = [f for f in os.listdir(directory) if f.startswith(prefix) and f.endswith(".pt")]
        files.sort(key=lambda f: int(f[len(prefix):-3]))
        for f in files[:-keep]:
            os.remove(os.path.join(directory, f))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.collector is None:
            self._pending_state = state  # restored in setup()
        else:
            self._restore(state)

    def _restore(self, state: dict[str, Any]) -> None:
        self._credit = float(state.get("credit", 0.0))
        self._batches_collected = int(state.get("batches_collected", 0))
        self._collected_ahead = max(0, self._batches_collected - int(state.get("global_step", self._batches_collected)))
        if "stats" in state:
            self.collector.stats.load_state_dict(state["stats"])
        rank, _ = _rank_and_world(getattr(self, "trainer", None))
        if rank == 0 and "buffer" in state:
            self.buffer.load_state_dict(state["buffer"])
        elif rank > 0 and self.save_buffer and "buffer_step" in state:
            path = self._side_file(rank, int(state["buffer_step"]))
            if os.path.isfile(path):
                self.buffer.load_state_dict(torch.load(path, weights_only=True))
            else:
                warnings.warn(f"rank {rank}: no replay side file {path} for this checkpoint's step; this rank "
                              "starts with an empty buffer and prefills again", stacklevel=2)


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
        self, store: EpisodeStore, paths: list[Path], mode: str, batch_size: int, sequence_length: int,
        batches: int, seed: int, shuffle: bool, rank: int, world: int, keys: list[str] | None,
        cross_episodes: bool, skip_corrupt: bool, pool_episodes: int,
    ) -> None:
        self.store, self.paths, self.mode = store, paths, mode
        self.batch_size, self.sequence_length, self.batches = batch_size, sequence_length, batches
        self.seed, self.shuffle, self.rank, self.world, self.keys = seed, shuffle, rank, world, keys
        self.cross_episodes, self.skip_corrupt, self.pool_episodes = cross_episodes, skip_corrupt, pool_episodes
        self.epoch = 0

    def _load(self, path: Path) -> dict[str, np.ndarray] | None:
        episode = self.store.load(path, skip_corrupt=self.skip_corrupt)
        if episode is not None and self.keys is not None:
            episode = {k: episode[k] for k in self.keys}
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
            self.store, paths, self.mode, self.batch_size, self.sequence_length, batches, self.seed + 1000 * rank,
            shuffle, rank, world, self.keys, self.cross_episodes, self.skip_corrupt, self.pool_episodes,
        )
        return DataLoader(ds, batch_size=None, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)

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
