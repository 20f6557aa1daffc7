"""The online datamodules: one lifecycle (OnlineDataModule) over an acting part and a batch part;
the replay stream, the sampler set once, one rule for priorities and real_ratio, evaluation."""

from types import SimpleNamespace

import pytest
import torch

from lightning_wm.data.acting import InProcessActing, PoolActing
from lightning_wm.data.modules import ReplayDataModule, UnrollDataModule
from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.data.samplers import RowSampler, SequenceSampler, WindowSampler
from lightning_wm.data.settings import ActingSettings, EvalSettings, ModelReplaySettings, ReplaySettings
from lightning_wm.envs import EnvConfig
from lightning_wm.policies import RandomAgent
from lightning_wm.protocols import AgentSink, EnvStepCounter, ImaginationHost, SamplerSource


class ConstantAgent:
    """Always the same discrete action; no state."""

    def __init__(self, action: int = 0) -> None:
        self.action = action

    def initial_state(self, n):
        return None

    def act(self, obs, state, explore):
        return torch.full((obs.shape[0],), self.action, dtype=torch.long), state, {}


class WindowAgent(ConstantAgent):
    """An agent that names the sampler its batches need (a SamplerSource, as MuZero is)."""

    def replay_sampler(self):
        return WindowSampler(num_unroll_steps=3, td_steps=2, history=1)


def test_replay_stream_follows_replay_ratio():
    dm = ReplayDataModule(
        EnvConfig("CartPole-v1", num_envs=2),
        batch_size=3,
        sampler=SequenceSampler(4),
        prefill=20,
        replay_ratio=0.25,
        replay=ReplaySettings(capacity=1000),
    )
    dm.setup("fit")
    dm.attach_agent(ConstantAgent(), 0)
    stream = iter(dm.train_dataloader())
    batch = next(stream)
    assert batch["obs"].shape == (3, 4, 4) and batch["action"].shape == (3, 4)
    steps = dm.collector.stats.env_steps
    assert steps == dm.env_steps == 20 + 4  # prefill, then 1 / replay_ratio rows per batch
    for _ in range(5):
        next(stream)
    assert dm.collector.stats.env_steps == steps + 5 * 4
    dm.teardown("fit")
    assert dm.env_steps == steps + 5 * 4, "teardown closes the envs, the count stays"
    with pytest.raises(RuntimeError, match="setup"):
        dm.collect_for_batch()
    dm.setup("fit")  # a later fit acts in fresh envs and goes on counting
    next(iter(dm.train_dataloader()))
    assert dm.env_steps == steps + 6 * 4 and dm.collector.stats is dm.acting.stats
    dm.teardown("fit")


def test_replay_stream_of_single_transitions():
    dm = ReplayDataModule(
        EnvConfig("Pendulum-v1", num_envs=2), batch_size=5, sampler=RowSampler(), prefill=20, replay_ratio=0.5
    )
    dm.setup("fit")
    dm.attach_agent(RandomAgent(dm.spec, seed=0), 0)  # continuous actions
    batch = next(iter(dm.train_dataloader()))
    assert batch["obs"].shape == (5, 3) and batch["action"].shape == (5, 1) and batch["reward"].shape == (5,)
    assert dm.collector.stats.env_steps == 20 + 2
    dm.teardown("fit")


def test_replay_module_refuses_a_prefill_larger_than_the_buffer():
    with pytest.raises(ValueError, match=r"prefill \(500 rows\) exceeds the replay capacity \(100 rows\)"):
        ReplayDataModule(EnvConfig(id="CartPole-v1"), prefill=500, replay={"capacity": 100})


