"""The evaluations of ``main.py fit`` runs, read back from their TensorBoard folders: a markdown
table (every evaluation, the first at the target in gradient steps, frames and fit minutes, the
lowest evaluation after it, where the run stopped), the medians over the runs, and one plot of
every run's evaluations against frames.

    python bench/fit_runs.py --target 475 --frames-per-step 2 --png bench/dreamer_pixels_state_cpu.png \\
        "frame+state/0=runs/s0/lightning_logs/dreamer-cartpole_pixels_state" \\
        "frame/0=runs/px/work/dreamer_pixels/lightning_logs/dreamer_pixels"

Each run is ``LABEL=FOLDER``: the run folder ``lightning_logs/<run name>`` (its ``version_*``
folders, one per fit: a resumed run adds one) or a folder holding exactly one such run. A label's
part before ``/`` names its group: one colour a group in the plot, one median line a group.
Evaluations are ``val/return`` (logged at global step ``n - 1`` after ``n`` gradient steps); agent
steps are ``env/steps`` at that step (the random prefill included); frames = agent steps ×
``--frames-per-step`` (the config's ``action_repeat``). Fit time counts from each fit's start
(the event file's creation), the earlier fits of a resumed run added.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

from benchlib import env_steps_at, read_version_scalars, version_folders


class Evaluation(NamedTuple):
    gradient_steps: int
    agent_steps: float
    fit_s: float
    value: float


def run_folder(path: Path) -> Path:
    """The one folder at or under ``path`` that holds ``version_*`` folders; one line if none or many."""
    found = sorted({v.parent for v in Path(path).rglob("version_*") if v.is_dir()})
    if len(found) != 1:
        what = "no run (no version_* folder)" if not found else f"{len(found)} runs: {', '.join(map(str, found))}"
        sys.exit(f"fit_runs: {path} holds {what}; name one lightning_logs/<run name> folder")
    return found[0]


def fit_started(version: Path) -> float | None:
    """When the fit began: the creation time in the name of the folder's first event file."""
    stamps = [int(f.name.split(".")[3]) for f in version.glob("events.out.tfevents.*")]
    return float(min(stamps)) if stamps else None


def evaluations(run_dir: Path) -> list[Evaluation]:
    """Every ``val/return`` of the run, its fits in order, with agent steps and fit seconds then."""
    out: list[Evaluation] = []
    earlier_fits_s = 0.0
    for version in version_folders(run_dir):
        scalars = read_version_scalars(version, ("env/steps", "val/return"))
        events = [e for tag in scalars for e in scalars[tag]]
        start = fit_started(version)
        if not events or start is None:
            continue
        for wall, step, value in scalars["val/return"]:
            agent = env_steps_at(scalars["env/steps"], step)
            out.append(Evaluation(step + 1, agent, earlier_fits_s + wall - start, value))
        earlier_fits_s += max(wall for wall, _, _ in events) - start
    return out


def group_of(label: str) -> str:
    """A run label's group: its part before ``/`` (``frame+state/0`` -> ``frame+state``)."""
    return label.split("/")[0]


class Summary(NamedTuple):
    label: str
    evaluations: list[Evaluation]
    first: Evaluation | None  # the first evaluation at or above the target
    lowest_after: float | None  # the lowest evaluation from the first on


def summarize(label: str, evals: list[Evaluation], target: float) -> Summary:
    """Where ``evals`` first reach ``target`` and the lowest evaluation from there to the end."""
    first = next((e for e in evals if e.value >= target), None)
    lowest = None if first is None else min(e.value for e in evals if e.gradient_steps >= first.gradient_steps)
    return Summary(label, evals, first, lowest)


def table(summaries: list[Summary], target: float, frames_per_step: float) -> str:
    """The markdown table: one row a run."""
    rows = [
        f"| run | evaluations (gradient steps: return) | first ≥ {target:g} | frames then | fit min then "
        "| lowest after | last evaluated at (steps) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in summaries:
        listed = ", ".join(f"{e.gradient_steps:,}: {e.value:.1f}" for e in s.evaluations)
        last = f"{s.evaluations[-1].gradient_steps:,}" if s.evaluations else "none"
        if s.first is None:
            best = max((e.value for e in s.evaluations), default=float("nan"))
            rows.append(f"| {s.label} | {listed} | not reached (best {best:.1f}) | | | | {last} |")
            continue
        frames = s.first.agent_steps * frames_per_step
        cells = [s.label, listed, f"{s.first.gradient_steps:,}", f"{frames:,.0f}", f"{s.first.fit_s / 60:.1f}"]
        rows.append("| " + " | ".join(cells + [f"{s.lowest_after:.1f}", last]) + " |")
    return "\n".join(rows)


def medians(summaries: list[Summary], target: float, frames_per_step: float) -> list[str]:
    """Per group (a label's part before ``/``): the median frames and fit minutes to the target."""
    groups: dict[str, list[Summary]] = {}
    for s in summaries:
        groups.setdefault(group_of(s.label), []).append(s)
    lines = []
    for group, members in groups.items():
        reached = [s.first for s in members if s.first is not None]
        if not reached:
            lines.append(f"{group}: the target reached by none of {len(members)} runs")
            continue
        frames = statistics.median(e.agent_steps * frames_per_step for e in reached)
        minutes = statistics.median(e.fit_s / 60 for e in reached)
        held = sum(s.lowest_after is not None and s.lowest_after >= target for s in members)
        lines.append(
            f"{group}: {len(reached)} of {len(members)} runs reach the target; median {frames:,.0f} frames, "
            f"{minutes:.1f} min of fit; {held} hold it to their last evaluation"
        )
    return lines


def plot(summaries: list[Summary], target: float, frames_per_step: float, path: Path) -> None:
    """Every run's evaluations against frames, one colour a group, the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colours: dict[str, str] = {}
    for s in summaries:
        group = group_of(s.label)
        new = group not in colours
        colour = colours.setdefault(group, f"C{len(colours)}")
        xs = [e.agent_steps * frames_per_step for e in s.evaluations]
        ys = [e.value for e in s.evaluations]
        ax.plot(xs, ys, "o-", color=colour, alpha=0.8, ms=3, label=group if new else None)
    ax.axhline(target, color="grey", ls="--", lw=1)
    ax.set_xlabel("frames")
    ax.set_ylabel("evaluation return")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="LABEL=FOLDER: a run folder lightning_logs/<run name>")
    parser.add_argument("--target", type=float, required=True, help="the evaluation return to reach")
    parser.add_argument("--frames-per-step", type=float, default=1.0, help="the config's action_repeat")
    parser.add_argument("--png", type=Path, help="draw every run's evaluations against frames here")
    args = parser.parse_args()
    summaries = []
    for spec in args.runs:
        label, sep, folder = spec.partition("=")
        if not sep or not label or not folder:
            sys.exit(f"fit_runs: {spec!r} is not LABEL=FOLDER (for example seed0=lightning_logs/dreamer-cartpole)")
        summaries.append(summarize(label, evaluations(run_folder(Path(folder))), args.target))
    print(table(summaries, args.target, args.frames_per_step))
    print()
    print("\n".join(medians(summaries, args.target, args.frames_per_step)))
    if args.png:
        plot(summaries, args.target, args.frames_per_step, args.png)
        print(f"plot: {args.png}")


if __name__ == "__main__":
    main()
