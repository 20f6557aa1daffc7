"""The smaller faults a probe found, each with the behaviour it has now: settings out of range are
refused when the config is read, ``convert`` of a non-vision config and a killed actor are one
line, World Models V/M keep ``best.ckpt`` by the lowest ``val/loss`` and survive fits shorter
than an epoch, MuZero trains on torch versions whose ``aminmax`` has no derivative."""

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_wm.callbacks import NonFiniteLossGuard
from lightning_wm.cli import main

from support.processes import descendants, wait_until

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("config", "option", "value", "message"),
    [
        ("dreamer/cartpole.yaml", "behavior.discount", "1.5", "behavior.discount must be in"),
        ("impala/cartpole.yaml", "loss.discount", "-1", "loss.discount must be in"),
        ("muzero/cartpole.yaml", "discount", "1.5", "discount must be in"),
        ("muzero/cartpole.yaml", "search.num_simulations", "0", "num_simulations must be >= 1"),
    ],
)
def test_settings_out_of_range_are_refused_when_the_config_is_read(config, option, value, message, monkeypatch):
    import lightning_wm.cli as cli

    built = []
    monkeypatch.setattr(cli.Trainer, "fit", lambda *a, **k: built.append(True))  # never reached
    with pytest.raises(ValueError, match=message):
        main(["fit", "--config", str(ROOT / "configs" / config), f"--model.init_args.{option}", value])
    assert not built


def test_convert_with_a_config_that_is_not_a_vision_model_is_one_line():
    with pytest.raises(ValueError, match="convert encodes an episode store with a World Models vision model"):
        main(["convert", "--config", str(ROOT / "configs/dreamer/cartpole.yaml"), "--target", "out"])


def test_ckpt_path_last_without_a_run_is_one_line_and_creates_no_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="--ckpt_path last: there is no last.ckpt"):
        main(["fit", "--config", str(ROOT / "configs/dreamer/cartpole.yaml"), "--trainer.run_name", "none",
              "--ckpt_path", "last"])  # fmt: skip
    assert not (tmp_path / "lightning_logs/none").exists()


def test_muzero_backward_needs_no_derivative_of_aminmax(monkeypatch):
    """torch 2.11 (the GPU machines' torch) has no derivative for aminmax; 2.13 has one. With an
    aminmax whose backward raises, a MuZero unroll still trains."""
    from lightning_wm.agents.muzero.model import scale_hidden

    real = torch.aminmax

    class NoDerivative(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dim, keepdim):
            return real(x, dim=dim, keepdim=keepdim)

        @staticmethod
        def backward(ctx, *grads):
            raise RuntimeError("derivative for aten::aminmax is not implemented")

    monkeypatch.setattr(torch, "aminmax", lambda x, dim=None, keepdim=False: NoDerivative.apply(x, dim, keepdim))
    state = torch.randn(4, 3, 5, requires_grad=True)
    scale_hidden(state).square().sum().backward()
    assert state.grad is not None and torch.isfinite(state.grad).all()


def _store(directory: Path, episodes: int = 4, length: int = 12) -> None:
    from lightning_wm.data.episodes import EpisodeStore

    rng = np.random.default_rng(0)
    store = EpisodeStore(directory)
    for _ in range(episodes):
        first, last = np.zeros(length, bool), np.zeros(length, bool)
        first[0], last[-1] = True, True
        frames = rng.integers(0, 255, (length, 64, 64, 3), dtype=np.uint8)
        store.add(
            {"obs": frames, "action": rng.integers(0, 2, length), "reward": np.ones(length, np.float32),
             "is_first": first, "is_last": last, "is_terminal": last.copy()}
        )  # fmt: skip


