"""What a command prints: the lines that matter, and progress an RL user can read.

* :func:`quiet` hides, in one place, warnings and log lines that are harmless and not the
  user's business (third-party deprecations, advertisements, Lightning's notes that do not
  apply to an online RL run); each entry says why it is safe to hide. Everything that could
  mean a run is wrong stays. ``--verbose`` or ``LIGHTNING_WM_VERBOSE=1`` shows everything.
* :class:`RunProgress` is the training progress of the CLI's Trainer: gradient steps of
  ``max_steps`` with env steps, the mean return of the episodes that ended since the last
  log, the last ``val/return`` and env frames per second; epochs only for epoch-based runs.
  On a terminal it is a tqdm bar; otherwise (a log file, a pipe) it prints one line every
  ``LIGHTNING_WM_PROGRESS_EVERY`` seconds (30) and one at the end, never carriage returns.
* :func:`progress` is the same for ``record`` / ``evaluate`` / ``convert``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import sys
import time
import typing
import warnings
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks.progress.progress_bar import ProgressBar

__all__ = ["PROGRESS_EVERY_ENV", "VERBOSE_ENV", "RunProgress", "is_verbose", "progress", "quiet"]

VERBOSE_ENV = "LIGHTNING_WM_VERBOSE"
PROGRESS_EVERY_ENV = "LIGHTNING_WM_PROGRESS_EVERY"


@dataclass(frozen=True)
class Hidden:
    """One kind of line that is hidden unless verbose: ``pattern`` (a regex searched in the
    message) of a warning ``category`` or of a log record of ``logger``; ``why`` it is safe."""

    pattern: str
    why: str
    category: type[Warning] | None = None
    logger: str | None = None


HIDDEN: tuple[Hidden, ...] = (
    # -- warnings -------------------------------------------------------------------------------
    Hidden(
        r"isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        why="torch deprecates an API that pytorch_lightning's own _pytree helper still calls; "
        "nothing of ours uses it and it changes no result",
    ),
    Hidden(
        r"LightningCLI's args parameter is intended to run from within Python",
        category=UserWarning,
        why="tests and scripts call main(args=...) on purpose",
    ),
    # -- Lightning's info lines ---------------------------------------------------------------
    Hidden(
        r"^💡 Tip:", logger="pytorch_lightning.utilities.rank_zero", why="an advertisement for another logging service"
    ),
    Hidden(
        r"^(TPU|HPU) available: False", logger="pytorch_lightning.utilities.rank_zero", why="hardware that is absent"
    ),
    Hidden(
        r"^GPU available: False, used: False",
        logger="pytorch_lightning.utilities.rank_zero",
        why="no GPU at all; a GPU that is present (used or not) is still reported",
    ),
    Hidden(
        r"^`Trainer\(limit_\w+_batches=1(\.0)?\)` was configured",
        logger="pytorch_lightning.utilities.rank_zero",
        why="repeats a setting of the config (online validation is one batch of episodes)",
    ),
    Hidden(
        r"^`Trainer\.fit` stopped: `max_(steps|epochs)=\d+` reached\.$",
        logger="pytorch_lightning.utilities.rank_zero",
        why="the planned end of the run, which the progress shows; other stops (max_time, ...) are shown",
    ),
    Hidden(
        r"^Seed set to \d+$",
        logger="lightning_fabric.utilities.seed",
        why="the seed is in the run's saved config.yaml and in --print_config",
    ),
)


def is_verbose() -> bool:
    """``LIGHTNING_WM_VERBOSE`` is set to something other than ``0``/``false``/empty."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


class _LogFilter(logging.Filter):
    def __init__(self, patterns: list[re.Pattern[str]]) -> None:
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.search(message) for p in self.patterns)


def headless_rendering() -> None:
    """Render with SDL's dummy video driver unless the user chose one: frames are only ever
    rendered into arrays (``render_mode="rgb_array"``), and without it SDL prints a misleading
    ``error: XDG_RUNTIME_DIR is invalid or not set`` on machines without a display session.
    SDL installs no signal handlers either (``SDL_NO_SIGNAL_HANDLERS``): its SIGTERM/SIGINT handler
    turns the signal into a quit event nobody reads, so an env that rendered would ignore SIGTERM
    (:mod:`lightning_wm.signals` handles them)."""
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    os.environ.setdefault("SDL_NO_SIGNAL_HANDLERS", "1")
    os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")  # pygame's greeting on import


