"""``structlm`` command line (one module per command group).

    structlm algebra info NAME [--json]
    structlm algebra table [--json]
    structlm bench layer [--preset quick|small|target|full] [overrides...]
    structlm cost [--preset paper-110m] [--algebra Q2^2] [--structured-scores] [--json]
    structlm train CONFIG.yaml [CONFIG.yaml ...] [--max-steps N] [--plot PNG]
    structlm generate --prompt TEXT [--model DIR] [--max-new-tokens N] [...]
    structlm bench generate [--preset paper-110m] [--algebra Q2^2] [--modes fixed,paper]
    structlm bench share [MODEL] [--compressed DIR] [--method shared] [--batches 1,16] [...]
    structlm eval ppl MODEL [--corpus austen] [...]
    structlm share analyze | compress MODEL [...]
    structlm share self-contain FOLDER [...]  (upgrade compressed folders of earlier versions)
    structlm convert MODEL --algebra Q2^2 --targets mlp --out DIR [--heal-steps N] [...]
    structlm routes MODEL [--batch 1] [--tokens 8] [--decode-steps 1] [--convert Q2^2]
    structlm experiment study CONFIG.yaml [--out DIR] [--max-steps N] [--threads N]
    structlm experiment share | convert MODEL [--config YAML] [--out DIR] [...]
    structlm demo  (= structlm experiment demo)

Every command first sets the C allocator to keep freed memory for reuse (large tensors
then skip the page faults of a fresh ``mmap``: :mod:`structlm.cpu_malloc`);
``structlm --system-malloc COMMAND ...`` leaves it as it is.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from structlm.algebra import AlgebraError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``structlm`` command."""
    from structlm.cli.algebra import add_algebra_commands
    from structlm.cli.bench import add_bench_commands
    from structlm.cli.convert import add_convert_commands
    from structlm.cli.experiment import add_experiment_commands
    from structlm.cli.lm import add_lm_commands
    from structlm.cli.routes import add_routes_command
    from structlm.cli.share import add_share_commands

    p = argparse.ArgumentParser(prog="structlm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system-malloc", action="store_true",
                   help="leave the C allocator as it is (by default structlm keeps freed "
                   "memory for reuse: structlm.cpu_malloc)")
    sub = p.add_subparsers(dest="command", required=True)
    add_algebra_commands(sub)
    bench = add_bench_commands(sub)
    add_lm_commands(sub)
    add_share_commands(sub, bench)
    add_convert_commands(sub)
    add_routes_command(sub)
    add_experiment_commands(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``structlm`` command."""
    from structlm.config import RunError
    from structlm.cpu_malloc import retain_freed_memory

    args = build_parser().parse_args(argv)
    if not args.system_malloc:
        retain_freed_memory()
    try:
        return int(args.func(args))
    except (AlgebraError, ValueError, RunError, FileNotFoundError) as err:
        print(f"structlm: error: {err}", file=sys.stderr)
        return 2

