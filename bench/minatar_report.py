"""What ``bench/minatar.py`` prints and draws from its run records: the tables (both metrics per
frame budget, the trivial policies, the paper's reference values) and one PNG per game.

The paper's reference values (:data:`PAPER`) are read off the MinAtar repository's
``img/learning_curves.gif`` (Young & Tian 2019, "MinAtar: An Atari-Inspired Testbed for Thorough
and Reproducible Reinforcement Learning Experiments"; 30 seeds, the mean return of the last 100
training episodes), about ±5%. The paper's Seaquest predates minatar 1.0.11's oxygen fix.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

PAPER_SOURCE = "MinAtar repository, img/learning_curves.gif (Young & Tian 2019), read off the figure (±5%)"
# game -> curve -> {frames: mean return of the last 100 training episodes}
PAPER: dict[str, dict[str, dict[int, float]]] = {
    "breakout": {"DQN": {1_000_000: 9.5, 5_000_000: 10.0}, "AC(λ=0.8)": {1_000_000: 9.0, 5_000_000: 17.5}},
    "space_invaders": {"DQN": {1_000_000: 30.0, 5_000_000: 43.0}, "AC(λ=0.8)": {1_000_000: 50.0, 5_000_000: 185.0}},
    "asterix": {
        "DQN": {1_000_000: 10.0, 5_000_000: 17.0},
        "AC(λ=0.8)": {1_000_000: 1.0, 5_000_000: 19.0},
        "AC(λ=0)": {5_000_000: 20.5},
    },
    "freeway": {"DQN": {1_000_000: 48.0, 5_000_000: 50.0}, "AC(λ=0.8)": {1_000_000: 0.0, 5_000_000: 47.0}},
    "seaquest": {"DQN": {1_000_000: 1.0, 5_000_000: 20.0}, "AC(λ=0.8)": {1_000_000: 1.0, 5_000_000: 15.0}},
}


def paper_best(game: str, frames: int) -> tuple[str, float] | None:
    """The paper's best curve at ``frames`` on ``game`` and its value, or None where it has none."""
    points = [(curve, values[frames]) for curve, values in PAPER.get(game, {}).items() if frames in values]
    return max(points, key=lambda p: p[1]) if points else None


def value_at(history: list[dict[str, float]], frames: int, every: int, key: str = "eval_return") -> float | None:
    """``key`` of the run's evaluation at ``frames``: the first one at or past it and before the
    next point (``frames + every``); None where the run has none there (or the row lacks ``key``)."""
    rows = [row for row in history if frames <= row["frames"] < frames + every]
    if not rows or rows[0].get(key) is None or math.isnan(float(rows[0][key])):
        return None
    return float(rows[0][key])


def frames_to_reach(history: list[dict[str, float]], target: float, key: str = "eval_return") -> int | None:
    """Frames of the first evaluation whose ``key`` is at least ``target`` (None: never)."""
    return next((int(row["frames"]) for row in history if row.get(key) is not None and row[key] >= target), None)


def split_sets(config: str | Path, sets: list[list[str]]) -> tuple[list[list[str]], list[list[str]]]:
    """The ``--set KEY VALUE`` pairs of a run split against the config file it overrides: (those
    that change it, those that give its own value again). A value counts as the same when its YAML
    reading equals the file's at that dotted key (``2.0`` and ``2`` alike); a key the file leaves to
    a default counts as a change. The record's ``sets`` are the first: equal settings given two
    ways make one :func:`variant`."""
    import yaml  # not at the top: RLlib's venv imports this module too

    from lightning_wm.settings import flatten

    missing = object()
    values = flatten(yaml.safe_load(Path(config).read_text()))
    changed, same = [], []
    for key, value in sets:
        given = values.get(key, missing)
        (same if given is not missing and given == yaml.safe_load(value) else changed).append([key, value])
    return changed, same


def variant(record: dict[str, Any]) -> str:
    """The system and the ``--set`` overrides a run was made with: ``dyna (imagination.real_ratio
    0.125)`` (``init_args.`` left out of the keys); runs of one variant are the seeds of one row."""
    sets = [f"{key.replace('init_args.', '').removeprefix('model.')} {value}" for key, value in record.get("sets", [])]
    return f"{record['system']} ({'; '.join(sets)})" if sets else record["system"]


PARTIAL_MARK = "†"  # a training-return window that holds fewer than 100 episodes
CUT_MARK = "‡"  # a run stopped before its budget: its record so far


def finished(record: dict[str, Any]) -> bool:
    """Whether the run reached its budget (records before 2026-11-30 have no ``finished``: they did)."""
    return bool(record.get("finished", True))


