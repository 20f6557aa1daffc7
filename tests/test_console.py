"""The console: only what matters on screen, RL progress in the bar, two-line command-line errors."""

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_wm import console
from lightning_wm.cli import main

from support.presets import DREAMER_TINY, REPLAY_DATA_TINY, data_overrides, model_overrides

ROOT = Path(__file__).resolve().parents[1]
CARTPOLE = str(ROOT / "configs/dreamer/cartpole.yaml")
IMPALA_CARTPOLE = str(ROOT / "configs/impala/cartpole.yaml")
SHRUNK = [
    "--config",
    CARTPOLE,
    "--trainer.max_steps",
    "8",
    "--trainer.val_check_interval",
    "4",
    "--trainer.log_every_n_steps",
    "2",
    "--trainer.checkpoint_every_n_steps",
    "4",
    *model_overrides(DREAMER_TINY),
    *data_overrides(REPLAY_DATA_TINY),
]
# what a new user saw, none of which is theirs to act on
SILENCED = [
    "No seed found",
    "Seed set to",
    "Tip:",
    "litlogger",
    "GPU available: False",
    "TPU available",
    "LeafSpec",
    "`weights_only` was not set",
    "Epoch 0",
    "XDG_RUNTIME_DIR",
    "limit_val_batches=1",
    "manual optimization",
    "`Trainer.fit` stopped",
    "usage:",
]


