"""MinAtar (the ``minatar`` extra): the env factory's binary frames, the small conv encoder every
family can use, and a tiny CLI fit of each MinAtar config (configs/*/minatar*.yaml)."""

import sys
import types
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from lightning_wm.agents.muzero import MuZeroModel
from lightning_wm.envs import EnvConfig, EnvError, make_env, make_vector_env
from lightning_wm.nn.actor_critic import FrameEncoder
from lightning_wm.nn.blocks import SmallConvDecoder, SmallConvEncoder
from lightning_wm.nn.codec import ObservationCodec

from support.presets import (
    DREAMER_TINY,
    MUZERO_DATA_TINY,
    MUZERO_TINY,
    REPLAY_DATA_TINY,
    UNROLL_DATA_TINY,
    data_overrides,
    model_overrides,
    overrides,
)

ROOT = Path(__file__).resolve().parents[1]
FRAMES_10 = gym.spaces.Box(0, 255, (10, 10, 4), np.uint8)  # MinAtar Breakout's frames after the factory


def needs_minatar():
    """Skip without the ``minatar`` package. Its ``minatar.gym`` module is asked for, not the bare
    name: once a bench test has put ``bench/`` on ``sys.path``, ``import minatar`` finds the bench
    script ``bench/minatar.py`` where the package is not installed (and then nothing skipped)."""
    pytest.importorskip("minatar.gym", reason='MinAtar is the optional extra: pip install -e ".[minatar]"')


# -- the env factory -------------------------------------------------------------------------------
def test_minatar_frames_are_uint8_0_or_255_at_their_own_size():
    needs_minatar()
    env = make_env(EnvConfig(id="MinAtar/Breakout-v1"))
    assert env.observation_space == gym.spaces.Box(0, 255, (10, 10, 4), np.uint8)
    assert env.action_space == gym.spaces.Discrete(3)  # -v1: the minimal action set
    obs, _ = env.reset(seed=2**40 + 3)  # a 64-bit derived seed is folded for MinAtar's RandomState
    assert obs.dtype == np.uint8 and obs.shape == (10, 10, 4)
    assert set(np.unique(obs)) <= {0, 255} and obs.any()
    again, _ = make_env(EnvConfig(id="MinAtar/Breakout-v1")).reset(seed=2**40 + 3)
    np.testing.assert_array_equal(obs, again)


def test_minatar_vector_env_and_frame_stack():
    needs_minatar()
    envs = make_vector_env(EnvConfig(id="MinAtar/SpaceInvaders-v1", num_envs=3))
    obs, _ = envs.reset(seed=[1, 2, 3])
    assert obs.shape == (3, 10, 10, 6) and obs.dtype == np.uint8
    envs.close()
    stacked = make_env(EnvConfig(id="MinAtar/Asterix-v1", frame_stack=2))
    assert stacked.observation_space.shape == (10, 10, 8)


def test_minatar_refuses_options_that_render_or_resize():
    needs_minatar()
    with pytest.raises(EnvError, match="drop grayscale, crop"):
        make_env(EnvConfig(id="MinAtar/Breakout-v1", grayscale=True, crop=(0, 0, 5, 5)))


def test_minatar_missing_names_the_extra(monkeypatch):
    monkeypatch.setattr(gym, "registry", {k: v for k, v in gym.registry.items() if not k.startswith("MinAtar/")})
    monkeypatch.setitem(sys.modules, "minatar", None)  # import minatar raises ImportError
    monkeypatch.setitem(sys.modules, "minatar.gym", None)
    with pytest.raises(EnvError, match=r'pip install -e "\.\[minatar\]"'):
        make_env(EnvConfig(id="MinAtar/Breakout-v1"))


def test_needs_minatar_skips_where_a_bench_script_shadows_the_package(monkeypatch):
    # where the package is missing, ``import minatar`` finds bench/minatar.py once bench/ is on
    # sys.path: a plain module, not a package; the guard must still skip
    monkeypatch.setitem(sys.modules, "minatar", types.ModuleType("minatar"))
    monkeypatch.delitem(sys.modules, "minatar.gym", raising=False)
    with pytest.raises(pytest.skip.Exception, match="optional extra"):
        needs_minatar()