def partial_window(episodes: float | None) -> bool:
    """Whether fewer than the paper's 100 training episodes had ended (``episodes``; None: unknown)."""
    return episodes is not None and episodes < 100


def since_previous(history: list[dict[str, float]], index: int) -> tuple[int, float] | None:
    """The training episodes that ended between the evaluation before ``history[index]`` (negative
    indices count from the end) and that one, and their mean return: ``(count, mean)``, exact where
    both windows are partial (fewer than 100 episodes, so each mean is over every episode so far);
    None otherwise or without any."""
    if not -len(history) <= index < len(history):
        return None
    index %= len(history)
    row = history[index]
    before = history[index - 1] if index > 0 else {"train_episodes": 0, "train_return": 0.0}
    n, m = row.get("train_episodes"), row.get("train_return")
    n0, m0 = before.get("train_episodes"), before.get("train_return")
    if None in (n, m, n0, m0) or not partial_window(n) or n <= n0:
        return None
    return int(n - n0), (m * n - m0 * n0) / (n - n0)


def partial_last_table(groups: dict[tuple[str, str], list[dict[str, Any]]]) -> list[str]:
    """Markdown lines: for each (variant, game) whose runs end on a partial window (:data:`PARTIAL_MARK`),
    the episodes of each seed's last interval (:func:`since_previous`): how the run plays at its end,
    which the mean over all of its episodes hides; empty when none."""
    lines: list[str] = []
    for (system, game), runs in sorted(groups.items()):
        last = [since_previous(r["history"], -1) for r in runs]
        if all(x is None for x in last):
            continue
        cells = ", ".join("–" if x is None else f"{x[1]:.2f} ({x[0]})" for x in last)
        frames = ", ".join(f"{r['frames']:,}" for r in runs)
        lines.append(f"| {system} | {game} | {frames} | {cells} |")
    if not lines:
        return []
    return [
        "",
        f"{PARTIAL_MARK} windows at the runs' last evaluations: the training episodes ended since the evaluation before",
        "",
        "| system | game | frames (per seed) | their mean return (episodes), per seed |",
        "| --- | --- | --- | --- |",
        *lines,
    ]


def _cell(values: list[float | None], episodes: list[float | None] | None = None) -> str:
    """``mean (per seed)``, or ``–`` where a seed lacks the value; a seed's value marked
    :data:`PARTIAL_MARK` where its ``episodes`` (training episodes ended so far) are a
    :func:`partial_window`."""
    if any(v is None for v in values):
        return "–"
    marks = [PARTIAL_MARK if partial_window(n) else "" for n in (episodes or [None] * len(values))]
    return f"{statistics.fmean(values):.2f} ({', '.join(f'{v:.2f}{m}' for v, m in zip(values, marks))})"