def test_prefill_must_fit_the_capacity_the_env_streams_can_use():
    """100 rows over 3 env streams are 3 rings of 33 rows: 99 usable. A prefill of 100 could never
    be reached, and the random policy would act before every batch for the whole run."""
    with pytest.raises(
        ValueError,
        match=r"prefill \(100 rows\) exceeds the replay capacity \(99 rows: 3 env streams "
        r"of 33 rows",
    ):
        ReplayDataModule(EnvConfig("CartPole-v1", num_envs=3), prefill=100, replay=ReplaySettings(capacity=100))

    dm = ReplayDataModule(
        EnvConfig("CartPole-v1", num_envs=3),
        prefill=99,
        batch_size=2,
        sampler=SequenceSampler(4),
        replay_ratio=0.25,
        replay=ReplaySettings(capacity=100),
    )
    dm.setup("fit")
    agent = ConstantAgent(1)
    dm.attach_agent(agent, 0)
    stream = iter(dm.train_dataloader())
    for batch in range(1, 7):
        next(stream)
        # the prefill once, then only the replay ratio's rows (4 per batch, in whole vector steps of 3)
        assert dm.collector.stats.env_steps == 99 + 3 * (4 * batch // 3)
        assert dm.collector.agent is agent
    assert len(dm.buffer) == 99
    dm.teardown("fit")


def test_acting_in_process_needs_an_attached_agent():
    """The datamodule never takes the module out of the trainer: without the AgentPublisher
    callback (or attach_agent) there is nothing to act with, and the error says so."""
    dm = ReplayDataModule(EnvConfig("CartPole-v1"), batch_size=2, prefill=10, sampler=SequenceSampler(2))
    dm.setup("fit")
    assert isinstance(dm, AgentSink) and isinstance(dm, EnvStepCounter) and isinstance(dm, ImaginationHost)
    with pytest.raises(RuntimeError, match="AgentPublisher"):
        dm.collect_for_batch()
    dm.teardown("fit")
    unrolls = UnrollDataModule(EnvConfig("CartPole-v1"), unroll_length=2, batch_size=1)
    unrolls.setup("fit")
    with pytest.raises(RuntimeError, match="attach_agent"):
        unrolls.next_batch()
    unrolls.teardown("fit")


def test_the_acting_part_follows_the_settings():
    replay = ReplayDataModule(EnvConfig("CartPole-v1", num_envs=2), prefill=10)
    assert isinstance(replay.acting, InProcessActing) and replay.acting.num_streams == 2
    actors = ReplayDataModule(
        EnvConfig("CartPole-v1", num_envs=2), prefill=10, acting={"num_actors": 3, "envs_per_actor": 4}
    )
    assert isinstance(actors.acting, PoolActing) and actors.acting.num_streams == 12
    assert actors.acting.chunk_length == 64 and actors.collector is None
    unrolls = UnrollDataModule(EnvConfig("CartPole-v1"), unroll_length=7, acting=ActingSettings(num_actors=1))
    assert unrolls.acting.chunk_length == 7 and unrolls.acting.overlap
    with pytest.raises(ValueError, match=r"acting.chunk_length does not apply to unrolls"):
        UnrollDataModule(EnvConfig("CartPole-v1"), acting=ActingSettings(num_actors=1, chunk_length=8))
    with pytest.raises(ValueError, match=r"acting.ratio_slack does not apply"):
        UnrollDataModule(EnvConfig("CartPole-v1"), acting={"ratio_slack": 8})


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ActingSettings(num_actors=-1), r"acting.num_actors must be >= 0, got -1"),
        (lambda: ActingSettings(backend="mpi"), r"acting\.backend must be one of \['local', 'ray'\], got 'mpi'"),
        (lambda: ActingSettings(timeout_s=0), r"acting.timeout_s must be > 0, got 0"),
        (lambda: ActingSettings(publish_every=0), r"acting.publish_every must be >= 1, got 0"),
        (lambda: EvalSettings(episodes=0), r"eval.episodes must be >= 1, got 0"),
        (lambda: ReplaySettings(capacity=0), r"replay.capacity must be >= 1, got 0"),
        (lambda: ReplaySettings(alpha=-1.0), r"replay.alpha and replay.beta must be >= 0, got -1.0, 0.4"),
        (lambda: ModelReplaySettings(sequence_length=0), r"model_replay.sequence_length must be >= 1, got 0"),
        (lambda: ReplayDataModule(acting={"queue": 1}), r"acting: unknown setting\(s\) \['queue'\]"),
    ],
)
def test_settings_groups_refuse_bad_values_in_one_line(make, message):
    with pytest.raises(ValueError, match=message) as err:
        make()
    assert "\n" not in str(err.value)


def test_the_sampler_is_set_once_by_the_agent_unless_given():
    """A replay datamodule without a sampler samples as the agent it acts for says (a
    SamplerSource); otherwise SequenceSampler(64); an explicit sampler wins over the agent's."""
    env = EnvConfig("CartPole-v1", num_envs=2)
    assert isinstance(WindowAgent(), SamplerSource) and not isinstance(ConstantAgent(), SamplerSource)
    derived = ReplayDataModule(env, batch_size=4, prefill=30)
    derived.setup("fit")
    derived.attach_agent(WindowAgent(), 0)
    sampler = derived.sampler
    assert isinstance(sampler, WindowSampler) and (sampler.num_unroll_steps, sampler.td_steps) == (3, 2)
    derived.attach_agent(derived.acting.agent, 1)  # the same agent again: the same sampler
    assert derived.sampler is sampler
    derived.collect_for_batch()
    assert derived.sample_batch()["mask"].shape == (4, 1 + 3 + 2 + 1)
    derived.teardown("fit")

    plain = ReplayDataModule(env, prefill=10)
    plain.attach_agent(ConstantAgent(), 0)
    assert isinstance(plain.sampler, SequenceSampler) and plain.sampler.length == 64

    explicit = ReplayDataModule(env, prefill=10, sampler=RowSampler())
    explicit.attach_agent(WindowAgent(), 0)
    assert isinstance(explicit.sampler, RowSampler)


