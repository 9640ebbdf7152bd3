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

__all__ = ["ConfigError", "Distinct", "NonEmpty", "OneOf", "Range", "RunError", "check_fields",
           "coerce", "dataclass_from_dict", "read_yaml", "validated"]

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value or file that cannot be used (the message names it)."""


class RunError(RuntimeError):
    """A run that cannot proceed for a reason the user can act on (a folder another
    process writes, an unreadable checkpoint); the message says what to do."""


@dataclasses.dataclass(frozen=True)
class Range:
    """The valid range of a numeric field, written next to its type:
    ``lr: Annotated[float, Range(gt=0)] = 3e-4``. Floats must also be finite."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    note: str = ""
    """Said after the range in the message (e.g. what the bound value means)."""
    also: float | None = None
    """One more valid value outside the range (e.g. ``0`` meaning "off")."""

    def text(self) -> str:
        """The range as a reader writes it (``> 0``, ``0 to 1``, ...)."""
        lo = f">= {_num(self.ge)}" if self.ge is not None else (
            f"> {_num(self.gt)}" if self.gt is not None else "")
        hi = f"<= {_num(self.le)}" if self.le is not None else (
            f"< {_num(self.lt)}" if self.lt is not None else "")
        out = " and ".join(t for t in (lo, hi) if t) or "finite"
        if self.also is not None:
            out += f", or {_num(self.also)}"
        return out + (f" ({self.note})" if self.note else "")

    def check(self, value: Any, key: str) -> None:
        if value is None:
            return
        v = float(value)
        ok = v == self.also or (math.isfinite(v) and (self.ge is None or v >= self.ge)
              and (self.gt is None or v > self.gt) and (self.le is None or v <= self.le)
              and (self.lt is None or v < self.lt))
        if not ok:
            raise ConfigError(f"{key}: {value!r} is out of range: expected {self.text()}")


@dataclasses.dataclass(frozen=True)
class OneOf:
    """The valid values of a field: ``Annotated[str, OneOf("relative", "absolute")]``."""

    choices: tuple[Any, ...]

    def __init__(self, *choices: Any) -> None:
        object.__setattr__(self, "choices", choices)

    def text(self) -> str:
        return "one of " + ", ".join(map(repr, self.choices))

    def check(self, value: Any, key: str) -> None:
        if value is not None and value not in self.choices:
            raise ConfigError(f"{key}: {value!r} is not valid: expected {self.text()}")


@dataclasses.dataclass(frozen=True)
class Distinct:
    """A list field whose items must not repeat (a repeated seed or arm would be counted
    twice in a report)."""

    def text(self) -> str:
        return "no repeated items"

    def check(self, value: Any, key: str) -> None:
        if value is None:
            return
        seen, dup = set(), []
        for v in value:
            k = repr(v)
            if k in seen and v not in dup:
                dup.append(v)
            seen.add(k)
        if dup:
            raise ConfigError(f"{key}: {list(value)!r} repeats {dup}: every item must be "
                              "distinct (a repeated one would be counted twice)")


@dataclasses.dataclass(frozen=True)
class NonEmpty:
    """A list or string field that must not be empty."""

    def text(self) -> str:
        return "not empty"

    def check(self, value: Any, key: str) -> None:
        if value is not None and len(value) == 0:
            what = "a value" if isinstance(value, str) else "at least one item"
            raise ConfigError(f"{key}: {value!r} is empty: give {what}")


_CHECKS = (Range, OneOf, Distinct, NonEmpty)


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(v)


def field_checks(tp: Any) -> tuple[Any, list[Any]]:
    """``(the type without Annotated, the checks written next to it)``."""
    if typing.get_origin(tp) is typing.Annotated:
        args = typing.get_args(tp)
        return args[0], [a for a in args[1:] if isinstance(a, _CHECKS)]
    return tp, []


def _unique_keys_loader() -> Any:
    """PyYAML's ``SafeLoader`` refusing a key repeated in one mapping (plain PyYAML keeps
    the last value without a word: ``lr: 1e-3`` then ``lr: 0.1`` would train at 0.1)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (each key may appear once)",
                        key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def read_yaml(path: str | None) -> dict[str, Any]:
    """The mapping in a YAML file (``{}`` for ``None`` or an empty file); a key repeated
    in one mapping is an error."""
    if not path:
        return {}
    import os

    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    try:
        with open(path) as fh:
            data = yaml.load(fh, Loader=_unique_keys_loader())  # a SafeLoader
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
    :class:`ConfigError` naming ``key``. ``Annotated[X, Range(...) | OneOf(...) | ...]``
    is coerced to ``X`` and then checked."""
    inner, checks = field_checks(tp)
    if checks or inner is not tp:
        value = coerce(value, inner, key)
        for check in checks:
            check.check(value, key)
        return value
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
    hints = typing.get_type_hints(cls, include_extras=True)
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


def check_fields(obj: Any) -> None:
    """Coerce every field of dataclass instance ``obj`` to its annotated type and check the
    ranges written next to it (what :func:`validated` runs after ``__init__``): the API
    checks exactly what the YAML and the flags check.

    Raises:
        ConfigError: naming the field, the value and the valid range.
    """
    cls = type(obj)
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(obj):
        tp = hints.get(f.name, Any)
        if dataclasses.is_dataclass(field_checks(tp)[0]):
            continue
        value = getattr(obj, f.name)
        try:
            new = coerce(value, tp, f.name)
        except ConfigError as e:
            raise ConfigError(f"{e} (in {cls.__name__})") from None
        if new is not value:
            object.__setattr__(obj, f.name, new)


def validated(cls: type[T]) -> type[T]:
    """Class decorator, applied *under* ``@dataclass``: every instance runs
    :func:`check_fields` before the class's own ``__post_init__``."""
    own = cls.__dict__.get("__post_init__")

    def __post_init__(self: Any) -> None:
        check_fields(self)
        if own is not None:
            own(self)

    __post_init__.__doc__ = own.__doc__ if own is not None else None
    cls.__post_init__ = __post_init__  # type: ignore[attr-defined]
    return cls
