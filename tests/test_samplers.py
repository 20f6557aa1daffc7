"""Samplers on hand-built buffers: shapes, masks, episode ends, write heads, ratios."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.data.samplers import MixedSampler, RowSampler, SequenceSampler, TransitionSampler, WindowSampler


def episodes(lengths: list[int], stream: int = 0, start: int = 0, last_open: bool = False) -> dict:
    """Rows ``[T, 1, ...]`` of consecutive episodes of ``lengths`` rows for one stream:
    obs = [stream, t, episode, step]; the last episode has no last row if ``last_open``."""
    t, ep, step, first, last = [], [], [], [], []
    for e, n in enumerate(lengths):
        for k in range(n):
            t.append(len(t))
            ep.append(e)
            step.append(k)
            first.append(k == 0)
            last.append(k == n - 1 and not (last_open and e == len(lengths) - 1))
    t = np.array(t) + start
    obs = np.stack([np.full(len(t), stream), t, ep, step], axis=1)
    return {
        "obs": obs[:, None].astype(np.int64),
        "reward": np.where(first, 0.0, t)[:, None].astype(np.float32),
        "is_first": np.array(first)[:, None],
        "is_last": np.array(last)[:, None],
        "is_terminal": np.array(last)[:, None],
        "action": np.where(last, 0, 1)[:, None].astype(np.int64),
    }


def buffer_of(*streams: dict, cap: int = 20, prioritized: bool = False, seed: int = 0) -> ReplayBuffer:
    buf = ReplayBuffer(cap * len(streams), len(streams), prioritized=prioritized, alpha=1.0, seed=seed)
    for s, rows in enumerate(streams):
        buf.add_many(rows, streams=[s])
    return buf


# ---------------------------------------------------------------------------- windows (MuZero)
def test_window_masks_past_the_episode_end_and_never_starts_on_a_last_row():
    buf = buffer_of(episodes([4, 3, 6]))  # last rows at t = 3, 6, 12
    sampler = WindowSampler(num_unroll_steps=2, td_steps=2)  # windows of 5 rows
    batch = sampler.sample(buf, 2000)
    t, ep = batch["obs"][..., 1], batch["obs"][..., 2]
    assert batch["obs"].shape == (2000, 5, 4) and batch["mask"].shape == (2000, 5) and batch["mask"].dtype == torch.bool
    assert not batch["is_last"][:, 0].any()  # never a position on a last row
    assert set(t[:, 0].tolist()) == {0, 1, 2, 4, 5, 7, 8, 9, 10, 11}
    # mask: rows of the position's episode up to and including its last row, nothing after
    same = ep == ep[:, :1]
    np.testing.assert_array_equal(batch["mask"].numpy(), same.numpy())
    end = {0: 3, 1: 6, 2: 12}
    for row_t, row_ep, mask in zip(t.tolist(), ep[:, 0].tolist(), batch["mask"].tolist()):
        assert sum(mask) == min(5, end[row_ep] - row_t[0] + 1)
    # late positions are sampled as often as early ones (masked, not rejected)
    counts = np.bincount(t[:, 0].numpy(), minlength=13)[[0, 1, 2, 4, 5, 7, 8, 9, 10, 11]]
    assert counts.min() > 0.75 * 2000 / 10
    # bookkeeping: the window's rows and their generations
    assert torch.equal(batch["row_index"][:, 0], batch["index"]) and torch.equal(batch["generation"], t[:, 0])
    written = batch["row_index"] <= 12  # one stream that never wrapped: slot = t = generation
    np.testing.assert_array_equal(batch["row_generation"][written].numpy(), t[written].numpy())
    assert torch.all(batch["row_generation"][~written] == -1) and not batch["mask"][~written].any()


def test_window_masks_rows_past_the_write_head_and_overwritten_rows():
    # stream 0: an episode still running (no last row yet); ring of 8 that wrapped: t = 4..11 stored
    buf = buffer_of(episodes([12], last_open=True), cap=8)
    batch = WindowSampler(num_unroll_steps=3, td_steps=1).sample(buf, 1000)
    t = batch["obs"][..., 1]
    assert set(t[:, 0].tolist()) == set(range(4, 12))
    exists = t[:, :1] + torch.arange(5) <= 11  # rows after t = 11 are not written yet
    np.testing.assert_array_equal(batch["mask"].numpy(), exists.numpy())
    # the slot after the head holds the oldest row (t = 4): it is masked, not a continuation
    assert torch.all(t[~batch["mask"]] < t[:, :1].expand(-1, 5)[~batch["mask"]])


def test_window_positions_follow_priorities_and_weights():
    buf = buffer_of(episodes([5, 5]), prioritized=True)
    priority = np.zeros(20)
    priority[[1, 6, 8]] = [1.0, 3.0, 0.0]  # slot 8 zero; slot 4 (a last row) gets the most but is no position
    priority[4] = 50.0
    buf.update_priorities(np.arange(10), priority[:10])
    batch = WindowSampler(1, 1).sample(buf, 4000)
    counts = np.bincount(batch["index"].numpy(), minlength=10)
    assert set(np.flatnonzero(counts)) == {1, 6}
    assert abs(counts[6] / counts.sum() - 0.75) < 0.03
    np.testing.assert_allclose(batch["weight"][batch["index"] == 1].numpy(), 1.0)
    np.testing.assert_allclose(batch["weight"][batch["index"] == 6].numpy(), 3.0**-0.4, rtol=1e-6)


def test_window_longer_than_the_ring_masks_what_the_ring_cannot_hold():
    buf = buffer_of(episodes([30], last_open=True), cap=6)  # t = 24..29 stored
    batch = WindowSampler(num_unroll_steps=5, td_steps=4).sample(buf, 200)  # 10 rows > 6 slots
    t = batch["obs"][..., 1]
    np.testing.assert_array_equal(batch["mask"].numpy(), (t[:, :1] + torch.arange(10) <= 29).numpy())
    assert batch["mask"].sum(1).max() == 6


def test_window_history_holds_the_rows_before_the_position_of_its_episode():
    # episodes [4, 6]: t = 0..3 and 4..9; ring of 8 that wrapped: t = 2..9 stored
    buf = buffer_of(episodes([4, 6]), cap=8)
    batch = WindowSampler(num_unroll_steps=1, td_steps=1, history=3).sample(buf, 3000)
    t, ep = batch["obs"][..., 1], batch["obs"][..., 2]
    assert batch["obs"].shape == (3000, 6, 4) and batch["mask"].shape == (3000, 6)
    pos = t[:, 3]
    assert set(pos.tolist()) == {2, 4, 5, 6, 7, 8}  # t = 3 and 9 are last rows
    assert torch.equal(batch["generation"], pos) and torch.equal(batch["row_index"][:, 3], batch["index"])
    # history rows: t - 3 .. t - 1, kept where they exist (t >= 2: written and not overwritten) and
    # belong to t's episode; the forward rows as without history
    rows = pos[:, None] + torch.arange(-3, 3)
    belongs = (rows >= 2) & (ep == ep[:, 3:4])
    forward_end = torch.where(ep[:, 3] == 0, 3, 9)[:, None]
    expected = torch.cat([belongs[:, :3], (rows[:, 3:] <= forward_end)], 1)
    np.testing.assert_array_equal(batch["mask"].numpy(), expected.numpy())
    assert torch.equal(t[batch["mask"]], rows[batch["mask"]])
    # age: rows written to the stream after the position (10 rows written: t = 9 is the newest)
    assert torch.equal(batch["age"], 9 - pos)
    with pytest.raises(ValueError, match="history"):
        WindowSampler(1, 1, history=-1)


# ---------------------------------------------------------------------------- transitions and rows
def test_transitions_carry_the_next_row_and_skip_last_rows_and_the_newest_row():
    buf = buffer_of(episodes([3, 4], stream=0), episodes([6], stream=1, last_open=True))
    batch = TransitionSampler().sample(buf, 3000)
    t, nt = batch["obs"][:, 1], batch["next_obs"][:, 1]
    assert torch.equal(nt, t + 1) and torch.equal(batch["next_obs"][:, 0], batch["obs"][:, 0])
    assert not batch["is_last"].any()
    stream0, stream1 = t[batch["obs"][:, 0] == 0], t[batch["obs"][:, 0] == 1]
    assert set(stream0.tolist()) == {0, 1, 3, 4, 5} and set(stream1.tolist()) == {
        0,
        1,
        2,
        3,
        4,
    }  # t=5 of stream 1: no t+1
    assert torch.equal(batch["next_is_last"], (batch["obs"][:, 0] == 0) & ((t == 1) | (t == 5)))
    assert torch.equal(batch["next_is_terminal"], batch["next_is_last"])
    assert torch.equal(batch["next_reward"], (t + 1).float())
    assert set(batch) >= {"index", "generation", "action"} and "row_index" not in batch


def test_rows_are_single_rows_with_index_and_generation():
    buf = buffer_of(episodes([3, 4]), cap=5)  # t = 2..6 stored
    batch = RowSampler().sample(buf, 500)
    assert batch["obs"].shape == (500, 4) and batch["action"].shape == (500,)
    assert torch.equal(batch["generation"], batch["obs"][:, 1]) and torch.equal(batch["index"], batch["obs"][:, 1] % 5)
    assert set(batch["obs"][:, 1].tolist()) == set(range(2, 7))


def test_sequences_report_row_index_and_generation():
    buf = buffer_of(episodes([9]), episodes([9], stream=1), cap=6)
    batch = SequenceSampler(4).sample(buf, 64)
    t = batch["obs"][..., 1]
    np.testing.assert_array_equal(batch["row_generation"].numpy(), t.numpy())
    np.testing.assert_array_equal(batch["row_index"].numpy(), (batch["obs"][..., 0] * 6 + t % 6).numpy())
    assert torch.equal(batch["row_index"][:, 0], batch["index"])


def test_can_sample_says_whether_a_stream_holds_a_position():
    buf = buffer_of(episodes([3]), cap=5)
    assert (
        RowSampler().can_sample(buf) and SequenceSampler(3).can_sample(buf) and not SequenceSampler(4).can_sample(buf)
    )
    assert not RowSampler().can_sample(ReplayBuffer(4, 1)) and TransitionSampler().can_sample(buf)
    with pytest.raises(ValueError, match="windows of 4 rows"):
        SequenceSampler(4).sample(buf, 2)
    only_last = buffer_of({k: v[2:] for k, v in episodes([3]).items()})
    with pytest.raises(ValueError, match="cannot sample window positions"):
        WindowSampler(1, 1).sample(only_last, 2)


# ---------------------------------------------------------------------------- mixed (Dyna)
def test_mixed_sampler_keeps_the_ratio_and_marks_real_items():
    real = buffer_of(episodes([10]), prioritized=True)
    imagined = ReplayBuffer(40, 2, seed=1)
    mixed = MixedSampler(SequenceSampler(3), real_ratio=0.25)
    batch = mixed.sample(real, imagined, 8)  # imagined buffer empty: all real
    assert batch["is_real"].all() and batch["obs"].shape == (8, 3, 4)
    imagined.add_many({k: np.concatenate([v, v], axis=1) for k, v in episodes([4], stream=7).items()})
    for _ in range(5):
        batch = mixed.sample(real, imagined, 8)
        assert batch["is_real"].tolist() == [True] * 2 + [False] * 6
        assert torch.all(batch["obs"][:, 0, 0] == torch.where(batch["is_real"], 0, 7))
        np.testing.assert_allclose(batch["weight"][2:].numpy(), 1.0)  # the uniform part weighs 1
        assert batch["index"].shape == (8,) and batch["row_index"].shape == (8, 3)
    assert MixedSampler(RowSampler(), real_ratio=1.0).sample(real, imagined, 5)["is_real"].all()
    assert not MixedSampler(RowSampler(), real_ratio=0.0).sample(real, imagined, 5)["is_real"].any()
    assert MixedSampler(RowSampler(), 0.5).sample(real, None, 4)["is_real"].all()
    with pytest.raises(ValueError, match="real_ratio"):
        MixedSampler(RowSampler(), real_ratio=1.5)
    imagined.write(np.array([0]), {"extra": np.ones(1)}, np.array([0]))
    with pytest.raises(ValueError, match=r"only imagined \['extra'\]"):
        mixed.sample(real, imagined, 8)
