"""Offline data: :class:`EpisodeDataModule`, frames or sequences from an
:class:`~lightning_wm.data.episodes.EpisodeStore` (World Models V and M); also where ``record`` writes."""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_wm.data.episodes import CorruptEpisodeError, EpisodeStore, check_layout, row_layout
from lightning_wm.data.ranks import rank_and_world
from lightning_wm.envs import EnvConfig, EnvSpec, env_spec
from lightning_wm.seeding import derive_seed
from lightning_wm.signals import check_stop_between_batches

__all__ = ["EpisodeDataModule", "split_episodes"]


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
            check_stop_between_batches()  # a scheduler's stop: end after the step before
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
        rank, world = rank_and_world(self)
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
        _, world = rank_and_world(self)
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
