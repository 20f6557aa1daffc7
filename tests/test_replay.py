"""Tests for lightning_wm.data.replay (ReplayBuffer) and lightning_wm.data.sumtree: shapes, sequences,
priorities, state and errors (per-stream write heads and generations: test_replay_streams.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.data.samplers import SequenceSampler
from lightning_wm.data.sumtree import SumTree

from support.replay_rows import fill, make_row, rows, seqs

torch.set_num_threads(1)


# ---------------------------------------------------------------------------- sum tree
@pytest.mark.parametrize("n,k", [(1, 2), (5, 2), (8, 2), (13, 4), (1000, 8), (5000, 64)])
def test_sumtree_find_matches_cumsum(n, k):
    rng = np.random.default_rng(0)
    tree = SumTree(n, branching=k)
    values = rng.random(n) * (rng.random(n) > 0.3)
    values[0] = max(values[0], 0.1)
    tree.set(np.arange(n), values)
    assert tree.total == pytest.approx(values.sum())
    mass = rng.random(1000) * values.sum()
    expected = np.searchsorted(np.cumsum(values), mass, side="right")
    np.testing.assert_array_equal(tree.find(mass), expected)
    # duplicate indices in one batch update: last wins, sums stay exact
    tree.set(np.array([0, 0, n - 1]), np.array([9.0, 3.0, 2.0]))
    values[0], values[n - 1] = 3.0, 2.0
    assert tree.total == pytest.approx(values.sum())
    other = SumTree(n, branching=k)
    other.set_all(values)
    for a, b in zip(other.levels, tree.levels):
        np.testing.assert_allclose(a, b)


# ---------------------------------------------------------------------------- basics
def test_dtypes_shapes_and_len():
    buf = ReplayBuffer(20, 2, seed=0)
    assert len(buf) == 0 and buf.num_streams == 2
    fill(buf, 3, pixels=True)
    assert len(buf) == 6
    batch = rows(buf, 5)
    assert batch["pixels"].dtype == torch.uint8 and batch["pixels"].shape == (5, 4, 4, 3)
    assert batch["is_first"].dtype == torch.bool
    assert batch["reward"].dtype == torch.float32
    assert batch["action"].dtype == torch.int64 and batch["action"].shape == (5,)
    assert batch["index"].dtype == torch.int64 and "weight" not in batch
    seq = seqs(buf, 4, 3)
    assert seq["pixels"].shape == (4, 3, 4, 4, 3) and seq["pixels"].dtype == torch.uint8
    assert seq["obs"].shape == (4, 3, 2) and seq["index"].shape == (4,)
    # storage is not promoted either
    assert buf._data["pixels"].dtype == np.uint8


def test_torch_input_and_dict_obs_nesting():
    buf = ReplayBuffer(12, 3, seed=0)
    for t in range(4):
        buf.add(
            {
                "obs": {"image": torch.full((3, 2, 2, 1), t, dtype=torch.uint8), "state": torch.randn(3, 5)},
                "is_first": torch.tensor([t == 0] * 3),
                "logits": torch.zeros(3, 4),
            }
        )
    assert sorted(buf.keys) == ["is_first", "logits", "obs/image", "obs/state"]
    seq = seqs(buf, 2, 4)
    assert set(seq) == {"obs", "is_first", "logits", "index", "generation", "row_index", "row_generation"}
    assert seq["obs"]["image"].shape == (2, 4, 2, 2, 1) and seq["obs"]["image"].dtype == torch.uint8
    assert seq["obs"]["state"].shape == (2, 4, 5)
    assert torch.equal(seq["obs"]["image"][:, :, 0, 0, 0], torch.arange(4, dtype=torch.uint8).expand(2, 4))


def test_sequences_never_mix_streams_and_are_consecutive():
    buf = ReplayBuffer(5 * 30, 5, seed=1)
    fill(buf, 25)
    seq = seqs(buf, 512, 8)
    stream, t = seq["obs"][..., 0], seq["obs"][..., 1]
    assert torch.all(stream == stream[:, :1])
    assert torch.all(t[:, 1:] - t[:, :-1] == 1)
    assert set(stream[:, 0].tolist()) == set(range(5))
    # index is the start slot: stream * cap_per_stream + start
    assert torch.equal(seq["index"], stream[:, 0] * buf.cap_per_stream + t[:, 0])


def test_ring_wraparound_only_newest_rows_and_head_never_crossed():
    buf = ReplayBuffer(2 * 10, 2, seed=2)
    fill(buf, 27)  # each stream keeps t = 17..26, write head between 26 and 17
    assert len(buf) == 20
    stored = rows(buf, 2000)["obs"][:, 1]
    assert set(stored.tolist()) == set(range(17, 27))
    seq = seqs(buf, 4000, 5)
    t = seq["obs"][..., 1]
    assert torch.all(t[:, 1:] - t[:, :-1] == 1), "window spans the write head"
    assert set(t[:, 0].tolist()) == set(range(17, 23))  # every valid start, and only those
    full = seqs(buf, 50, 10)["obs"][..., 1]  # the whole ring in order
    assert torch.all(full == torch.arange(17, 27))


def test_partially_filled_ring_never_returns_unwritten_rows():
    buf = ReplayBuffer(100, 1, seed=3)
    fill(buf, 7)
    t = seqs(buf, 1000, 7)["obs"][..., 1]
    assert torch.all(t == torch.arange(7))
    assert set(rows(buf, 1000)["obs"][:, 1].tolist()) == set(range(7))


def _episodic_buffer(prioritized: bool = False) -> ReplayBuffer:
    buf = ReplayBuffer(2 * 60, 2, prioritized=prioritized, seed=4)
    lengths = [[5, 9, 3, 12, 7, 4, 11, 9], [8, 8, 2, 15, 6, 10, 7, 4]]
    firsts = []
    for lens in lengths:
        f = np.zeros(60, bool)
        f[np.cumsum([0] + lens[:-1])] = True
        firsts.append(f)
    for t in range(60):
        buf.add(make_row(t, 2, is_first=[firsts[0][t], firsts[1][t]]))
    return buf


@pytest.mark.parametrize("prioritized", [False, True])
def test_cross_episodes_flag(prioritized):
    buf = _episodic_buffer(prioritized)
    crossing = seqs(buf, 2000, 6, True)["is_first"]
    assert crossing[:, 1:].any(), "cross_episodes=True should allow resets inside windows"
    seq = seqs(buf, 2000, 6, False)
    assert not seq["is_first"][:, 1:].any()
    t = seq["obs"][..., 1]
    assert torch.all(t[:, 1:] - t[:, :-1] == 1)
    assert seq["is_first"][:, 0].any()  # windows may start at a reset
    # length 15 fits only in stream 1's 15-step episode: rejection falls back to exact enumeration
    long = seqs(buf, 64, 15, False)
    assert torch.all(long["obs"][:, 0, 0] == 1) and not long["is_first"][:, 1:].any()
    with pytest.raises(ValueError, match="no valid window"):
        seqs(buf, 4, 16, False)
    seqs(buf, 4, 16, True)  # fine when crossing is allowed


def test_terminal_fraction_oversamples_windows_holding_an_episode_end():
    buf = ReplayBuffer(2 * 400, 2, seed=7)
    ends = {(0, 150), (1, 390)}  # two episode ends among 800 rows
    for t in range(400):
        row = make_row(t, 2)
        row["is_terminal"] = np.array([(e, t) in ends for e in range(2)])
        buf.add(row)
    plain = SequenceSampler(8).sample(buf, 4000)
    assert plain["is_terminal"].any(1).float().mean() < 0.05  # 16 of the 786 windows
    mixed = SequenceSampler(8, terminal_fraction=0.25).sample(buf, 4000)
    holds = mixed["is_terminal"].any(1)
    assert holds[3000:].all()  # the last quarter: windows holding an end, drawn among those only
    t_end = mixed["obs"][3000:, :, 1][mixed["is_terminal"][3000:]]
    assert set(t_end.tolist()) == {150, 390}
    starts = mixed["obs"][3000:, 0, 1]
    assert set(starts.tolist()) == set(range(143, 151)) | set(range(383, 391))  # every such window
    assert holds[:3000].float().mean() < 0.05  # the rest as usual
    t = mixed["obs"][..., 1]
    assert torch.all(t[:, 1:] - t[:, :-1] == 1)
    # with no episode end stored yet the whole batch is ordinary; 0 changes nothing (same RNG draws)
    empty = ReplayBuffer(100, 1, seed=8)
    fill(empty, 50)
    assert SequenceSampler(8, terminal_fraction=0.5).sample(empty, 16)["obs"].shape == (16, 8, 2)
    a, b = ReplayBuffer(100, 1, seed=9), ReplayBuffer(100, 1, seed=9)
    fill(a, 50), fill(b, 50)
    assert torch.equal(
        SequenceSampler(8).sample(a, 16)["index"], SequenceSampler(8, terminal_fraction=0.0).sample(b, 16)["index"]
    )
    with pytest.raises(ValueError, match="terminal_fraction"):
        SequenceSampler(8, terminal_fraction=1.5)


# ---------------------------------------------------------------------------- priorities
def test_prioritized_row_frequencies_match_priorities():
    buf = ReplayBuffer(8, 1, prioritized=True, alpha=0.5, seed=5)
    fill(buf, 8)
    priority = np.arange(1, 9, dtype=np.float64) ** 2  # p^alpha = 1..8
    buf.update_priorities(np.arange(8), priority)
    counts = np.zeros(8)
    for _ in range(50):
        counts += np.bincount(rows(buf, 1000)["index"].numpy(), minlength=8)
    expected = np.arange(1, 9) / 36 * 50_000
    np.testing.assert_allclose(counts, expected, rtol=0.05)
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 30  # 7 dof; p ~ 1e-4 (stratified sampling makes it far smaller)


def test_prioritized_sequence_frequencies_exclude_invalid_starts():
    buf = ReplayBuffer(2 * 10, 2, prioritized=True, alpha=1.0, seed=6)
    fill(buf, 13)  # wrapped: t = 3..12 per stream, slots 3..9,0..2
    rng = np.random.default_rng(0)
    priority = rng.uniform(0.5, 3.0, size=20)
    buf.update_priorities(np.arange(20), priority)
    cap, L = 10, 4
    counts = np.zeros(20)
    for _ in range(40):
        seq = seqs(buf, 1000, L)
        counts += np.bincount(seq["index"].numpy(), minlength=20)
        t = seq["obs"][..., 1]
        assert torch.all(t[:, 1:] - t[:, :-1] == 1)
    slot = np.arange(20) % cap
    valid = (slot - 3) % cap <= cap - L  # starts t = 3..9 (logical offsets 0..6)
    assert counts[~valid].sum() == 0
    expected = priority * valid / (priority * valid).sum() * 40_000
    np.testing.assert_allclose(counts[valid], expected[valid], rtol=0.1)


def test_importance_weights_hand_computed():
    buf = ReplayBuffer(2, 1, prioritized=True, alpha=1.0, beta=0.5, seed=7)
    fill(buf, 2)
    buf.update_priorities(torch.tensor([0, 1]), torch.tensor([1.0, 4.0]))
    # N = 2, P = [0.2, 0.8]: w = (N P)^-beta = [0.4^-0.5, 1.6^-0.5] -> / max = [1, 0.5]
    batch = rows(buf, 64)
    idx, w = batch["index"].numpy(), batch["weight"].numpy()
    assert set(idx) == {0, 1}
    np.testing.assert_allclose(w[idx == 0], 1.0, rtol=1e-6)
    np.testing.assert_allclose(w[idx == 1], 0.5, rtol=1e-6)
    assert batch["weight"].dtype == torch.float32
    seq = seqs(buf, 8, 1)
    np.testing.assert_allclose(seq["weight"].numpy(), np.where(seq["index"].numpy() == 0, 1.0, 0.5), rtol=1e-6)


def test_update_priorities_and_new_rows_get_max_priority():
    buf = ReplayBuffer(4, 1, prioritized=True, alpha=1.0, seed=8)
    fill(buf, 3)
    buf.update_priorities(np.array([0, 1, 2]), np.array([0.0, 0.0, 5.0]))
    assert set(rows(buf, 200)["index"].tolist()) == {2}
    buf.add(make_row(3, 1))  # slot 3 gets the max priority seen (5)
    counts = np.bincount(rows(buf, 1000)["index"].numpy(), minlength=4)
    assert counts[0] == counts[1] == 0
    assert abs(counts[2] - 500) <= 5 and abs(counts[3] - 500) <= 5
    buf.add(make_row(4, 1))  # overwrites slot 0: reused slot gets max priority again
    assert abs(np.bincount(rows(buf, 999)["index"].numpy(), minlength=4)[0] - 333) <= 1
    with pytest.raises(ValueError, match="finite"):
        buf.update_priorities(np.array([0]), np.array([np.nan]))
    with pytest.raises(ValueError, match="out of range"):
        buf.update_priorities(np.array([4]), np.array([1.0]))
    with pytest.raises(ValueError, match="prioritized=True"):
        ReplayBuffer(4).update_priorities(np.array([0]), np.array([1.0]))


# ---------------------------------------------------------------------------- state
def _only_tensors_and_scalars(obj) -> bool:
    if isinstance(obj, dict):
        return all(isinstance(k, str) and _only_tensors_and_scalars(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(_only_tensors_and_scalars(v) for v in obj)
    return isinstance(obj, (torch.Tensor, int, float, bool, str, type(None)))


@pytest.mark.parametrize("prioritized", [False, True])
def test_save_load_round_trip(tmp_path, prioritized):
    buf = ReplayBuffer(3 * 8, 3, prioritized=prioritized, alpha=0.7, beta=0.3, seed=9)
    fill(buf, 11, pixels=True)  # wrapped, head at slot 3
    if prioritized:
        buf.update_priorities(np.arange(24), np.linspace(0.1, 3.0, 24))
    assert _only_tensors_and_scalars(buf.state_dict())
    path = tmp_path / "replay.pt"
    buf.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["replay.pt"]
    torch.load(path, weights_only=True)  # must not need weights_only=False
    other = ReplayBuffer.load(path)
    assert (other.prioritized, other.alpha, other.beta, len(other)) == (prioritized, 0.7, 0.3, 24)
    for b in (buf, other):  # the ring position is restored: the next add overwrites the same slot
        b.add(make_row(11, 3, pixels=True))
    for _ in range(3):
        a, b = seqs(buf, 16, 5), seqs(other, 16, 5)
        for key in a:
            assert torch.equal(a[key], b[key]), key
    if prioritized:
        np.testing.assert_array_equal(buf._tree.leaves, other._tree.leaves)
        assert buf._tree.total == pytest.approx(other._tree.total, rel=1e-12)


def test_partial_state_saves_only_written_rows_and_checks_shape():
    buf = ReplayBuffer(1000, 2, seed=10)
    fill(buf, 4)
    state = buf.state_dict()
    assert state["data"]["obs"].shape == (2, 4, 2)
    other = ReplayBuffer(1000, 2, seed=0)
    other.load_state_dict(state)
    assert len(other) == 8
    assert torch.equal(seqs(other, 5, 4)["obs"], seqs(buf, 5, 4)["obs"])
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(500, 2).load_state_dict(state)


def test_memmap_storage_matches_in_memory(tmp_path):
    mem = ReplayBuffer(4 * 16, 4, prioritized=True, seed=11)
    disk = ReplayBuffer(4 * 16, 4, prioritized=True, seed=11, storage_dir=tmp_path / "rb")
    for t in range(21):
        row = make_row(t, 4, is_first=[t % 5 == 0] * 4, pixels=True)
        mem.add(row)
        disk.add(row)
    assert isinstance(disk._data["pixels"], np.memmap)
    assert sorted(p.suffix for p in (tmp_path / "rb").iterdir()) == [".npy"] * 7
    for _ in range(3):
        a, b = seqs(mem, 8, 4, False), seqs(disk, 8, 4, False)
        for key in a:
            assert torch.equal(a[key], b[key]), key
    disk.flush()
    on_disk = np.load(tmp_path / "rb" / "pixels.npy", mmap_mode="r")
    assert on_disk.shape == (4, 16, 4, 4, 3) and on_disk.dtype == np.uint8
    # a memmap buffer's state round-trips too
    path = tmp_path / "rb.pt"
    disk.save(path)
    restored = ReplayBuffer.load(path, storage_dir=tmp_path / "rb2")
    assert isinstance(restored._data["pixels"], np.memmap)
    assert torch.equal(rows(restored, 4)["pixels"], rows(disk, 4)["pixels"])


# ---------------------------------------------------------------------------- errors
def test_clear_errors():
    buf = ReplayBuffer(20, 2, seed=12)
    with pytest.raises(ValueError, match=r"empty \(0 rows\)"):
        rows(buf, 4)
    with pytest.raises(ValueError, match="empty"):
        seqs(buf, 4, 2)
    with pytest.raises(ValueError, match=r"'reward': expected a leading dimension of 2"):
        buf.add({**make_row(0, 2), "reward": np.zeros(3)})
    fill(buf, 3)
    with pytest.raises(ValueError, match=r"'obs' changed shape"):
        buf.add({**make_row(3, 2), "obs": np.zeros((2, 5))})
    with pytest.raises(ValueError, match="missing key.*'action'"):
        row = make_row(3, 2)
        del row["action"]
        buf.add(row)
    with pytest.raises(ValueError, match="reserved"):
        buf.add({**make_row(3, 2), "index": np.zeros(2)})
    with pytest.raises(ValueError, match="dtype object"):
        buf.add({**make_row(3, 2), "logits": np.zeros((2, 3)), "notes": np.array(["a", None], dtype=object)})
    assert "logits" not in buf  # nothing allocated either
    assert len(buf) == 6  # failed adds wrote nothing
    with pytest.raises(
        ValueError, match=r"windows of 4 rows: the fullest of the 2 streams holds only 3 rows \(6 rows in total"
    ):
        seqs(buf, 4, 4)
    no_flags = ReplayBuffer(10, 1)
    for _ in range(5):
        no_flags.add({"obs": np.zeros((1, 2))})
    with pytest.raises(ValueError, match="needs an 'is_first' key"):
        seqs(no_flags, 2, 3, False)


def test_new_key_later_is_zero_filled():
    buf = ReplayBuffer(10, 1, seed=13)
    fill(buf, 3)
    buf.add({**make_row(3, 1), "logits": np.ones((1, 2), np.float32)})
    seq = seqs(buf, 3, 4)
    assert torch.equal(seq["logits"][:, :, 0], torch.tensor([[0.0, 0.0, 0.0, 1.0]]).expand(3, 4))