def test_priorities_for_a_uniform_replay_are_an_error_at_the_first_batch():
    replay = ReplayDataModule(EnvConfig("CartPole-v1"), batch_size=2, prefill=10, sampler=SequenceSampler(2))
    replay.setup("fit")
    replay.attach_agent(ConstantAgent(), 0)
    replay.collect_for_batch()
    batch = replay.sample_batch()
    assert replay.apply_feedback(batch, {"loss": torch.tensor(0.0)}) == {"applied": 0, "stale": 0}
    with pytest.raises(ValueError, match=r"replay is uniform: set data.init_args.replay.prioritized: true"):
        replay.apply_feedback(batch, {"priority": torch.ones(2)})
    replay.teardown("fit")
    unrolls = UnrollDataModule(EnvConfig("CartPole-v1"), unroll_length=2, batch_size=1)
    with pytest.raises(ValueError, match=r"replay is uniform: set data.init_args.replay.prioritized: true"):
        unrolls.apply_feedback({"index": torch.zeros(1, dtype=torch.long)}, {"priority": torch.ones(1)})


@pytest.mark.parametrize("cls", [ReplayDataModule, UnrollDataModule])
def test_real_ratio_is_checked_by_both_datamodules(cls):
    dm = cls(EnvConfig("CartPole-v1"), **({"prefill": 10} if cls is ReplayDataModule else {}))
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"real_ratio must be in \[0, 1\]"):
            dm.set_imagination(None, bad)
    dm.set_imagination(None, 0.5)
    assert dm.imagination is None


def test_both_datamodules_evaluate_in_an_eval_env():
    """eval.env: the validation episodes play in another env (e.g. the real one while training in
    a dream); it must fit the training env's spaces."""
    real = EnvConfig("CartPole-v1", max_episode_steps=7, seed=3)
    for dm in (
        ReplayDataModule(EnvConfig("CartPole-v1"), prefill=10, eval={"episodes": 2, "envs": 2, "env": real}),
        UnrollDataModule(EnvConfig("CartPole-v1"), eval=EvalSettings(episodes=2, envs=2, env=real)),
    ):
        episodes = dm.evaluate(ConstantAgent())
        assert len(episodes) == 2 and all(e["length"] <= 7 for e in episodes)
        assert len(dm.evaluate(ConstantAgent(), episodes=1)) == 1
    with pytest.raises(ValueError, match=r"eval.env Pendulum-v1 .* does not fit env CartPole-v1"):
        ReplayDataModule(EnvConfig("CartPole-v1"), prefill=10, eval={"env": EnvConfig("Pendulum-v1")})


def test_unroll_counts_survive_a_checkpoint():
    """The acting part's env steps are checkpoint state of every online datamodule."""
    dm = UnrollDataModule(EnvConfig("CartPole-v1", num_envs=2), unroll_length=3, batch_size=2)
    dm.setup("fit")
    dm.attach_agent(ConstantAgent(), 0)
    dm.next_batch()
    state = dm.state_dict()
    assert dm.env_steps == 2 * 4 and state["stats"]["env_steps"] == 8
    resumed = UnrollDataModule(EnvConfig("CartPole-v1", num_envs=2), unroll_length=3, batch_size=2)
    resumed.load_state_dict(state)  # before setup: kept until setup builds the parts
    resumed.setup("fit")
    assert resumed.env_steps == 8 and resumed.pop_env_stats().env_steps == 8
    for d in (dm, resumed):
        d.teardown("fit")


def test_model_replay_needs_in_process_acting_and_room_for_a_sequence():
    with pytest.raises(ValueError, match=r"acting.num_actors: 0"):
        UnrollDataModule(EnvConfig("CartPole-v1"), model_replay={"capacity": 1000}, acting={"num_actors": 2})
    with pytest.raises(ValueError, match=r"model_replay.capacity \(40\) must hold model_replay.sequence_length"):
        UnrollDataModule(EnvConfig("CartPole-v1", num_envs=2), model_replay={"capacity": 40, "sequence_length": 32})
    dm = UnrollDataModule(
        EnvConfig("CartPole-v1", num_envs=2), unroll_length=4, batch_size=2, model_replay={"capacity": 200}
    )
    dm.setup("fit")
    assert isinstance(dm.model_buffer, ReplayBuffer) and dm.real_buffer() is dm.model_buffer
    dm.teardown("fit")


def test_ddp_side_files_follow_the_checkpoint_step(tmp_path):
    """Every rank keeps its buffer in a file per checkpoint step (BufferCheckpoint); resuming an
    older checkpoint loads that step's buffer, not the newest one."""
    from lightning_wm.callbacks import BufferCheckpoint

    def module(rank):
        dm = ReplayDataModule(
            EnvConfig(id="CartPole-v1", num_envs=2),
            prefill=20,
            batch_size=2,
            sampler=SequenceSampler(4),
            replay=ReplaySettings(capacity=1000, save=True),
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


@pytest.mark.slow
def test_seeded_fits_are_identical_run_to_run():
    """Two fits with the same seed: the same env rows, the same weights (seeds come from
    lightning_wm.seeding roles: train envs, prefill policy, replay sampler)."""
    import pytorch_lightning as pl

    from lightning_wm.cli import Trainer

    from support.tiny_agent import TinyAgent

    def fit():
        pl.seed_everything(7)
        dm = ReplayDataModule(
            EnvConfig("CartPole-v1", num_envs=2, seed=11),
            batch_size=4,
            sampler=SequenceSampler(8),
            prefill=40,
            replay_ratio=0.5,
            replay=ReplaySettings(capacity=500),
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
