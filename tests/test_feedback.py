"""Feedback from the learner into the replay buffer, and buffers checkpointed beside the .ckpt."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_wm.callbacks import BufferCheckpoint
from lightning_wm.cli import Trainer
from lightning_wm.data.modules import ReplayDataModule
from lightning_wm.data.samplers import RowSampler, SequenceSampler, WindowSampler
from lightning_wm.data.settings import EvalSettings, ReplaySettings
from lightning_wm.envs import EnvConfig
from lightning_wm.policies import RandomAgent

from support.tiny_agent import PriorityProbe


@pytest.mark.slow
def test_priorities_returned_by_training_step_change_what_is_sampled(tmp_path):
    """End to end through Lightning and the DataModule: rows given priority 0 are never sampled
    again, the one row given a high priority fills most of every later batch."""
    dm = ReplayDataModule(
        EnvConfig("CartPole-v1", num_envs=1),
        batch_size=8,
        sampler=RowSampler(),
        prefill=64,
        replay_ratio=4.0,
        replay=ReplaySettings(capacity=5000, prioritized=True, alpha=1.0),
        eval=EvalSettings(episodes=1, envs=1),
    )
    model = PriorityProbe(dm.spec)
    trainer = Trainer(
        max_steps=60,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
    )  # the CLI's Trainer adds ReplayFeedback itself
    trainer.fit(model, dm)
    seen = [set(zip(i.tolist(), g.tolist())) for i, g in model.seen]
    zeroed: set[tuple[int, int]] = set()
    for step, rows in enumerate(seen):
        if step >= 2:  # Lightning sampled batch `step - 1` before the feedback of `step - 2` ... arrived
            zeroed |= seen[step - 2] - {model.favourite}
        assert not rows & zeroed, f"step {step}: rows given priority 0 were sampled again"
    late = torch.stack([(i == model.favourite[0]) & (g == model.favourite[1]) for i, g in model.seen[-40:]])
    assert late.float().mean() > 0.5  # uniform replay would give it ~1/70 of the samples
    assert len(dm.buffer) < 100


def test_feedback_on_a_batch_whose_rows_were_overwritten_since_is_skipped():
    """Lightning's one-batch prefetch: batch N + 1 (and its env steps) is made before the feedback
    of batch N arrives; rows overwritten by those env steps keep their new occupant's priority."""
    dm = ReplayDataModule(
        EnvConfig("CartPole-v1", num_envs=1),
        batch_size=12,
        sampler=RowSampler(),
        prefill=12,
        replay_ratio=0.25,
        replay=ReplaySettings(capacity=12, prioritized=True, alpha=1.0),
    )
    dm.setup("fit")
    dm.attach_agent(RandomAgent(dm.spec, seed=0), 0)
    stream = iter(dm.train_dataloader())
    batch_n = next(stream)
    next(stream)  # 4 env steps: the 4 oldest rows are replaced
    buffer = dm.buffer
    overwritten = buffer.generation(*np.divmod(batch_n["index"].numpy(), 12)) != batch_n["generation"].numpy()
    assert 0 < overwritten.sum() < 12
    result = dm.apply_feedback(batch_n, {"loss": torch.tensor(0.0), "priority": torch.full((12,), 5.0)})
    assert result == {"applied": int((~overwritten).sum()), "stale": int(overwritten.sum())}
    leaves = buffer._tree.leaves
    np.testing.assert_allclose(leaves[batch_n["index"][~torch.from_numpy(overwritten)].numpy()], 5.0)
    np.testing.assert_allclose(leaves[batch_n["index"][torch.from_numpy(overwritten)].numpy()], 1.0)
    dm.teardown("fit")


def test_written_columns_and_mixed_batches_through_apply_feedback():
    dm = ReplayDataModule(
        EnvConfig("CartPole-v1", num_envs=2),
        batch_size=6,
        sampler=WindowSampler(num_unroll_steps=2, td_steps=1),
        prefill=40,
        replay=ReplaySettings(capacity=200, prioritized=True),
    )
    dm.setup("fit")
    dm.attach_agent(RandomAgent(dm.spec, seed=0), 0)
    dm.collect_for_batch()
    batch = dm.sample_batch()
    mask = batch["mask"]
    columns = {"root_value": torch.arange(int(mask.sum()), dtype=torch.float32)}
    write = {"index": batch["row_index"][mask], "generation": batch["row_generation"][mask], "columns": columns}
    result = dm.apply_feedback(batch, {"write": write})
    assert result["stale"] == 0 and result["applied"] == int(mask.sum())
    last_wins = dict(zip(batch["row_index"][mask].tolist(), columns["root_value"].tolist()))  # windows overlap
    stored = dm.buffer.column("root_value").reshape(-1)
    assert stored.dtype == np.float32 and np.count_nonzero(stored) == len(last_wins) - (0.0 in last_wins.values())
    np.testing.assert_array_equal(stored[list(last_wins)], list(last_wins.values()))
    # a mixed batch: priorities only for its real items
    mixed = {**batch, "is_real": torch.tensor([True, False, True, False, True, False])}
    before = dm.buffer._tree.leaves.copy()
    assert dm.apply_feedback(mixed, {"priority": torch.full((6,), 9.0)})["applied"] == 3
    changed = np.flatnonzero(dm.buffer._tree.leaves != before)
    assert set(changed.tolist()) == set(batch["index"][mixed["is_real"]].tolist())
    dm.teardown("fit")


