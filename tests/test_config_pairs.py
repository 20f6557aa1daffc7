"""Configs that pair with another config and must learn as it does: the GPU configs against the CPU
configs whose measured returns are their goals, the actor-process config against the in-process
one it is compared with. Each may differ only in the keys listed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_wm.settings import flatten

ROOT = Path(__file__).resolve().parents[1]


def flat_config(name: str) -> dict[str, object]:
    """``configs/<name>`` as dotted keys."""
    return flatten(yaml.safe_load((ROOT / "configs" / name).read_text()))


def differing_keys(a: str, b: str) -> tuple[set[str], dict[str, object]]:
    """The dotted keys where ``configs/<a>`` and ``configs/<b>`` differ, and ``a`` flattened."""
    flat_a, flat_b = flat_config(a), flat_config(b)
    return {key for key in flat_a.keys() | flat_b.keys() if flat_a.get(key) != flat_b.get(key)}, flat_a


@pytest.mark.parametrize(
    "gpu, cpu, allowed",
    [
        ("dreamer/minatar_gpu.yaml", "dreamer/minatar.yaml", {"model.init_args.compile.mode"}),
        # the pixel job's CPU form, measured at full length on the CPU: one thread there, eager
        (
            "dreamer/cartpole_pixels_gpu.yaml",
            "dreamer/cartpole_pixels.yaml",
            {"model.init_args.compile.mode", "trainer.torch_threads"},
        ),
        # the GPU job runs 100k frames, the length of the CPU runs' 3-seed reference, with their
        # temperature schedule; the CPU config runs 200k with the schedule stretched to its length
        (
            "muzero/minatar_gpu.yaml",
            "muzero/minatar.yaml",
            {
                "model.init_args.search.cuda_graphs",
                "trainer.max_steps",
                "model.init_args.search.temperature.boundaries",
            },
        ),
    ],
)
def test_gpu_configs_learn_as_their_cpu_configs(gpu, cpu, allowed):
    """The GPU goals compare with the CPU configs' measured returns: the GPU configs may differ only
    in where and how fast they run (device, threads, compile, captured search), how often they
    validate and (MuZero) the run's length with the schedule sized to it."""
    differ, a = differing_keys(gpu, cpu)
    when = {"trainer.accelerator", "trainer.devices", "trainer.val_check_interval", "trainer.checkpoint_every_n_steps"}
    assert differ <= allowed | when, sorted(differ - allowed - when)
    assert a["trainer.accelerator"] == "gpu" and differ & allowed == allowed


def test_the_pong_gpu_job_makes_the_cpu_configs_updates_on_twice_the_rows_each_used_twice():
    """pong_gpu.yaml's header: pong_cpu.yaml's network, loss and optimizer, each update on twice the
    unrolls, each unroll used exactly twice (so twice the updates, the anneal over them), acted by
    policy-copy actors; nothing else may differ."""
    differ, gpu = differing_keys("impala/pong_gpu.yaml", "impala/pong_cpu.yaml")
    cpu = flat_config("impala/pong_cpu.yaml")
    device = {"trainer.accelerator", "trainer.devices", "trainer.torch_threads"}
    when = {"trainer.val_check_interval", "trainer.checkpoint_every_n_steps"}
    updates = {"data.init_args.batch_size", "trainer.max_steps", "model.init_args.optim.lr_anneal_steps"}
    rest = differ - device - when - updates
    assert all(key.startswith(("data.init_args.acting.", "data.init_args.replay.")) for key in rest), sorted(rest)
    assert gpu["data.init_args.batch_size"] == 2 * cpu["data.init_args.batch_size"]
    assert gpu["data.init_args.replay.max_use"] == 2 and gpu["data.init_args.replay.use_all"] is True
    assert gpu["trainer.max_steps"] == gpu["model.init_args.optim.lr_anneal_steps"] == 2 * cpu["trainer.max_steps"]
    assert gpu["data.init_args.acting.policy"] == "copies"


def test_the_dreamer_actors_config_is_the_in_process_config_with_actors():
    """The actor-process run is compared with cartpole.yaml's measured figures: only ``acting``."""
    differ, a = differing_keys("dreamer/cartpole_actors.yaml", "dreamer/cartpole.yaml")
    assert differ and all(key.startswith("data.init_args.acting.") for key in differ), sorted(differ)
    assert a["data.init_args.acting.num_actors"] == 1


def test_the_impala_minatar_actors_config_is_the_in_process_config_with_actors():
    """Its runs are compared frame for frame with minatar.yaml's in-process figures: only ``acting``."""
    differ, a = differing_keys("impala/minatar_actors.yaml", "impala/minatar.yaml")
    assert differ and all(key.startswith("data.init_args.acting.") for key in differ), sorted(differ)
    assert a["data.init_args.acting.num_actors"] == 2 and a["data.init_args.acting.fetch_ahead"] is False


def test_the_frame_and_state_config_is_the_pixel_config_with_the_state_vector():
    """Its runs are set beside cartpole_pixels.yaml's: what the state vector adds, nothing else."""
    differ, a = differing_keys("dreamer/cartpole_pixels_state.yaml", "dreamer/cartpole_pixels.yaml")
    assert differ == {"data.init_args.env.keep_state"} and a["data.init_args.env.keep_state"] is True


def test_the_carracing_config_is_the_pixel_config_on_another_task():
    """Its header says it learns with cartpole_pixels.yaml's networks and DreamerV3 options: it may
    differ only in the task (env, run length, prefill, replay size, evaluation episodes), the
    continuous actor, and CartPole's extra weight on terminal steps, which it leaves out."""
    differ, a = differing_keys("dreamer/carracing.yaml", "dreamer/cartpole_pixels.yaml")
    task = {"trainer.max_steps", "data.init_args.prefill", "data.init_args.replay.capacity"}
    task |= {"data.init_args.eval.episodes", "model.init_args.loss.continue_terminal_weight"}
    actor = {"model.init_args.behavior.actor_grad", "model.init_args.behavior.actor_dist"}
    env = {key for key in differ if key.startswith("data.init_args.env.")}
    assert differ - env <= task | actor, sorted(differ - env - task - actor)
    assert a["data.init_args.env.id"] == "CarRacing-v3" and a["model.init_args.behavior.actor_dist"] == "bounded_normal"
