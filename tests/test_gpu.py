"""Every family on a GPU (skipped without CUDA): each shipped config family, shrunk, fits a few
steps on the device, then ``validate`` and ``evaluate`` from its checkpoint there; under
``bf16-mixed``; with the compile options; DDP on one GPU.

Run on a CUDA machine: ``python -m pytest -q tests/test_gpu.py`` (``bench/gpu_check.py`` runs it
and adds a speed table). ``LIGHTNING_WM_TEST_DEVICE=cpu`` runs the same checks on the CPU (what
``bench/gpu_check.py --device cpu --quick`` does), so the file itself is exercised without a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_wm.cli import main

from support.presets import (
    DREAMER_TINY,
    IMPALA_TINY,
    MEMORY_TINY,
    MUZERO_DATA_TINY,
    MUZERO_TINY,
    REPLAY_DATA_TINY,
    UNROLL_DATA_TINY,
    VISION_TINY,
    data_overrides,
    model_overrides,
)

DEVICE = os.environ.get("LIGHTNING_WM_TEST_DEVICE", "cuda")
ACCELERATOR = "gpu" if DEVICE == "cuda" else "cpu"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
ON_DEVICE = ["--trainer.accelerator", ACCELERATOR, "--trainer.devices", "1", *QUIET]


def _config(path: str) -> list[str]:
    return ["--config", str(ROOT / "configs" / path)]


STEPS = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2"]
DREAMER = [*_config("dreamer/cartpole.yaml"), *model_overrides(DREAMER_TINY), *data_overrides(REPLAY_DATA_TINY)]
MUZERO = [*_config("muzero/cartpole.yaml"), *model_overrides(MUZERO_TINY), *data_overrides(MUZERO_DATA_TINY)]
IMPALA = [*_config("impala/cartpole.yaml"), *model_overrides(IMPALA_TINY), *data_overrides(UNROLL_DATA_TINY)]

# the online families, shrunk: (name, fit arguments)
FAMILIES: dict[str, list[str]] = {
    "dreamer-vector": DREAMER,
    "dreamer-pixels": [
        *_config("dreamer/cartpole_pixels.yaml"),
        *model_overrides(DREAMER_TINY),
        *data_overrides(REPLAY_DATA_TINY),
    ],
    "muzero-vector": MUZERO,
    # Pong-shaped: stacked 32x32 gray frames through the conv representation, BatchNorm, reanalyse
    "muzero-conv": [
        *_config("muzero/pong.yaml"),
        *model_overrides({"net": {"channels": 8, "support_size": 10}, "search": {"num_simulations": 2}}),
        *model_overrides({"reanalyse": {"batch_size": 16}}),
        *data_overrides(
            {"env": {"num_envs": 2, "size": [32, 32], "max_episode_steps": 50}, "replay": {"capacity": 400}}
        ),
        *data_overrides({"batch_size": 4, "prefill": 40, "replay_ratio": 1.0, "eval": {"episodes": 1, "envs": 1}}),
    ],
    "impala-vector-actors": [*IMPALA, "--data.init_args.acting.num_actors", "2"],
    "impala-conv-actors": [
        *_config("impala/pong.yaml"),
        *model_overrides({"net": {"fc_size": 32}}),
        *data_overrides(UNROLL_DATA_TINY),
        *data_overrides({"env": {"max_episode_steps": 50}}),  # a Pong episode to evaluate, cut short
        "--data.init_args.acting.num_actors",
        "2",
    ],
    "dyna": [
        *_config("impala/cartpole_dyna.yaml"),
        *model_overrides({"train_freq": 16, "model_train_start": 16}),
        *model_overrides({"rollout": {"min_length": 3, "max_length": 3}}),
        *model_overrides({"imagination": {"rollout_batch_size": 8, "real_ratio": 0.5}}),
        *model_overrides({"world_model": {"init_args": {"net": DREAMER_TINY["net"]}}}),
        *data_overrides(UNROLL_DATA_TINY),
        *data_overrides({"batch_size": 4, "model_replay": {"capacity": 1000, "batch_size": 2, "sequence_length": 8}}),
    ],
}
NEEDS_CV2 = {"muzero-conv", "impala-conv-actors"}


def _trained_on(cli: Any) -> str:
    """Where the fit ran (Lightning moves the module back to the CPU when fit ends)."""
    return cli.trainer.strategy.root_device.type


def _fit_validate_evaluate(args: list[str], capsys: pytest.CaptureFixture) -> Any:
    cli = main(args=["fit", *args, *STEPS, *ON_DEVICE, "--trainer.run_name", "run"])
    assert cli.trainer.global_step == 2
    assert _trained_on(cli) == DEVICE
    validated = main(args=["validate", *args, *ON_DEVICE, "--trainer.run_name", "run", "--ckpt_path", "last"])
    metrics = validated.trainer.callback_metrics
    assert any(torch.isfinite(torch.as_tensor(v)).all() for k, v in metrics.items() if k.startswith("val/"))
    capsys.readouterr()
    main(args=["evaluate", *args, *ON_DEVICE, "--trainer.run_name", "run", "--ckpt_path", "last", "--episodes", "1"])
    assert "return" in capsys.readouterr().out
    return cli


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_fits_validates_and_evaluates_on_the_device(family, capsys):
    if family in NEEDS_CV2:
        pytest.importorskip("cv2", reason="Atari preprocessing needs opencv (.[atari])")
    _fit_validate_evaluate(FAMILIES[family], capsys)


def test_world_models_pipeline_on_the_device(capsys):
    """record -> V -> convert -> M -> C (real env), each model on the device."""
    folder = "worldmodels/cartpole_pixels/"
    main(["record", *_config(folder + "record.yaml"), "--episodes", "4", "--data.init_args.env.num_envs", "2"])
    vision = [*_config(folder + "vision.yaml"), *model_overrides(VISION_TINY)]
    data = [
        "--data.init_args.batch_size",
        "8",
        "--data.init_args.val_fraction",
        "0.3",
        "--data.init_args.val_batches",
        "1",
    ]
    fitted = main(["fit", *vision, *data, *ON_DEVICE, "--trainer.max_epochs", "1"])
    assert _trained_on(fitted) == DEVICE
    main(["validate", *vision, *data, *ON_DEVICE, "--ckpt_path", "last"])
    main(
        ["convert", *vision, *ON_DEVICE, "--ckpt_path", "last", "--target", "data/worldmodels/cartpole_pixels/latents"]
    )
    memory = [*_config(folder + "memory.yaml"), *model_overrides(MEMORY_TINY)]
    seqs = ["--data.init_args.batch_size", "2", "--data.init_args.sequence_length", "6"]
    seqs += ["--data.init_args.val_fraction", "0.3", "--data.init_args.val_batches", "1"]
    fitted = main(["fit", *memory, *seqs, *ON_DEVICE, "--trainer.max_epochs", "1"])
    assert _trained_on(fitted) == DEVICE
    main(["validate", *memory, *seqs, *ON_DEVICE, "--ckpt_path", "last"])
    controller = [*_config(folder + "controller.yaml")]
    controller += model_overrides({"es": {"popsize": 3, "episodes_per_member": 1}, "max_episode_steps": 20})
    controller += ["--data.init_args.eval.episodes", "1", "--data.init_args.eval.envs", "1"]
    fitted = main(["fit", *controller, *ON_DEVICE, "--trainer.max_steps", "1", "--trainer.val_check_interval", "1"])
    assert fitted.trainer.global_step == 1
    capsys.readouterr()
    main(["evaluate", *controller, *ON_DEVICE, "--ckpt_path", "last", "--episodes", "1"])
    assert "return" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["dreamer-vector", "muzero-vector", "impala-vector-actors", "dyna"])
def test_bf16_mixed(family):
    cli = main(["fit", *FAMILIES[family], *STEPS, *ON_DEVICE, "--trainer.precision", "bf16-mixed"])
    assert cli.trainer.global_step == 2
    assert all(torch.isfinite(p).all() for p in cli.model.parameters())


@pytest.fixture
def seen(monkeypatch) -> dict[str, Any]:
    """Devices and autocast seen by Dreamer's acting and learning during a fit."""
    from lightning_wm.agents.dreamer import Dreamer

    record: dict[str, Any] = {"act": set(), "learn": set(), "autocast": set()}
    act, training_step = Dreamer.act, Dreamer.training_step

    def recording_act(self, obs, state, explore):
        action, state, extras = act(self, obs, state, explore)
        record["act"].add((obs.device.type, action.device.type))
        return action, state, extras

    def recording_step(self, batch, batch_idx):
        record["learn"].add((next(self.parameters()).device.type, batch["obs"].device.type))
        record["autocast"].add(torch.is_autocast_enabled(DEVICE) and torch.get_autocast_dtype(DEVICE))
        return training_step(self, batch, batch_idx)

    monkeypatch.setattr(Dreamer, "act", recording_act)
    monkeypatch.setattr(Dreamer, "training_step", recording_step)
    return record


