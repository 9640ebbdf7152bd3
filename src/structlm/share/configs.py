"""Dataclass configs from YAML / dicts: the project's one config layer
(:mod:`structlm.config`), re-exported for the share commands."""

from __future__ import annotations

from ..config import ConfigError, dataclass_from_dict, read_yaml

__all__ = ["ConfigError", "dataclass_from_dict", "read_yaml"]
