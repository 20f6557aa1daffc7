"""Dreamer from the command line: tiny fits of the shipped configs (vector, pixel, dict
observations, continuous Pendulum) whose losses fall, the size presets, the horizon schedule, and
resume after a crash and from a checkpoint (optimizers, slow critic, return norm)."""

from pathlib import Path

import pytest
import torch
import yaml

from lightning_wm.agents.dreamer import BehaviorSettings
from lightning_wm.cli import main
from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.world_model import RolloutSchedule

from support.presets import REPLAY_DATA_TINY, data_overrides
from support.tb_scalars import logged_scalars

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


def _fit_args(config: str, steps: int, extra: list[str] = ()) -> list[str]:
    return [
        "fit",
        "--config",
        str(ROOT / "configs/dreamer" / config),
        "--config",
        str(ROOT / "configs/dreamer/presets/debug.yaml"),  # the shipped smoke-test sizes, tested here too
        "--trainer.max_steps",
        str(steps),
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.val_check_interval",
        str(steps),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.run_name",
        "run",
        "--model.init_args.optim.model.lr",
        "3e-3",
        *data_overrides(REPLAY_DATA_TINY),
        "--data.init_args.sampler.init_args.length",
        "16",  # twice the preset's: the sequences these loss checks were set with (pixel fits pass 8 again)
        *extra,
    ]


@pytest.mark.slow
def test_cli_fit_cartpole_vector_losses_fall():
    cli = main(args=_fit_args("cartpole.yaml", 24))
    assert cli.trainer.global_step == 24  # one counted optimizer step per gradient step
    losses = logged_scalars(Path("lightning_logs/run"), "train/loss_model")
    assert len(losses) >= 20
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    for tag in (
        "train/loss_kl_dyn",
        "train/loss_actor",
        "train/loss_critic",
        "train/entropy",
        "train/imag_return",
        "grad_norm/model",
        "val/return",
        "val/openloop_mse",
        "env/steps",
        "env/episode_return",
        "env/episode_length",
    ):
        assert logged_scalars(Path("lightning_logs/run"), tag), tag
    # the open-loop figure of the vector observation (add_figure: 4 panels, one per CartPole dimension)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(next(Path("lightning_logs/run").glob("version_*"))), size_guidance={"images": 0})
    acc.Reload()
    image = acc.Images("val/openloop")[-1]
    assert (image.height, image.width) == (round(100 * (1.2 + 1.4 * 4)), 640)  # openloop_curves' size at 100 dpi


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["xs", "s", "m"])
def test_cli_size_presets_build_and_take_a_step(preset):
    """Each size preset instantiates from the CLI over a family config and trains one step."""
    args = _fit_args(
        "cartpole.yaml",
        1,
        [
            "--config",
            str(ROOT / f"configs/dreamer/presets/{preset}.yaml"),
            "--model.init_args.behavior.horizon",
            "3",
            "--data.init_args.sampler.init_args.length",
            "8",
            "--data.init_args.batch_size",
            "2",
            "--trainer.limit_val_batches",
            "0",
        ],
    )
    cli = main(args=args)
    wanted = yaml.safe_load((ROOT / f"configs/dreamer/presets/{preset}.yaml").read_text())["model"]["init_args"]["net"]
    assert cli.trainer.global_step == 1
    assert all(getattr(cli.model.net, key) == value for key, value in wanted.items())
    assert cli.model.net.symlog_obs and cli.model.loss.continue_terminal_weight == 4.0  # the rest: cartpole.yaml's
    assert torch.isfinite(torch.tensor(logged_scalars(Path("lightning_logs/run"), "train/loss_model"))).all()


@pytest.mark.slow
def test_horizon_schedule_grows_the_imagination_with_env_steps():
    # debug fit: 64 prefill rows, then 4 env steps per gradient step (one env, replay ratio 0.25)
    cli = main(
        args=_fit_args(
            "cartpole.yaml",
            10,
            [
                "--model.init_args.behavior.horizon_schedule",
                "{start_step: 70, end_step: 100, min_length: 2, max_length: 6}",
                "--data.init_args.replay_ratio",
                "0.25",
            ],
        )
    )
    horizons = logged_scalars(Path("lightning_logs/run"), "train/horizon")
    assert horizons[0] == 2 and horizons[-1] == 6 and horizons == sorted(horizons) and len(set(horizons)) > 2
    assert cli.model.current_horizon() == 6
    with pytest.raises(ValueError, match="horizon_schedule.min_length"):
        BehaviorSettings(horizon_schedule=RolloutSchedule(start_step=0, end_step=10, min_length=0, max_length=5))