# -- the small conv encoder -------------------------------------------------------------------------
def test_small_conv_encoder_is_the_minatar_network_torso():
    encoder = SmallConvEncoder(4, (10, 10), channels=16, hidden=128)
    # one 3x3 conv (4 -> 16, no padding: 8x8 planes), a 1024 -> 128 layer
    assert sum(p.numel() for p in encoder.parameters()) == (4 * 16 * 9 + 16) + (16 * 8 * 8 * 128 + 128)
    out = encoder(torch.rand(2, 3, 4, 10, 10))
    assert out.shape == (2, 3, 128) and (out >= 0).all()  # ReLU features
    decoder = SmallConvDecoder(32, 4, (10, 10), channels=16)
    assert decoder(torch.rand(2, 3, 32)).shape == (2, 3, 4, 10, 10)


def test_each_family_takes_10x10_frames_with_the_small_conv():
    frames = torch.randint(0, 2, (5, 10, 10, 4), dtype=torch.uint8) * 255
    impala = FrameEncoder((10, 10, 4), "small", (16,), 128)
    assert isinstance(impala.stack, SmallConvEncoder) and impala(frames).shape == (5, 128)
    muzero = MuZeroModel(FRAMES_10, 3, {**MUZERO_TINY["net"], "conv": "small", "channels": 8})
    out = muzero.initial_inference(frames)
    assert muzero.state_shape == (16,) and out["state"].shape == (5, 16) and out["policy_logits"].shape == (5, 3)
    nxt = muzero.recurrent_inference(out["state"], torch.zeros(5, dtype=torch.int64))
    assert nxt["state"].shape == (5, 16)
    codec = ObservationCodec(FRAMES_10, 24, 16, 1, "silu", True, 8, True, conv="small")
    assert codec.encode(frames[None]).shape == (1, 5, 16)
    assert codec.loss(torch.zeros(1, 5, 24), frames[None]).shape == (1, 5)
    assert codec.decode(torch.zeros(1, 5, 24)).shape == (1, 5, 10, 10, 4)


def test_pixel_range_unit_feeds_binary_channels_as_0_and_1():
    frames = torch.randint(0, 2, (5, 10, 10, 4), dtype=torch.uint8) * 255
    centered = FrameEncoder((10, 10, 4), "small", (16,), 128)
    unit = FrameEncoder((10, 10, 4), "small", (16,), 128, pixel_range="unit")
    unit.load_state_dict(centered.state_dict())
    seen = {}
    for name, encoder in (("centered", centered), ("unit", unit)):
        encoder.stack.conv.register_forward_hook(lambda m, args, out, name=name: seen.update({name: args[0]}))
        encoder(frames)
    channels_first = frames.permute(0, 3, 1, 2).float()
    assert torch.equal(seen["unit"], channels_first / 255)  # an empty cell is 0, a set one 1
    assert torch.equal(seen["centered"], channels_first / 255 - 0.5)


def test_small_conv_options_are_checked():
    from lightning_wm.agents.dreamer.settings import DreamerNet
    from lightning_wm.agents.muzero.settings import MuZeroNet
    from lightning_wm.nn.actor_critic import ActorCriticSettings

    with pytest.raises(ValueError, match=r"net\.conv must be one of \['deep', 'shallow', 'small'\], got 'tiny'"):
        ActorCriticSettings(conv="tiny")
    with pytest.raises(ValueError, match=r"net\.pixel_range must be one of \['centered', 'unit'\], got 'binary'"):
        ActorCriticSettings(pixel_range="binary")
    with pytest.raises(ValueError, match=r"net\.conv must be one of \['resnet', 'small'\], got 'tiny'"):
        MuZeroNet(conv="tiny")
    with pytest.raises(ValueError, match=r"net\.conv must be one of \['strided', 'small'\], got 'tiny'"):
        DreamerNet(conv="tiny")
    with pytest.raises(ValueError, match="at least 3x3"):
        SmallConvEncoder(1, (2, 10))


