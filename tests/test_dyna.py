"""Dyna with IMPALA: imagined unrolls mixed into UnrollDataModule batches at real_ratio, and the
DynaLearner (IMPALA + a Dreamer world model trained beside it) from configs/impala/cartpole_dyna.yaml."""

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_wm.agents.dreamer import Dreamer
from lightning_wm.agents.dyna import DynaLearner, DynaOptimSettings, DynaWorldModel, ImaginationSettings
from lightning_wm.agents.impala import IMPALA
from lightning_wm.cli import main
from lightning_wm.data.modules import UnrollDataModule
from lightning_wm.envs import EnvConfig
from lightning_wm.optim import GradClipSettings, OptimSettings
from lightning_wm.world_model import RolloutSchedule, WorldModel

from support.presets import DREAMER_TINY, IMPALA_TINY, UNROLL_DATA_TINY, data_overrides, overrides

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs/impala/cartpole_dyna.yaml")
SHRINK = [
    "--trainer.max_steps",
    "10",
    "--trainer.val_check_interval",
    "10",
    "--trainer.log_every_n_steps",
    "1",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.run_name",
    "run",
    *data_overrides(UNROLL_DATA_TINY),
    "--data.init_args.batch_size",
    "4",  # twice the preset's: at real_ratio 0.5, 2 real and 2 imagined unrolls per batch
    "--data.init_args.model_replay.capacity",
    "1000",
    "--data.init_args.model_replay.batch_size",
    "2",
    "--data.init_args.model_replay.sequence_length",
    "8",
    "--model.init_args.model_train_start",
    "16",
    "--model.init_args.train_freq",
    "16",
    "--model.init_args.rollout.min_length",
    "3",
    "--model.init_args.rollout.max_length",
    "3",
    "--model.init_args.imagination.rollout_batch_size",
    "8",
    "--model.init_args.imagination.real_ratio",
    "0.5",
    *overrides({"net": DREAMER_TINY["net"]}, "--model.init_args.world_model.init_args"),  # the policy: the config's
]


class StepModel(nn.Module, WorldModel):
    """CartPole-shaped toy dynamics: the state is the observation, nudged by the action."""

    def __init__(self):
        super().__init__()
        self.push = nn.Parameter(torch.tensor([0.1, 0.0, 0.0, 0.0]))

    def initial_state(self, obs):
        return obs.float()

    def step(self, state, action, generator=None):
        nxt = state + (action[:, 1:2] - action[:, :1]) * self.push
        return torch.ones(len(state)), nxt, torch.zeros(len(state))

    def features(self, state):
        return state

    def decode(self, state):
        return state


def test_imagined_unrolls_fill_batches_at_real_ratio():
    """With an imagination set, a batch of 8 unrolls holds round(0.25 * 8) = 2 real ones (so only
    their env steps are taken) and 6 windows of T+1 imagined rows, all with the real unrolls' keys."""
    dm = UnrollDataModule(
        EnvConfig("CartPole-v1", num_envs=2), unroll_length=4, batch_size=8, model_replay={"capacity": 200}
    )
    policy = IMPALA(dm.spec, net=IMPALA_TINY["net"])
    dm.setup("fit")
    dm.attach_agent(policy, 0)
    try:
        first = dm.next_batch()
        assert "is_real" not in first and first["obs"].shape == (8, 5, 4), "all real without imagination"
        assert "model" not in first, "no model sequences while the replay holds < model_sequence_length rows per env"
        rows_before = len(dm.model_buffer)
        assert rows_before > 0, "real rows reach the world model's replay"
        dyna = DynaWorldModel(
            StepModel(),
            dm.spec,
            ImaginationSettings(real_ratio=0.25, rollout_batch_size=10),
            RolloutSchedule(0, 0, 6, 6),
            seed=0,
        )
        img = dyna.fill_img_buffer(policy, dm.real_buffer(), None, envstep=0, policy_version=9)
        dm.set_imagination(img, dyna.real_ratio)
        steps_before = dm.pop_env_stats().env_steps
        for _ in range(3):
            batch = dm.next_batch()
            assert batch["is_real"].tolist() == [True] * 2 + [False] * 6
            assert batch["obs"].shape == (8, 5, 4) and batch["logits"].shape == (8, 5, 2)
            assert (batch["policy_version"][~batch["is_real"]] == 9).all()
        # 3 batches x 2 real unrolls x 4 steps: at most one chunk of 2 envs x 4 steps per 2 unrolls
        assert dm.pop_env_stats().env_steps - steps_before <= 3 * 2 * 4 + 2 * 5
        loss, logs = policy.learner_loss(batch)
        assert torch.isfinite(loss) and "policy_loss" in logs
    finally:
        dm.teardown("fit")