@pytest.mark.slow
def test_cli_fit_pendulum_continuous():
    cli = main(args=_fit_args("pendulum.yaml", 8))
    assert cli.trainer.global_step == 8 and cli.model.actor_grad == "dynamics"
    losses = logged_scalars(Path("lightning_logs/run"), "train/loss_model")
    assert len(losses) == 8 and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert logged_scalars(Path("lightning_logs/run"), "val/return")


@pytest.mark.slow
def test_cli_fit_carracing_frames_with_continuous_actions():
    """configs/dreamer/carracing.yaml shrunk (50-step episodes): 64x64 CarRacing frames, a
    bounded-Normal actor trained through the dynamics; the actions it takes stay inside the
    env's box (steering in [-1, 1], gas and brake in [0, 1])."""
    cli = main(
        args=_fit_args(
            "carracing.yaml",
            10,
            ["--data.init_args.sampler.init_args.length", "8", "--data.init_args.env.max_episode_steps", "50"],
        )
    )
    assert cli.model.wm.pixels and cli.model.actor_grad == "dynamics"
    low, high = torch.tensor([-1.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 1.0])  # steering, gas, brake
    replayed = cli.datamodule.sample_batch()["action"].reshape(-1, 3)
    with torch.no_grad():  # the trained actor's own actions on 64 frames, exploring
        frames = torch.randint(0, 256, (64, 64, 64, 3), dtype=torch.uint8)
        taken, _, _ = cli.model.act(frames, None, explore=True)
    assert taken.shape == (64, 3)
    for actions in (replayed, taken):
        assert ((actions >= low) & (actions <= high)).all()
    losses = logged_scalars(Path("lightning_logs/run"), "train/loss_recon")
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    assert logged_scalars(Path("lightning_logs/run"), "val/return")


@pytest.mark.slow
def test_cli_fit_on_dict_observations_frame_and_state():
    """{"image", "state"} observations: both parts are encoded and reconstructed, replay keeps
    the frame uint8, acting and the open-loop video work on the dict."""
    cli = main(args=_fit_args("cartpole_pixels_state.yaml", 12, ["--data.init_args.sampler.init_args.length", "8"]))
    codec = cli.model.wm.codec
    assert codec.is_dict and set(codec.encoders) == {"image", "state"} and codec.images == ["image"]
    assert cli.datamodule.sample_batch()["obs"]["image"].dtype == torch.uint8
    losses = logged_scalars(Path("lightning_logs/run"), "train/loss_recon")
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    assert logged_scalars(Path("lightning_logs/run"), "val/return")
    assert logged_scalars(Path("lightning_logs/run"), "val/openloop_mse")
    assert list(Path("lightning_logs/run").glob("version_*/openloop/step_12.gif"))
    # the decoder gives back both parts in the env's format
    decoded = cli.model.wm.decode_features(torch.zeros(3, cli.model.wm.feat_dim))
    assert decoded["image"].shape == (3, 64, 64, 3) and decoded["image"].dtype == torch.uint8
    assert decoded["state"].shape == (3, 4)


@pytest.mark.slow
def test_cli_fit_cartpole_pixels_losses_fall_and_logs_openloop_image_and_gif():
    cli = main(args=_fit_args("cartpole_pixels.yaml", 12, ["--data.init_args.sampler.init_args.length", "8"]))
    assert cli.model.wm.pixels
    losses = logged_scalars(Path("lightning_logs/run"), "train/loss_recon")
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    version = next(Path("lightning_logs/run").glob("version_*"))
    acc = EventAccumulator(str(version))
    acc.Reload()
    assert "val/openloop" in acc.Tags()["images"]
    # ... and an animated GIF in the run's log directory: real | model side by side, one row per sequence
    from PIL import Image

    gif = version / "openloop" / "step_12.gif"
    assert gif.is_file(), sorted(p.name for p in version.rglob("*"))
    with Image.open(gif) as image:
        assert image.n_frames == 8  # one frame per step of the (8-step) sequences
        rows = cli.model.openloop_sequences * (3 + 64 + 2)  # one [bar, frame, gap] per sequence
        assert image.size == (2 * 64 + 2, rows)
        image.seek(6)  # open-loop (after the 5 context steps): the model half differs from the real half
        frame = torch.tensor(list(image.convert("RGB").getdata()), dtype=torch.float32).reshape(rows, 130, 3)
    assert frame[3:67, :64].std() > 0 and frame[3:67, 66:].std() > 0