VISION = [
    "--model", "lightning_wm.agents.worldmodels.Vision", "--model.init_args.latent_dim", "4",
    "--model.init_args.depth", "4", "--model.init_args.patience", "2",
    "--data", "lightning_wm.data.offline.EpisodeDataModule", "--data.init_args.directory", "frames",
    "--data.init_args.batch_size", "8", "--data.init_args.val_fraction", "0.3", "--data.init_args.val_batches", "1",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
]  # fmt: skip


@pytest.mark.slow
def test_vision_keeps_best_by_lowest_val_loss_and_a_fit_shorter_than_an_epoch_ends_cleanly():
    _store(Path("frames"))
    short = main(["fit", *VISION, "--trainer.max_steps", "1", "--trainer.run_name", "short"])
    assert short.trainer.global_step == 1  # EarlyStopping had no val/loss to compare: no crash
    cli = main(
        ["fit", *VISION, "--trainer.max_epochs", "3", "--data.init_args.train_batches", "2", "--trainer.run_name", "v"]
    )
    best = torch.load("lightning_logs/v/checkpoints/best.ckpt", weights_only=True)
    state = best["callbacks"]["RunCheckpoints"]  # kept as -val/loss: higher is better
    assert state["best"] is not None and -state["best"] > 0 and state["best_step"] == best["global_step"]
    assert cli.trainer.checkpoint_callback.best == state["best"]
    main(["convert", *VISION, "--trainer.run_name", "v", "--ckpt_path", "best", "--target", "latents"])
    assert any(Path("latents").glob("*.npz"))


@pytest.mark.slow
def test_a_killed_actor_ends_the_fit_with_one_line_and_its_traceback_on_request(tmp_path):
    args = [
        sys.executable, str(ROOT / "main.py"), "fit", "--config", str(ROOT / "configs/impala/cartpole.yaml"),
        "--data.init_args.env.num_envs", "2", "--data.init_args.unroll_length", "4", "--data.init_args.batch_size", "2",
        "--trainer.max_steps", "100000", "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    proc = subprocess.Popen(
        args, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        actors = sorted(
            wait_until(lambda: len(descendants(proc.pid)) >= 2 and descendants(proc.pid), 120, what="actors")
        )
        assert actors, "no actor started"
        os.kill(actors[-1], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "actor" in errors[0] and "LIGHTNING_WM_TRACEBACK=1" in errors[0]


def test_the_non_finite_guard_reads_its_flags_lazily_and_names_the_first_bad_step():
    """Steps only queue flags (no host read per step); a check at the log interval, before a
    checkpoint or at the end names the first non-finite loss and its step."""
    guard = NonFiniteLossGuard()
    module = SimpleNamespace(device=torch.device("cpu"))
    trainer = SimpleNamespace(
        global_step=0, log_every_n_steps=5, callback_metrics={"train/value_loss": torch.tensor(1.0)}
    )
    losses = [1.0, 2.0, float("inf"), float("nan"), 3.0]
    for step, loss in enumerate(losses[:4]):
        trainer.global_step = step + 1
        guard.on_train_batch_end(trainer, module, {"loss": torch.tensor(loss), "priority": torch.ones(3)}, None, step)
    assert len(guard._pending) == 4  # nothing read yet: the interval is 5 steps
    with pytest.raises(FloatingPointError, match=r"^loss became inf at step 3\. .*last good checkpoint"):
        guard.on_save_checkpoint(trainer, module, {})  # a checkpoint is never written past a bad step
    assert guard._pending == []
    trainer.callback_metrics = {"train/value_loss": torch.tensor(float("nan"))}
    trainer.global_step = 9
    guard.on_train_batch_end(trainer, module, torch.tensor(0.5), None, 8)
    with pytest.raises(FloatingPointError, match=r"^train/value_loss became nan at step 9"):
        guard.on_train_end(trainer, module)
    trainer.callback_metrics = {}
    for step in range(5):  # finite: read at the interval, nothing raised, nothing left queued
        guard.on_train_batch_end(trainer, module, torch.tensor(1.0), None, step)
    assert guard._pending == []
