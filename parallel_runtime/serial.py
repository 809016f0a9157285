"""The one serialiser of the values that cross the process boundary: frozen dataclasses <-> JSON values.

``to_json(value)`` turns a dataclass (with nested dataclasses, Enums, tuples, ``dict[str, ...]``, None, bool, int,
float and str inside) into plain JSON values. ``from_json(kind, data)`` rebuilds a ``kind`` from them and checks every
field against the dataclass's type hints on the way: a missing, unknown or mistyped field is a ``WireError`` that names
its path (``DenoiseArgs.sampling.steps: expected int, got 'ten'``), so a bad message is refused with an error reply
instead of failing as a KeyError deep inside a rank. Rebuilding runs each dataclass's ``__post_init__``, so a value's
own checks (a StrategyPlan's degrees, a tensor descriptor's shape) hold on both sides of the wire.

No pickle, no code: what arrives is data, and only the types named here can be built from it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


class WireError(ValueError):
    """A message that does not fit the type it claims to be; the text names the field."""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def to_json(value: Any) -> Any:
    """``value`` as JSON values (dicts, lists, str, int, float, bool, None)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {_key(k): to_json(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise WireError(f"{value} is not a finite number; JSON cannot carry it")
        return value
    raise WireError(f"a {type(value).__name__} cannot cross the process boundary; give it a dataclass")


def _key(key: object) -> str:
    if not isinstance(key, str):
        raise WireError(f"dict keys must be strings on the wire, got {key!r}")
    return key


def from_json(kind: type[T], data: Any, path: str | None = None) -> T:
    """Rebuild a ``kind`` from JSON values, checking every field; raises WireError naming the first bad one."""
    return _build(kind, data, path or getattr(kind, "__name__", str(kind)))


def _fail(path: str, expected: str, data: Any) -> WireError:
    shown = repr(data)
    return WireError(f"{path}: expected {expected}, got {shown[:80] + '…' if len(shown) > 80 else shown}")


def _build(kind: Any, data: Any, path: str) -> Any:
    origin = typing.get_origin(kind)
    if kind is Any:
        return data
    if kind is type(None):
        if data is not None:
            raise _fail(path, "null", data)
        return None
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        if data is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _build(option, data, path)
            except WireError as e:
                errors.append(e)
        raise errors[0] if len(errors) == 1 else _fail(path, " or ".join(_name(o) for o in options), data)
    if origin is tuple:
        args = typing.get_args(kind)
        if not isinstance(data, (list, tuple)):
            raise _fail(path, "a list", data)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v, f"{path}[{i}]") for i, v in enumerate(data))
        if len(data) != len(args):
            raise _fail(path, f"a list of {len(args)}", data)
        return tuple(_build(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, data)))
    if origin is dict:
        key_kind, value_kind = typing.get_args(kind)
        if key_kind is not str:
            raise TypeError(f"{path}: only dict[str, ...] crosses the wire")
        if not isinstance(data, dict):
            raise _fail(path, "an object", data)
        return {_key(k): _build(value_kind, v, f"{path}.{k}") for k, v in data.items()}
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(data)
        except ValueError:
            raise _fail(path, "one of " + ", ".join(repr(m.value) for m in kind), data) from None
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return _build_dataclass(kind, data, path)
    if kind is bool:
        if not isinstance(data, bool):
            raise _fail(path, "true or false", data)
        return data
    if kind is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise _fail(path, "a whole number", data)
        return data
    if kind is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)) or not math.isfinite(data):
            raise _fail(path, "a finite number", data)
        return float(data)
    if kind is str:
        if not isinstance(data, str):
            raise _fail(path, "a string", data)
        return data
    raise TypeError(f"{path}: {kind!r} has no wire form; use a dataclass, an Enum or a plain type")


def _build_dataclass(kind: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise _fail(path, f"a {kind.__name__} object", data)
    fields = {f.name: f for f in dataclasses.fields(kind) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise WireError(f"{path}: unknown field {unknown[0]!r} (a {kind.__name__} has {', '.join(fields)})")
    hints = _hints(kind)
    values = {}
    for name, field in fields.items():
        if name in data:
            values[name] = _build(hints[name], data[name], f"{path}.{name}")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise WireError(f"{path}: missing field {name!r}")
    try:
        return kind(**values)
    except (ValueError, TypeError) as e:  # the dataclass's own checks (__post_init__)
        raise WireError(f"{path}: {e}") from None


def _name(kind: Any) -> str:
    return getattr(kind, "__name__", str(kind))
