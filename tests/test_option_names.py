"""Every option path a message or docstring of the package quotes (``data.init_args.replay.capacity``,
``--model.init_args.policy.init_args.optim.lr``) names a setting that exists: resolved through the
constructors' signatures and the settings dataclasses, so a rename cannot leave an old name behind
in an error message."""

import collections.abc
import dataclasses
import inspect
import re
import types
import typing
from pathlib import Path

import pytest
from torch import nn

from lightning_wm.agents.dreamer import Dreamer
from lightning_wm.agents.dyna import DynaLearner
from lightning_wm.agents.impala import IMPALA
from lightning_wm.agents.muzero import MuZero, MuZeroRepresentation
from lightning_wm.agents.random import RandomPolicy
from lightning_wm.agents.worldmodels import Controller, Memory, Vision
from lightning_wm.data.generations import GenerationDataModule
from lightning_wm.data.modules import ReplayDataModule, UnrollDataModule
from lightning_wm.data.offline import EpisodeDataModule

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_wm"
MODELS = (Dreamer, MuZero, IMPALA, DynaLearner, Vision, Memory, Controller, RandomPolicy)
DATAMODULES = (ReplayDataModule, UnrollDataModule, EpisodeDataModule, GenerationDataModule)
# what a class_path argument (Dyna's policy and world_model, IMPALA's encoder) may build
INJECTABLE = (*MODELS, MuZeroRepresentation)
# the console's own example of a misspelt option (what its "did you mean" message explains)
DELIBERATE = {("lightning_wm/console.py", "model.init_args.hiden")}
PATH = re.compile(r"(?<![\w./])(model|data)\.init_args((?:\.[A-Za-z_]\w*)*)")


def _fields(cls: type) -> dict[str, typing.Any]:
    """A settings dataclass's fields or a constructor's parameters -> their (resolved) types."""
    if dataclasses.is_dataclass(cls):
        return typing.get_type_hints(cls)
    names = list(inspect.signature(cls.__init__).parameters)[1:]
    hints = typing.get_type_hints(cls.__init__)
    return {name: hints.get(name, typing.Any) for name in names}


def resolves(kind: typing.Any, names: list[str]) -> bool:
    """Whether the dotted ``names`` lead to an option of ``kind`` (a class, a union, a factory)."""
    if not names:
        return True
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        return any(resolves(arg, names) for arg in typing.get_args(kind) if arg is not type(None))
    if kind is typing.Any or origin in (dict, collections.abc.Mapping) or kind is dict:
        return True  # free-form (env kwargs, a mapping): anything below is the user's
    if origin is collections.abc.Callable:  # built from a class_path
        if names[0] == "init_args":
            return any(resolves(cls, names[1:]) for cls in INJECTABLE)
        return names == ["class_path"]
    if inspect.isclass(kind) and (dataclasses.is_dataclass(kind) or issubclass(kind, nn.Module) or kind in DATAMODULES):
        fields = _fields(kind)
        return names[0] in fields and resolves(fields[names[0]], names[1:])
    return False


def quoted_paths() -> list[tuple[str, str]]:
    """``(where, path)`` of every ``model.init_args...`` / ``data.init_args...`` in the package's
    source (messages, docstrings, comments); placeholders in capitals (``GROUP.FIELD``) skipped."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in PATH.finditer(line):
                rel = path.relative_to(PACKAGE.parent).as_posix()
                if not any(c.isupper() for c in match.group(2)) and (rel, match.group(0)) not in DELIBERATE:
                    found.append((f"{rel}:{number}", match.group(0)))
    return found


def test_the_resolver_knows_good_and_stale_paths():
    def ok(path: str) -> bool:
        kind, _, rest = path.split(".", 2)
        return any(
            resolves(cls, rest.split(".") if rest else []) for cls in (MODELS if kind == "model" else DATAMODULES)
        )

    assert ok("data.init_args.replay.prioritized") and ok("data.init_args.model_replay.capacity")
    assert ok("model.init_args.policy.init_args.loss.discount") and ok("model.init_args.search.num_simulations")
    assert ok("model.init_args.encoder.init_args.detach") and ok("data.init_args.env.kwargs.dreamer_ckpt")
    assert not ok("data.init_args.prioritized") and not ok("data.init_args.model_replay_size")
    assert not ok("model.init_args.loss.discount_factor") and not ok("model.init_args.net.hidden.width")


@pytest.mark.parametrize("kind", ["model", "data"])
def test_every_quoted_option_path_exists(kind):
    roots = MODELS if kind == "model" else DATAMODULES
    stale = [
        f"{where}: {path}"
        for where, path in quoted_paths()
        if path.startswith(kind) and not any(resolves(cls, path.split(".")[2:]) for cls in roots)
    ]
    assert quoted_paths(), "the scan found no option paths at all"
    assert not stale, "option paths that name no setting:\n" + "\n".join(stale)
