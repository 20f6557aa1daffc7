"""The IMPALA LightningModule on the UnrollDataModule: every config from the CLI with and without
actor processes, determinism, the encoder injection point, priorities and their feedback, and
two DDP ranks ending with identical weights."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from lightning_wm.agents.impala import IMPALA, ActorCriticSettings, unroll_loss
from lightning_wm.cli import main
from lightning_wm.data.modules import UnrollDataModule
from lightning_wm.envs import EnvConfig
from lightning_wm.optim import OptimSettings

from support.presets import IMPALA_TINY, UNROLL_DATA_TINY, data_overrides, model_overrides
from support.unit_fit import fit_quietly

ROOT = Path(__file__).resolve().parents[1]
SHRINK = [
    "--trainer.max_steps",
    "3",
    "--trainer.val_check_interval",
    "3",
    "--trainer.log_every_n_steps",
    "1",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.run_name",
    "run",
    *data_overrides(UNROLL_DATA_TINY),
    *model_overrides(IMPALA_TINY),
]


@pytest.mark.slow
@pytest.mark.parametrize("num_actors", [0, 2])
@pytest.mark.parametrize("name", ["cartpole", "pendulum", "pong", "pong_cpu"])
def test_config_fits_and_evaluates_from_the_cli(name, num_actors, capsys):
    if name == "pong":
        pytest.importorskip("cv2", reason="Pong goes through AtariPreprocessing, which needs opencv (.[atari])")
    if name == "pong_cpu":
        pytest.importorskip("envpool", reason="pong_cpu.yaml steps EnvPool's envs (.[envpool])")
    config = str(ROOT / f"configs/impala/{name}.yaml")
    extra = ["--trainer.accelerator", "cpu", "--model.init_args.net.fc_size", "32"] if name.startswith("pong") else []
    cli = main(args=["fit", "--config", config, *SHRINK, *extra, "--data.init_args.acting.num_actors", str(num_actors)])
    assert cli.trainer.global_step == 3
    logged = cli.trainer.logged_metrics
    for key in (
        "train/total_loss",
        "train/policy_loss",
        "train/value_loss",
        "train/entropy_loss",
        "train/cur_lr",
        "train/rho_mean",
        "train/rho_clipped_fraction",
        "train/policy_lag",
        "env/steps",
        "val/return",
    ):
        assert key in logged, f"{key} not logged"
    replay = cli.datamodule.replay
    uses = replay.max_use if replay.capacity else 1  # a replayed unroll serves max_use batches
    assert float(logged["env/steps"]) * uses >= 3 * 2 * 4
    if num_actors:
        assert "actors/frames_per_s" in logged and "actors/policy_lag" in logged
        assert cli.datamodule.acting.pool is None, "the actors were stopped"
    main(args=["evaluate", "--config", config, *SHRINK, *extra, "--ckpt_path", "last", "--episodes", "1"])
    assert "return" in capsys.readouterr().out


def test_one_training_step_on_unrolls_acted_in_process_without_a_trainer():
    """The fast lane's check: IMPALA builds, acts a batch of unrolls in process, and one
    optimizer step on the V-trace loss of its training_step changes its weights."""
    dm = UnrollDataModule(EnvConfig("CartPole-v1", num_envs=2, seed=0), unroll_length=4, batch_size=2)
    model = IMPALA(dm.spec, net=ActorCriticSettings(**IMPALA_TINY["net"]))
    model.log = model.log_dict = lambda *args, **kwargs: None  # training_step outside a Trainer
    dm.setup("fit")
    dm.attach_agent(model, 0)
    try:
        batch = dm.next_batch()
    finally:
        dm.teardown("fit")
    assert batch["obs"].shape == (2, 5, 4) and batch["logits"].shape == (2, 5, 2)
    config = model.configure_optimizers()
    optimizer = config["optimizer"] if isinstance(config, dict) else config
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss = model.training_step(batch, 0)["loss"]
    assert torch.isfinite(loss)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def _fit(seed: int, steps: int = 6, **data_kwargs) -> tuple[IMPALA, list[dict], UnrollDataModule]:
    pl.seed_everything(seed)
    dm = UnrollDataModule(EnvConfig("CartPole-v1", num_envs=3, seed=seed), unroll_length=5, batch_size=3, **data_kwargs)
    model = IMPALA(
        dm.spec,
        net=ActorCriticSettings(**IMPALA_TINY["net"]),
        optim=OptimSettings(lr=0.01),
        priority=data_kwargs.get("replay", {}).get("prioritized", False),
    )
    outputs: list[dict] = []

    class Keep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, out, batch, batch_idx):
            outputs.append(
                {
                    "out": {k: v.detach().clone() for k, v in out.items()},
                    "batch": {k: v.clone() for k, v in batch.items()},
                }
            )

    fit_quietly(model, dm, steps, Keep())
    return model, outputs, dm


@pytest.mark.slow
def test_same_seed_gives_bit_identical_weights_in_process():
    (a, *_), (b, *_), (c, *_) = _fit(0), _fit(0), _fit(1)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), f"{name} differs between two runs of one seed"
    assert not all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values()))


@pytest.mark.slow
def test_priorities_come_back_to_the_unroll_replay(monkeypatch):
    applied = []
    original = UnrollDataModule.apply_feedback

    def spy(self, batch, feedback):
        result = original(self, batch, feedback)
        applied.append((batch["index"].clone(), feedback["priority"].clone(), result))
        return result

    monkeypatch.setattr(UnrollDataModule, "apply_feedback", spy)
    _, outputs, _ = _fit(0, steps=8, replay={"capacity": 12, "max_use": 3, "prioritized": True})
    for item in outputs:
        batch, out = item["batch"], item["out"]
        assert out["priority"].shape == (3,) and (out["priority"] >= 0).all()
        assert "weight" in batch and batch["index"].shape == (3,)
    # the ReplayFeedback callback (in the default callbacks) hands every step's priorities back
    assert len(applied) == 8
    for (index, priority, result), item in zip(applied, outputs):
        assert torch.equal(index, item["batch"]["index"]) and torch.equal(priority, item["out"]["priority"])
        assert result["applied"] + result["stale"] == 3
    assert sum(r["applied"] for *_, r in applied) > 0
    # the datamodule hands priorities of a batch's unrolls to its replay
    dm = UnrollDataModule(
        EnvConfig("CartPole-v1", num_envs=3),
        unroll_length=5,
        batch_size=3,
        replay={"capacity": 12, "max_use": 2, "prioritized": True},
    )
    batcher = dm.batcher
    batcher.add({"x": np.zeros((6, 3))})
    batch = batcher.batch()
    assert dm.apply_feedback(batch, {"priority": torch.tensor([4.0, 0.5, 0.5])}) == {"applied": 3, "stale": 0}
    assert list(batcher._priority)[0] == pytest.approx(4.0, abs=1e-5)
    plain = UnrollDataModule(EnvConfig("CartPole-v1"), unroll_length=5, batch_size=3)
    with pytest.raises(ValueError, match="prioritized: true"):
        plain.apply_feedback(batch, {"priority": torch.ones(3)})


@pytest.mark.slow
def test_priority_and_is_weights_in_the_training_step():
    spec = UnrollDataModule(EnvConfig("CartPole-v1")).spec
    with pytest.raises(ValueError, match="needs priority: true"):
        IMPALA(spec, priority_is_weight=True)
    _, outputs, _ = _fit(0, steps=2)
    batch = outputs[0]["batch"]
    torch.manual_seed(0)
    model = IMPALA(spec, net=ActorCriticSettings(**IMPALA_TINY["net"]), priority=True, priority_is_weight=True)
    with pytest.raises(ValueError, match="no importance weights"):
        model.training_step(batch, 0)
    weight = torch.tensor([1.0, 0.25, 0.0])
    out = model.training_step({**batch, "weight": weight}, 0)
    want = unroll_loss(model.net, batch, model.loss, weight)
    assert torch.equal(out["loss"], want.total_loss) and torch.equal(out["priority"], want.priority)
    assert not torch.equal(out["loss"], unroll_loss(model.net, batch, model.loss).total_loss)
    unweighted = IMPALA(spec, net=ActorCriticSettings(**IMPALA_TINY["net"]), priority=True)
    unweighted.load_state_dict(model.state_dict())
    out = unweighted.training_step({**batch, "weight": weight}, 0)  # weights in the batch, not asked for
    assert torch.equal(out["loss"], unroll_loss(model.net, batch, model.loss).total_loss)


@pytest.mark.slow
def test_encoder_injection_from_the_command_line():
    cli = main(
        args=[
            "fit",
            "--config",
            str(ROOT / "configs/impala/cartpole.yaml"),
            *SHRINK,
            "--data.init_args.acting.num_actors",
            "0",
            "--model.init_args.encoder",
            "support.impala_encoders.SumEncoder",
            "--model.init_args.encoder.init_args.width",
            "5",
            "--trainer.limit_val_batches",
            "0",
        ]
    )
    net = cli.model.net
    assert type(net.encoder).__name__ == "SumEncoder" and net.value.in_features == 5
    assert cli.trainer.global_step == 3


DDP_SCRIPT = ROOT / "tests" / "support" / "impala_ddp_fit.py"


@pytest.mark.slow
def test_ddp_ranks_with_their_own_actors_end_identical(tmp_path):
    out = subprocess.run(
        [sys.executable, str(DDP_SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for name, weight in ranks[0]["weights"].items():
        assert torch.equal(weight, ranks[1]["weights"][name]), f"{name} differs between the ranks"
    assert ranks[0]["obs_sum"] != ranks[1]["obs_sum"], "both ranks' actors played the same episodes"
    assert all(r["env_steps"] > 0 and r["actor_pids"] for r in ranks)
    assert set(ranks[0]["actor_pids"]).isdisjoint(ranks[1]["actor_pids"]), "each rank has its own actors"
