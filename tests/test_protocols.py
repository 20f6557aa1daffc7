"""Protocols and callbacks: the env-stats logger, acting copies, evaluation requests."""

import pickle

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from lightning_wm.callbacks import EnvStatsLogger, default_callbacks
from lightning_wm.data.generations import GenerationDataModule
from lightning_wm.data.modules import ReplayDataModule, UnrollDataModule
from lightning_wm.data.offline import EpisodeDataModule
from lightning_wm.envs import EnvConfig, env_spec
from lightning_wm.protocols import (
    ActingAgent,
    Agent,
    AgentSink,
    EnvHolder,
    EnvStats,
    EnvStatsSource,
    EvaluationRequest,
    GenerationTask,
)

from support.tiny_agent import TinyAgent
from support.unit_fit import quiet_trainer

SPEC = env_spec(EnvConfig("CartPole-v1"))


class _Logged(TinyAgent):
    """TinyAgent on dummy batches that remembers what was logged and its env steps per step."""

    def __init__(self):
        super().__init__(SPEC)
        self.seen_env_steps: list[int] = []
        self.logged: dict[int, dict[str, float]] = {}

    def training_step(self, batch, batch_idx):
        self.seen_env_steps.append(self.env_steps)
        return self.net(batch).sum() * 0.0

    def log(self, name, value, *args, **kwargs):
        self.logged.setdefault(self.global_step, {})[name] = float(value)
        super().log(name, value, *args, **kwargs)


class _Stats(pl.LightningDataModule):
    """Every batch 10 env steps; an episode finishes every other batch; a gauge from batch 2 on."""

    def __init__(self):
        super().__init__()
        self.env_steps, self.pops = 0, 0

    def train_dataloader(self):
        return DataLoader(torch.zeros(100, 4), batch_size=None)

    def pop_env_stats(self) -> EnvStats:
        self.pops += 1
        if self.pops % 2 == 1:  # popped before and after each step: new data once per batch
            self.env_steps += 10
        episodes = [{"return": float(self.pops), "length": 5.0}] if self.pops % 4 == 1 else []
        metrics = {"actors/policy_lag": float(self.pops)} if self.pops > 2 else {}
        return EnvStats(self.env_steps, episodes, metrics)


def _fit(model, datamodule, steps, callbacks):
    trainer = quiet_trainer(
        max_steps=steps,
        log_every_n_steps=2,
        callbacks=callbacks,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule)
    return trainer


@pytest.mark.slow
def test_env_stats_logger_logs_env_and_actor_metrics_and_keeps_env_steps_current():
    model, dm = _Logged(), _Stats()
    assert isinstance(dm, EnvStatsSource)
    _fit(model, dm, 6, [EnvStatsLogger()])
    # the module sees the env steps taken for its batch before training on it
    assert model.seen_env_steps == [10, 20, 30, 40, 50, 60]
    assert sorted(model.logged) == [2, 4, 6], "logged every log_every_n_steps"
    first = model.logged[2]
    assert first["env/steps"] == 20
    # one episode (pop 1, before step 1) since the start; the next one (pop 5) comes before step 3
    assert first["env/episodes"] == 1 and first["env/episode_return"] == 1.0 and first["env/episode_length"] == 5
    assert first["actors/policy_lag"] == 4.0  # the latest gauge value
    later = model.logged[4]
    assert later["env/steps"] == 40 and later["env/episodes"] == 1 and later["env/episode_return"] == 5.0


@pytest.mark.slow
def test_env_stats_logger_ignores_a_datamodule_without_the_protocol():
    model = _Logged()

    class Plain(pl.LightningDataModule):
        def train_dataloader(self):
            return DataLoader(torch.zeros(10, 4), batch_size=None)

    assert not isinstance(Plain(), EnvStatsSource)
    _fit(model, Plain(), 3, [EnvStatsLogger()])
    assert model.seen_env_steps == [0, 0, 0]
    assert not any(k.startswith("env/") for logs in model.logged.values() for k in logs)


