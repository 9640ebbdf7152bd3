"""``structlm`` command line (one module per command group).

    structlm algebra info NAME [--json]
    structlm algebra table [--json]
    structlm bench layer [--preset quick|small|target|full] [overrides...]
    structlm cost [--preset paper-110m] [--algebra Q2^2] [--structured-scores] [--json]
    structlm train CONFIG.yaml [CONFIG.yaml ...] [--max-steps N] [--plot PNG]
    structlm study CONFIG.yaml [--out DIR] [--max-steps N] [--threads N]
    structlm generate --prompt TEXT [--model DIR] [--max-new-tokens N] [...]
    structlm bench generate [--preset paper-110m] [--algebra Q2^2] [--modes fixed,paper]
    structlm bench share [MODEL] [--compressed DIR] [--method shared] [--batches 1,16] [...]
    structlm eval ppl MODEL [--corpus austen] [...]
    structlm share analyze | compress | experiment MODEL [...]
    structlm convert MODEL [--config YAML] [--algebras Q2^2,Q4] [--targets mlp,attn] [...]
    structlm demo
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..algebra import AlgebraError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``structlm`` command."""
    from .algebra import add_algebra_commands
    from .bench import add_bench_commands
    from .convert import add_convert_commands
    from .lm import add_lm_commands
    from .share import add_share_commands

    p = argparse.ArgumentParser(prog="structlm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    add_algebra_commands(sub)
    bench = add_bench_commands(sub)
    add_lm_commands(sub)
    add_share_commands(sub, bench)
    add_convert_commands(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``structlm`` command."""
    from ..config import RunError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (AlgebraError, ValueError, RunError, FileNotFoundError) as err:
        print(f"structlm: error: {err}", file=sys.stderr)
        return 2

