"""Dataclass configs from YAML / dicts with errors that name unknown keys."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["dataclass_from_dict", "read_yaml"]

T = TypeVar("T")


def dataclass_from_dict(cls: type[T], raw: dict[str, Any],
                        nested: dict[str, type] | None = None) -> T:
    """``cls(**raw)``, refusing unknown keys (named in the error) and building the
    ``nested`` dataclass fields from dicts."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} keys {unknown}; expected some of "
                         f"{sorted(names)}")
    raw = dict(raw)
    for key, sub in (nested or {}).items():
        if isinstance(raw.get(key), dict):
            raw[key] = dataclass_from_dict(sub, raw[key])
    return cls(**raw)


def read_yaml(path: str | None) -> dict[str, Any]:
    """The mapping in a YAML file (``{}`` for ``None`` or an empty file)."""
    if not path:
        return {}
    import yaml

    with open(path) as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
    return data
