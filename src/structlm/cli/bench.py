"""``structlm bench layer | generate | train`` (``bench share`` is registered by
:mod:`.share`, beside the other shared-basis commands)."""

from __future__ import annotations

import argparse
from typing import Any

from structlm.cli.args import generate_modes, prompt, shapes
from structlm.cli.dataclass_flags import add_dataclass_flags
from structlm.cli.lm import _check_gpt2_preset
from structlm.config import dataclass_from_dict


def _cmd_bench_layer(args: argparse.Namespace) -> int:
    from structlm.bench.layer import config_from_args, run_layer_bench
    from structlm.bench.timing import warn_if_passive_wait

    cfg = config_from_args(args.preset, **args.flags.values(args))
    out = args.out or f"bench-out/layer_{args.preset}"
    warn_if_passive_wait()
    run_layer_bench(cfg, out)
    with open(out + ".md") as fh:
        print(fh.read())
    print(f"wrote {out}.csv, {out}.md, {out}.png")
    return 0


def _cmd_bench_generate(args: argparse.Namespace) -> int:
    from structlm.bench.generate import GenerateBenchConfig, run_generate_bench
    from structlm.bench.timing import warn_if_passive_wait

    given = args.flags.values(args)
    if not given.get("model") and not (given.get("dense_model") and given.get("algebra_model")):
        _check_gpt2_preset(given.get("preset", GenerateBenchConfig.preset))

    if args.prompt:
        given["prompts"] = tuple(args.prompt)
    cfg = dataclass_from_dict(GenerateBenchConfig, given)
    warn_if_passive_wait()
    run_generate_bench(cfg, args.out)
    with open(args.out + ".md") as fh:
        print(fh.read())
    return 0


def _cmd_bench_train(args: argparse.Namespace) -> int:
    import dataclasses

    from structlm.bench.timing import warn_if_passive_wait
    from structlm.bench.train_step import PRESETS, run_train_bench

    given = args.flags.values(args)
    cfgs = [dataclasses.replace(c, **given) for c in PRESETS[args.preset]]
    out = args.out or f"bench-out/train_{args.preset}"
    warn_if_passive_wait()
    run_train_bench(cfgs, out)
    with open(out + ".md") as fh:
        print(fh.read())
    print(f"wrote {out}.csv, {out}.md")
    return 0


def add_bench_commands(sub: Any) -> Any:
    """Register ``bench`` on the top-level subparsers; returns its subparsers."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench_command", required=True)
    from structlm.bench.generate import GenerateBenchConfig
    from structlm.bench.layer import PRESETS, LayerBenchConfig

    layer = bench.add_parser("layer", help="dense vs AlgebraLinear (blocked), interleaved")
    layer.add_argument("--preset", default="quick", choices=sorted(PRESETS),
                       help="the grid to start from; the flags below override its fields")
    layer.add_argument("--out", help="output prefix (default bench-out/layer_<preset>)")
    layer.set_defaults(func=_cmd_bench_layer, flags=add_dataclass_flags(
        layer, LayerBenchConfig, parse={"shapes": shapes, "blocks": shapes},
        aliases={"ms": ["--m"]},
        title="LayerBenchConfig fields (override the preset's; lists are comma-separated)"))

    bgen = bench.add_parser("generate", help="dense vs algebra generation throughput")
    bgen.add_argument("--prompt", action="append", default=None, type=prompt,
                      help="a prompt (repeatable; default: the built-in prompts)")
    bgen.add_argument("--out", default="bench-out/generate")
    bgen.set_defaults(func=_cmd_bench_generate, flags=add_dataclass_flags(
        bgen, GenerateBenchConfig, exclude=("prompts",),
        parse={"modes": generate_modes}))

    from structlm.bench.train_step import PRESETS as TRAIN_PRESETS
    from structlm.bench.train_step import TrainBenchConfig

    btrain = bench.add_parser("train", help="training-step tokens/s, dense vs algebra model")
    btrain.add_argument("--preset", default="study-cpu", choices=sorted(TRAIN_PRESETS),
                        help="the configurations to time (paper-110m: T = 1536 at batch 1 "
                        "and 2; study-cpu: the CPU study's step); flags override their fields")
    btrain.add_argument("--out", help="output prefix (default bench-out/train_<preset>)")
    btrain.set_defaults(func=_cmd_bench_train, flags=add_dataclass_flags(
        btrain, TrainBenchConfig, exclude=("preset",),
        title="TrainBenchConfig fields (override the preset's)"))
    return bench
