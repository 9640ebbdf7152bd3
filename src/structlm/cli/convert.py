"""``structlm convert MODEL``: change a pretrained model's product, heal it, and compare
it with equal-MAC baselines (:mod:`structlm.experiments.convert.experiment`)."""

from __future__ import annotations

import argparse
from typing import Any

from structlm.cli.args import positive_int
from structlm.cli.dataclass_flags import add_dataclass_flags
from structlm.config import read_yaml


def convert_config(args: argparse.Namespace) -> Any:
    """The ConvertExperimentConfig of ``structlm convert``: the YAML, then the flags."""
    from structlm.experiments.convert.experiment import ConvertExperimentConfig

    raw = {**read_yaml(args.config), "model": args.model, **args.flags.values(args)}
    if args.heal_flags.values(args):
        raw["heal"] = {**(raw.get("heal") or {}), **args.heal_flags.values(args)}
    return ConvertExperimentConfig.from_dict(raw)


def _cmd_convert(args: argparse.Namespace) -> int:
    import torch

    from structlm.experiments.convert.experiment import run_convert_experiment

    cfg = convert_config(args)
    torch.set_num_threads(args.threads)
    res = run_convert_experiment(cfg, args.out)
    print(f"{args.out.rstrip('/')}/report.md written ({res['seconds'] / 60:.1f} min)")
    return 0


def add_convert_commands(sub: Any) -> None:
    """Register ``convert`` on the top-level subparsers."""
    from structlm.experiments.convert.experiment import ConvertExperimentConfig
    from structlm.hf.finetune import FinetuneConfig

    cv = sub.add_parser("convert", help="change a pretrained model's product (algebra "
                        "layers, parameters kept), heal it, compare equal-MAC baselines")
    cv.add_argument("model", help="smollm2 (built in), a local folder, or a hub id")
    cv.add_argument("--config", default=None, help="YAML with ConvertExperimentConfig fields")
    cv.add_argument("--threads", type=positive_int, default=2)
    cv.add_argument("--out", default="convert-report")
    title = "{} fields (a flag given overrides the YAML's key; lists are comma-separated)"
    cv.set_defaults(func=_cmd_convert,
                    flags=add_dataclass_flags(cv, ConvertExperimentConfig, exclude=("model",),
                                              title=title.format("ConvertExperimentConfig")),
                    heal_flags=add_dataclass_flags(cv, FinetuneConfig, prefix="heal",
                                                   title=title.format("healing FinetuneConfig")))