@pytest.mark.slow
def test_resume_after_a_crash_continues_from_the_checkpoint_exactly():
    """A fit dies at step 7 (last checkpoint at 6); `fit --ckpt_path last` starts from step 6 with
    the checkpoint's weights, slow critic, return norm, three optimizer states, env-step counter
    and replay buffer, and then takes only the steps still due."""
    from support import fit_probes

    base = ["--data.init_args.replay.save", "true", "--trainer.checkpoint_every_n_steps", "3"]
    with pytest.raises(RuntimeError, match="simulated crash at step 7"):
        main(
            args=_fit_args(
                "cartpole.yaml",
                12,
                [
                    *base,
                    "--trainer.callbacks",
                    '[{"class_path": "support.fit_probes.CrashAt", "init_args": {"step": 7}}]',
                ],
            )
        )
    ckpt = torch.load("lightning_logs/run/checkpoints/last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 6
    data_state = ckpt["ReplayDataModule"]
    record = ckpt["replay_buffers"]
    assert record["step"] == 6 and "buffer" not in data_state
    expected = ReplayBuffer.load(Path(record["dir"]) / "replay_rank0_step6.pt")  # pruned by the later saves
    assert not expected.column("is_last")[0, expected.newest[0]]
    assert expected.mark_episode_end() == 1
    cli = main(
        args=_fit_args(
            "cartpole.yaml",
            12,
            [*base, "--ckpt_path", "last", "--trainer.callbacks", '[{"class_path": "support.fit_probes.RecordStart"}]'],
        )
    )
    seen = fit_probes.SEEN
    assert seen["global_step"] == 6
    assert seen["env_steps"] == data_state["stats"]["env_steps"]
    # the buffer comes back from the file beside the checkpoint, its last episode ended at the restart
    for key, value in expected.state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(seen["buffer"][key], value), key
    for key, value in expected.state_dict()["data"].items():
        assert torch.equal(seen["buffer"]["data"][key], value), key
    for name, tensor in ckpt["state_dict"].items():  # incl. slow_critic.*, ret_low, ret_high
        assert torch.equal(seen["model"][name], tensor), name
    assert len(seen["optimizers"]) == 3
    for restored, saved in zip(seen["optimizers"], ckpt["optimizer_states"]):
        assert restored.keys() == saved["state"].keys() and restored
        for k in saved["state"]:
            assert torch.equal(restored[k]["exp_avg"], saved["state"][k]["exp_avg"])
    # the resumed run took the 6 remaining steps and their env steps: as many as a run that never
    # crashed (prefill + one batch's steps per gradient step, + the batch Lightning fetches ahead)
    assert cli.trainer.global_step == 12
    per_step = 1 / cli.datamodule.replay_ratio  # one env here
    assert cli.datamodule.collector.stats.env_steps == seen["env_steps"] + 6 * per_step
    assert cli.datamodule.collector.stats.env_steps == cli.datamodule.prefill + (12 + 1) * per_step


@pytest.mark.slow
def test_cli_resume_restores_optimizers_slow_critic_and_return_norm():
    main(args=_fit_args("cartpole.yaml", 6))
    ckpt_path = Path("lightning_logs/run/checkpoints/last.ckpt")
    ckpt = torch.load(ckpt_path, weights_only=False)
    assert ckpt["global_step"] == 6
    assert len(ckpt["optimizer_states"]) == 3 and all(s["state"] for s in ckpt["optimizer_states"])
    state = ckpt["state_dict"]
    assert any(k.startswith("slow_critic.") for k in state)
    assert state["ret_high"] != 0 or state["ret_low"] != 0
    # the slow critic moved towards the critic but is its own copy
    assert not torch.equal(state["slow_critic.0.weight"], state["critic.0.weight"])
    cli = main(args=_fit_args("cartpole.yaml", 10, ["--ckpt_path", "last"]))
    assert cli.trainer.global_step == 10
    model = cli.model
    assert model.ret_high.item() != state["ret_high"].item()  # kept updating from the restored value
    assert len(cli.trainer.optimizers) == 3