def _run(*args: str, env: dict | None = None, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LIGHTNING_WM_PROGRESS_EVERY": "0", **(env or {})}
    env.pop("SDL_VIDEODRIVER", None)  # as on a user's machine
    env.pop(console.VERBOSE_ENV, None)
    return subprocess.run(
        [sys.executable, str(ROOT / "main.py"), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600
    )


@pytest.mark.slow
def test_the_default_config_prints_the_rl_progress_and_none_of_the_silenced_lines(tmp_path):
    out = _run("fit", *SHRUNK, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    for line in SILENCED:
        assert line not in text, line
    assert "\r" not in text, "a log file gets one line per update, not carriage returns"
    lines = [line for line in out.stdout.splitlines() if line.startswith("train:")]
    assert lines, out.stdout
    final = lines[-1]
    assert final.startswith("train: 8/8 steps (100%)"), final
    for field in ("env steps ", "return ", "val/return ", "frames/s", "elapsed"):
        assert field in final, (field, final)


@pytest.mark.slow
def test_verbose_shows_what_is_otherwise_hidden(tmp_path):
    out = _run("fit", *SHRUNK, "--trainer.max_steps", "2", "--verbose", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Seed set to 0" in out.stderr and "Tip:" in out.stderr


@pytest.mark.slow
def test_the_bar_on_a_terminal_is_tqdm_with_the_same_fields(tmp_path, monkeypatch):
    """Through a pseudo-terminal: one bar, steps of max_steps, no epochs."""
    if not Path("/usr/bin/script").exists():
        pytest.skip("needs util-linux script for a pseudo-terminal")
    command = " ".join(["stty cols 250 rows 40;", sys.executable, str(ROOT / "main.py"), "fit", *SHRUNK])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        ["/usr/bin/script", "-qec", command, "/dev/null"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:]
    screen = out.stdout.replace("\r", "\n")
    assert "train: 100%" in screen and "8/8" in screen
    assert "env steps " in screen and "frames/s" in screen and "Epoch" not in screen


def test_progress_off_a_terminal_prints_lines_at_most_every_interval():
    stream = io.StringIO()
    bar = console._LineProgress(100, "record CartPole-v1", "ep", stream, every_s=3600)
    for _ in range(100):
        bar.update(1)
    bar.close()
    assert stream.getvalue().splitlines() == [bar.line()]
    assert bar.line().startswith("record CartPole-v1: 100/100 episodes (100%) | 0:00:00 elapsed")


@pytest.mark.parametrize(
    "args, first, help_for",
    [
        (["--trainer.max_steps", "abc"], "error: --trainer.max_steps expects int, got 'abc'", None),
        (
            ["--trainer.max_step", "3"],
            "error: unrecognized arguments: --trainer.max_step 3 (did you mean '--trainer.max_steps'?)",
            None,
        ),
        (
            ["--trainer.max_stepz", "3"],
            "error: unrecognized arguments: --trainer.max_stepz 3 (did you mean '--trainer.max_steps'?)",
            None,
        ),
        (["--trainer.zzz", "3"], "error: unrecognized arguments: --trainer.zzz 3", None),
        (
            ["--model.init_args.behavior.horizon", "x"],
            "error: --model.init_args.behavior.horizon expects int, got 'x'",
            "--model.help lightning_wm.agents.dreamer.Dreamer",
        ),
        (
            ["--model.compil", "true"],
            "error: --model.init_args.compil: Dreamer has no option 'compil' (did you mean 'compile'?)",
            "--model.help lightning_wm.agents.dreamer.Dreamer",
        ),
        (
            ["--data.init_args.acting.backend", "bogus"],
            "error: --data.init_args.acting.backend expects one of 'local', 'ray', got 'bogus'",
            "--data.help lightning_wm.data.modules.ReplayDataModule",
        ),
    ],
)
def test_command_line_errors_are_two_lines_without_a_usage_dump(capsys, args, first, help_for):
    with pytest.raises(SystemExit) as exit_info:
        main(args=["fit", "--config", CARTPOLE, *args])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0] == first
    assert "fit --help" in lines[1] and (help_for is None or help_for in lines[1])


DYNA = str(ROOT / "configs/impala/cartpole_dyna.yaml")
DYNA_HELP = "--model.help lightning_wm.agents.dyna.DynaLearner"


@pytest.mark.parametrize(
    "args, first",
    [
        (
            ["--model.init_args.policy.init_args.optim.lr", "x"],
            "error: --model.init_args.policy.init_args.optim.lr expects float, got 'x'",
        ),
        (
            ["--model.init_args.policy.init_args.nett", "1"],
            "error: --model.init_args.policy.init_args.nett: IMPALA has no option 'nett' (did you mean 'net'?)",
        ),
        (
            ["--model.init_args.policy.init_args.optim.lrr", "1"],
            "error: --model.init_args.policy.init_args.optim.lrr: IMPALA has no option 'optim.lrr'"
            " (did you mean 'optim.lr'?)",
        ),
        (
            ["--model.init_args.policy.init_args.optim.lr_anneal_steps", "null"],
            "error: --model.init_args.policy.init_args.optim.lr_anneal_steps: null two classes deep arrives as the"
            " string 'None'; give the group as YAML instead:"
            " --model.init_args.policy '{init_args: {optim: {lr_anneal_steps: null}}}'",
        ),
    ],
)
def test_errors_in_a_class_inside_a_class_name_the_whole_key_and_the_inner_class(capsys, args, first):
    with pytest.raises(SystemExit) as exit_info:
        main(args=["fit", "--config", DYNA, *args])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [first, lines[1]] and DYNA_HELP in lines[1]


def test_null_for_an_option_of_a_settings_group_is_advised_and_the_advice_works(capsys):
    """``null`` inside a class's settings group (``optim.lr_anneal_steps``) reaches jsonargparse as
    the string 'None': the error says so and names the YAML group that works."""
    with pytest.raises(SystemExit) as exit_info:
        main(args=["fit", "--config", IMPALA_CARTPOLE, "--model.init_args.optim.lr_anneal_steps", "null"])
    assert exit_info.value.code == 2
    first = capsys.readouterr().err.strip().splitlines()[0]
    assert first == (
        "error: --model.init_args.optim.lr_anneal_steps: null in a settings group arrives as the string 'None'; "
        "give the group as YAML instead: --model.init_args.optim '{lr_anneal_steps: null}'"
    )
    with pytest.raises(SystemExit) as exit_info:
        main(
            args=[
                "fit",
                "--config",
                IMPALA_CARTPOLE,
                "--model.init_args.optim",
                "{lr_anneal_steps: null}",
                "--print_config",
            ]
        )
    assert exit_info.value.code == 0
    optim = capsys.readouterr().out.split("    optim:", 1)[1]
    assert "lr_anneal_steps: null" in optim and "lr: 0.001" in optim  # merged into the config's group


def test_the_advised_yaml_group_sets_the_nested_null(capsys):
    nested = ["--model.init_args.policy", "{init_args: {optim: {lr_anneal_steps: null}}}", "--print_config"]
    with pytest.raises(SystemExit) as exit_info:
        main(args=["fit", "--config", DYNA, *nested])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    policy = printed[printed.index("  policy:") : printed.index("  world_model:")]
    assert "lr_anneal_steps: null" in policy


def test_a_yaml_error_names_its_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_steps: [1\n")
    with pytest.raises(SystemExit) as exit_info:
        main(args=["fit", "--config", CARTPOLE, "--config", str(bad)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: config file '{bad}' is not valid YAML" in err and "(line 3, column 1)" in err
    assert "<unicode string>" not in err


@pytest.mark.slow
def test_pixel_rendering_prints_no_sdl_error_line(tmp_path):
    out = _run(
        "record",
        "--data",
        "lightning_wm.data.offline.EpisodeDataModule",
        "--data.directory",
        "eps",
        "--data.env",
        '{"id": "CartPole-v1", "pixels": true}',
        "--episodes",
        "1",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "XDG_RUNTIME_DIR" not in out.stderr and "Hello from the pygame community" not in out.stdout
    assert "recorded 1 episodes" in out.stdout
