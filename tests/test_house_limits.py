"""The size limits of the house rules, checked on the package's and the benches' source: no module
over 600 lines, no function over 80 lines, and no ``type: ignore`` in the acting package (issue 57)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_wm"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _sources() -> list[Path]:
    return sorted([*PACKAGE.rglob("*.py"), *(ROOT / "bench").glob("*.py")])


def test_no_module_over_the_limit() -> None:
    long = {
        str(p.relative_to(ROOT)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_over_the_limit() -> None:
    long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_line_count_spans_the_whole_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    tree = ast.parse(f"def f():\n{body}\n")
    node = tree.body[0]
    assert node.end_lineno - node.lineno + 1 == MAX_FUNCTION_LINES + 1


def test_no_type_ignore_in_acting() -> None:
    hits = [
        f"{p.relative_to(PACKAGE)}:{i}"
        for p in sorted((PACKAGE / "data" / "acting").glob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "type: ignore" in line
    ]
    assert not hits, f"type: ignore in data/acting: {hits}"
