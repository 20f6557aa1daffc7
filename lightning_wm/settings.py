"""Typed setting groups: how agents and datamodules take their options.

Every agent takes a few groups (``net``, ``search``, ``loss``, ``optim``, ...), each a frozen
dataclass. jsonargparse reads them from nested YAML mappings and lists their fields in
``--model.help CLASS``; a checkpoint stores them as plain nested dicts (``weights_only``
loading reads no classes), and :func:`as_settings` turns either form back into the dataclass.

* :func:`as_settings` — an instance, a mapping (YAML, a checkpoint's hyperparameters) or
  ``None`` (the defaults) as the dataclass ``cls``; unknown keys are one clear error.
* :func:`plain` — dataclasses (nested) as dicts and tuples as lists: what a checkpoint keeps.
* :func:`flatten` — nested mappings as dotted keys (``search.num_simulations``), for messages
  that name one setting.
* :func:`find_settings` — every instance of a settings class inside a value (e.g. each
  :class:`~lightning_wm.optim.OptimSettings` of an agent with several optimizers).
* :func:`check_at_least`, :func:`check_positive`, :func:`check_in_range`, :func:`check_one_of` —
  the groups' ``__post_init__`` checks: a bad value is one ``ValueError`` that names the setting
  (``es.popsize must be >= 2, got 1``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

__all__ = [
    "as_settings",
    "plain",
    "flatten",
    "find_settings",
    "group_defaults",
    "check_at_least",
    "check_positive",
    "check_in_range",
    "check_one_of",
]

T = TypeVar("T")


def as_settings(
    cls: type[T], value: T | Mapping[str, Any] | None, name: str | None = None, default: T | None = None
) -> T:
    """``value`` as a ``cls`` (a dataclass): an instance as it is, ``None`` as the defaults, a
    mapping field by field (nested dataclass fields from nested mappings, lists as tuples where
    the default is a tuple).

    ``default`` (an instance of ``cls``; ``cls()`` when None) gives the defaults: what ``None``
    stands for and the value of every field a mapping leaves out, nested groups included (an
    agent whose ``optim`` group defaults to another learning rate than ``OptimSettings()``).

    Raises:
        ValueError: a key that is not a field of ``cls`` (named, with the fields it has).
    """
    if value is None:
        return cls() if default is None else default
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"{name or cls.__name__} must be a {cls.__name__} or a mapping, got {type(value).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"{name or cls.__name__}: unknown setting(s) {unknown}; {cls.__name__} has {sorted(fields)}")
    defaults = cls() if default is None else default
    kwargs: dict[str, Any] = {}
    for key, item in value.items():
        field_default = getattr(defaults, key)
        if dataclasses.is_dataclass(field_default) and (item is None or isinstance(item, Mapping)):
            item = as_settings(type(field_default), item, f"{name or cls.__name__}.{key}", field_default)
        elif isinstance(item, list) and isinstance(field_default, tuple):
            item = tuple(item)
        kwargs[key] = item
    return dataclasses.replace(defaults, **kwargs)


def plain(value: Any) -> Any:
    """Dataclasses as dicts and tuples as lists, recursively: a value ``weights_only`` loading reads."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def flatten(value: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"search": {"num_simulations": 8}}`` -> ``{"search.num_simulations": 8}`` (dataclasses too)."""
    out: dict[str, Any] = {}
    for key, item in value.items():
        name = f"{prefix}{key}"
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            item = plain(item)
        if isinstance(item, Mapping) and item:
            out.update(flatten(item, name + "."))
        else:
            out[name] = item
    return out


def group_defaults(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """The flattened defaults of every settings group (dataclass) in ``hparams`` that builds without
    arguments: ``{"behavior.reinforce_weight": 0.9, ...}``."""
    groups = {}
    for key, item in hparams.items():
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            try:
                groups[key] = type(item)()
            except (TypeError, ValueError):
                continue
    return flatten(groups)


def find_settings(value: Any, cls: type[T]) -> Iterator[T]:
    """Every ``cls`` instance inside ``value`` (nested dataclasses, mappings, lists), depth first."""
    if isinstance(value, cls):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from find_settings(getattr(value, f.name), cls)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from find_settings(item, cls)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from find_settings(item, cls)


# -- the groups' checks ----------------------------------------------------------------------------
def check_at_least(name: str, value: float | None, least: float) -> None:
    """``ValueError`` naming the setting ``name`` (``group.field``) unless ``value >= least`` (NaN
    fails); ``None`` (a setting left unset) passes."""
    if value is not None and not value >= least:
        raise ValueError(f"{name} must be >= {least}, got {value}")


def check_positive(name: str, value: float) -> None:
    """``ValueError`` naming ``name`` unless ``value > 0``."""
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def check_in_range(name: str, value: float, low: float, high: float) -> None:
    """``ValueError`` naming ``name`` unless ``low <= value <= high``."""
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def check_one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    """``ValueError`` naming ``name`` and the allowed values unless ``value`` is one of them."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
