"""Tests for lightning_wm.data.episodes (EpisodeStore)."""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from lightning_wm.data.episodes import CorruptEpisodeError, EpisodeStore

torch.set_num_threads(1)


def make_episode(T: int, seed: int = 0, dict_obs: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, size=(T, 8, 8, 3), dtype=np.uint8)
    ep = {
        "obs": {"image": image, "state": rng.standard_normal((T, 4)).astype(np.float32)} if dict_obs else image,
        "reward": rng.standard_normal(T).astype(np.float32),
        "is_first": np.arange(T) == 0,
        "is_last": np.arange(T) == T - 1,
        "is_terminal": np.zeros(T, bool),
        "action": rng.integers(0, 4, size=T).astype(np.int64),
    }
    return ep


def assert_episode_equal(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for key in a:
        if isinstance(a[key], dict):
            assert_episode_equal(a[key], b[key])
        else:
            assert a[key].dtype == b[key].dtype, key
            np.testing.assert_array_equal(a[key], b[key])


def test_round_trip_order_and_total_steps(tmp_path):
    store = EpisodeStore(tmp_path / "eps")
    assert (tmp_path / "eps").is_dir() and len(store) == 0 and store.total_steps() == 0
    episodes = [make_episode(T, seed=i, dict_obs=i % 2 == 1) for i, T in enumerate([5, 12, 1, 7])]
    paths = [store.add(ep) for ep in episodes]
    assert store.paths() == paths  # sorted in recording order
    assert len(store) == 4 and store.total_steps() == 25
    assert paths[1].name.endswith("-T12.npz")
    for ep, path in zip(episodes, paths):
        assert_episode_equal(store.load(path), ep)
    for ep, loaded in zip(episodes, store.episodes()):
        assert_episode_equal(loaded, ep)
    # a reopened store keeps counting after the existing episodes
    again = EpisodeStore(tmp_path / "eps")
    new = again.add(make_episode(3))
    assert again.paths()[-1] == new and again.total_steps() == 28


def test_total_steps_reads_only_names(tmp_path, monkeypatch):
    store = EpisodeStore(tmp_path)
    store.add(make_episode(4))
    store.add(make_episode(6))
    monkeypatch.setattr(np, "load", lambda *a, **k: pytest.fail("total_steps loaded a file"))
    assert store.total_steps() == 10 and store.lengths() == [4, 6]


def test_atomic_write_leaves_no_temp_and_ignores_leftovers(tmp_path, monkeypatch):
    store = EpisodeStore(tmp_path)
    path = store.add(make_episode(5))
    assert os.listdir(tmp_path) == [path.name]
    # leftovers of a crashed writer are never listed
    (tmp_path / f".{path.name[:-4]}-x.npz.tmp").write_bytes(b"partial")
    (tmp_path / "20260101T000000-000099-abcd-T9.npz.tmp").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("hello")
    assert store.paths() == [path] and store.total_steps() == 5
    # a crash while writing leaves no file under a real name and no temp file
    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez_compressed", boom)
    before = set(os.listdir(tmp_path))
    with pytest.raises(OSError, match="disk full"):
        store.add(make_episode(3))
    assert set(os.listdir(tmp_path)) == before


def test_corrupt_file_raises_naming_it_and_skip_warns(tmp_path):
    store = EpisodeStore(tmp_path)
    good = store.add(make_episode(6, seed=1))
    bad = store.add(make_episode(9, seed=2))
    last = store.add(make_episode(4, seed=3))
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])  # truncated, e.g. by a crash of an older writer
    with pytest.raises(CorruptEpisodeError, match=bad.name) as info:
        store.load(bad)
    assert "delete" in str(info.value) and "re-record" in str(info.value)
    assert isinstance(info.value, ValueError)
    with pytest.warns(RuntimeWarning, match=bad.name):
        assert store.load(bad, skip_corrupt=True) is None
    with pytest.warns(RuntimeWarning, match=bad.name):
        lengths = [len(ep["reward"]) for ep in store.episodes(skip_corrupt=True)]
    assert lengths == [6, 4]
    with pytest.raises(CorruptEpisodeError, match=bad.name):
        list(store.episodes())
    assert good.exists() and last.exists()


def test_flipped_bytes_are_detected(tmp_path):
    store = EpisodeStore(tmp_path)
    path = store.add(make_episode(20, seed=4))
    data = bytearray(path.read_bytes())
    mid = len(data) // 3
    data[mid : mid + 64] = bytes(64)  # zero a chunk inside compressed member data
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptEpisodeError, match=path.name):
        store.load(path)


def test_length_mismatches(tmp_path):
    store = EpisodeStore(tmp_path)
    with pytest.raises(ValueError, match="differ in length"):
        store.add({"obs": np.zeros((5, 2)), "reward": np.zeros(4)})
    with pytest.raises(ValueError, match="empty"):
        store.add({})
    path = store.add(make_episode(5))
    renamed = path.with_name(path.name.replace("-T5.npz", "-T6.npz"))
    path.rename(renamed)
    with pytest.raises(CorruptEpisodeError, match="T=6"):
        store.load(renamed)
    odd = tmp_path / "odd.npz"
    np.savez_compressed(odd, obs=np.zeros((3, 2)), reward=np.zeros(2))
    with pytest.raises(CorruptEpisodeError, match="odd.npz"):
        store.load(odd)


def test_metadata_round_trip(tmp_path):
    store = EpisodeStore(tmp_path)
    assert store.read_metadata() == {}
    meta = {"env_id": "CartPole-v1", "obs_space": {"shape": [4], "dtype": "float32"}, "num_actions": 2}
    store.write_metadata(meta)
    assert store.read_metadata() == meta
    assert sorted(os.listdir(tmp_path)) == ["meta.json"]
    assert len(store) == 0  # metadata is not an episode
    (tmp_path / "meta.json").write_text("{broken")
    with pytest.raises(ValueError, match="meta.json"):
        store.read_metadata()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store.write_metadata(meta)
    assert store.read_metadata() == meta
