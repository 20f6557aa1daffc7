"""The dependency direction of the package (INTERFACES §0), checked on the source: the
foundation imports neither data/ nor agents/, data/ never imports agents/, agents/ import data/
only where listed, and no module hides an import of the package inside a function."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_wm"

# agents/ reading recorded episodes (where dreams start) is the one use of data/ by an agent
# and Dyna's imagination (buffer fills from the real replay, batches mixed from both)
AGENTS_MAY_IMPORT_DATA = {
    "agents/worldmodels/vm_model.py": {"lightning_wm.data.episodes"},
    "agents/worldmodels/controller.py": {"lightning_wm.data.episodes"},
    "agents/dreamer/dream.py": {"lightning_wm.data.episodes"},
    "agents/dyna/imagination.py": {"lightning_wm.data.replay", "lightning_wm.data.samplers"},
    # MuZero names the sampler its training reads (SamplerSource.replay_sampler)
    "agents/muzero/agent.py": {"lightning_wm.data.samplers"},
}
# the modules a file may import inside a function (the command line, cli.py, sits on top of everything
# and is not checked: its subcommands load what they need). An optional backend written against a
# newer API of a third-party package (gymnasium 1.x's vector envs: EnvPool's and MinAtar's one-loop
# vector envs) loads only where a config asks for it, so the package imports beside older gymnasiums
# (LightZero's 0.28, where bench/mcts_speed.py runs)
LAZY_IMPORTS_ALLOWED = {"envs.py": {"lightning_wm.envpool_backend", "lightning_wm.minatar_vector"}}


def _imports(path: Path) -> list[tuple[str, bool]]:
    """``(module, at module level)`` for every import of ``lightning_wm`` in ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_wm"):
            names = [node.module] if node.module != "lightning_wm" else [f"lightning_wm.{a.name}" for a in node.names]
            found += [(name, id(node) in top) for name in names]
        elif isinstance(node, ast.Import):
            found += [(a.name, id(node) in top) for a in node.names if a.name.startswith("lightning_wm")]
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in ("data", "agents") else "foundation"


def test_imports_follow_the_layers():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "cli.py":
            continue
        own = rel.split("/")[0] if "/" in rel and rel.split("/")[0] in ("data", "agents") else "foundation"
        for module, at_top in _imports(path):
            target = _layer(module)
            if not at_top and module not in LAZY_IMPORTS_ALLOWED.get(rel, set()):
                problems.append(f"{rel}: imports {module} inside a function")
            if own == "foundation" and target != "foundation":
                problems.append(f"{rel}: foundation module imports {module}")
            if own == "data" and target == "agents":
                problems.append(f"{rel}: data/ imports {module}")
            if own == "agents" and target == "data" and module not in AGENTS_MAY_IMPORT_DATA.get(rel, set()):
                problems.append(f"{rel}: agents/ imports {module}")
    assert not problems, "\n".join(problems)
