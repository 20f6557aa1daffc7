"""MuZero from the command line: the CartPole and Pong configs shrunk, every logged part, seeded
determinism, the averaged weights (EMAWeights) and resume, actor processes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from support.muzero_helpers import small
from support.presets import MUZERO_DATA_TINY, MUZERO_TINY, data_overrides, model_overrides
from support.tb_scalars import logged_scalars

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


def _cartpole_args(steps: int, run: str = "run", extra: tuple[str, ...] = ()) -> list[str]:
    """configs/muzero/cartpole.yaml shrunk to a few seconds."""
    return [
        "fit",
        "--config",
        str(ROOT / "configs/muzero/cartpole.yaml"),
        *f"--seed_everything 7 --trainer.max_steps {steps} --trainer.log_every_n_steps 1".split(),
        *f"--trainer.val_check_interval {steps} --trainer.enable_progress_bar false --trainer.run_name {run}".split(),
        *TINY_MODEL,
        *data_overrides(MUZERO_DATA_TINY),
        *extra,
    ]


TINY_MODEL = model_overrides(MUZERO_TINY)


@pytest.mark.slow
def test_cli_fit_cartpole_logs_every_part():
    from lightning_wm.cli import main

    cli = main(
        args=_cartpole_args(
            6, extra=("--model.init_args.reanalyse.ratio", "0.5", "--model.init_args.reanalyse.td_steps", "3")
        )
    )
    assert cli.trainer.global_step == 6
    run = Path("lightning_logs/run")
    for tag in (
        "loss/total",
        "loss/value",
        "loss/reward",
        "loss/policy",
        "replay/priority_mean",
        "replay/priority_max",
        "replay/weight_mean",
        "replay/age",
        "reanalyse/fraction",
        "reanalyse/rows",
        "search/root_value",
        "search/visit_entropy",
        "search/depth",
        "search/temperature",
        "val/return",
        "env/steps",
    ):
        assert logged_scalars(run, tag), tag
    assert logged_scalars(run, "reanalyse/fraction")[-1] == 0.5
    # priorities came back: the buffer's positions no longer all share the initial priority
    leaves = cli.datamodule.buffer._tree.leaves
    assert len(np.unique(leaves[leaves > 0])) > 1


@pytest.mark.slow
def test_same_seed_same_weights():
    """num_actors 0: acting, sampling, search noise and training all follow the seed, so two fits
    of one config end bit-identical."""
    from lightning_wm.cli import main

    weights = []
    for run in ("a", "b"):
        cli = main(
            args=_cartpole_args(
                5, run=run, extra=("--model.init_args.reanalyse.ratio", "0.25", "--trainer.limit_val_batches", "0")
            )
        )
        weights.append({k: v.clone() for k, v in cli.model.state_dict().items()})
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key
    start = small().state_dict()
    assert any(not torch.equal(weights[0][k], start[k]) for k in start if k.startswith("model."))


@pytest.mark.slow
def test_averaged_weights_are_evaluated_and_saved_and_a_resumed_run_continues_from_the_online_ones(recwarn):
    """configs/muzero/cartpole.yaml lists EMAWeights: the module after fit and last.ckpt's
    state_dict are the average (what `evaluate` loads, without a warning), the online weights are
    kept beside it, and a longer run resumed from the finished run's last.ckpt starts from those
    (Lightning's own callback saved the average twice there), with the callback listed or not."""
    from lightning_wm.callbacks import EMAWeights
    from lightning_wm.cli import main

    from support import fit_probes

    cli = main(args=_cartpole_args(6, run="ema"))
    assert [c.update_every_n_steps for c in cli.trainer.callbacks if isinstance(c, EMAWeights)] == [1]
    ckpt = torch.load("lightning_logs/ema/checkpoints/last.ckpt", weights_only=True)
    average, online = ckpt["state_dict"], ckpt["current_model_state"]
    assert average.keys() == online.keys()
    for name, value in cli.model.state_dict().items():
        assert torch.equal(value, average[name]), name
    moved = [k for k in average if k.startswith("model.") and not torch.equal(average[k], online[k])]
    assert moved, "the average equals the online weights: nothing was averaged"
    assert ckpt["averaging_state"]["n_averaged"].item() == 6

    config = str(ROOT / "configs/muzero/cartpole.yaml")
    main(
        args=[
            "evaluate",
            "--config",
            config,
            "--trainer.run_name",
            "ema",
            "--ckpt_path",
            "last",
            "--episodes",
            "1",
            *TINY_MODEL,
        ]
    )
    assert not [w for w in recwarn if "WeightAveraging" in str(w.message)]

    # a run that lists no averaging, resumed from that checkpoint, also continues from the online weights
    main(
        args=_cartpole_args(
            7,
            run="plain",
            extra=(
                "--ckpt_path",
                "lightning_logs/ema/checkpoints/last.ckpt",
                "--trainer.callbacks",
                '[{"class_path": "support.fit_probes.RecordStart"}]',
            ),
        )
    )
    assert fit_probes.SEEN["global_step"] == 6
    for name, value in online.items():
        assert torch.equal(fit_probes.SEEN["model"][name], value), name

    callbacks = (
        '[{"class_path": "lightning_wm.callbacks.EMAWeights", "init_args": {"decay": 0.99}}, '
        '{"class_path": "support.fit_probes.RecordStart"}]'
    )
    cli = main(args=_cartpole_args(8, run="ema", extra=("--ckpt_path", "last", "--trainer.callbacks", callbacks)))
    assert fit_probes.SEEN["global_step"] == 6 and cli.trainer.global_step == 8
    for name, value in online.items():
        assert torch.equal(fit_probes.SEEN["model"][name], value), name


def test_ema_weights_options_are_checked_and_follow_lightnings_schedule():
    from lightning_wm.callbacks import EMAWeights

    every = EMAWeights(decay=0.99)
    assert [every.should_update(step_idx=i) for i in range(3)] == [True] * 3
    assert not every.should_update(epoch_idx=0)
    later = EMAWeights(decay=0.5, update_every_n_steps=2, update_starting_at_step=3)
    assert [later.should_update(step_idx=i) for i in range(7)] == [False] * 4 + [True, False, True]
    with pytest.raises(ValueError, match="decay must be in"):
        EMAWeights(decay=1.0)
    with pytest.raises(ValueError, match="update_every_n_steps"):
        EMAWeights(update_every_n_steps=0)


@pytest.mark.slow
def test_cli_fit_pong_config_shrunk():
    """configs/muzero/pong.yaml (frame stacks from the sampler's history, conv net, BatchNorm,
    latent consistency, reanalyse, SGD with warm-up) shrunk to a CPU smoke test."""
    from lightning_wm.cli import main

    # its own sizes, not MUZERO_TINY's: pong.yaml's conv net (channels) and 2 simulations per search
    args = (
        "--seed_everything 1 --trainer.accelerator cpu --trainer.max_steps 2 --trainer.log_every_n_steps 1 "
        "--trainer.limit_val_batches 0 --trainer.enable_progress_bar false --trainer.run_name pong "
        "--model.init_args.net.channels 8 --model.init_args.search.num_simulations 2 "
        "--model.init_args.net.support_size 10 --model.init_args.reanalyse.batch_size 16 "
        "--data.init_args.env.num_envs 2 --data.init_args.replay.capacity 400 --data.init_args.batch_size 4 "
        "--data.init_args.prefill 40 --data.init_args.replay_ratio 1.0"
    ).split()
    config = str(ROOT / "configs/muzero/pong.yaml")
    cli = main(args=["fit", "--config", config, *args, "--data.init_args.env.size", "[32, 32]"])
    assert cli.trainer.global_step == 2
    assert cli.model.model.obs_shape == (4, 32, 32, 1)
    run = Path("lightning_logs/pong")
    for tag in ("loss/value", "loss/policy", "loss/reward", "loss/repr", "reanalyse/rows"):
        assert logged_scalars(run, tag), tag


@pytest.mark.slow
def test_cli_fit_with_actor_processes():
    """num_actors 1: the actor searches with the acting copy (CPU, published weights) and its
    rows carry the search's root_value and visit_probs; training goes on from them."""
    from lightning_wm.cli import main

    cli = main(
        args=_cartpole_args(
            6,
            run="actors",
            extra=("--data.init_args.acting.num_actors", "1", "--data.init_args.acting.chunk_length", "8"),
        )
    )
    assert cli.trainer.global_step == 6
    buffer = cli.datamodule.buffer
    probs, version = buffer.column("visit_probs"), buffer.column("policy_version")
    stored = buffer.generation(np.arange(buffer.num_streams)[:, None], np.arange(buffer.cap_per_stream)[None]) >= 0
    searched = stored & (probs.sum(-1) > 0)  # rows acted by a search (not the random prefill, not last rows)
    assert searched.sum() > 0
    np.testing.assert_allclose(probs[searched].sum(-1), 1.0, rtol=1e-5)
    assert np.isfinite(buffer.column("root_value")[searched]).all()
    assert (version[searched] >= 0).all()
    assert "actors/policy_lag" in cli.trainer.logged_metrics
