"""Typed dataclass <-> plain dict conversion with errors a user can act on.

Every config section is a dataclass whose fields carry a docstring-like ``help`` in their
metadata. `from_dict` rejects unknown keys (listing the valid ones), wrong types and values
outside a ``Literal``; the sections' own ``__post_init__`` checks ranges.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

from polytrain.errors import ConfigError

__all__ = ["FieldInfo", "describe_field", "from_dict", "option", "positive", "to_dict"]

T = TypeVar("T")


def positive(section: str, name: str, value: float, *, allow_zero: bool = False) -> None:
    """A `ConfigError` unless ``value`` (``section.name``) is positive (non-negative with
    ``allow_zero``)."""
    ok = value >= 0 if allow_zero else value > 0
    if not ok:
        need = "a non-negative" if allow_zero else "a positive"
        raise ConfigError(f"{section}.{name} = {value!r}: expected {need} number")


def option(default: Any, help: str) -> Any:
    """A dataclass field with a default and a one-line description."""
    if isinstance(default, list | dict):
        value = default
        return dataclasses.field(
            default_factory=lambda: type(value)(value), metadata={"help": help}
        )
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """What a config field says about itself: its annotation, default and one-line help."""

    path: str
    type: Any
    default: Any
    help: str


def describe_field(cls: type, path: str) -> FieldInfo:
    """The field at dotted ``path`` (``"train.steps"``) of dataclass ``cls``, nested sections
    followed through their annotations. An unknown name is a `ConfigError` listing the valid
    ones (as `from_dict` does)."""
    *sections, name = path.split(".")
    for section in [*sections, name]:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if section not in fields:
            raise ConfigError(f"unknown key {path!r}: valid keys here are {', '.join(fields)}")
        tp = typing.get_type_hints(cls)[section]
        if section != name:
            cls = tp
    f = fields[name]
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:  # pragma: no cover - every config field has a default
        default = None
    return FieldInfo(path, tp, default, str(f.metadata.get("help", "")))


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        (inner,) = get_args(tp) or (Any,)
        return f"list of {_type_name(inner)}"
    if origin is dict:
        return "table"
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to floats)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        choices = get_args(tp)
        if value in choices and type(value) is type(choices[list(choices).index(value)]):
            return value
        raise ConfigError(
            f"{key} = {value!r} is not a valid choice: expected one of "
            f"{', '.join(repr(c) for c in choices)}"
        )
    if origin in (Union, types.UnionType):
        errors = []
        for option_tp in get_args(tp):
            try:
                return _coerce(value, option_tp, key)
            except ConfigError as exc:
                errors.append(exc)
        raise ConfigError(f"{key} = {value!r} has the wrong type: expected {_type_name(tp)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key} = {value!r} has the wrong type: expected none")
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key} = {value!r} has the wrong type: expected {_type_name(tp)}")
        (inner,) = get_args(tp) or (Any,)
        return [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:  # a free table (a factory's keyword arguments): string keys only
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key} = {value!r} has the wrong type: expected a table of keys")
        return dict(value)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} = {value!r} has the wrong type: expected a table of keys")
        return from_dict(tp, value, prefix=f"{key}.")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - only the types above appear in configs
        raise AssertionError(f"unsupported config type {tp!r} for {key}")
    raise ConfigError(f"{key} = {value!r} has the wrong type: expected {_type_name(tp)}")


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types are `ConfigError`s."""
    assert dataclasses.is_dataclass(cls)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ConfigError(
            f"unknown key {prefix + unknown[0]!r}: valid keys are "
            f"{', '.join(prefix + n for n in names)}"
        )
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if prefix and not str(exc).startswith(prefix):
            raise ConfigError(f"{prefix}{exc}") from None
        raise


def to_dict(obj: Any) -> dict[str, Any]:
    """Plain nested dict of a config dataclass, ``None`` values left out (TOML has no null)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out[f.name] = to_dict(value)
        elif value is not None:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out
