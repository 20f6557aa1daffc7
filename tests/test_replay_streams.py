"""ReplayBuffer's per-stream write heads (``add_many``), priorities on add, generations against
feedback for overwritten rows, written columns, episode ends and state round trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_wm.data.replay import ReplayBuffer

from support.replay_rows import fill, make_row, rows, seqs

torch.set_num_threads(1)


# ---------------------------------------------------------------------------- per-stream heads
def _stream_rows(stream: int, ts, extra: bool = False) -> dict:
    """Rows for one stream at times ``ts`` ([T, 1, ...]): obs = [stream, t]."""
    ts = np.asarray(ts)
    rows = {
        "obs": np.stack([np.full(len(ts), stream), ts], axis=1)[:, None].astype(np.int64),
        "reward": ts[:, None].astype(np.float32),
        "is_first": (ts % 5 == 0)[:, None],
        "is_last": (ts % 5 == 4)[:, None],
        "is_terminal": np.zeros((len(ts), 1), bool),
        "action": (ts % 3)[:, None].astype(np.int64),
    }
    if extra:
        rows["logits"] = np.tile(ts[:, None, None], (1, 1, 2)).astype(np.float32)
    return rows


def _state_equal(a: ReplayBuffer, b: ReplayBuffer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        if key == "data":
            assert sa[key].keys() == sb[key].keys()
            for k in sa[key]:
                assert torch.equal(sa[key][k], sb[key][k]), k
        elif torch.is_tensor(sa[key]):
            assert torch.equal(sa[key], sb[key]), key
        else:
            assert sa[key] == sb[key], key


@pytest.mark.parametrize("prioritized", [False, True])
def test_add_many_equals_the_same_rows_added_one_by_one(prioritized):
    rng = np.random.default_rng(0)
    one, many = (ReplayBuffer(3 * 7, 3, prioritized=prioritized, seed=1) for _ in range(2))
    t = 0
    for T in [1, 3, 9, 2, 0, 5]:  # 9 > 7 rows per stream: only the newest 7 of that chunk survive
        chunk = {
            k: np.stack([make_row(t + i, 3)[k] for i in range(T)]) if T else np.zeros((0, 3, *v.shape[1:]))
            for k, v in make_row(0, 3).items()
        }
        priority = rng.uniform(0.5, 2.0, size=(T, 3)) if prioritized and T % 2 else None
        if priority is not None and T > 7:
            priority[0, 0] = 5.0  # the max seen comes from a row the chunk overwrites itself
        for i in range(T):
            one.add({k: v[i] for k, v in chunk.items()}, priority=None if priority is None else priority[i])
        many.add_many(chunk, priority=priority)  # T = 0 writes nothing
        t += T
    _state_equal(one, many)
    # and for a subset of streams, in any order
    sub = {k: np.concatenate([v, v], axis=1) for k, v in _stream_rows(0, [30, 31, 32]).items()}
    for i in range(3):
        one.add({k: v[i] for k, v in sub.items()}, streams=[2, 0])
    many.add_many(sub, streams=[2, 0])
    _state_equal(one, many)
    assert one.rows_per_stream.tolist() == [7, 7, 7]
    assert one.generation(np.array([0, 1, 2]), one.newest).tolist() == [22, 19, 22]  # rows written - 1


def test_each_stream_has_its_own_write_head():
    buf = ReplayBuffer(3 * 10, 3, seed=0)
    buf.add_many(_stream_rows(0, range(12)), streams=[0])  # wraps: keeps t = 2..11
    buf.add_many(_stream_rows(1, range(5)), streams=[1])
    assert buf.rows_per_stream.tolist() == [10, 5, 0] and len(buf) == 15
    assert buf.oldest.tolist() == [2, 0, 0] and buf.newest[:2].tolist() == [1, 4]
    # generations are each stream's write counter: slot 0 of stream 0 holds its 11th row
    assert buf.generation(np.array([0, 0, 1, 2]), np.array([0, 2, 4, 0])).tolist() == [10, 2, 4, -1]
    counts = np.zeros(3)
    for _ in range(20):
        batch = rows(buf, 500)
        counts += np.bincount(batch["obs"][:, 0].numpy(), minlength=3)
        stream, t = batch["obs"][:, 0].numpy(), batch["obs"][:, 1].numpy()
        assert np.all(np.where(stream == 0, (t >= 2) & (t <= 11), t <= 4))
        assert np.array_equal(batch["generation"].numpy(), t)  # the t-th row written to its stream
    np.testing.assert_allclose(counts / counts.sum(), [10 / 15, 5 / 15, 0], atol=0.02)  # uniform over rows
    # windows of 4 never cross a head: stream 0 has starts t = 2..8 (7), stream 1 t = 0..1 (2)
    seq = seqs(buf, 9000, 4)
    stream, t = seq["obs"][..., 0].numpy(), seq["obs"][..., 1].numpy()
    assert np.all(stream == stream[:, :1]) and np.all(np.diff(t, axis=1) == 1)
    assert set(t[stream[:, 0] == 1, 0].tolist()) == {0, 1} and set(t[stream[:, 0] == 0, 0].tolist()) == set(range(2, 9))
    assert abs((stream[:, 0] == 1).mean() - 2 / 9) < 0.02
    np.testing.assert_array_equal(seq["row_generation"].numpy(), seq["generation"].numpy()[:, None] + np.arange(4))
    with pytest.raises(ValueError, match="duplicates"):
        buf.add_many(_stream_rows(0, [1]), streams=[1, 1])
    with pytest.raises(ValueError, match=r"out of range \[0, 3\)"):
        buf.add_many(_stream_rows(0, [1]), streams=[3])
    with pytest.raises(ValueError, match=r"'obs': expected leading dimensions \[T, 2\]"):
        buf.add_many(_stream_rows(0, [1]), streams=[0, 1])


def test_priorities_on_add_default_to_the_max_seen():
    buf = ReplayBuffer(4, 1, prioritized=True, alpha=1.0, seed=0)
    buf.add(make_row(0, 1))  # max seen so far: 1
    buf.add(make_row(1, 1), priority=3.0)  # given; raises the max to 3
    buf.add(make_row(2, 1))  # max seen: 3
    buf.add_many({k: v[None] for k, v in make_row(3, 1).items()}, priority=np.array([[0.0]]))
    np.testing.assert_allclose(buf._tree.leaves, [1.0, 3.0, 3.0, 0.0])
    with pytest.raises(ValueError, match="prioritized=False"):
        ReplayBuffer(4).add(make_row(0, 1), priority=1.0)
    with pytest.raises(ValueError, match="finite"):
        buf.add(make_row(4, 1), priority=-1.0)


# ---------------------------------------------------------------------------- generations and feedback
def test_feedback_for_overwritten_rows_is_skipped():
    """Lightning fetches batch N + 1 (and acts for it) before batch N's feedback arrives: rows
    of batch N overwritten meanwhile keep their new occupant's priority and columns."""
    buf = ReplayBuffer(4, 1, prioritized=True, alpha=1.0, seed=0)
    fill(buf, 4)
    batch_n = rows(buf, 16)  # every slot, with the generation it had when sampled
    fill_rows = [make_row(t, 1) for t in (4, 5)]
    for row in fill_rows:  # "batch N + 1": acting overwrites slots 0 and 1 (generations 4, 5)
        buf.add(row)
    rows(buf, 16)
    index, generation = batch_n["index"], batch_n["generation"]
    applied = buf.update_priorities(index, torch.full((16,), 7.0), generation)
    fresh = np.isin(index.numpy(), [2, 3])
    assert applied == fresh.sum() > 0
    np.testing.assert_allclose(buf._tree.leaves, [1.0, 1.0, 7.0, 7.0])  # new rows keep the max they got
    values = torch.arange(16, dtype=torch.float64)[:, None].expand(16, 2)
    assert buf.write(index, {"value": values}, generation) == fresh.sum()
    value = buf.column("value")[0]
    assert value.dtype == np.float32 and value.shape == (4, 2)  # float64 stored as float32, like rows
    assert np.all(value[:2] == 0) and set(value[2:, 0].tolist()) <= set(np.flatnonzero(fresh).tolist())
    # without a generation only written slots are touched; an unwritten slot is never given a priority
    empty = ReplayBuffer(8, 1, prioritized=True, seed=0)
    fill(empty, 2)
    assert empty.update_priorities(np.array([1, 5]), np.array([2.0, 2.0])) == 1
    assert empty._tree.leaves[5] == 0


