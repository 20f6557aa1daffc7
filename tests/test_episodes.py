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


# -- reliability: concurrent writers, stale temps, mixed stores, messages ---------------------------


def _rewrite_metadata(directory: str, n: int) -> None:
    store = EpisodeStore(directory)
    for i in range(n):
        store.write_metadata({"env": {"id": "CartPole-v1"}, "writer": os.getpid(), "i": i})


@pytest.mark.slow  # worker processes
def test_two_processes_writing_metadata_do_not_collide(tmp_path):
    """Both used the fixed temp name ``.meta.json.tmp``: one renamed the other's file away."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rewrite_metadata, args=(str(tmp_path), 300)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert EpisodeStore(tmp_path).read_metadata()["i"] == 299
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_stale_temp_files_of_killed_writers_are_removed_on_open(tmp_path):
    stale, fresh = tmp_path / ".20250101T000000-000001-ab-T5.npz.1-aa.tmp", tmp_path / ".x.npz.2-bb.tmp"
    stale.write_bytes(b"half an episode")
    fresh.write_bytes(b"a live writer's file")
    old = stale.stat().st_mtime - 3600
    os.utime(stale, (old, old))
    EpisodeStore(tmp_path)
    assert not stale.exists() and fresh.exists()


def test_store_counts_what_this_process_wrote(tmp_path):
    EpisodeStore(tmp_path).add(make_episode(4))
    mine = EpisodeStore(tmp_path)
    mine.add(make_episode(3))
    mine.add(make_episode(5))
    assert (mine.episodes_written, mine.rows_written) == (2, 8)
    assert len(mine) == 3 and mine.total_steps() == 12


def test_start_recording_refuses_other_env_settings_naming_both(tmp_path):
    store = EpisodeStore(tmp_path)
    env = {"id": "CartPole-v1", "pixels": True, "size": [64, 64], "num_envs": 8, "seed": 0}
    assert store.start_recording(env, episodes=10, streams=8) == 0
    # other envs count and seed are fine (they change which episodes, not their shape)
    assert store.start_recording({**env, "num_envs": 2, "seed": 5}, episodes=3, streams=2) == 10
    with pytest.raises(ValueError, match=r"size: the store has \[64, 64\], this run \[32, 32\]") as err:
        store.start_recording({**env, "size": [32, 32]}, episodes=1, streams=1)
    assert str(tmp_path) in str(err.value)
    assert store.read_metadata()["env"]["size"] == [64, 64]


def test_start_recording_continues_from_the_episodes_an_old_store_holds(tmp_path):
    store = EpisodeStore(tmp_path)
    for i in range(3):
        store.add(make_episode(4, seed=i))
    assert store.start_recording({"id": "CartPole-v1"}, episodes=2, streams=4) == 3
    assert store.start_recording({"id": "CartPole-v1"}, episodes=2, streams=1) == 7  # 4 indices: one per stream


def test_an_episode_of_another_shape_is_reported_with_its_file_and_key(tmp_path):
    from lightning_wm.data.offline import EpisodeDataModule

    store = EpisodeStore(tmp_path)
    for i in range(3):
        store.add(make_episode(6, seed=i))
    odd = make_episode(6, seed=9)
    odd["obs"] = odd["obs"][:, :4]
    path = store.add(odd)
    dm = EpisodeDataModule(str(tmp_path), mode="frames", batch_size=8, val_fraction=0.0, pool_episodes=8)
    with pytest.raises(CorruptEpisodeError, match=rf"{path.name}.*'obs'.*\(4, 8, 3\).*\(8, 8, 3\)"):
        for _ in dm.train_dataloader():
            pass
