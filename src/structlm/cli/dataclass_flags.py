"""Command-line flags derived from a config dataclass, so the CLI cannot drift from it.

Each field becomes ``--field-name`` (with an optional prefix, e.g. ``--finetune-steps``
for ``FinetuneConfig.steps``); its help text is the field's docstring (the string
literal after the field, as this project writes them) and its default; its value is
parsed by the config layer's :func:`~structlm.config.coerce` for the field's annotated
type, so a flag and a YAML key accept exactly the same values and a bad one is an
argparse error naming the flag. Lists are comma-separated; booleans are
``--x`` / ``--no-x``; ``X | None`` fields also accept ``none``. Nested dataclasses and
mapping fields are not flags (set them in the YAML). A flag not given leaves no
attribute (``argparse.SUPPRESS``), so only the flags on the command line override the
YAML, and ``--x none`` can set an optional field to ``None``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
import types
import typing
from collections import abc
from collections.abc import Callable, Iterable
from typing import Any, Union

from structlm.config import ConfigError, coerce, field_checks

__all__ = ["FlagSet", "add_dataclass_flags", "field_docs"]


def field_docs(cls: type) -> dict[str, str]:
    """The docstring of each field of dataclass ``cls`` (and its dataclass bases): the
    string literal written right after the field's annotated assignment."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for a, b in itertools.pairwise(body):
            if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
                    and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
                    and isinstance(b.value.value, str)):
                docs[a.target.id] = _plain(b.value.value)
    return docs


def _plain(doc: str) -> str:
    """A field docstring as one line of plain text (no reST roles or literals)."""
    doc = re.sub(r":\w+:`~?\.*([^`]+)`", r"\1", doc)
    return " ".join(doc.replace("``", "").split())


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _is_list(tp: Any) -> bool:
    return typing.get_origin(tp) in (list, tuple, abc.Sequence)


def _flag_parser(tp: Any, optional: bool, flag: str, annotated: Any = None
                 ) -> Callable[[str], Any]:
    """Parse a flag's text like the YAML value: ``annotated`` (the field's full type, with
    its range) checks it too."""
    def parse(text: str) -> Any:
        if optional and text.strip().lower() == "none":
            return None
        value: Any = [v.strip() for v in text.split(",") if v.strip()] if _is_list(tp) else text
        try:
            return coerce(value, tp if annotated is None else annotated, flag)
        except ConfigError as e:  # argparse names the flag: keep the rest of the message
            msg = re.sub(r"^\[(\d+)\]: ", lambda m: f"item {int(m[1]) + 1}: ",
                         str(e).removeprefix(flag).removeprefix(": "))
            raise argparse.ArgumentTypeError(msg) from None
    parse.__name__ = getattr(tp, "__name__", "value")  # argparse names it in errors
    return parse


def _default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if isinstance(value, list | tuple):
        return ",".join(map(str, value)) or "empty"
    return repr(value) if isinstance(value, str) else str(value)


@dataclasses.dataclass
class FlagSet:
    """The flags one dataclass added to a parser: ``values(args)`` gives the fields whose
    flags were given, keyed by field name (ready to merge into the YAML's mapping)."""

    cls: type
    dests: dict[str, str]
    """field name -> argparse dest"""

    def values(self, args: argparse.Namespace) -> dict[str, Any]:
        return {name: getattr(args, dest) for name, dest in self.dests.items()
                if hasattr(args, dest)}


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, *, prefix: str = "",
                        exclude: Iterable[str] = (),
                        parse: dict[str, Callable[[str], Any]] | None = None,
                        aliases: dict[str, list[str]] | None = None,
                        title: str | None = None) -> FlagSet:
    """Add a flag for every field of dataclass ``cls`` except ``exclude``, nested
    dataclasses and mappings; ``parse`` replaces the parser of named fields (e.g. a layer
    list that also takes ranges), ``aliases`` adds other spellings of a field's flag.
    Returns the :class:`FlagSet`."""
    skip = set(exclude)
    hints = typing.get_type_hints(cls, include_extras=True)
    docs = field_docs(cls)
    group = parser.add_argument_group(title or f"{cls.__name__} fields "
                                      "(lists are comma-separated)")
    dests: dict[str, str] = {}
    for field in dataclasses.fields(cls):
        annotated = hints.get(field.name, Any)
        base, checks = field_checks(annotated)
        tp, optional = _unwrap_optional(base)
        if (field.name in skip or field.name.startswith("_") or dataclasses.is_dataclass(tp)
                or typing.get_origin(tp) is dict or tp in (dict, Any)):
            continue
        flag = "--" + (prefix + "-" if prefix else "") + field.name.replace("_", "-")
        names = [flag, *(aliases or {}).get(field.name, [])]
        dest = (prefix.replace("-", "_") + "__" if prefix else "") + field.name
        doc = docs.get(field.name, "")
        valid = "; ".join(c.text() for c in checks)
        help_text = ((f"{doc} " if doc else "") + (f"Valid: {valid}. " if valid else "")
                     + f"(default: {_default_text(field)})")
        help_text = help_text.replace("%", "%%")
        if tp is bool:
            group.add_argument(*names, dest=dest, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
        else:
            kind = (parse or {}).get(field.name) or _flag_parser(tp, optional, flag, annotated)
            metavar = "A,B,..." if _is_list(tp) else field.name.upper()
            group.add_argument(*names, dest=dest, type=kind, default=argparse.SUPPRESS,
                               metavar=metavar, help=help_text)
        dests[field.name] = dest
    return FlagSet(cls, dests)