# -- every MinAtar config, shrunk, from the command line ---------------------------------------------
def _fit(config: str, *extra: str):
    from lightning_wm.cli import main

    needs_minatar()
    return main(
        args=[
            "fit",
            "--config",
            str(ROOT / "configs" / config),
            *"--seed_everything 3 --trainer.max_steps 3 --trainer.log_every_n_steps 1".split(),
            *"--trainer.val_check_interval 3 --trainer.enable_progress_bar false --trainer.run_name run".split(),
            "--data.init_args.env.id",
            "MinAtar/Asterix-v1",  # any game: the configs default to Breakout
            *extra,
        ]
    )


@pytest.mark.slow
def test_impala_minatar_config_fits():
    cli = _fit("impala/minatar.yaml", *data_overrides(UNROLL_DATA_TINY))
    assert cli.trainer.global_step == 3 and "val/return" in cli.trainer.logged_metrics
    assert isinstance(cli.model.net.encoder.parts["obs"].stack, SmallConvEncoder)


@pytest.mark.slow
def test_impala_minatar_actors_config_fits_with_two_actor_processes():
    cli = _fit(
        "impala/minatar_actors.yaml",
        *data_overrides(UNROLL_DATA_TINY),
        *"--data.init_args.acting.envs_per_actor 2".split(),  # one batch (2 unrolls) a chunk, as 8 of 8 there
    )
    assert cli.trainer.global_step == 3 and "val/return" in cli.trainer.logged_metrics
    assert cli.datamodule.acting.num_streams == 4 and cli.datamodule.fetch_ahead is False  # 2 actors x 2 envs


@pytest.mark.slow
def test_muzero_minatar_config_fits():
    tiny = {**MUZERO_TINY, "net": {**MUZERO_TINY["net"], "channels": 4}}
    cli = _fit("muzero/minatar.yaml", *model_overrides(tiny), *data_overrides(MUZERO_DATA_TINY))
    assert cli.trainer.global_step == 3 and cli.model.model.obs_shape == (10, 10, 4)
    assert "val/return" in cli.trainer.logged_metrics


@pytest.mark.slow
def test_dreamer_minatar_config_fits():
    cli = _fit(
        "dreamer/minatar.yaml",
        *model_overrides(DREAMER_TINY),
        *data_overrides(REPLAY_DATA_TINY),
        "--data.init_args.replay_ratio",
        "0.5",
    )
    assert cli.trainer.global_step == 3 and "val/return" in cli.trainer.logged_metrics
    assert isinstance(cli.model.wm.codec.encoders["obs"], SmallConvEncoder)


@pytest.mark.slow
def test_impala_minatar_dyna_config_fits_with_imagination():
    cli = _fit(
        "impala/minatar_dyna.yaml",
        *data_overrides(UNROLL_DATA_TINY),
        *"--trainer.max_steps 10 --trainer.val_check_interval 10 --data.init_args.batch_size 4".split(),
        *"--data.init_args.model_replay.capacity 1000 --data.init_args.model_replay.batch_size 2".split(),
        *"--data.init_args.model_replay.sequence_length 8 --model.init_args.model_train_start 16".split(),
        *"--model.init_args.train_freq 16 --model.init_args.rollout.min_length 3".split(),
        *"--model.init_args.rollout.max_length 3 --model.init_args.imagination.rollout_batch_size 8".split(),
        *"--model.init_args.imagination.real_ratio 0.5".split(),
        *overrides({"net": DREAMER_TINY["net"]}, "--model.init_args.world_model.init_args"),
    )
    logged = cli.trainer.logged_metrics
    assert cli.trainer.global_step == 10 and float(logged["imagination/rows"]) > 0
    assert isinstance(cli.model.world_model.wm.codec.encoders["obs"], SmallConvEncoder)
