"""Print a markdown table of ``evaluate --out`` records (one JSON line an evaluation).

Each row is one record: its run, the checkpoint file (and the training step it was saved at: a
generation for CMA-ES), the model settings asked for with
``--columns`` (dotted names into the record's ``hparams``; a path shows its last folder or file
name), the evaluation env's first seed and the return over the episodes (mean ± std, median).
``--runs`` keeps the records whose run name contains any of the given strings; the file's order
is kept.

    python bench/evaluations.py bench/worldmodels_carracing_evals.jsonl \\
        --columns memory_ckpt dream.dir dream.temperature
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from benchlib import read_json_lines


def setting(record: dict[str, Any], dotted: str) -> Any:
    """``record["hparams"]`` at ``dotted`` (``"dream.dir"``), or None where it is not set."""
    value: Any = record.get("hparams", {})
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def show(value: Any) -> str:
    """A cell: a checkpoint or folder path as the names that tell runs apart, numbers as given."""
    if isinstance(value, str) and "/" in value:
        parts = Path(value).parts
        if "checkpoints" in parts:  # lightning_logs/<run>/checkpoints/<file>: the run and the file
            at = parts.index("checkpoints")
            return "/".join(parts[max(at - 1, 0) : at] + parts[at + 1 :])
        return parts[-1]
    return "—" if value is None else str(value)


def step(record: dict[str, Any]) -> str:
    """`` (step N)`` where the record names the training step its checkpoint was saved at."""
    return "" if record.get("checkpoint_step") is None else f" (step {record['checkpoint_step']})"


def table(records: list[dict[str, Any]], columns: list[str]) -> str:
    """The markdown table of ``records`` with the settings ``columns``."""
    head = ["run", "checkpoint", *columns, "env seed", "episodes", "return (mean ± std)", "median"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for record in records:
        returns = record["returns"]
        cells = [
            record["run"],
            show(record.get("checkpoint")) + step(record),
            *(show(setting(record, name)) for name in columns),
            str(record["env"]["seed"]),
            str(len(returns)),
            f"{record['return_mean']:.2f} ± {record['return_std']:.2f}",
            f"{statistics.median(returns):.2f}",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", help="files written by evaluate --out")
    parser.add_argument("--columns", nargs="*", default=[], help="model settings to show, dotted (dream.dir)")
    parser.add_argument("--runs", nargs="*", default=[], help="keep runs whose name contains one of these")
    args = parser.parse_args(argv)
    records = [r for path in args.records for r in read_json_lines(path)]
    if args.runs:
        records = [r for r in records if any(part in r["run"] for part in args.runs)]
    if not records:
        raise SystemExit(f"no evaluation records in {', '.join(args.records)} (filter: {args.runs or 'none'})")
    print(table(records, args.columns))


if __name__ == "__main__":
    main()