def _groups(records: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """The records by (variant, game), one per seed in seed order: of several runs of one seed
    (a longer budget run again: in process its first points repeat; a stopped run's record so far,
    then its finished one) the one with most frames, a finished one before a stopped one."""
    longest: dict[tuple[str, str, int], dict[str, Any]] = {}
    for r in records:
        key = (variant(r), r["game"], r["seed"])
        if key not in longest or (r["frames"], finished(r)) > (longest[key]["frames"], finished(longest[key])):
            longest[key] = r
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in sorted(longest.values(), key=lambda r: r["seed"]):
        groups[(variant(r), r["game"])].append(r)
    return groups


def summary(records: list[dict[str, Any]], every: int, targets: list[float]) -> str:
    """Markdown: per system variant (:func:`variant`) and game, at each multiple of the runs'
    evaluation spacing (their ``eval_every``, else ``every``) where every seed has an evaluation
    (:func:`value_at`): the paper's metric (mean return of the last 100 training episodes) and the
    greedy evaluation, means over seeds with the per-seed values, the training wall time and the
    paper's best curve at that budget; then frames to reach each target (greedy) per seed; then
    the trivial policies' greedy scores (:func:`trivial_table`)."""
    groups = _groups(records)
    partial = cut = False
    lines = [
        "| system | game | seeds | frames | last 100 training episodes (per seed) | greedy eval (per seed) "
        "| paper's best | mean wall time | frames/s |",
        "| --- | --- | ---: | ---: | --- | --- | --- | ---: | ---: |",
    ]
    for (system, game), runs in sorted(groups.items()):
        reached = min(r["frames"] for r in runs)
        spacing = max(r.get("eval_every", every) for r in runs)
        for point in range(spacing, reached + 1, spacing):
            greedy = [value_at(r["history"], point, spacing) for r in runs]
            if any(v is None for v in greedy):
                continue
            trained = [value_at(r["history"], point, spacing, "train_return") for r in runs]
            episodes = [value_at(r["history"], point, spacing, "train_episodes") for r in runs]
            partial |= any(partial_window(n) for n in episodes)
            seconds = [value_at(r["history"], point, spacing, "seconds") for r in runs]
            best = paper_best(game, point)
            stopped = not all(finished(r) for r in runs)
            cut |= stopped
            lines.append(
                f"| {system}{CUT_MARK if stopped else ''} | {game} | {len(runs)} | {point:,} | {_cell(trained, episodes)} | {_cell(greedy)} | "
                f"{f'{best[1]:g} ({best[0]})' if best else '–'} | {statistics.fmean(seconds):.0f} s | "
                f"{statistics.fmean(r['frames_per_s'] for r in runs):,.0f} |"
            )
    if partial:
        lines += [
            "",
            f"{PARTIAL_MARK} fewer than 100 training episodes had ended: the mean of all of the run's episodes so far",
            *partial_last_table(groups),
        ]
    if cut:
        lines += [
            "",
            f"{CUT_MARK} a seed's run was stopped before its frame budget: its record so far (`finished: false`); "
            "the same command with its `--run-dir` resumes it",
        ]
    if targets:
        lines += ["", "| system | game | target return | frames to reach it, per seed |", "| --- | --- | ---: | --- |"]
        for (system, game), runs in sorted(groups.items()):
            for target in targets:
                reach = [frames_to_reach(r["history"], target) for r in runs]
                cells = ", ".join(f"{f:,}" if f is not None else f"not in {r['frames']:,}" for f, r in zip(reach, runs))
                lines.append(f"| {system} | {game} | {target:g} | {cells} |")
    trivial = trivial_table(records)
    return "\n".join(lines + (["", trivial] if trivial else []))


def trivial_table(records: list[dict[str, Any]]) -> str:
    """Markdown: per game, the greedy evaluation's score of each trivial policy (uniform random,
    each constant action) on the evaluation seeds of the runs, mean over the distinct seed sets
    (records without ``trivial`` are left out); empty when no record has them."""
    per_game: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for r in records:
        if r.get("trivial"):
            per_game[r["game"]][r["trivial"]["key"]] = r["trivial"]["scores"]
    if not per_game:
        return ""
    lines = [
        "| game | trivial policies on the evaluation seeds (mean over seed sets) | seed sets |",
        "| --- | --- | ---: |",
    ]
    for game, sets in sorted(per_game.items()):
        names = list(next(iter(sets.values())))
        means = {n: statistics.fmean(s[n] for s in sets.values() if n in s) for n in names}
        lines.append(f"| {game} | {', '.join(f'{n} {v:.2f}' for n, v in means.items())} | {len(sets)} |")
    return "\n".join(lines)


def plot_games(records: list[dict[str, Any]], folder: str, suffix: str = "") -> list[str]:
    """:func:`plot_game` for every game of ``records`` into ``folder/minatar_<game><suffix>.png``;
    the paths written."""
    paths = []
    for game in sorted({r["game"] for r in records}):
        paths.append(str(Path(folder) / f"minatar_{game}{suffix}.png"))
        plot_game(records, game, paths[-1])
    return paths


def plot_game(records: list[dict[str, Any]], game: str, path: str) -> None:
    """One PNG of ``game``: per system variant, the paper's metric per seed (thin) and its mean over
    seeds (thick) against frames, the greedy evaluation's mean (dashed), the paper's reference
    points (:data:`PAPER`, markers) and the best trivial policy's greedy score (dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    runs_of = {v: runs for (v, g), runs in _groups(records).items() if g == game}
    labels = {name: legend_name(name) for name in runs_of}
    for i, (name, runs) in enumerate(sorted(runs_of.items())):
        color = colors[i % len(colors)]
        for r in runs:
            rows = [h for h in r["history"] if h.get("train_return") is not None]
            ax.plot([h["frames"] for h in rows], [h["train_return"] for h in rows], color=color, lw=0.7, alpha=0.4)
        mean = _mean_curve(runs, "train_return")
        name = labels[name]
        so_far = "" if all(finished(r) for r in runs) else f", {CUT_MARK} stopped before its budget"
        if mean:
            ax.plot(*zip(*mean), color=color, lw=2.2,
                    label=f"{name}: last 100 training episodes ({len(runs)} seeds{so_far})")  # fmt: skip
        greedy = _mean_curve(runs, "eval_return")
        if greedy:
            ax.plot(*zip(*greedy), color=color, lw=1.2, ls="--", label=f"{name}: greedy evaluation")
    _paper_references(ax, game, max(r["frames"] for runs in runs_of.values() for r in runs))
    best = _best_trivial(records, game)
    if best is not None:
        ax.axhline(best[1], color="gray", ls=":", label=f"trivial: {best[0]} (greedy seeds)")
    ax.set_title(f"MinAtar {game}; paper: {PAPER_SOURCE}", fontsize=7)
    ax.set_xlabel("frames")
    ax.set_ylabel("return")
    if max(len(label) for label in labels.values()) > 60:  # long override lists: the legend under the axes
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(0.0, -0.2))
    else:
        ax.legend(fontsize=6, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# --set keys that change a run's speed, not what it learns: left out of a plot's legend
SPEED_ONLY_SETS = ("compile", "search.compile", "optim.implementation")


def legend_name(name: str) -> str:
    """:func:`variant`'s name without its speed-only overrides (:data:`SPEED_ONLY_SETS`)."""
    system, _, sets = name.partition(" (")
    kept = [s for s in sets.removesuffix(")").split("; ") if s and s.split(" ")[0] not in SPEED_ONLY_SETS]
    return f"{system} ({'; '.join(kept)})" if kept else system


def _paper_references(ax: Any, game: str, last_frames: int) -> None:
    """The paper's points (:data:`PAPER`) within the runs' frames as markers; where the runs end
    before a curve's first point (a 200k-frame run against DQN at 1M) that point as a level line."""
    for (curve, points), marker in zip(PAPER.get(game, {}).items(), "os^"):
        inside = {f: v for f, v in points.items() if f <= 1.05 * last_frames}
        if inside:
            ax.scatter(list(inside), list(inside.values()), marker=marker, s=60, color="black", zorder=5,
                       label=f"paper {curve}")  # fmt: skip
        else:
            first = min(points)
            ax.axhline(points[first], color="black", lw=1.0, ls="-." if marker == "o" else (0, (1, 3)),
                       label=f"paper {curve} at {first / 1e6:g}M frames")  # fmt: skip


RATIO_FRACTIONS = (0.5, 0.75, 0.9, 1.0)


def frames_ratio_table(records: list[dict[str, Any]], fractions: tuple[float, ...] = RATIO_FRACTIONS) -> str:
    """Markdown: for every variant of a system with ``--set`` overrides, the frames its mean curve
    over seeds (the paper's metric) needs to each level against the frames the config's own runs
    (no overrides) need, and their ratio. The levels are ``fractions`` of the lower of the two
    final means, so both curves reach them; a curve crosses a level between two evaluations
    (linear interpolation) or at one; a level already passed at the first evaluation is left out
    (no earlier point to place it)."""
    groups = _groups(records)
    lines = []
    for (name, game), runs in sorted(groups.items()):
        config = groups.get((runs[0]["system"], game))
        if name == runs[0]["system"] or config is None:
            continue
        ours, theirs = _mean_curve(config, "train_return"), _mean_curve(runs, "train_return")
        if not ours or not theirs:
            continue
        top = min(ours[-1][1], theirs[-1][1])
        for fraction in fractions:
            level = fraction * top
            base, other = frames_at_level(ours, level), frames_at_level(theirs, level)
            if base is None or other is None:
                continue
            lines.append(
                f"| {name} | {game} | {len(config)} / {len(runs)} | {fraction:g} × {top:.2f} = {level:.2f} | "
                f"{base:,.0f} | {other:,.0f} | {other / base:.2f} |"
            )
    if not lines:
        return ""
    head = [
        "| variant | game | seeds (config / variant) | level: the lower final mean × | frames, config | frames, variant | ratio |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    return "\n".join(head + lines)


def frames_at_level(curve: list[tuple[int, float]], level: float) -> float | None:
    """Frames where ``curve`` ``[(frames, value)]`` first reaches ``level``, linearly between the
    two evaluations around the crossing; None where it never does or does at its first point."""
    if not curve or curve[0][1] >= level:
        return None
    for (f0, v0), (f1, v1) in zip(curve, curve[1:]):
        if v1 >= level > v0:
            return f0 + (f1 - f0) * (level - v0) / (v1 - v0)
    return None


def _mean_curve(runs: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """``(frames, mean over seeds)`` at each evaluation spacing point where every seed has ``key``."""
    spacing = max(r.get("eval_every", 1) for r in runs)
    reached = min(r["frames"] for r in runs)
    out = []
    for point in range(spacing, reached + 1, spacing):
        values = [value_at(r["history"], point, spacing, key) for r in runs]
        if all(v is not None for v in values):
            out.append((point, statistics.fmean(values)))
    return out


def _best_trivial(records: list[dict[str, Any]], game: str) -> tuple[str, float] | None:
    scores = [r["trivial"]["scores"] for r in records if r["game"] == game and r.get("trivial")]
    if not scores:
        return None
    means = {n: statistics.fmean(s[n] for s in scores) for n in scores[0]}
    return max(means.items(), key=lambda kv: kv[1])