def test_dyna_learner_takes_a_step_by_hand_without_a_trainer():
    """The fast lane's check: a DynaLearner of tiny parts builds; through the optimizers it
    configures, its world model takes a step on real sequences of the model replay and its policy
    one on a batch of real and imagined unrolls (what its training_step does under a Trainer)."""
    dm = UnrollDataModule(
        EnvConfig("CartPole-v1", num_envs=2, seed=0),
        unroll_length=4,
        batch_size=4,
        model_replay={"capacity": 200, "batch_size": 2, "sequence_length": 8},
    )
    learner = DynaLearner(
        dm.spec,
        policy=lambda s: IMPALA(s, net=IMPALA_TINY["net"]),
        world_model=lambda s: Dreamer(s, **DREAMER_TINY),
        rollout={"start_step": 0, "end_step": 0, "min_length": 3, "max_length": 3},
        imagination={"real_ratio": 0.5, "rollout_batch_size": 8},
    )
    (policy_opt, model_opt), _ = learner.configure_optimizers()
    before = {k: v.clone() for k, v in learner.state_dict().items()}
    dm.setup("fit")
    dm.attach_agent(learner, 0)
    try:
        batch = dm.next_batch()
        for _ in range(10):  # until the model replay holds a sequence per env
            if "model" in batch:
                break
            batch = dm.next_batch()
        loss, _, _ = learner.world_model.world_model_loss(batch["model"])
        model_opt.zero_grad()
        loss.backward()
        model_opt.step()
        img = learner.dyna.fill_img_buffer(learner.policy, dm.real_buffer(), None, envstep=0, policy_version=1)
        dm.set_imagination(img, learner.dyna.real_ratio)
        batch = dm.next_batch()
        batch.pop("model", None)
        assert batch["is_real"].tolist() == [True, True, False, False]
        loss, logs = learner.policy.learner_loss(batch, 0)
        assert torch.isfinite(loss) and "policy_loss" in logs
        policy_opt.zero_grad()
        loss.backward()
        policy_opt.step()
    finally:
        dm.teardown("fit")
    for part in ("policy.", "world_model.wm."):
        assert any(not torch.equal(before[k], v) for k, v in learner.state_dict().items() if k.startswith(part)), part


def test_unroll_imagination_needs_in_process_acting():
    with pytest.raises(ValueError, match="num_actors: 0"):
        UnrollDataModule(EnvConfig("CartPole-v1"), acting={"num_actors": 2}, model_replay={"capacity": 1000})
    dm = UnrollDataModule(EnvConfig("CartPole-v1"))
    with pytest.raises(ValueError, match=r"model_replay.capacity > 0"):
        dm.real_buffer()


def test_dyna_learner_checks_its_parts_and_checkpoints_its_cadence():
    dm = UnrollDataModule(EnvConfig("CartPole-v1"))
    with pytest.raises(ValueError, match="world_model"):
        DynaLearner(dm.spec, policy=lambda s: IMPALA(s), world_model=lambda s: IMPALA(s))

    def build():
        return DynaLearner(
            dm.spec,
            policy=lambda s: IMPALA(
                s, net=IMPALA_TINY["net"], optim=OptimSettings(clip=GradClipSettings(type="clip_norm"))
            ),
            world_model=lambda s: Dreamer(s, **DREAMER_TINY),
            model_train_start=100,
        )

    learner = build()
    assert learner.dyna.should_train(350) and not learner.dyna.should_train(349), "first fill after the warm-up"
    learner.dyna.trained(700)
    checkpoint = {}
    learner.on_save_checkpoint(checkpoint)
    assert "grad_clipper" in checkpoint, "the policy's own checkpoint hook runs"
    restored = build()
    restored.on_load_checkpoint(checkpoint)
    assert restored.dyna.state_dict() == learner.dyna.state_dict()


