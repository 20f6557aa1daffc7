"""World Models from the CLI with the shipped configs (``configs/worldmodels/<name>``), sizes shrunk:
record -> fit V -> convert -> fit M -> fit C (real; then resumed) -> evaluate, and C in the dream."""

from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_wm.cli import main
from lightning_wm.data.episodes import EpisodeStore

from support.presets import MEMORY_TINY, VISION_TINY, model_overrides

torch.set_num_threads(1)

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "worldmodels"
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def flags(settings: dict[str, object]) -> list[str]:
    """``{"trainer.max_steps": 2}`` -> ``["--trainer.max_steps", "2"]`` (None -> ``null``)."""
    return [part for key, value in settings.items() for part in (f"--{key}", "null" if value is None else str(value))]


def _record_v_convert_m(cfg: Path, name: str, env: list[str]) -> str:
    """Record 6 episodes, fit V one epoch, convert, fit M one epoch; the latent store's folder."""
    frames, latents = f"data/worldmodels/{name}/frames", f"data/worldmodels/{name}/latents"
    main(
        ["record", "--config", str(cfg / "record.yaml"), "--episodes", "6", "--data.init_args.env.num_envs", "2", *env]
    )
    assert len(EpisodeStore(frames).paths()) == 6
    v_args = model_overrides(VISION_TINY)
    small_v = {"trainer.max_epochs": 1, "data.init_args.batch_size": 8}
    split = {"data.init_args.val_fraction": 0.3, "data.init_args.val_batches": 1}
    main(["fit", "--config", str(cfg / "vision.yaml"), *v_args, *QUIET, *flags({**small_v, **split})])
    main(["convert", "--config", str(cfg / "vision.yaml"), *v_args, "--ckpt_path", "last", "--target", latents])
    assert len(EpisodeStore(latents).paths()) == 6
    small_m = {"trainer.max_epochs": 1, "data.init_args.batch_size": 2, "data.init_args.sequence_length": 6}
    main(
        [
            "fit",
            "--config",
            str(cfg / "memory.yaml"),
            *QUIET,
            *model_overrides(MEMORY_TINY),
            *flags({**small_m, **split}),
        ]
    )
    return latents


def _run_pipeline(name: str, capsys, env: list[str] = (), member_steps: int = 30, controller: list[str] = ()) -> None:
    """The whole pipeline of ``configs/worldmodels/<name>`` (``controller``: further overrides of C's fits)."""
    cfg = CONFIGS / name
    latents = _record_v_convert_m(cfg, name, list(env))
    small_c = {
        "model.init_args.es.popsize": 3,
        "model.init_args.es.episodes_per_member": 1,
        "model.init_args.max_episode_steps": member_steps,
        "data.init_args.eval.episodes": 1,
        "data.init_args.eval.envs": 1,
        "trainer.val_check_interval": 2,
    }
    fit_c = ["fit", "--config", str(cfg / "controller.yaml"), *QUIET, *flags(small_c), *env, *controller]
    first = main([*fit_c, "--trainer.max_steps", "2"])
    features = VISION_TINY["latent_dim"] + MEMORY_TINY["net"]["hidden"]  # z and h
    n_actions = first.model.num_params // (features + 1)
    assert first.model.cmaes.countiter == 2 and first.model.num_params == (features + 1) * n_actions
    resumed = main([*fit_c, "--trainer.max_steps", "3", "--ckpt_path", "last"])
    assert resumed.trainer.global_step == 3 and resumed.model.cmaes.countiter == 3
    saved = torch.load(f"lightning_logs/worldmodels-{name}-controller/checkpoints/last.ckpt", weights_only=False)
    assert saved["global_step"] == 3
    capsys.readouterr()
    main(
        [
            "evaluate",
            "--config",
            str(cfg / "controller.yaml"),
            "--ckpt_path",
            "last",
            "--episodes",
            "2",
            *env,
            *controller,
        ]
    )
    assert "return" in capsys.readouterr().out
    in_dream = {
        "trainer.max_steps": 1,
        "trainer.run_name": "dream",
        "model.init_args.train_in": "dream",
        "model.init_args.dream.dir": latents,
        "model.init_args.dream.max_steps": member_steps,
    }
    dream = main([*fit_c, *flags(in_dream)])
    assert dream.model.cmaes.countiter == 1


@pytest.mark.slow
def test_cli_pipeline_end_to_end_and_controller_resume(capsys):
    _run_pipeline("cartpole_pixels", capsys)


def _fit_one_generation(config: str, *overrides: str):
    one = {"trainer.max_steps": 1, "trainer.limit_val_batches": 0, "model.init_args.es.popsize": 3}
    return main(["fit", "--config", str(CONFIGS / "carracing" / config), *QUIET, *flags(one), *overrides])


