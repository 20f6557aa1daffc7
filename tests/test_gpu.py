"""GPU smoke tests (skipped without CUDA): Dreamer learns and acts on the GPU, under
``bf16-mixed``, with ``compile: true``, and takes a DDP step on one GPU.

Run on a CUDA machine: ``python -m pytest -q tests/test_gpu.py``.
"""

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_wm.cli import main

from support.presets import DREAMER_TINY, REPLAY_DATA_TINY, data_overrides, model_overrides

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
SHRUNK = [
    "--config",
    str(ROOT / "configs/dreamer/cartpole.yaml"),
    "--trainer.max_steps",
    "4",
    "--trainer.val_check_interval",
    "2",
    "--trainer.accelerator",
    "gpu",
    "--trainer.devices",
    "1",
    *model_overrides(DREAMER_TINY),
    *data_overrides(REPLAY_DATA_TINY),
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
]


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
        record["autocast"].add(torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda"))
        return training_step(self, batch, batch_idx)

    monkeypatch.setattr(Dreamer, "act", recording_act)
    monkeypatch.setattr(Dreamer, "training_step", recording_step)
    return record


def test_dreamer_acts_and_learns_on_the_gpu(seen):
    cli = main(args=["fit", *SHRUNK])
    assert cli.trainer.global_step == 4
    assert seen["act"] == {("cuda", "cuda")}
    assert seen["learn"] == {("cuda", "cuda")}
    assert torch.isfinite(torch.tensor(float(cli.trainer.callback_metrics["val/return"])))


def test_dreamer_bf16_mixed(seen):
    cli = main(args=["fit", *SHRUNK, "--trainer.precision", "bf16-mixed"])
    assert seen["autocast"] == {torch.bfloat16}
    assert all(torch.isfinite(p).all() for p in cli.model.parameters())


def test_dreamer_compiled(seen):
    cli = main(args=["fit", *SHRUNK, "--model.init_args.compile", "true"])
    assert cli.trainer.global_step == 4 and seen["learn"] == {("cuda", "cuda")}


def test_dreamer_ddp_step_on_one_gpu(seen):
    cli = main(args=["fit", *SHRUNK, "--trainer.strategy", "ddp", "--trainer.max_steps", "1"])
    assert cli.trainer.world_size == 1 and cli.trainer.global_step == 1
    assert type(cli.trainer.strategy).__name__ == "DDPStrategy"
    assert seen["learn"] == {("cuda", "cuda")}
