"""``structlm bench layer | generate`` (``bench share`` is registered by
:mod:`.share`, beside the other shared-basis commands)."""

from __future__ import annotations

import argparse
from typing import Any

from .args import generate_modes, ints, positive_int, prompt, shapes, strs
from .lm import _check_gpt2_preset


def _cmd_bench_layer(args: argparse.Namespace) -> int:
    from ..bench.layer import config_from_args, run_layer_bench

    cfg = config_from_args(
        args.preset, ms=args.m, shapes=args.shapes, algebras=args.algebras,
        schedules=args.schedules, modes=args.modes, trials=args.trials, threads=args.threads)
    out = args.out or f"bench-out/layer_{args.preset}"
    run_layer_bench(cfg, out)
    with open(out + ".md") as fh:
        print(fh.read())
    print(f"wrote {out}.csv, {out}.md, {out}.png")
    return 0


def _cmd_bench_generate(args: argparse.Namespace) -> int:
    from ..bench.generate import GenerateBenchConfig, run_generate_bench

    if not (args.dense_model and args.algebra_model):
        _check_gpt2_preset(args.preset)

    cfg = GenerateBenchConfig(preset=args.preset, algebra=args.algebra,
                              dense_model=args.dense_model or "",
                              algebra_model=args.algebra_model or "",
                              modes=tuple(args.modes), max_new_tokens=args.max_new_tokens,
                              runs=args.runs, threads=args.threads,
                              **({"prompts": tuple(args.prompt)} if args.prompt else {}))
    run_generate_bench(cfg, args.out)
    with open(args.out + ".md") as fh:
        print(fh.read())
    return 0


def add_bench_commands(sub: Any) -> Any:
    """Register ``bench`` on the top-level subparsers; returns its subparsers."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench_command", required=True)
    layer = bench.add_parser("layer", help="dense F.linear vs AlgebraLinear (blocked)")
    layer.add_argument("--preset", default="quick", choices=["quick", "small", "target", "full"])
    layer.add_argument("--m", type=ints, help="comma-separated batch sizes, e.g. 1,32,2048")
    layer.add_argument("--shapes", type=shapes, help="KxN list, e.g. 1024x4096,4096x4096")
    layer.add_argument("--algebras", type=strs, help="e.g. Q4,Q8,Q2^2")
    layer.add_argument("--schedules", type=strs, help="cyclic,block")
    layer.add_argument("--modes", type=strs, help="fwd,fwdbwd")
    layer.add_argument("--trials", type=int, help="interleaved trials per configuration")
    layer.add_argument("--threads", type=int, help="torch threads (default 2)")
    layer.add_argument("--out", help="output prefix (default bench-out/layer_<preset>)")
    layer.set_defaults(func=_cmd_bench_layer)

    bgen = bench.add_parser("generate", help="dense vs algebra generation throughput")
    bgen.add_argument("--preset", default="paper-110m")
    bgen.add_argument("--algebra", default="Q2^2")
    bgen.add_argument("--dense-model", default=None)
    bgen.add_argument("--algebra-model", default=None)
    bgen.add_argument("--modes", type=generate_modes, default=("fixed", "paper"))
    bgen.add_argument("--max-new-tokens", type=positive_int, default=256)
    bgen.add_argument("--runs", type=positive_int, default=4, help="the first is dropped")
    bgen.add_argument("--prompt", action="append", default=None, type=prompt)
    bgen.add_argument("--threads", type=int, default=2)
    bgen.add_argument("--out", default="bench-out/generate")
    bgen.set_defaults(func=_cmd_bench_generate)

    return bench