def test_write_keeps_dtypes_and_later_rows_may_leave_written_columns_out():
    buf = ReplayBuffer(2 * 4, 2, seed=0)
    fill(buf, 3)
    gen = buf.generation(np.array([0, 1]), np.array([1, 2]))
    assert (
        buf.write(np.array([1, 4 + 2]), {"action": np.array([2.9, 1.2]), "target": {"visits": np.ones((2, 3))}}, gen)
        == 2
    )
    assert buf.column("action").dtype == np.int64 and buf.column("action")[0, 1] == 2  # cast to the stored dtype
    assert buf.column("target/visits").shape == (2, 4, 3)
    buf.add(make_row(3, 2))  # rows without the written column are fine ...
    buf.add(make_row(4, 2))  # ... and zero it when they overwrite a slot that had it
    assert np.all(buf.column("target/visits")[:, 0] == 0) and np.all(buf.column("target/visits")[0, 1] == 1)
    seq = seqs(buf, 4, 2)
    assert seq["target"]["visits"].shape == (4, 2, 3)
    with pytest.raises(ValueError, match="expected 2 rows"):
        buf.write(np.array([0, 1]), {"target": {"visits": np.ones((3, 3))}}, np.array([0, 1]))
    with pytest.raises(ValueError, match="per-row shape"):
        buf.write(np.array([0]), {"action": np.ones((1, 2))}, np.array([0]))
    with pytest.raises(ValueError, match="reserved"):
        buf.write(np.array([0]), {"next_obs": np.ones((1, 2))}, np.array([0]))


