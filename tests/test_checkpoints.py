"""Checkpoints: one reader (weights_only, one-line errors), atomic writes, the resume rule,
``last`` / ``best`` resolution with a fallback for a corrupt ``last.ckpt``."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_wm.checkpoints import CheckpointError, load_checkpoint, load_weights
from lightning_wm.cli import main

from support import tiny_agent
from support.presets import TINY_FIT

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

# half the preset's prefill: these tests fit and resume many times, and a checkpoint needs few rows
TINY = [*TINY_FIT, "--data.prefill", "32", "--trainer.enable_model_summary", "false"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A checkpoint folder of a 6-step TinyAgent run (hidden 16), copied into each test."""
    root = tmp_path_factory.mktemp("trained")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        main(args=["fit", *TINY, "--trainer.max_steps", "6"])
    finally:
        os.chdir(cwd)
    return root / "lightning_logs"


@pytest.fixture
def run(trained) -> Path:
    """This test's copy of the trained run: ``lightning_logs/tiny/checkpoints/last.ckpt``."""
    shutil.copytree(trained, "lightning_logs")
    return Path("lightning_logs/tiny/checkpoints")


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


@pytest.mark.slow  # the run fixture fits
@pytest.mark.parametrize(
    "content, why",
    [
        (b"", "empty"),
        (None, "truncated or corrupt"),  # the first half of a real checkpoint
        (b"this is not a checkpoint\n" * 40, "not a checkpoint file"),
    ],
    ids=["empty", "truncated", "garbage"],
)
def test_unreadable_checkpoints_are_one_line_errors_naming_the_file(run, content, why):
    bad = Path("bad.ckpt")
    real = (run / "last.ckpt").read_bytes()
    bad.write_bytes(real[: len(real) // 2] if content is None else content)
    with pytest.raises(CheckpointError, match=why) as err:
        load_checkpoint(bad)
    assert "bad.ckpt" in _one_line(err)


def test_a_checkpoint_holding_python_objects_is_refused_not_executed(tmp_path):
    torch.save({"state_dict": {}, "thing": Path("x")}, tmp_path / "obj.ckpt")
    with pytest.raises(CheckpointError, match="holds Python objects") as err:
        load_checkpoint(tmp_path / "obj.ckpt")
    _one_line(err)
    torch.save(torch.zeros(3), tmp_path / "tensor.ckpt")
    with pytest.raises(CheckpointError, match="not a Lightning checkpoint"):
        load_checkpoint(tmp_path / "tensor.ckpt")


@pytest.mark.slow
def test_fit_from_a_garbage_checkpoint_prints_one_error_line_without_traceback(tmp_path):
    Path(tmp_path / "bad.ckpt").write_bytes(b"\x00garbage" * 100)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    out = subprocess.run(
        [sys.executable, str(ROOT / "main.py"), "fit", *TINY, "--trainer.max_steps", "2", "--ckpt_path", "bad.ckpt"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env=env,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "bad.ckpt" in errors[0] and "not a checkpoint file" in errors[0], out.stderr[-3000:]


@pytest.mark.slow  # the run fixture fits
@pytest.mark.parametrize("ckpt_path", ["last", "FILE"])
def test_resume_refuses_a_config_that_contradicts_the_checkpoint_naming_the_keys(run, ckpt_path):
    """One rule for ``last`` and an explicit file: the checkpoint's architecture is kept, and a
    config that differs is refused (it was silently overridden by a file, ignored for last)."""
    path = str(run / "last.ckpt") if ckpt_path == "FILE" else "last"
    with pytest.raises(CheckpointError, match=r"hidden: checkpoint 16, config 32") as err:
        main(args=["fit", *TINY, "--trainer.max_steps", "8", "--model.hidden", "32", "--ckpt_path", path])
    assert "epsilon" not in _one_line(err)  # only the differing keys are named
    cli = main(args=["fit", *TINY, "--trainer.max_steps", "8", "--ckpt_path", path])  # the same config resumes
    assert cli.trainer.global_step == 8 and cli.model.net[0].out_features == 16


@pytest.mark.slow  # the run fixture fits
def test_evaluating_another_familys_checkpoint_is_refused_by_name(run):
    with pytest.raises(CheckpointError, match=r"holds a TinyAgent .* builds a RandomPolicy") as err:
        main(
            args=[
                "evaluate",
                "--model",
                "lightning_wm.agents.random.RandomPolicy",
                *TINY[2:],
                "--ckpt_path",
                "last",
                "--episodes",
                "1",
            ]
        )
    _one_line(err)


@pytest.mark.slow  # the run fixture fits
def test_evaluating_with_other_settings_that_fit_the_weights_warns_naming_them(run, capsys):
    from lightning_wm.checkpoints import CheckpointWarning

    with pytest.warns(CheckpointWarning, match=r"epsilon: checkpoint 0\.3, config 0\.5"):
        main(args=["evaluate", *TINY, "--model.epsilon", "0.5", "--ckpt_path", "last", "--episodes", "1"])
    assert "return" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match=r"do not fit this TinyAgent .*hidden: checkpoint 16, config 32"):
        main(args=["evaluate", *TINY, "--model.hidden", "32", "--ckpt_path", "last", "--episodes", "1"])


@pytest.mark.slow  # the run fixture fits
def test_weights_that_do_not_fit_are_one_line_naming_the_tensors(run):
    from lightning_wm.envs import EnvConfig, env_spec

    model = tiny_agent.TinyAgent(env_spec(EnvConfig("CartPole-v1")), hidden=32)
    model._hparams = type(model.hparams)()  # a module that records no settings: only its weights are compared
    with pytest.raises(CheckpointError, match=r"shapes differ .*net\.0\.weight \(16, 4\) vs \(32, 4\)") as err:
        load_weights(model, run / "last.ckpt")
    _one_line(err)


# -- writing: atomic, loud, no stale temps -------------------------------------------------------


def test_a_checkpoint_folder_that_cannot_be_written_stops_fit_at_start(tmp_path, capsys):
    """It used to train, exit 0 and write nothing (Lightning swallows the PermissionError)."""
    Path("lightning_logs/tiny").mkdir(parents=True)
    Path("lightning_logs/tiny/checkpoints").write_text("a file where the folder should be")
    with pytest.raises(PermissionError, match=r"checkpoint folder .*lightning_logs/tiny/checkpoints.* is not writable"):
        main(args=["fit", *TINY, "--trainer.max_steps", "2"])
    assert not list(Path("lightning_logs/tiny").glob("version_*")), "no run folder for a run that cannot be saved"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_checkpoint_folder_stops_fit_at_start():
    Path("lightning_logs/tiny/checkpoints").mkdir(parents=True)
    os.chmod("lightning_logs/tiny/checkpoints", 0o555)
    try:
        with pytest.raises(PermissionError, match="not writable"):
            main(args=["fit", *TINY, "--trainer.max_steps", "2"])
    finally:
        os.chmod("lightning_logs/tiny/checkpoints", 0o755)


@pytest.mark.slow
def test_a_save_that_fails_mid_run_stops_the_run(monkeypatch):
    import lightning_wm.checkpoints as checkpoints

    real, calls = checkpoints.atomic_torch_save, []

    def failing(obj, path):
        calls.append(path)
        if len(calls) >= 2:
            raise PermissionError(13, "Permission denied", str(path))
        return real(obj, path)

    monkeypatch.setattr(checkpoints, "atomic_torch_save", failing)
    with pytest.raises(PermissionError, match="Permission denied"):
        main(args=["fit", *TINY, "--trainer.max_steps", "6", "--trainer.checkpoint_every_n_steps", "2"])
    assert len(calls) == 2


@pytest.mark.slow
def test_kill_9_during_a_checkpoint_write_keeps_last_ckpt_and_the_next_run_cleans_up(tmp_path):
    """The temp dir is another folder than the logs: the half-written file must be a temp file
    beside the target, never last.ckpt; the resumed run removes it once it is stale."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]), "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    args = [*TINY, "--trainer.max_steps", "8", "--trainer.checkpoint_every_n_steps", "2"]
    # saves: step=2.ckpt (1), its copy to last.ckpt (no torch.save), step=4.ckpt (2: killed half-way)
    out = subprocess.run(
        [sys.executable, str(TESTS / "support" / "kill_during_save.py"), "2", "fit", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env=env,
    )
    assert out.returncode == -9, out.stderr[-3000:]
    folder = tmp_path / "lightning_logs/tiny/checkpoints"
    assert load_checkpoint(folder / "last.ckpt")["global_step"] == 2
    temps = list(folder.glob(".*.tmp"))
    assert len(temps) == 1 and temps[0].name.startswith(".step=4.ckpt."), sorted(p.name for p in folder.iterdir())
    assert not list((tmp_path / "tmp").iterdir()), "nothing is written through the temp dir"
    old = temps[0].stat().st_mtime - 3600
    os.utime(temps[0], (old, old))  # stale: its writer is long gone
    os.chdir(tmp_path)
    cli = main(args=["fit", *args, "--ckpt_path", "last"])
    assert cli.trainer.global_step == 8
    assert not list(folder.glob(".*.tmp"))


@pytest.mark.slow
def test_a_corrupt_last_ckpt_falls_back_to_the_newest_intact_checkpoint_with_a_warning():
    from lightning_wm.checkpoints import CheckpointWarning

    main(args=["fit", *TINY, "--trainer.max_steps", "5", "--trainer.checkpoint_every_n_steps", "2"])
    folder = Path("lightning_logs/tiny/checkpoints")
    assert sorted(p.name for p in folder.glob("*.ckpt")) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt"]
    (folder / "last.ckpt").write_bytes(b"")
    with pytest.warns(
        CheckpointWarning,
        match=r"last\.ckpt in .* cannot be read \(it is empty .*\); using "
        r"step=4\.ckpt, the newest intact",
    ):
        cli = main(
            args=[
                "fit",
                *TINY,
                "--trainer.max_steps",
                "7",
                "--trainer.checkpoint_every_n_steps",
                "2",
                "--ckpt_path",
                "last",
            ]
        )
    assert cli.trainer.global_step == 7
    assert load_checkpoint(folder / "last.ckpt")["global_step"] == 7


@pytest.mark.slow
def test_resume_from_last_without_a_last_ckpt_is_refused_naming_the_folder():
    """A typo in run_name used to train from scratch and exit 0."""
    with pytest.raises(FileNotFoundError, match=r"no last\.ckpt in .*lightning_logs/tiny/checkpoints"):
        main(args=["fit", *TINY, "--trainer.max_steps", "2", "--ckpt_path", "last"])
    cli = main(args=["fit", *TINY, "--trainer.max_steps", "2", "--resume_if_exists", "true"])  # starts fresh
    assert cli.trainer.global_step == 2
    cli = main(args=["fit", *TINY, "--trainer.max_steps", "4", "--resume_if_exists", "true"])  # resumes
    assert (
        cli.trainer.global_step == 4
        and load_checkpoint("lightning_logs/tiny/checkpoints/last.ckpt")["global_step"] == 4
    )


@pytest.mark.slow
def test_best_ckpt_holds_the_highest_validation_return_and_evaluate_takes_it(monkeypatch, capsys):
    returns = iter([3.0, 7.0, 5.0, 7.0, 2.0, 4.0])  # validations at steps 2, 4, ..., 12: best 7 (twice)

    def validation_step(self, batch, batch_idx):
        self.log("val/return", next(returns), batch_size=1)

    monkeypatch.setattr(tiny_agent.TinyAgent, "validation_step", validation_step)
    main(
        args=[
            "fit",
            *TINY,
            "--trainer.max_steps",
            "12",
            "--trainer.val_check_interval",
            "2",
            "--trainer.check_val_every_n_epoch",
            "null",
            "--trainer.limit_val_batches",
            "1",
        ]
    )
    best = load_checkpoint("lightning_logs/tiny/checkpoints/best.ckpt")
    assert best["global_step"] == 8  # the second 7.0: ties go to the newer checkpoint
    state = next(v for k, v in best["callbacks"].items() if k.startswith("RunCheckpoints"))
    assert state == {"best": 7.0, "best_step": 8}
    assert load_checkpoint("lightning_logs/tiny/checkpoints/last.ckpt")["global_step"] == 12
    main(args=["evaluate", *TINY, "--ckpt_path", "best", "--episodes", "1", "--out", "evals.jsonl"])
    assert "return" in capsys.readouterr().out
    record = json.loads(Path("evals.jsonl").read_text())  # the record names the file and its step
    assert record["checkpoint"] == str(Path("lightning_logs/tiny/checkpoints/best.ckpt").resolve())
    assert record["checkpoint_step"] == 8


def test_a_setting_added_after_the_checkpoint_resumes_at_its_default_only():
    """A checkpoint written before a settings field existed (no key) resumes while the config leaves
    that field at its default; set to another value, it is named as a difference."""
    import dataclasses

    from lightning_wm.agents.dreamer.settings import BehaviorSettings
    from lightning_wm.checkpoints import hparam_differences
    from lightning_wm.settings import plain

    current = BehaviorSettings()
    old = plain(current)
    del old["bootstrap_critic"]  # as saved before the option existed
    assert hparam_differences({"behavior": old}, {"behavior": current}) == {}
    changed = dataclasses.replace(current, bootstrap_critic="slow_critic")
    assert hparam_differences({"behavior": old}, {"behavior": changed}) == {
        "behavior.bootstrap_critic": (None, "slow_critic")
    }


def test_resume_if_exists_resumes_from_last_else_the_newest_step_else_best(tmp_path):
    from lightning_wm.checkpoints import resume_point

    assert resume_point(tmp_path / "missing") is None
    assert resume_point(tmp_path) is None
    (tmp_path / "best.ckpt").write_bytes(b"x")
    assert resume_point(tmp_path) == (str(tmp_path / "best.ckpt"), "best.ckpt, the only checkpoint there")
    for step in (200, 1000, 400):  # by step number, not by name
        (tmp_path / f"step={step}.ckpt").write_bytes(b"x")
    assert resume_point(tmp_path) == (str(tmp_path / "step=1000.ckpt"), "the newest periodic checkpoint step=1000.ckpt")
    (tmp_path / "last.ckpt").write_bytes(b"x")
    assert resume_point(tmp_path) == ("last", "")


def test_checkpoint_keep_sets_how_many_periodic_checkpoints_stay(tmp_path):
    from lightning_wm.checkpoints import RunCheckpoints
    from lightning_wm.cli import Trainer

    trainer = Trainer(logger=False, default_root_dir=str(tmp_path), checkpoint_every_n_steps=1, checkpoint_keep=3)
    (callback,) = [c for c in trainer.callbacks if isinstance(c, RunCheckpoints)]
    assert callback.keep == 3
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for step in (1, 2, 10, 3, 20):  # pruned by step number, not by name
        (folder / f"step={step}.ckpt").write_bytes(b"x")
    RunCheckpoints(folder, 1, keep=3)._prune()
    assert sorted(p.name for p in folder.iterdir()) == ["step=10.ckpt", "step=20.ckpt", "step=3.ckpt"]
    with pytest.raises(ValueError, match="trainer.checkpoint_keep must be >= 1, got 0"):
        Trainer(logger=False, default_root_dir=str(tmp_path), checkpoint_keep=0)


class _Budgeted(torch.nn.Module):
    """A model whose ``es.episodes`` is a budget a resume may change; ``width`` is not."""

    resume_may_change = ("es.episodes",)

    def __init__(self, width: int, episodes: int) -> None:
        super().__init__()
        self.hparams = {"width": width, "es": {"episodes": episodes}}
        self.layer = torch.nn.Linear(2, width)


def test_a_resume_may_change_the_budgets_a_model_lists_and_is_warned_naming_them():
    from lightning_wm.checkpoints import CheckpointWarning, check_compatible

    saved = _Budgeted(3, 1)
    checkpoint = {"state_dict": saved.state_dict(), "hyper_parameters": dict(saved.hparams)}
    with pytest.warns(CheckpointWarning, match=r"es\.episodes: checkpoint 1, config 2"):
        check_compatible(checkpoint, _Budgeted(3, 2), "c.ckpt", "resume", "refuse")
    with pytest.raises(CheckpointError, match=r"\(width: checkpoint 3, config 4\)"):  # the budget is not listed
        check_compatible(checkpoint, _Budgeted(4, 2), "c.ckpt", "resume", "refuse")