@contextlib.contextmanager
def _own_warnings_as_lines() -> Iterator[None]:
    """Warnings of lightning_wm's own categories print as ``warning: <message>``: they are
    meant for the user, and the source line of the ``warnings.warn`` call is not."""
    original = warnings.formatwarning

    def formatwarning(message: Any, category: type[Warning], filename: str, lineno: int, line: Any = None) -> str:
        if category.__module__.split(".")[0] == "lightning_wm":
            return f"warning: {message}\n"
        return original(message, category, filename, lineno, line)

    warnings.formatwarning = formatwarning  # type: ignore[assignment]
    try:
        yield
    finally:
        warnings.formatwarning = original


@contextlib.contextmanager
def quiet(verbose: bool | None = None) -> Iterator[None]:
    """Hide the :data:`HIDDEN` lines while the block runs (all are shown when ``verbose``,
    default :func:`is_verbose`). Restores the warning filters and log filters afterwards."""
    headless_rendering()
    verbose = is_verbose() if verbose is None else verbose
    if verbose:
        with _own_warnings_as_lines():
            yield
        return
    by_logger: dict[str, list[re.Pattern[str]]] = {}
    for entry in HIDDEN:
        if entry.logger is not None:
            by_logger.setdefault(entry.logger, []).append(re.compile(entry.pattern))
    filters = [(logging.getLogger(name), _LogFilter(patterns)) for name, patterns in by_logger.items()]
    for logger, log_filter in filters:
        logger.addFilter(log_filter)
    try:
        with warnings.catch_warnings(), _own_warnings_as_lines():
            for entry in HIDDEN:
                if entry.category is not None:
                    warnings.filterwarnings("ignore", message=f".*{entry.pattern}", category=entry.category)
            yield
    finally:
        for logger, log_filter in filters:
            logger.removeFilter(log_filter)


# ---------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------


def _every_s() -> float:
    try:
        return max(0.0, float(os.environ.get(PROGRESS_EVERY_ENV, "30")))
    except ValueError:
        return 30.0


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _number(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if float(value).is_integer() and abs(value) >= 1:
        return f"{int(value):,}"
    return f"{value:.4g}" if abs(value) < 1 else f"{value:,.1f}"


_PLURAL = {"step": "steps", "batch": "batches", "ep": "episodes", "it": "items"}


class _LineProgress:
    """tqdm's ``update``/``set_postfix_str``/``close`` as a line every ``every_s`` seconds."""

    def __init__(
        self, total: int | None, desc: str, unit: str, file: IO[str], every_s: float, initial: int = 0
    ) -> None:
        self.total, self.desc, self.unit, self.file, self.every_s = total, desc, unit, file, every_s
        self.n = self._start = initial
        self.postfix = ""
        self._t0 = self._last = time.monotonic()
        self._printed: tuple[int, str] | None = None

    def line(self) -> str:
        """``train: 1,250/5,000 steps (25%) | <postfix> | 0:05:12 elapsed, ~0:15:36 left``."""
        elapsed = time.monotonic() - self._t0
        unit = _PLURAL.get(self.unit, self.unit)
        count = f"{self.n:,}/{self.total:,} {unit}" if self.total else f"{self.n:,} {unit}"
        if self.total:
            count += f" ({100 * self.n / self.total:.0f}%)"
        timing = f"{_clock(elapsed)} elapsed"
        done = self.n - self._start
        if self.total and 0 < done and self.n < self.total:
            timing += f", ~{_clock(elapsed / done * (self.total - self.n))} left"
        return " | ".join(p for p in (f"{self.desc}: {count}", self.postfix, timing) if p)

    def update(self, k: int = 1) -> None:
        self.n += k
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self._emit()

    def set_postfix_str(self, text: str, refresh: bool = False) -> None:
        self.postfix = text

    def _emit(self) -> None:
        print(self.line(), file=self.file, flush=True)
        self._printed = (self.n, self.postfix)

    def close(self) -> None:
        if self._printed != (self.n, self.postfix):  # the last state is always shown
            self._emit()

    def __enter__(self) -> _LineProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _is_terminal(file: IO[str]) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):
        return False


