"""DataModules: the offline episode streams and the online replay stream."""

import numpy as np
import pytest
import torch

from lightning_wm.data.episodes import EpisodeStore
from lightning_wm.data.modules import EpisodeDataModule, ReplayDataModule, _EpisodeStream, split_episodes
from lightning_wm.envs import EnvConfig


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


class ConstantAgent:
    """Always the same discrete action; no state."""

    def __init__(self, action: int = 0) -> None:
        self.action = action

    def initial_state(self, n):
        return None

    def act(self, obs, state, explore):
        return torch.full((obs.shape[0],), self.action, dtype=torch.long), state, {}


def test_replay_stream_follows_replay_ratio():
    dm = ReplayDataModule(
        EnvConfig("CartPole-v1", num_envs=2),
        capacity=1000,
        batch_size=3,
        sequence_length=4,
        prefill=20,
        replay_ratio=0.25,
    )
    dm.setup("fit")
    dm.collector.agent = ConstantAgent()
    dm._agent = lambda: dm.collector.agent
    stream = iter(dm.train_dataloader())
    batch = next(stream)
    assert batch["obs"].shape == (3, 4, 4) and batch["action"].shape == (3, 4)
    steps = dm.collector.stats.env_steps
    assert steps == 20 + 4  # prefill, then 1 / replay_ratio rows per batch
    for _ in range(5):
        next(stream)
    assert dm.collector.stats.env_steps == steps + 5 * 4
    dm.teardown("fit")


def test_replay_stream_of_single_transitions():
    dm = ReplayDataModule(
        EnvConfig("Pendulum-v1", num_envs=2),
        capacity=1000,
        batch_size=5,
        sequence_length=1,
        sample="transitions",
        prefill=20,
        replay_ratio=0.5,
    )
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["obs"].shape == (5, 3) and batch["action"].shape == (5, 1) and batch["reward"].shape == (5,)
    assert dm.collector.stats.env_steps == 20 + 2
    dm.teardown("fit")


def test_replay_module_refuses_a_prefill_larger_than_the_buffer():
    with pytest.raises(ValueError, match=r"prefill \(500 rows\) exceeds the replay capacity \(100 rows\)"):
        ReplayDataModule(EnvConfig(id="CartPole-v1"), capacity=100, prefill=500)


def test_prefill_must_fit_the_capacity_the_env_streams_can_use():
    """100 rows over 3 env streams are 3 rings of 33 rows: 99 usable. A prefill of 100 could never
    be reached, and the random policy would act before every batch for the whole run."""
    with pytest.raises(
        ValueError,
        match=r"prefill \(100 rows\) exceeds the replay capacity \(99 rows: 3 env streams "
        r"of 33 rows",
    ):
        ReplayDataModule(EnvConfig("CartPole-v1", num_envs=3), capacity=100, prefill=100)

    dm = ReplayDataModule(
        EnvConfig("CartPole-v1", num_envs=3),
        capacity=100,
        prefill=99,
        batch_size=2,
        sequence_length=4,
        replay_ratio=0.25,
    )
    dm.setup("fit")
    agent = ConstantAgent(1)
    dm._agent = lambda: agent
    stream = iter(dm.train_dataloader())
    for batch in range(1, 7):
        next(stream)
        # the prefill once, then only the replay ratio's rows (4 per batch, in whole vector steps of 3)
        assert dm.collector.stats.env_steps == 99 + 3 * (4 * batch // 3)
        assert dm.collector.agent is agent
    assert len(dm.buffer) == 99
    dm.teardown("fit")


def test_ddp_side_files_follow_the_checkpoint_step(tmp_path):
    """Every rank keeps its buffer in a file per checkpoint step (BufferCheckpoint); resuming an
    older checkpoint loads that step's buffer, not the newest one."""
    from types import SimpleNamespace

    from lightning_wm.callbacks import BufferCheckpoint

    def module(rank):
        dm = ReplayDataModule(
            EnvConfig(id="CartPole-v1", num_envs=2),
            capacity=1000,
            prefill=20,
            batch_size=2,
            sequence_length=4,
            save_buffer=True,
        )
        dm.trainer = SimpleNamespace(
            global_rank=rank,
            world_size=2,
            global_step=0,
            datamodule=dm,
            ckpt_path=None,
            checkpoint_callback=SimpleNamespace(dirpath=str(tmp_path)),
            default_root_dir=".",
        )
        dm.setup("fit")
        return dm

    dm, callback = module(1), BufferCheckpoint()
    checkpoints, sizes = {}, {}
    for step in (10, 20, 30):
        dm.collector.collect(step)
        dm.trainer.global_step = step
        checkpoints[step] = {"ReplayDataModule": dm.state_dict()}
        callback.on_save_checkpoint(dm.trainer, None, checkpoints[step])
        sizes[step] = len(dm.buffer)
        assert "buffer" not in checkpoints[step]["ReplayDataModule"]
        assert checkpoints[step]["replay_buffers"]["step"] == step
    assert sorted(p.name for p in tmp_path.glob("replay_rank1_*")) == [
        "replay_rank1_step20.pt",
        "replay_rank1_step30.pt",
    ]
    resumed = module(1)
    BufferCheckpoint().on_load_checkpoint(resumed.trainer, None, checkpoints[20])
    assert len(resumed.buffer) == sizes[20] < sizes[30]
    older = module(1)
    with pytest.warns(UserWarning, match="no replay file replay_rank1_step10.pt"):
        BufferCheckpoint().on_load_checkpoint(older.trainer, None, checkpoints[10])  # pruned: starts afresh
    assert len(older.buffer) == 0


def test_seeded_fits_are_identical_run_to_run(monkeypatch):
    """Two fits with the same seed: the same env rows, the same weights (seeds come from
    lightning_wm.seeding roles: train envs, prefill policy, replay sampler)."""
    import pytorch_lightning as pl

    from lightning_wm.cli import Trainer

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    from tiny_agent import TinyAgent

    def fit():
        pl.seed_everything(7)
        dm = ReplayDataModule(
            EnvConfig("CartPole-v1", num_envs=2, seed=11),
            capacity=500,
            batch_size=4,
            sequence_length=8,
            prefill=40,
            replay_ratio=0.5,
        )
        model = TinyAgent(dm.spec)
        Trainer(
            max_steps=12,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
        ).fit(model, dm)
        return model.state_dict(), dm.buffer.state_dict()["data"]

    (w1, d1), (w2, d2) = fit(), fit()
    for key in w1:
        assert torch.equal(w1[key], w2[key]), key
    for key in d1:
        assert torch.equal(torch.as_tensor(d1[key]), torch.as_tensor(d2[key])), key
