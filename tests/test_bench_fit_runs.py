"""bench/fit_runs.py: the evaluations of fit runs read back from TensorBoard event files."""

from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from support.bench_scripts import load_bench_script

fit_runs = load_bench_script("fit_runs.py")


def write_fit(version: Path, evals: dict[int, float], seconds_per_step: float, prefill: int = 1000) -> None:
    """One fit's events as the CLI logs them: env/steps every 25 steps (2 agent steps a gradient
    step after the prefill), val/return at global step n - 1 after n gradient steps."""
    writer = SummaryWriter(str(version))
    start = fit_runs.fit_started(version)
    last = max(evals)
    for step in range(24, last, 25):
        writer.add_scalar("env/steps", prefill + 2 * (step + 1), step, walltime=start + step * seconds_per_step)
    for n, value in evals.items():
        writer.add_scalar("val/return", value, n - 1, walltime=start + n * seconds_per_step)
    writer.close()


def test_evaluations_read_steps_frames_and_fit_time_across_a_resumed_run(tmp_path):
    run = tmp_path / "lightning_logs" / "dreamer-cartpole"
    write_fit(run / "version_0", {500: 40.0, 1000: 480.0}, seconds_per_step=1.0)
    write_fit(run / "version_1", {1500: 470.0, 2000: 500.0}, seconds_per_step=1.0, prefill=0)
    evals = fit_runs.evaluations(fit_runs.run_folder(tmp_path))
    assert [e.gradient_steps for e in evals] == [500, 1000, 1500, 2000]
    assert [e.value for e in evals] == [40.0, 480.0, 470.0, 500.0]
    assert evals[0].agent_steps == 1000 + 2 * 500
    # the second fit's times follow the first's whole span (its last event, 1,000 s in)
    assert evals[1].fit_s == pytest.approx(1000, abs=1) and evals[2].fit_s == pytest.approx(2500, abs=1)

    summary = fit_runs.summarize("frame/0", evals, target=475)
    assert summary.first.gradient_steps == 1000 and summary.lowest_after == 470.0
    header, _, row = fit_runs.table([summary], 475, frames_per_step=2).splitlines()
    assert header.endswith("| lowest after | last evaluated at (steps) |")
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "frame/0" and cells[1].startswith("500: 40.0, 1,000: 480.0")
    assert cells[2:] == ["1,000", "6,000", "16.7", "470.0", "2,000"]
    missed = fit_runs.summarize("frame/1", evals[:1], target=475)
    assert "not reached (best 40.0)" in fit_runs.table([missed], 475, 2)
    lines = fit_runs.medians([summary, missed], 475, frames_per_step=2)
    assert lines == [
        "frame: 1 of 2 runs reach the target; median 6,000 frames, 16.7 min of fit; 0 hold it to their last evaluation"
    ]


def test_a_folder_without_one_run_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="holds no run"):
        fit_runs.run_folder(tmp_path)
    for name in ("a", "b"):
        (tmp_path / name / "version_0").mkdir(parents=True)
    with pytest.raises(SystemExit, match="holds 2 runs"):
        fit_runs.run_folder(tmp_path)
