"""The one config layer: typed dataclasses from YAML or dicts, checked at the boundary.

Every command's config (training, studies, the share commands) is a dataclass; this
module reads YAML (a missing file, a syntax error or a non-mapping top level is a
one-line error naming the file) and builds the dataclass, refusing unknown keys and
coercing each value to its field's annotated type — ``lr: 3e-4`` (a string to PyYAML)
becomes a float, ``steps: 10.0`` an int — or naming the key, the value and the expected
type when it cannot.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections import abc
from typing import Any, TypeVar, Union

__all__ = ["ConfigError", "RunError", "coerce", "dataclass_from_dict", "read_yaml"]

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value or file that cannot be used (the message names it)."""


class RunError(RuntimeError):
    """A run that cannot proceed for a reason the user can act on (a folder another
    process writes, an unreadable checkpoint); the message says what to do."""


def read_yaml(path: str | None) -> dict[str, Any]:
    """The mapping in a YAML file (``{}`` for ``None`` or an empty file)."""
    if not path:
        return {}
    import os

    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: "
                          f"{getattr(e, 'problem', None) or e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys, got "
                          f"{type(data).__name__}")
    return data


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` as type ``tp`` (int, float, bool, str, ``X | None``, ``list[X]``,
    ``tuple[X, ...]``, ``dict[str, X]``; anything else is passed through), or a
    :class:`ConfigError` naming ``key``."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:  # a value already of one of the types is kept as it is
            if (isinstance(arg, type) and isinstance(value, arg)
                    and not (isinstance(value, bool) and arg is not bool)):
                return value
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: {value!r} is not {' or '.join(map(_type_name, args))}")
    if tp is Any or tp is object:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise ConfigError(f"{key}: {value!r} is not a boolean (true or false)")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: {value!r} is not an integer")
        if isinstance(value, int):
            return value
        num = _number(value)
        if num is not None and math.isfinite(num) and num == int(num):
            return int(num)
        raise ConfigError(f"{key}: {value!r} is not an integer")
    if tp is float:
        num = None if isinstance(value, bool) else _number(value)
        if num is None:
            raise ConfigError(f"{key}: {value!r} is not a number")
        return num
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: {value!r} is not a string")
    if origin in (list, tuple, abc.Sequence):
        if isinstance(value, str) or not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: {value!r} is not a list")
        args = typing.get_args(tp)
        item = args[0] if args else Any
        out = [coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: {value!r} is not a mapping")
        args = typing.get_args(tp)
        val_t = args[1] if len(args) == 2 else Any
        return {k: coerce(v, val_t, f"{key}.{k}") for k, v in value.items()}
    return value


def _number(value: Any) -> float | None:
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def dataclass_from_dict(cls: type[T], raw: dict[str, Any],
                        nested: dict[str, type] | None = None, where: str = "") -> T:
    """``cls(**raw)`` with every value coerced to its field's type, refusing unknown keys
    (named in the error) and building the ``nested`` dataclass fields from dicts (a
    partial mapping overrides the keys it names of the field's default instance).
    ``where`` (a file name) prefixes the messages."""
    prefix = f"{where}: " if where else ""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix}expected a mapping of {cls.__name__} keys, got "
                          f"{type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{prefix}unknown {cls.__name__} keys {unknown}; expected some of "
                          f"{sorted(fields)}")
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        sub = (nested or {}).get(key)
        if sub is not None and isinstance(value, dict):
            # a partial mapping overrides the field's own default, not the nested class's
            default = fields[key].default_factory  # type: ignore[misc]
            base = dataclasses.asdict(default()) if callable(default) else {}
            out[key] = dataclass_from_dict(sub, {**base, **value}, where=where)
            continue
        try:
            out[key] = coerce(value, hints.get(key, Any), key)
        except ConfigError as e:
            raise ConfigError(f"{prefix}{e} (in {cls.__name__})") from None
    return cls(**out)