def test_dreamer_acts_and_learns_on_the_device_with_autocast(seen):
    main(["fit", *DREAMER, *STEPS, *ON_DEVICE, "--trainer.precision", "bf16-mixed"])
    assert seen["act"] == {(DEVICE, DEVICE)} and seen["learn"] == {(DEVICE, DEVICE)}
    assert seen["autocast"] == {torch.bfloat16}


@pytest.mark.skipif(os.environ.get("LIGHTNING_WM_TEST_QUICK") == "1", reason="compilation takes minutes")
@pytest.mark.parametrize(
    ("family", "option"),
    [("dreamer-vector", "--model.init_args.compile"), ("muzero-vector", "--model.init_args.search.compile")],
)
def test_compile_options(family, option):
    cli = main(["fit", *FAMILIES[family], *STEPS, *ON_DEVICE, option, "true"])
    assert cli.trainer.global_step == 2


def test_ddp_on_one_device(seen):
    cli = main(["fit", *DREAMER, *STEPS, *ON_DEVICE, "--trainer.strategy", "ddp", "--trainer.max_steps", "1"])
    assert cli.trainer.world_size == 1 and cli.trainer.global_step == 1
    assert type(cli.trainer.strategy).__name__ == "DDPStrategy"
    assert seen["learn"] == {(DEVICE, DEVICE)}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_dreamer_fits_with_its_step_recorded_as_a_graph_and_resumes_eagerly(precision):
    """``compile.mode: graph``: two warm-up steps, the recording, replays; Lightning counts every
    step; the checkpoint resumes with the eager step (its optimizer state saved plain)."""
    run = [*DREAMER, *ON_DEVICE, "--trainer.run_name", "run", "--trainer.precision", precision]
    cli = main(["fit", *run, "--trainer.max_steps", "6", "--model.init_args.compile.mode", "graph"])
    assert cli.trainer.global_step == 6
    assert all(torch.isfinite(p).all() for p in cli.model.parameters())
    if DEVICE == "cuda":
        assert cli.model._captured.failed is None
        assert cli.model._captured.calls == {"eager": 2, "recorded": 1, "replayed": 4}
    resumed = main(["fit", *run, "--trainer.max_steps", "8", "--ckpt_path", "last"])
    assert resumed.trainer.global_step == 8