@pytest.mark.slow
def test_cli_pipeline_carracing_configs(capsys):
    """The paper-sized CarRacing configs run end to end with shrunk sizes and short episodes."""
    short = {"data.init_args.env.max_episode_steps": 12}
    # init_params_ckpt null: before controller_v.yaml has run
    _run_pipeline(
        "carracing",
        capsys,
        env=flags(short),
        member_steps=12,
        controller=flags({"model.init_args.init_params_ckpt": None}),
    )
    dream = _fit_one_generation(
        "controller_dream.yaml",
        *flags({"model.init_args.es.episodes_per_member": 1, "model.init_args.dream.max_steps": 12}),
    )
    assert dream.model.train_in == "dream" and dream.model.world_model.temperature == 1.15
    assert dream.model.cmaes.countiter == 1
    # the V-only controller (no M) with the paper's action mapping, and the road-following data agent
    v_only = _fit_one_generation("controller_v.yaml", *flags({"model.init_args.max_episode_steps": 12}))
    assert v_only.model.world_model is None and v_only.model.num_params == (VISION_TINY["latent_dim"] + 1) * 3
    assert v_only.model.clip_dims.tolist() == [False, False, True] and v_only.model.cmaes.countiter == 1
    # controller.yaml starts from the V-only controller's mean: its weights on z, zeros on h
    start_only = {"trainer.max_steps": 0, "model.init_args.es.popsize": 3, "trainer.overwrite": "true"}
    z_h = main(["fit", "--config", str(CONFIGS / "carracing" / "controller.yaml"), *QUIET, *flags(start_only)])
    z = VISION_TINY["latent_dim"]
    start = z_h.model.cmaes.mean.reshape(-1)[: 3 * (z + MEMORY_TINY["net"]["hidden"])].reshape(3, -1)
    np.testing.assert_allclose(start[:, :z].reshape(-1), v_only.model.params.detach()[: 3 * z].double(), atol=1e-7)
    assert not start[:, z:].any()
    road = {"episodes": 1, "data.init_args.directory": "road", "data.init_args.env.max_episode_steps": 30}
    main(["record", "--config", str(CONFIGS / "carracing" / "record_road.yaml"), *flags(road)])
    assert len(EpisodeStore("road").paths()) == 1


@pytest.mark.slow
def test_cli_pipeline_boxing_configs(capsys):
    """HumbleRL's Boxing (ALE/Boxing-v5, cropped to the ring) runs record -> V -> convert -> M -> C
    -> evaluate from the shipped configs, sizes shrunk and bouts cut at 12 steps; the random
    policy's score comes from ``evaluate`` on record.yaml, as the controller config says."""
    short = flags({"data.init_args.env.max_episode_steps": 12})
    _run_pipeline("boxing", capsys, env=short, member_steps=12)
    frames = EpisodeStore("data/worldmodels/boxing/frames")
    assert next(frames.episodes())["obs"].shape[1:] == (64, 64, 3)
    assert frames.read_metadata()["env"]["crop"] == [30, 28, 153, 103]
    main(["evaluate", "--config", str(CONFIGS / "boxing" / "record.yaml"), "--episodes", "2", *short])
    assert "ALE/Boxing-v5: return" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_controller_in_dreamers_dream_end_to_end(capsys):
    """configs/worldmodels/cartpole_dreamer: Dreamer (debug size) -> record -> controller in its
    dream -> evaluate in the real env, from the CLI with sizes shrunk."""
    root = CONFIGS.parents[1]
    cfg = CONFIGS / "cartpole_dreamer"
    dreamer = {
        "trainer.max_steps": 2,
        "trainer.val_check_interval": 2,
        "data.init_args.batch_size": 2,
        "data.init_args.sampler.init_args.length": 8,
        "data.init_args.prefill": 16,
        "data.init_args.eval.episodes": 1,
        "data.init_args.eval.envs": 1,
    }
    presets = [
        "--config",
        str(root / "configs/dreamer/cartpole.yaml"),
        "--config",
        str(root / "configs/dreamer/presets/debug.yaml"),
    ]
    main(["fit", *presets, *QUIET, *flags(dreamer)])  # from a scratch folder: named as from the repository
    assert Path("lightning_logs/dreamer-cartpole/checkpoints/last.ckpt").is_file()
    main(["record", "--config", str(cfg / "record.yaml"), "--episodes", "3"])
    assert len(EpisodeStore("data/worldmodels/cartpole_dreamer/episodes")) == 3
    small_c = {
        "model.init_args.es.popsize": 3,
        "model.init_args.es.episodes_per_member": 1,
        "model.init_args.max_episode_steps": 15,
        "data.init_args.eval.episodes": 1,
        "data.init_args.eval.envs": 1,
        "trainer.val_check_interval": 2,
        "trainer.max_steps": 2,
    }
    cli = main(["fit", "--config", str(cfg / "controller.yaml"), *QUIET, *flags(small_c)])
    assert cli.model.cmaes.countiter == 2 and cli.model.num_params == (32 + 16 + 1) * 2
    capsys.readouterr()
    best = {"ckpt_path": "last", "episodes": 2, "model.init_args.use": "best"}
    main(["evaluate", "--config", str(cfg / "controller.yaml"), *flags(best)])
    assert "return" in capsys.readouterr().out