def test_cli_trainer_adds_the_default_callbacks_once():
    from lightning_wm.cli import Trainer

    trainer = Trainer(logger=False, enable_checkpointing=False, callbacks=[EnvStatsLogger()])
    assert sum(isinstance(c, EnvStatsLogger) for c in trainer.callbacks) == 1
    assert {type(c) for c in default_callbacks()} <= {type(c) for c in Trainer(logger=False).callbacks}


@pytest.mark.slow
def test_acting_copy_is_a_frozen_cpu_agent_without_the_trainer():
    model = _Logged()
    trainer = _fit(model, _Stats(), 1, [])
    assert model.training is True
    clone = model.acting_copy()
    assert isinstance(model, ActingAgent) and isinstance(clone, Agent)
    assert clone._trainer is None and model._trainer is trainer
    assert not clone.training and all(not p.requires_grad for p in clone.parameters())
    assert all(p.requires_grad for p in model.parameters()), "the learner's own module is untouched"
    assert list(clone.state_dict()) == list(model.state_dict()) == list(model.acting_copy().state_dict())
    clone = pickle.loads(pickle.dumps(clone))  # spawn-safe
    obs = torch.randn(3, 4)
    torch.testing.assert_close(clone.act(obs, None, False)[0], model.act(obs, None, False)[0])


def test_online_datamodules_validate_with_one_evaluation_request():
    replay = ReplayDataModule(
        EnvConfig("CartPole-v1"), prefill=10, replay={"capacity": 100}, eval={"episodes": 2, "envs": 2}
    )
    generations = GenerationDataModule(EnvConfig("CartPole-v1"), eval={"episodes": 3, "envs": 3})
    assert isinstance(replay, EnvStatsSource) and isinstance(replay, EnvHolder) and isinstance(generations, EnvHolder)
    assert not isinstance(generations, EnvStatsSource)
    assert generations.eval.envs == 3 and GenerationDataModule(eval={"episodes": 4}).eval.envs == 10, "its own defaults"
    agent = TinyAgent(SPEC)
    for dm, episodes in ((replay, 2), (generations, 3)):
        batches = list(dm.val_dataloader())
        assert len(batches) == 1 and isinstance(batches[0], EvaluationRequest)
        finished = batches[0].run(agent)
        assert len(finished) == episodes and all(e["length"] > 0 for e in finished)
        assert len(batches[0].run(agent, episodes=1)) == 1
    task = next(iter(generations.train_dataloader()))
    assert isinstance(task, GenerationTask) and task.index == 0 and task.env == generations.env


def test_validation_step_needs_an_evaluation_request():
    with pytest.raises(TypeError, match="EvaluationRequest"):
        TinyAgent(SPEC).validation_step({"obs": torch.zeros(1)}, 0)


def test_online_datamodules_take_their_agent_through_attach_agent():
    """AgentSink is the declared way an acting part gets its agent (the AgentPublisher callback
    calls it); no other datamodule claims it."""
    for dm in (ReplayDataModule(EnvConfig("CartPole-v1"), prefill=10), UnrollDataModule(EnvConfig("CartPole-v1"))):
        assert isinstance(dm, AgentSink)
        agent = TinyAgent(SPEC)
        dm.attach_agent(agent, 3)
        assert dm.acting.agent is agent and dm.acting.version == 3, "in process: the live module itself"
    assert not isinstance(GenerationDataModule(EnvConfig("CartPole-v1")), AgentSink)


def test_episode_datamodule_holds_an_env_but_reports_no_env_stats(tmp_path):
    dm = EpisodeDataModule(str(tmp_path), env=EnvConfig("CartPole-v1"))
    assert isinstance(dm, EnvHolder) and dm.env.id == "CartPole-v1"
    assert not isinstance(dm, EnvStatsSource)