def progress(total: int | None, desc: str, unit: str = "it", file: IO[str] | None = None, initial: int = 0) -> Any:
    """A progress bar for ``total`` units: tqdm on a terminal, else a :class:`_LineProgress`
    (one line every ``LIGHTNING_WM_PROGRESS_EVERY`` seconds and one at the end). Both support
    ``update(k)``, ``set_postfix_str(text)``, ``close()`` and ``with``."""
    file = file if file is not None else sys.stderr
    if _is_terminal(file):
        from tqdm import tqdm

        return tqdm(
            total=total,
            desc=desc,
            unit=unit,
            file=file,
            initial=initial,
            dynamic_ncols=True,
            mininterval=0.5,
            smoothing=0.1,
        )
    return _LineProgress(total, desc, unit, file, _every_s(), initial)


class _Rate:
    """Env frames per second over the last ``window_s`` seconds of ``env/steps`` readings."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.samples: deque[tuple[float, float]] = deque()
        self.window_s = window_s

    def add(self, steps: float) -> None:
        now = time.monotonic()
        if self.samples and self.samples[-1][1] == steps:
            return
        self.samples.append((now, steps))
        while len(self.samples) > 2 and now - self.samples[1][0] > self.window_s:
            self.samples.popleft()

    def value(self) -> float | None:
        if len(self.samples) < 2:
            return None
        (t0, s0), (t1, s1) = self.samples[0], self.samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None


# metrics the bar shows by name, in this order: (metric, label)
RL_FIELDS = (("env/steps", "env steps"), ("env/episode_return", "return"), ("val/return", "val/return"))
FRAMES_PER_S = "actors/frames_per_s"  # an actor-fed datamodule's own measure, preferred when logged


class RunProgress(ProgressBar):
    """Training progress of the CLI's Trainer (see the module docstring).

    Runs with ``max_steps`` count gradient steps (``step 1,250/5,000``, resumed runs start at
    the checkpoint's step); epoch-based runs count batches over all epochs and show the
    epoch. Fields: ``env steps``, ``return`` (mean of the episodes that ended in the last
    logging window), ``val/return`` (the last validation), ``frames/s`` (env steps per second,
    all envs), then the other progress-bar metrics the module logs (e.g. ``train/loss``).
    Validation runs without a bar of its own.
    """

    FIELDS_EVERY_S = 0.5

    def __init__(self, file: IO[str] | None = None, every_s: float | None = None) -> None:
        super().__init__()
        self._enabled = True
        self._file = file
        self.every_s = every_s
        self._bar: Any = None
        self._rate = _Rate()
        self._batches = 0
        self._fields_at = -math.inf

    # -- ProgressBar API --------------------------------------------------------------
    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        text = sep.join(map(str, args))
        if self._bar is not None and hasattr(self._bar, "write"):
            self._bar.write(text)
        else:
            print(text, file=self._out(), **kwargs)

    def _out(self) -> IO[str]:
        return self._file if self._file is not None else sys.stdout

    # -- what is shown ----------------------------------------------------------------
    def fields(self, trainer: pl.Trainer) -> str:
        """``env steps 6,004 | return 187.3 | val/return 500.0 | 52 frames/s | train/loss 0.12``."""
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if _scalar(v)}
        parts = []
        for key, label in RL_FIELDS:
            if key in metrics:
                parts.append(f"{label} {_number(metrics[key])}")
        if "env/steps" in metrics:
            self._rate.add(metrics["env/steps"])
        rate = metrics.get(FRAMES_PER_S, self._rate.value())
        if rate is not None:
            parts.append(f"{rate:,.0f} frames/s")
        shown = {key for key, _ in RL_FIELDS} | {FRAMES_PER_S}
        for key, value in trainer.progress_bar_metrics.items():
            if key not in shown and key != "v_num" and _scalar(value):
                parts.append(f"{key} {_number(float(value))}")
        return " | ".join(parts)

    # -- hooks ------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._enabled:
            return
        self._steps = trainer.max_steps is not None and trainer.max_steps > 0
        self._batches = 0
        if self._steps:
            total, initial, unit = trainer.max_steps, trainer.global_step, "step"
        else:
            per_epoch, epochs = trainer.num_training_batches, trainer.max_epochs
            finite = math.isfinite(per_epoch) and epochs is not None and epochs > 0
            total, initial, unit = (int(per_epoch) * epochs if finite else None), 0, "batch"
        every = self.every_s if self.every_s is not None else _every_s()
        file = self._out()
        if _is_terminal(file):
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                initial=initial,
                desc="train",
                unit=unit,
                file=file,
                dynamic_ncols=True,
                mininterval=0.5,
                smoothing=0.1,
                leave=True,
            )
        else:
            self._bar = _LineProgress(total, "train", unit, file, every, initial)

    def _show(self, trainer: pl.Trainer, n: int, fields: bool = False) -> None:
        """Move the bar to ``n``; refresh its fields at most every ``FIELDS_EVERY_S`` seconds
        (reading metrics synchronises with an accelerator) or when ``fields`` is asked for."""
        if self._bar is None:
            return
        now = time.monotonic()
        if fields or now - self._fields_at >= self.FIELDS_EVERY_S:
            self._fields_at = now
            text = self.fields(trainer)
            if not self._steps:
                epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs > 0 else None
                epoch = trainer.current_epoch + 1 if epochs is None else min(trainer.current_epoch + 1, epochs)
                text = " | ".join(p for p in (f"epoch {epoch}" + (f"/{epochs}" if epochs else ""), text) if p)
            self._bar.set_postfix_str(text, refresh=False)
        self._bar.update(n - self._bar.n)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        self._show(trainer, trainer.global_step if self._steps else self._batches)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and self._bar is not None:
            self._show(trainer, self._bar.n, fields=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._bar is not None:
            self._show(trainer, trainer.global_step if self._steps else self._batches, fields=True)
            self._bar.close()
            self._bar = None


def _scalar(value: Any) -> bool:
    try:
        return getattr(value, "numel", lambda: 1)() == 1 and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


# ---------------------------------------------------------------------------------------
# Command-line errors
# ---------------------------------------------------------------------------------------

_KEY = re.compile(r'Parser key "([^"]+)":')
_EXPECTED = re.compile(r"Expected a (.+?)\. Got value: (.*)$")
_CLASS_PATH = re.compile(r"Problem with given class_path '([^']+)':")
_NOT_ACCEPTED = re.compile(r"(?:Option '([^']+)' is not accepted|unrecognized arguments: --([^=\s]+))")
_INNER_CLASS_PATH = re.compile(r"Got value: Namespace\(.*class_path='([^']+)'")
_ECHOED_OUTER_VALUE = ". Got value: "  # a class inside a class: its error repeats the outer value after this


def _own_value(text: str) -> str:
    """The value an error line gives, without the outer class's value a nested error appends."""
    return text.split(_ECHOED_OUTER_VALUE)[0].strip()


def _type_name(text: str) -> str:
    """``<class 'int'>`` -> ``int``; ``typing.Literal['a', 'b']`` -> ``one of 'a', 'b'``."""
    literal = re.fullmatch(r"typing\.Literal\[(.*)\]", text.strip())
    if literal:
        return f"one of {literal.group(1)}"
    return re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", text.strip())


def _suggest(class_path: str, option: str) -> str:
    """`` (did you mean 'hidden'?)`` from the init arguments of ``class_path``, if one is close."""
    import difflib
    import importlib
    import inspect

    try:
        module, name = class_path.rsplit(".", 1)
        init = getattr(importlib.import_module(module), name).__init__
        names = [p for p in inspect.signature(init).parameters if p != "self"]
        group, _, field = option.partition(".")
        if field and group in names:  # an option of a settings group: the group's fields
            settings = typing.get_type_hints(init).get(group)
            names = [f"{group}.{f.name}" for f in dataclasses.fields(settings)]
    except (ImportError, AttributeError, ValueError, TypeError, NameError):
        return ""
    close = difflib.get_close_matches(option, names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _nested_keys(lines: list[str]) -> list[str]:
    """The chain of ``Parser key "k":`` an error descends through, each deeper than the last
    (``model``, ``policy``, ``optim.lr``: a class's option inside a class's option); a key at the
    same depth or shallower (another Union alternative's) ends it."""
    chain: list[str] = []
    depth = -1
    for line in lines:
        match = _KEY.search(line)
        if match is None:
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= depth:
            break
        chain.append(match.group(1))
        depth = indent
    return chain


def _nested_null_advice(keys: list[str]) -> str:
    """What to type instead when ``null`` for an option inside a settings group of a class (``--model
    .init_args.optim.lr_anneal_steps``) or two classes deep reached the parser as the string
    ``'None'`` (jsonargparse passes it on as text): the enclosing group as YAML, which it parses."""
    if len(keys) > 2:  # the inner class's group: its init_args, then the option's path
        flag, path, where = ".init_args.".join(keys[:-1]), ["init_args", *keys[-1].split(".")], "two classes deep"
    else:  # the class's settings group: the option's path inside it
        group, *path = keys[-1].split(".")
        flag, where = f"{keys[0]}.init_args.{group}", "in a settings group"
    value = "null"
    for part in reversed(path):
        value = f"{{{part}: {value}}}"
    return (
        f"--{'.init_args.'.join(keys)}: null {where} arrives as the string 'None'; "
        f"give the group as YAML instead: --{flag} '{value}'"
    )


def explain_parser_error(message: str) -> tuple[str, str | None]:
    """jsonargparse's error message -> one line naming the key and what it expects, and the
    class path whose options are the relevant ``--X.help`` (``None`` if none).

    The Union noise jsonargparse prints for ``--model`` / ``--data`` (every subtype, the whole
    given value) is dropped; ``--model.hiden`` becomes ``--model.init_args.hiden: Dreamer has no
    option 'hiden' (did you mean 'hidden'?)``.
    """
    lines = [line.rstrip() for line in message.strip().splitlines()]
    keys = _nested_keys(lines)
    class_match = next((m for m in map(_CLASS_PATH.search, lines) if m), None)
    class_path = class_match.group(1) if class_match else None
    key = ".init_args.".join(keys) if keys else None
    expected = next((m for m in map(_EXPECTED.search, lines) if m and "NoneType" not in m.group(1)), None)
    if expected is None and key:  # an optional value: "- Expected a T" per alternative, then "Given value: v"
        inner = lines[next((i for i, line in enumerate(lines) if _KEY.search(line) and keys[-1] in line), 0) :]
        types = [
            m.group(1)
            for m in (re.search(r"- Expected a (.+)$", line) for line in inner)
            if m and "NoneType" not in m.group(1)
        ]
        given = next((m.group(1) for m in (re.search(r"Given value: (.*)$", line) for line in inner) if m), None)
        given = _own_value(given) if given is not None else None
        nested = len(keys) > 2 or (len(keys) == 2 and "." in keys[-1])
        if types and given == "None" and nested and any("NoneType" in line for line in inner):
            return _nested_null_advice(keys), class_path
        if types and given is not None:
            return f"--{key} expects {' or '.join(_type_name(t) for t in types)}, got {given!r}", class_path
    not_accepted = next((m for m in map(_NOT_ACCEPTED.search, lines) if m), None)
    if not_accepted and class_path:
        option = not_accepted.group(1) or not_accepted.group(2)
        # a class inside a class (Dyna's policy) names itself in the value it echoes
        echoed = _INNER_CLASS_PATH.search(not_accepted.string)
        owner = echoed.group(1) if echoed else class_path
        return (
            f"--{key or 'model'}.init_args.{option}: {owner.rsplit('.', 1)[-1]} has no option {option!r}"
            f"{_suggest(owner, option)}",
            class_path,
        )
    if expected and key:
        return f"--{key} expects {_type_name(expected.group(1))}, got {_own_value(expected.group(2))!r}", class_path
    if class_path and class_match is not None:  # the class itself failed: e.g. it cannot be imported
        index = lines.index(next(line for line in lines if _CLASS_PATH.search(line)))
        cause = next((line.strip() for line in lines[index + 1 :] if line.strip()), "")
        return f"--{key or 'model'}: {class_path!r} cannot be used ({cause})", None
    if key:
        rest = [_KEY.sub("", line).strip() for line in lines]
        rest = [line[2:] if line.startswith("- ") else line for line in rest if line]
        return f"--{key}: {rest[0] if rest else 'invalid value'}", class_path
    return lines[0] if lines else "invalid command line", class_path


def help_hint(prog: str, class_path: str | None, key: str | None = None) -> str:
    """The line after a command-line error: where the accepted options are listed."""
    prog = prog.replace(" [options]", "")
    hint = f"run `{prog} --help` for the accepted options"
    if class_path:
        group = (key or "model").split(".")[0]
        hint += f" (`{prog} --{group}.help {class_path}` for that class's)"
    return hint
