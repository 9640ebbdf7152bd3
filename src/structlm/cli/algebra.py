"""``structlm algebra info | table``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from structlm.algebra import CATALOGUE_NAMES
from structlm.algebra.facts import _rank_text, algebra_facts, algebra_table_markdown


def _cmd_algebra_info(args: argparse.Namespace) -> int:
    f = algebra_facts(args.name)
    if args.json:
        print(json.dumps(f))
        return 0
    width = max(len(k) for k in f)
    for k, v in f.items():
        if k == "exact_rank":
            v = _rank_text(f)
        print(f"{k:<{width}}  {v}")
    return 0


def _cmd_algebra_table(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps([algebra_facts(n) for n in CATALOGUE_NAMES]))
    else:
        print(algebra_table_markdown())
    return 0


def add_algebra_commands(sub: Any) -> None:
    """Register ``algebra`` on the top-level subparsers."""
    alg = sub.add_parser("algebra", help="facts about algebras").add_subparsers(
        dest="algebra_command", required=True)
    info = alg.add_parser("info", help="facts of one algebra (Q4, Q2^2, graph:3:0-1,1-2, ...)")
    info.add_argument("name")
    info.add_argument("--json", action="store_true", help="one JSON object")
    info.set_defaults(func=_cmd_algebra_info)
    table = alg.add_parser("table", help="the seed's table for the catalogue")
    table.add_argument("--json", action="store_true", help="a JSON list of info objects")
    table.set_defaults(func=_cmd_algebra_table)

