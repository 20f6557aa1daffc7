"""The command line end to end: help, config errors, fit/resume, record, evaluate."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_wm.cli import main
from lightning_wm.data.episodes import EpisodeStore

from support import tiny_agent
from support.presets import TINY_FIT

ROOT = Path(__file__).resolve().parents[1]


def run_cli(args):
    return main(args=args)


@pytest.mark.slow
def test_help_lists_extra_subcommands():
    out = subprocess.run(
        [sys.executable, str(ROOT / "main.py"), "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    for command in ("fit", "validate", "record", "evaluate", "convert"):
        assert command in out.stdout


def test_unknown_config_key_exits_2_naming_it(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(["fit", *TINY_FIT, "--model.hiden", "3"])
    assert exit_info.value.code == 2
    assert "hiden" in capsys.readouterr().err


def test_abbreviated_option_is_rejected(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(["fit", *TINY_FIT, "--trainer.max_step", "3"])
    assert exit_info.value.code == 2
    assert "max_step" in capsys.readouterr().err


@pytest.mark.slow
def test_fit_then_resume_from_last():
    cli = run_cli(
        [
            "fit",
            *TINY_FIT,
            "--data.replay.save",
            "true",
            "--trainer.max_steps",
            "30",
            "--trainer.checkpoint_every_n_steps",
            "20",
            "--trainer.val_check_interval",
            "15",
            "--trainer.check_val_every_n_epoch",
            "null",
            "--trainer.limit_val_batches",
            "1",
        ]
    )
    dm = cli.datamodule
    first_env_steps = dm.collector.stats.env_steps
    # 64 prefill rows + 2 rows per batch (replay ratio 0.5); Lightning fetches one batch
    # ahead of the step it trains on, so 30 steps draw 31 batches
    assert first_env_steps == 64 + (30 + 1) * 2
    last = Path("lightning_logs/tiny/checkpoints/last.ckpt")
    assert last.is_file()
    ckpt = torch.load(last, weights_only=False)
    assert ckpt["global_step"] == 30
    assert "val/return" in cli.trainer.callback_metrics
    rows_before = len(dm.buffer)
    cli = run_cli(["fit", *TINY_FIT, "--data.replay.save", "true", "--trainer.max_steps", "40", "--ckpt_path", "last"])
    assert cli.trainer.global_step == 40
    # the env-step counter continues (no second prefill, no catch-up burst); the batch fetched
    # ahead before the checkpoint already took its env steps, so the resumed run does not repeat them
    assert cli.datamodule.collector.stats.env_steps == first_env_steps + 10 * 2
    assert len(cli.datamodule.buffer) == rows_before + 10 * 2, "the saved buffer was not restored"
    assert len(list(Path("lightning_logs/tiny").glob("version_*"))) == 2
    # the second run overwrote last.ckpt (no last-v1.ckpt that `--ckpt_path last` would miss)
    assert sorted(p.name for p in last.parent.glob("last*.ckpt")) == ["last.ckpt"]
    assert torch.load(last, weights_only=False)["global_step"] == 40


@pytest.mark.slow
def test_torch_threads_option():
    before = torch.get_num_threads()
    try:
        run_cli(["fit", *TINY_FIT, "--trainer.max_steps", "1", "--trainer.torch_threads", "2"])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_float32_matmul_precision_option(tmp_path):
    from lightning_wm.cli import Trainer

    before = torch.get_float32_matmul_precision()
    kw = {"logger": False, "enable_checkpointing": False, "default_root_dir": str(tmp_path)}
    try:
        Trainer(float32_matmul_precision="high", **kw)
        assert torch.get_float32_matmul_precision() == "high"
        with pytest.raises(ValueError, match="float32_matmul_precision must be highest, high or medium"):
            Trainer(float32_matmul_precision="fast", **kw)
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.slow
def test_keep_freed_memory_is_on_by_default_and_can_be_switched_off(monkeypatch):
    from lightning_wm import runtime

    calls = []
    monkeypatch.setattr(runtime, "keep_freed_memory", lambda: calls.append(1) or True)
    run_cli(["fit", *TINY_FIT, "--trainer.max_steps", "1"])
    assert calls == [1]
    run_cli(
        [
            "fit",
            *TINY_FIT,
            "--trainer.max_steps",
            "1",
            "--trainer.keep_freed_memory",
            "false",
            "--trainer.overwrite",
            "true",
        ]
    )
    assert calls == [1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_keep_freed_memory_applies_on_glibc():
    import platform

    from lightning_wm import runtime

    assert runtime.keep_freed_memory() == (platform.libc_ver()[0] == "glibc")


@pytest.mark.slow
def test_record_pixels_then_evaluate_random(tmp_path):
    store_dir = tmp_path / "eps"
    args = [
        "--model",
        "lightning_wm.agents.random.RandomPolicy",
        "--data",
        "lightning_wm.data.offline.EpisodeDataModule",
        "--data.directory",
        str(store_dir),
        "--data.env",
        '{"id": "CartPole-v1", "pixels": true, "num_envs": 2}',
    ]
    out = subprocess.run(
        [sys.executable, str(ROOT / "main.py"), "record", *args, "--episodes", "3"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    store = EpisodeStore(store_dir)
    assert len(store) == 3
    episode = next(store.episodes())
    assert episode["obs"].shape[1:] == (64, 64, 3) and episode["obs"].dtype == np.uint8
    assert episode["is_first"][0] and episode["is_last"][-1]
    assert store.read_metadata()["env"]["pixels"] is True
    gif = tmp_path / "ep.gif"
    out = subprocess.run(
        [sys.executable, str(ROOT / "main.py"), "evaluate", *args, "--episodes", "2", "--video", str(gif)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "return" in out.stdout and "±" in out.stdout
    assert gif.stat().st_size > 1000


RANDOM_CARTPOLE = [
    "--model",
    "lightning_wm.agents.random.RandomPolicy",
    "--data",
    "lightning_wm.data.offline.EpisodeDataModule",
    "--data.directory",
    "eps",
]


def test_evaluate_writes_an_mp4_of_the_first_episode(capsys):
    run_cli(
        [
            "evaluate",
            *RANDOM_CARTPOLE,
            "--data.env",
            '{"id": "CartPole-v1", "seed": 3}',
            "--episodes",
            "2",
            "--video",
            "first.mp4",
        ]
    )
    video = Path("first.mp4")
    assert video.stat().st_size > 1000
    assert b"ftyp" in video.read_bytes()[:64]  # an MP4 container
    assert "wrote first.mp4" in capsys.readouterr().out


def test_evaluate_refuses_an_unknown_video_format_before_running_episodes(capsys):
    with pytest.raises(ValueError, match=r"must end in \.gif or \.mp4"):
        run_cli(["evaluate", *RANDOM_CARTPOLE, "--data.env", '{"id": "CartPole-v1"}', "--video", "ep.avi"])
    assert "return" not in capsys.readouterr().out


@pytest.mark.slow
def test_command_line_errors_are_one_message_without_traceback(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "main.py"),
            "evaluate",
            *RANDOM_CARTPOLE,
            "--data.env",
            '{"id": "CartPole-v9"}',
            "--episodes",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert "error: unknown or unbuildable env id 'CartPole-v9'" in out.stderr
    assert "Traceback" not in out.stderr and "Union subtypes" not in out.stderr


def test_missing_checkpoint_is_reported():
    with pytest.raises(FileNotFoundError, match="no_such.ckpt"):
        run_cli(["fit", *TINY_FIT, "--trainer.max_steps", "2", "--ckpt_path", "no_such.ckpt"])


def test_record_is_random_without_a_model():
    run_cli(
        [
            "record",
            "--data",
            "lightning_wm.data.offline.EpisodeDataModule",
            "--data.directory",
            "rnd",
            "--data.env",
            '{"id": "CartPole-v1", "num_envs": 2}',
            "--episodes",
            "3",
        ]
    )
    store = EpisodeStore("rnd")
    assert len(store) == 3
    actions = np.concatenate([e["action"][:-1] for e in store.episodes()])
    assert set(np.unique(actions)) == {0, 1}  # both actions taken: a random policy, not a constant one


def test_record_random_episodes_of_a_dict_observation_env():
    """The env of configs/dreamer/cartpole_pixels_state.yaml (frame + state vector), shrunk."""
    import json

    import yaml

    config = yaml.safe_load((ROOT / "configs/dreamer/cartpole_pixels_state.yaml").read_text())
    env = {**config["data"]["init_args"]["env"], "size": [16, 16], "max_episode_steps": 6, "num_envs": 2}
    assert env["keep_state"] and env["pixels"]
    run_cli(
        [
            "record",
            "--data",
            "lightning_wm.data.offline.EpisodeDataModule",
            "--data.directory",
            "dict",
            "--data.env",
            json.dumps(env),
            "--episodes",
            "2",
        ]
    )
    episodes = list(EpisodeStore("dict").episodes())
    assert len(episodes) == 2
    for episode in episodes:
        rows = len(episode["action"])
        assert episode["obs"]["image"].shape == (rows, 16, 16, 3) and episode["obs"]["image"].dtype == np.uint8
        assert episode["obs"]["state"].shape == (rows, 4) and episode["obs"]["state"].dtype == np.float32


@pytest.mark.slow
def test_a_nan_loss_stops_training_with_a_message_and_keeps_the_last_checkpoint(monkeypatch):
    run_cli(["fit", *TINY_FIT, "--trainer.max_steps", "4"])
    last = Path("lightning_logs/tiny/checkpoints/last.ckpt")
    good = torch.load(last, weights_only=False)["global_step"]
    original = tiny_agent.TinyAgent.training_step

    def diverging(self, batch, batch_idx):
        loss = original(self, batch, batch_idx)
        return loss * float("nan") if self.global_step >= 6 else loss

    monkeypatch.setattr(tiny_agent.TinyAgent, "training_step", diverging)
    with pytest.raises(FloatingPointError, match=r"loss became nan at step \d+.*last good checkpoint"):
        run_cli(["fit", *TINY_FIT, "--trainer.max_steps", "20", "--ckpt_path", "last"])
    assert torch.load(last, weights_only=False)["global_step"] == good  # not overwritten with NaN weights


# -- record: a store that is continued, shared and checked ------------------------------------------

RECORD = [
    "record",
    "--data",
    "lightning_wm.data.offline.EpisodeDataModule",
    "--data.directory",
    "store",
    "--data.env",
    '{"id": "CartPole-v1", "num_envs": 2}',
]


def _fingerprints(store: EpisodeStore) -> list[bytes]:
    return [e["obs"].tobytes() for e in store.episodes()]


@pytest.mark.slow  # records six episodes: about a second
def test_recording_twice_into_one_store_continues_the_seeds_instead_of_repeating_episodes(capsys):
    run_cli([*RECORD, "--episodes", "3"])
    run_cli([*RECORD, "--episodes", "3"])
    prints = [line for line in capsys.readouterr().out.splitlines() if line.startswith("recorded")]
    store = EpisodeStore("store")
    assert len(store) == 6 and len(set(_fingerprints(store))) == 6, "a second record repeated episodes"
    # each run reports its own rows, not the store's total
    rows = [int(line.split(" rows")[0].rsplit(" ", 1)[1]) for line in prints]
    assert sum(rows) == store.total_steps() and all(r < store.total_steps() for r in rows)


@pytest.mark.slow
def test_two_records_at_once_into_one_store_both_finish_with_their_own_counts(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "main.py"), *RECORD, "--episodes", "4"]
    procs = [
        subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    store = EpisodeStore(tmp_path / "store")
    assert len(store) == 8 and len(set(_fingerprints(store))) == 8
    rows = [int(o[0].split(" rows")[0].rsplit(" ", 1)[1]) for o in outs]
    assert sum(rows) == store.total_steps()
    assert not [p for p in os.listdir(tmp_path / "store") if p.endswith(".tmp")]


@pytest.mark.slow  # records pixel episodes: over a second
def test_recording_into_a_store_of_other_env_settings_is_refused_naming_both():
    pixels = ["record", "--data", "lightning_wm.data.offline.EpisodeDataModule", "--data.directory", "frames"]
    run_cli([*pixels, "--data.env", '{"id": "CartPole-v1", "pixels": true, "size": [32, 32]}', "--episodes", "1"])
    with pytest.raises(ValueError, match=r"size: the store has \[32, 32\], this run \[64, 64\]"):
        run_cli([*pixels, "--data.env", '{"id": "CartPole-v1", "pixels": true}', "--episodes", "1"])
    assert EpisodeStore("frames").read_metadata()["env"]["size"] == [32, 32]
    assert len(EpisodeStore("frames")) == 1


def test_record_with_a_replay_datamodule_is_one_clear_error():
    with pytest.raises(ValueError, match=r"record .* EpisodeDataModule.* ReplayDataModule"):
        run_cli(["record", *TINY_FIT, "--episodes", "1"])


# -- folders that cannot be written: refused before the work ------------------------------------------


def _not_a_folder(name: str) -> str:
    """A path under a regular file: nothing can be created there, not even by root."""
    Path("blocker").write_text("a file")
    return f"blocker/{name}"


def test_an_unwritable_store_is_refused_before_recording():
    with pytest.raises(PermissionError, match=r"blocker/eps.* not writable"):
        run_cli(
            [
                "record",
                "--data",
                "lightning_wm.data.offline.EpisodeDataModule",
                "--data.directory",
                _not_a_folder("eps"),
                "--episodes",
                "1",
            ]
        )


def test_an_unwritable_video_path_is_refused_before_the_episodes(capsys):
    with pytest.raises(PermissionError, match=r"video folder .*blocker.* not writable"):
        run_cli(
            [
                "evaluate",
                *RANDOM_CARTPOLE,
                "--data.env",
                '{"id": "CartPole-v1"}',
                "--episodes",
                "1",
                "--video",
                _not_a_folder("ep.gif"),
            ]
        )
    assert "return" not in capsys.readouterr().out


@pytest.mark.slow  # records a pixel episode first: about a second
def test_an_unwritable_convert_target_is_refused_before_encoding(tmp_path):
    run_cli(
        [
            "record",
            "--data",
            "lightning_wm.data.offline.EpisodeDataModule",
            "--data.directory",
            "store",
            "--data.env",
            '{"id": "CartPole-v1", "pixels": true}',
            "--episodes",
            "1",
        ]
    )
    target = _not_a_folder("latents")
    with pytest.raises(PermissionError, match=r"convert target .*blocker/latents.* not writable"):
        run_cli(
            [
                "convert",
                "--model",
                "lightning_wm.agents.worldmodels.vision.Vision",
                "--data",
                "lightning_wm.data.offline.EpisodeDataModule",
                "--data.directory",
                "store",
                "--target",
                target,
            ]
        )


def test_an_unwritable_replay_storage_dir_and_log_root_are_refused_before_training():
    with pytest.raises(PermissionError, match=r"storage_dir .*blocker/replay.* not writable"):
        run_cli(["fit", *TINY_FIT, "--trainer.max_steps", "1", "--data.replay.storage_dir", _not_a_folder("replay")])
    with pytest.raises(PermissionError, match=r"log folder .*blocker/lightning_logs.* not writable"):
        run_cli(["fit", *TINY_FIT, "--trainer.max_steps", "1", "--trainer.default_root_dir", "blocker"])


# -- settings checked when they are given, not at the first batch -------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        (["--data.prefill", "-1"], r"prefill must be >= 0, got -1"),
        (["--data.batch_size", "0"], r"batch_size must be >= 1, got 0"),
        (["--data.sampler.length", "0"], r"sequence length must be >= 1, got 0"),
        (["--data.replay.capacity", "0"], r"replay.capacity must be >= 1, got 0"),
    ],
)
def test_bad_data_settings_are_refused_at_construction(override, message):
    with pytest.raises(ValueError, match=message):
        run_cli(["fit", *TINY_FIT, "--trainer.max_steps", "1", *override])
    assert not Path("lightning_logs").exists(), "an empty run folder was made for a run that cannot start"


def test_a_dreamer_horizon_of_zero_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"behavior.horizon must be >= 1, got 0"):
        run_cli(
            ["fit", "--config", str(ROOT / "configs/dreamer/cartpole.yaml"), "--model.init_args.behavior.horizon", "0"]
        )
    assert not Path("lightning_logs").exists()


def test_evaluate_out_appends_one_json_line_a_run(capsys):
    args = ["evaluate", *RANDOM_CARTPOLE, "--data.env", '{"id": "CartPole-v1", "seed": 3}', "--episodes", "3"]
    run_cli([*args, "--out", "records/evals.jsonl"])
    run_cli([*args, "--out", "records/evals.jsonl", "--episodes", "2"])
    lines = Path("records/evals.jsonl").read_text().splitlines()
    assert len(lines) == 2
    one, two = (json.loads(line) for line in lines)
    assert len(one["returns"]) == 3 and len(two["returns"]) == 2
    assert one["return_mean"] == pytest.approx(np.mean(one["returns"]))
    assert one["return_std"] == pytest.approx(np.std(one["returns"]))
    assert one["env"]["id"] == "CartPole-v1" and one["checkpoint"] is None
    assert one["model"].endswith("RandomPolicy") and one["run"]
    printed = capsys.readouterr().out
    assert f"return {one['return_mean']:.2f} ± {one['return_std']:.2f} over 3 episodes" in printed
    assert "appended the result to records/evals.jsonl" in printed


def test_evaluate_out_into_a_folder_that_cannot_be_written_fails_before_the_episodes(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(OSError):
        run_cli(["evaluate", *RANDOM_CARTPOLE, "--data.env", '{"id": "CartPole-v1"}', "--out", f"{blocker}/x.jsonl"])
    assert "return" not in capsys.readouterr().out