def test_dyna_learner_settings_groups_and_the_world_model_optimizer():
    """Groups from mappings keep their other defaults; the world model's optimizer is Dyna's own
    (``optim.model``: Adam over the model's parameters, clipped at the norm given), next to the
    policy's; the checkpoint keeps the groups as plain dicts."""
    dm = UnrollDataModule(EnvConfig("CartPole-v1"))
    learner = DynaLearner(
        dm.spec,
        policy=lambda s: IMPALA(s, net=IMPALA_TINY["net"]),
        world_model=lambda s: Dreamer(s, **DREAMER_TINY),
        rollout={"start_step": 0, "end_step": 0, "min_length": 3, "max_length": 3},
        imagination={"real_ratio": 0.5},
        optim={"model": {"lr": 3e-4}},
    )
    assert learner.optim == DynaOptimSettings(OptimSettings(lr=3e-4, clip=GradClipSettings("clip_norm", 1000.0)))
    assert learner.dyna.real_ratio == 0.5 and learner.dyna.rollout_batch_size == 100_000
    assert learner.dyna.rollout_length_scheduler(10**6) == 3
    assert learner.hparams["imagination"]["real_ratio"] == 0.5 and learner.hparams["optim"]["model"]["lr"] == 3e-4
    (policy_opt, model_opt), schedulers = learner.configure_optimizers()
    model_params = {id(p) for p in learner.world_model.wm.parameters()}
    assert {id(p) for g in model_opt.param_groups for p in g["params"]} == model_params
    assert model_opt.param_groups[0]["lr"] == 3e-4 and model_opt.param_groups[0]["eps"] == 1e-8
    assert policy_opt.param_groups[0]["lr"] == 0.0005 and schedulers == []
    assert learner.model_clipper.grad_clip_type == "clip_norm" and learner.model_clipper.clip_value == 1000.0
    with pytest.raises(ValueError, match="imagination.real_ratio"):
        DynaLearner(dm.spec, policy=IMPALA, world_model=Dreamer, imagination={"real_ratio": 2.0})


@pytest.mark.slow
def test_cartpole_dyna_config_fits_with_imagination_and_evaluates(capsys):
    cli = main(args=["fit", "--config", CONFIG, *SHRINK])
    assert cli.trainer.global_step == 10
    logged = cli.trainer.logged_metrics
    assert float(logged["imagination/fills"]) >= 1 and float(logged["imagination/rows"]) > 0
    assert float(logged["train/real_fraction"]) == 0.5, "real_ratio holds in the learner's batches"
    for key in ("train/loss_model", "train/policy_loss", "env/steps", "val/return"):
        assert key in logged, f"{key} not logged"
    policy, world_model = cli.model.policy, cli.model.world_model
    assert isinstance(policy, IMPALA) and policy.net_settings.hidden == 64 and policy.optim.lr == 0.002
    # modules built inside the learner record their own settings, not the learner's
    assert policy.hparams["optim"]["lr"] == 0.002 and "imagination" not in policy.hparams
    assert world_model.hparams["net"]["deter"] == 16 and "policy" not in world_model.hparams
    assert cli.model.optim.model.lr == 1e-3 and cli.model.imagination.burn_in == 8
    assert not cli.datamodule.imagination.checkpoint
    main(args=["evaluate", "--config", CONFIG, *SHRINK, "--ckpt_path", "last", "--episodes", "1"])
    assert "return" in capsys.readouterr().out


def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.slow
def test_seeded_dyna_fits_repeat_exactly(tmp_path, monkeypatch):
    """The imagination (model transitions, sampled terminations, the imagination buffer's draws)
    follows the run's seed, so two fits of the config end with the same weights, also when one of
    them evaluates the model every 16 env steps; another seed does not."""
    monkeypatch.chdir(tmp_path)
    args = [
        "fit",
        "--config",
        CONFIG,
        *SHRINK,
        "--trainer.max_steps",
        "6",
        "--trainer.val_check_interval",
        "6",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.logger",
        "false",
    ]
    runs, evaluated = [], []
    for seed, eval_freq in ((3, 10**9), (3, 16), (4, 10**9)):
        cli = main(args=[*args, "--seed_everything", str(seed), "--model.init_args.eval_freq", str(eval_freq)])
        runs.append(_weights(cli.model))
        evaluated.append("world_model/eval_reward_mse" in cli.trainer.callback_metrics)
    assert evaluated == [False, True, False], "the second run evaluates the model on real rows"
    # the same weights: evaluating the model changes nothing about training
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert not all(torch.equal(runs[0][k], runs[2][k]) for k in runs[0])


@pytest.mark.slow
def test_the_world_models_rows_resume_with_model_replay_save(tmp_path, monkeypatch):
    """``model_replay.save``: the world model's real rows are saved beside the checkpoint and a
    resumed fit goes on with them (without it they start empty and refill as it acts)."""
    monkeypatch.chdir(tmp_path)
    args = [
        "fit",
        "--config",
        CONFIG,
        *SHRINK,
        "--data.init_args.model_replay.save",
        "true",
        "--trainer.logger",
        "false",
    ]
    first = main(args=args)
    saved_rows, saved_steps = len(first.datamodule.model_buffer), int(first.model.env_steps)
    assert saved_rows > 0 and list(tmp_path.rglob("model_rank0_step10.pt")), "the rows are saved beside the checkpoint"
    resumed = main(args=[*args, "--trainer.max_steps", "12", "--ckpt_path", "last"])
    acted_since = int(resumed.model.env_steps) - saved_steps
    assert 0 < acted_since < len(resumed.datamodule.model_buffer) <= saved_rows + acted_since
