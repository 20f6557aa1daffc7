"""Import a script of bench/ (not a package) as a module, for tests of its pure parts."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def load_bench_script(filename: str) -> ModuleType:
    """``bench/<filename>`` executed as a module named after it (its ``main`` does not run); bench/
    goes on ``sys.path`` (last: ``bench/minatar.py`` must not shadow the ``minatar`` package) for the
    modules the scripts share (``benchlib``)."""
    if str(BENCH_DIR) not in sys.path:
        sys.path.append(str(BENCH_DIR))
    spec = importlib.util.spec_from_file_location(f"bench_{Path(filename).stem}", BENCH_DIR / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