def test_mark_episode_end_closes_each_streams_newest_row():
    buf = ReplayBuffer(3 * 6, 3, seed=0)
    buf.add_many(_stream_rows(0, range(3), extra=True), streams=[0])
    buf.add_many(_stream_rows(1, range(5), extra=True), streams=[1])  # newest row t=4 is already last
    assert buf.mark_episode_end() == 1
    newest = buf.gather(np.array([0, 1]), buf.newest[:2])
    assert newest["is_last"].tolist() == [True, True] and newest["is_terminal"].tolist() == [False, False]
    assert newest["action"].tolist() == [0, 4 % 3] and newest["logits"][0].tolist() == [0.0, 0.0]
    assert newest["obs"].tolist() == [[0, 2], [1, 4]] and newest["reward"].tolist() == [2.0, 4.0]
    assert newest["logits"][1].tolist() == [4.0, 4.0]  # the already-last row is left alone
    assert buf.mark_episode_end() == 0
    assert ReplayBuffer(4, 1).mark_episode_end() == 0


@pytest.mark.parametrize("prioritized", [False, True])
def test_state_round_trip_with_heads_generations_priorities_and_columns(tmp_path, prioritized):
    buf = ReplayBuffer(3 * 6, 3, prioritized=prioritized, alpha=0.7, seed=3, storage_dir=tmp_path / "a")
    buf.add_many(_stream_rows(0, range(8)), streams=[0])
    buf.add_many(_stream_rows(1, range(2)), streams=[1])
    if prioritized:
        buf.update_priorities(np.arange(6), np.linspace(0.1, 2.0, 6))
    buf.write(
        np.array([1, 6]),
        {"value": np.array([0.5, 1.5], np.float32)},
        buf.generation(np.array([0, 1]), np.array([1, 0])),
    )
    buf.save(tmp_path / "b.pt")
    other = ReplayBuffer.load(tmp_path / "b.pt", storage_dir=tmp_path / "c")
    _state_equal(buf, other)
    for b in (buf, other):  # same write heads, same RNG, same priorities: the same future
        b.add_many(_stream_rows(2, range(3)), streams=[2])
    for _ in range(3):
        a, b = seqs(buf, 8, 2), seqs(other, 8, 2)
        for key in ("obs", "index", "generation", "value"):
            assert torch.equal(a[key], b[key]), key
    _state_equal(buf, other)


def test_loads_a_version_1_state_of_the_lockstep_buffer():
    """Checkpoints written before per-stream heads keep loading; generations are rebuilt from
    the stored time order."""
    buf = ReplayBuffer(2 * 5, 2, seed=0)
    fill(buf, 7)  # wrapped: head at slot 2, t = 2..6 stored
    new = buf.state_dict()
    old = {
        "version": 1,
        "capacity": 10,
        "num_envs": 2,
        "prioritized": False,
        "alpha": 0.6,
        "beta": 0.4,
        "pos": 2,
        "count": 5,
        "max_priority": 1.0,
        "rng_state": new["rng_state"],
        "data": new["data"],
    }
    restored = ReplayBuffer(10, 2, prioritized=True, seed=0)
    restored.load_state_dict(old)
    seq = seqs(restored, 64, 5)
    assert torch.all(seq["obs"][..., 1] == torch.arange(2, 7))
    np.testing.assert_array_equal(seq["row_generation"].numpy(), np.tile(np.arange(5), (64, 1)))
    restored.add(make_row(7, 2))
    assert restored.generation(np.array([0]), np.array([2])).tolist() == [5]


def test_random_prefill_rows_after_searched_rows_get_zero_extras():
    """One actor's prefill may arrive after another's searched rows: its missing agent extras are
    zeros (as on last rows); rows of a policy must still bring every key."""
    buf = ReplayBuffer(20, 2, seed=0)
    chunk = lambda version: {  # noqa: E731
        "obs": np.ones((3, 1, 4), np.float32),
        "reward": np.ones((3, 1), np.float32),
        "is_first": np.zeros((3, 1), bool),
        "is_last": np.zeros((3, 1), bool),
        "is_terminal": np.zeros((3, 1), bool),
        "action": np.ones((3, 1), np.int64),
        "policy_version": np.full((3, 1), version, np.int64),
    }
    buf.add_many({**chunk(2), "visit_probs": np.full((3, 1, 2), 0.5, np.float32)}, streams=[0])
    buf.add_many(chunk(-1), streams=[1])
    assert (buf.column("visit_probs")[1, :3] == 0).all() and (buf.column("visit_probs")[0, :3] == 0.5).all()
    with pytest.raises(ValueError, match=r"missing key\(s\) \['visit_probs'\]"):
        buf.add_many(chunk(3), streams=[1])
    with pytest.raises(ValueError, match=r"missing key\(s\) \['reward'\]"):
        rows_without_reward = chunk(-1)
        del rows_without_reward["reward"]
        buf.add_many(rows_without_reward, streams=[1])
