"""What ``main`` reads before the CLI is built and what it prints when a command ends early: YAML
files checked first, ``--verbose`` found, jsonargparse's wrapped errors unwrapped, "did you mean"
for a mistyped option, and the one line a stopped command prints."""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import signal
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pytorch_lightning.cli import LightningArgumentParser

from lightning_wm import console
from lightning_wm.signals import RunStopped

__all__ = [
    "ArgumentParser",
    "check_config_files",
    "did_you_mean",
    "interrupted_line",
    "nothing_to_save",
    "user_message",
    "wants_verbose",
]


def wants_verbose(argv: list[str]) -> bool:
    """``--verbose`` (or ``--verbose true`` / ``--verbose=true``) is on the command line."""
    for i, arg in enumerate(argv):
        if arg == "--verbose":
            following = argv[i + 1].lower() if i + 1 < len(argv) else ""
            return following not in ("false", "0", "no")
        if arg.startswith("--verbose="):
            return arg.split("=", 1)[1].lower() in ("true", "1", "yes")
    return False


def check_config_files(argv: list[str]) -> None:
    """YAML files given on the command line (``--config F``, ``--model F.yaml``, ...) are read
    first, so that a syntax error names its file (jsonargparse says ``"<unicode string>"``);
    on an error: two lines (the error, where the options are listed) and exit code 2."""
    import yaml

    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if not value and i + 1 < len(argv):
            value = argv[i + 1]
        if not name.startswith("-") or not value.endswith((".yaml", ".yml")) or not os.path.isfile(value):
            continue
        try:
            with open(value, encoding="utf-8") as f:
                yaml.safe_load(f)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            sys.stderr.write(
                f"error: config file {value!r} is not valid YAML: {problem}{where}\n"
                f"{console.help_hint(Path(sys.argv[0]).name, None)}\n"
            )
            raise SystemExit(2) from None


def user_message(err: BaseException) -> str:
    """The message of ``err`` without jsonargparse's wrapping: an error raised while a subclass
    (``--data``/``--model``) is built comes back as "Does not validate against any of the Union
    subtypes" followed by every alternative and the whole namespace; keep only the real cause."""
    text = str(err)
    if "Union subtypes" not in text:
        return text
    causes = [
        line.strip()[2:]
        for line in text.splitlines()
        if line.startswith("  - ") and "Expected a <class 'NoneType'>" not in line
    ]
    return "\n".join(causes) or text


def did_you_mean(option: str, known: Iterable[str]) -> str:
    """`` (did you mean '--trainer.max_steps'?)`` for a mistyped ``option`` among the ``known``
    option strings of a parser, or "" when none is close."""
    option = option.split("=", 1)[0]
    if not option.startswith("--"):
        option = f"--{option}"
    group = option.rsplit(".", 1)[0] + "." if "." in option else "--"  # the same group's options only
    close = difflib.get_close_matches(option, [k for k in known if k.startswith(group)], n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def interrupted_line() -> str:
    """What a command that a Ctrl-C ended before any stop rule applied prints (exit 130)."""
    return f"stopped at once by {signal.Signals.SIGINT.name} before the command could save anything"


@contextlib.contextmanager
def nothing_to_save(command: str) -> Iterator[None]:
    """A stopped ``command`` that writes nothing says so in its one line."""
    try:
        yield
    except RunStopped as stop:
        raise type(stop)(stop.signum, f"during {command}; it writes nothing, so nothing was lost") from None


class ArgumentParser(LightningArgumentParser):
    """LightningCLI's parser whose errors are two lines: what is wrong with which key (and the
    type it expects), and where the accepted options are listed; no usage dump."""

    def error(self, message: str, ex: Exception | None = None) -> Any:
        if not self.exit_on_error:
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        line, class_path = console.explain_parser_error(message)
        unknown = re.search(r"unrecognized arguments: (--\S+)", line)
        if unknown and class_path is None:
            line += did_you_mean(unknown.group(1), parser._option_string_actions)
        key = line[2:].split(" ", 1)[0].split(":")[0] if line.startswith("--") else None
        sys.stderr.write(f"error: {line}\n{console.help_hint(parser.prog, class_path, key)}\n")
        self.exit(2)
