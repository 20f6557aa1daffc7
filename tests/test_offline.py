"""EpisodeDataModule: the offline episode streams (frames, sequences), split and sharded by episode."""

import numpy as np
import pytest
import torch

from lightning_wm.data.episodes import EpisodeStore
from lightning_wm.data.offline import EpisodeDataModule, _EpisodeStream, split_episodes


def fill_store(directory, lengths, frame=(8, 8, 3)):
    store = EpisodeStore(directory)
    for e, n in enumerate(lengths):
        rows = n + 1
        store.add(
            {
                "obs": np.full((rows, *frame), e, np.uint8),
                "step": np.arange(rows, dtype=np.int64),
                "episode": np.full(rows, e, np.int64),
                "reward": np.ones(rows, np.float32),
                "is_first": np.arange(rows) == 0,
                "is_last": np.arange(rows) == rows - 1,
                "is_terminal": np.arange(rows) == rows - 1,
            }
        )
    return store


def test_split_is_by_episode_and_deterministic(tmp_path):
    store = fill_store(tmp_path / "s", [5] * 20)
    train, val = split_episodes(store.paths(), 0.2)
    assert val and train and not set(train) & set(val)
    assert split_episodes(store.paths(), 0.2) == (train, val)


def test_frames_mode_batches(tmp_path):
    fill_store(tmp_path / "s", [9] * 10)
    dm = EpisodeDataModule(str(tmp_path / "s"), mode="frames", batch_size=6, val_fraction=0.2)
    batches = list(dm.train_dataloader())
    # one pass over the training rows: 10 episodes * 10 rows * 0.8 / 6 per batch
    assert len(batches) == int(10 * 10 * 0.8 // 6)
    assert batches[0]["obs"].shape == (6, 8, 8, 3) and batches[0]["obs"].dtype == torch.uint8
    val_ids = {int(b["obs"][i, 0, 0, 0]) for b in dm.val_dataloader() for i in range(6)}
    train_ids = {int(b["obs"][i, 0, 0, 0]) for b in batches for i in range(6)}
    assert val_ids and not val_ids & train_ids, "validation frames leak into training"


@pytest.mark.parametrize("cross", [True, False])
def test_sequence_windows_are_consecutive(tmp_path, cross):
    fill_store(tmp_path / "s", [3, 12, 4, 15, 2, 11])
    dm = EpisodeDataModule(
        str(tmp_path / "s"),
        mode="sequences",
        batch_size=8,
        sequence_length=6,
        val_fraction=0.0,
        cross_episodes=cross,
        train_batches=5,
    )
    for batch in dm.train_dataloader():
        assert batch["step"].shape == (8, 6)
        for b in range(8):
            steps, first = batch["step"][b], batch["is_first"][b]
            for t in range(1, 6):
                # consecutive within an episode; a border is marked by is_first
                assert bool(first[t]) == (steps[t] == 0)
                if not first[t]:
                    assert steps[t] == steps[t - 1] + 1 and batch["episode"][b, t] == batch["episode"][b, t - 1]
            if not cross:
                assert not first[1:].any()


def test_shards_split_episodes_across_ranks(tmp_path):
    store = fill_store(tmp_path / "s", [4] * 8)
    seen = []
    for rank in range(2):
        ds = _EpisodeStream(
            store,
            store.paths(),
            "sequences",
            4,
            3,
            batches=6,
            seed=0,
            shuffle=True,
            rank=rank,
            world=2,
            keys=None,
            cross_episodes=True,
            skip_corrupt=False,
            pool_episodes=64,
        )
        batches = list(ds)
        assert len(batches) == 6, "every rank yields the same number of batches"
        seen.append({int(e) for b in batches for e in b["episode"].flatten()})
    assert not seen[0] & seen[1]


def test_empty_store_tells_what_to_do(tmp_path):
    dm = EpisodeDataModule(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="record"):
        dm.train_dataloader()


def test_corrupt_episode_is_named_or_skipped(tmp_path):
    store = fill_store(tmp_path / "s", [5] * 4)
    bad = store.paths()[1]
    bad.write_bytes(bad.read_bytes()[:50])
    dm = EpisodeDataModule(str(tmp_path / "s"), mode="frames", batch_size=4, val_fraction=0.0, train_batches=4)
    with pytest.raises(ValueError, match=bad.name):
        list(dm.train_dataloader())
    dm = EpisodeDataModule(
        str(tmp_path / "s"), mode="frames", batch_size=4, val_fraction=0.0, train_batches=4, skip_corrupt=True
    )
    with pytest.warns(RuntimeWarning, match=bad.name):
        assert len(list(dm.train_dataloader())) == 4