def _datamodule(tmp_path, rank: int, storage: bool = False) -> ReplayDataModule:
    dm = ReplayDataModule(
        EnvConfig("CartPole-v1", num_envs=2),
        batch_size=4,
        sampler=SequenceSampler(4),
        prefill=10,
        replay=ReplaySettings(
            capacity=60, prioritized=True, save=True, storage_dir=str(tmp_path / f"mm{rank}") if storage else None
        ),
    )
    dm.trainer = SimpleNamespace(
        global_rank=rank,
        world_size=2,
        global_step=0,
        datamodule=dm,
        ckpt_path=None,
        checkpoint_callback=SimpleNamespace(dirpath=str(tmp_path / "ckpt")),
        default_root_dir=str(tmp_path),
    )
    dm.setup("fit")
    return dm


def test_buffer_checkpoint_round_trip_is_bit_exact(tmp_path):
    dm = _datamodule(tmp_path, rank=1, storage=True)
    dm.collector.collect(40)  # wraps the 30-row rings
    buffer = dm.buffer
    chunk = {
        k: v[:, :1]
        for k, v in SequenceSampler(3).sample(buffer, 1).items()
        if k in ("obs", "reward", "is_first", "is_last", "is_terminal", "action")
    }
    buffer.add_many({k: v.transpose(0, 1) for k, v in chunk.items()}, streams=[1])  # heads now differ
    batch = dm.sample_batch()
    dm.apply_feedback(batch, {"priority": torch.linspace(0.5, 2.0, 4)})
    dm.trainer.global_step = 17
    checkpoint: dict = {}
    callback = BufferCheckpoint()
    callback.on_save_checkpoint(dm.trainer, None, checkpoint)
    path = tmp_path / "ckpt" / "replay_rank1_step17.pt"
    assert checkpoint["replay_buffers"] == {"step": 17, "dir": str((tmp_path / "ckpt").resolve()), "names": ["replay"]}
    stamp = path.stat().st_mtime_ns
    callback.on_save_checkpoint(dm.trainer, None, checkpoint)  # same step, unchanged: not written again
    assert path.stat().st_mtime_ns == stamp
    expected = buffer.state_dict()
    restored = _datamodule(tmp_path, rank=1)
    restored.trainer.ckpt_path = str(tmp_path / "ckpt" / "last.ckpt")
    BufferCheckpoint().on_load_checkpoint(restored.trainer, None, checkpoint)
    state = restored.buffer.state_dict()
    newest = (expected["pos"] - 1) % 30  # the restart closes each stream's episode at its newest row
    for key in ("is_last", "action"):
        expected["data"][key][torch.arange(2), newest] = key == "is_last"
    for key, value in expected.items():
        if key == "data":
            for k in value:
                assert torch.equal(state["data"][k], value[k]), k
        elif torch.is_tensor(value):
            assert torch.equal(state[key], value), key
        else:
            assert state[key] == value, key
    for a, b in ((dm.sample_batch(), restored.sample_batch()) for _ in range(3)):  # same RNG, same priorities
        assert torch.equal(a["index"], b["index"]) and torch.equal(a["weight"], b["weight"])
    for d in (dm, restored):
        d.teardown("fit")


def test_buffers_that_opt_out_are_not_saved(tmp_path):
    dm = _datamodule(tmp_path, rank=0)
    dm.buffer.checkpoint = False
    checkpoint: dict = {}
    BufferCheckpoint().on_save_checkpoint(dm.trainer, None, checkpoint)
    assert checkpoint == {} and not (tmp_path / "ckpt").exists()
    dm.teardown("fit")


def test_a_checkpoint_with_the_buffer_inline_still_restores_it(tmp_path):
    """Checkpoints written before BufferCheckpoint held rank 0's buffer in the datamodule state."""
    dm = _datamodule(tmp_path, rank=0)
    dm.collector.collect(12)
    old_state = {**dm.state_dict(), "buffer": dm.buffer.state_dict()}
    resumed = _datamodule(tmp_path, rank=0)
    resumed.load_state_dict(old_state)
    assert len(resumed.buffer) == len(dm.buffer) == 24 and resumed.collector.stats.env_steps == 24
    assert resumed.buffer.column("is_last")[[0, 1], resumed.buffer.newest].all()
    for d in (dm, resumed):
        d.teardown("fit")


@pytest.mark.slow
def test_the_sampler_is_chosen_on_the_command_line_by_short_name(monkeypatch, tmp_path):
    from lightning_wm.cli import main

    monkeypatch.chdir(tmp_path)
    args = [
        "fit",
        "--model",
        "support.tiny_agent.TinyAgent",
        "--data",
        "ReplayDataModule",
        "--data.env.id",
        "CartPole-v1",
        "--data.batch_size",
        "4",
        "--data.prefill",
        "32",
        "--data.sampler",
        "WindowSampler",
        "--data.sampler.num_unroll_steps",
        "3",
        "--data.sampler.td_steps",
        "2",
        "--trainer.max_steps",
        "2",
        "--trainer.limit_val_batches",
        "0",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger",
        "false",
    ]
    cli = main(args=args)
    sampler = cli.datamodule.sampler
    assert isinstance(sampler, WindowSampler) and sampler.window == 6
    assert cli.datamodule.sample_batch()["mask"].shape == (4, 6)
    with pytest.raises(SystemExit):  # the shorthand of the sampler is gone: an unknown option
        main(args=[*args, "--data.sequence_length", "8"])
