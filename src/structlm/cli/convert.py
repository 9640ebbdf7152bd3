"""``structlm convert MODEL --algebra … --targets … --out DIR``: convert a pretrained
model, optionally heal it, and save a folder that loads back converted
(:mod:`structlm.convert.save`)."""

from __future__ import annotations

import argparse
from typing import Any

from structlm.cli.args import MODEL_HELP, positive_int
from structlm.cli.dataclass_flags import add_dataclass_flags
from structlm.config import read_yaml


def convert_config(args: argparse.Namespace) -> Any:
    """The ConvertConfig of ``structlm convert``: the YAML, then the flags given."""
    from structlm.convert.save import ConvertConfig

    raw = {**read_yaml(args.config), "model": args.model, **args.flags.values(args)}
    for key, flags in (("heal", args.heal_flags), ("distill", args.distill_flags)):
        if flags.values(args):
            raw[key] = {**(raw.get(key) or {}), **flags.values(args)}
    return ConvertConfig.from_dict(raw)


def _cmd_convert(args: argparse.Namespace) -> int:
    import torch

    from structlm.convert.save import REPORT, convert_and_save

    cfg = convert_config(args)
    torch.set_num_threads(args.threads)
    rep = convert_and_save(cfg, args.out)
    before, after = rep["original"], rep["converted"]
    print(f"converted {rep['model']}: {len(rep['conversion']['modules'])} projections to "
          f"{cfg.algebra} ({cfg.targets}, {cfg.schedule} types); projection MACs/token "
          f"{before['projection_macs']:,.0f} -> {after['projection_macs']:,.0f} "
          f"({after['projection_macs'] / before['projection_macs']:.3f}x), parameters "
          f"{before['projection_parameters']:,} -> {after['projection_parameters']:,}")
    for text, value in before.get("ppl", {}).items():  # every perplexity computed
        bos_id = rep.get("text", {}).get(text, {}).get("bos", {}).get("bos_id")
        line = (f"  perplexity {text} (bos={'none' if bos_id is None else bos_id}): "
                f"original {value:.2f} -> converted {after['ppl'][text]:.2f}")
        if "ppl_distilled" in after:
            line += f" -> distilled {after['ppl_distilled'][text]:.2f}"
        if "ppl_healed" in after:
            line += f" -> healed {after['ppl_healed'][text]:.2f}"
        print(line)
    print(f"wrote {args.out} (load it with AutoModelForCausalLM.from_pretrained after "
          f"import structlm; details in {REPORT})")
    return 0


def add_convert_commands(sub: Any) -> None:
    """Register ``convert`` on the top-level subparsers."""
    from structlm.convert.save import ConvertConfig
    from structlm.hf.finetune import FinetuneConfig

    cv = sub.add_parser("convert", help="convert a pretrained model's projections to algebra "
                        "layers (parameters kept), optionally heal, save a loadable folder")
    cv.add_argument("model", help=MODEL_HELP)
    cv.add_argument("--out", required=True, help="new folder to write (never overwritten)")
    cv.add_argument("--config", default=None, help="YAML with ConvertConfig fields")
    cv.add_argument("--threads", type=positive_int, default=2)
    title = "{} fields (a flag given overrides the YAML's key)"
    cv.set_defaults(func=_cmd_convert,
                    flags=add_dataclass_flags(cv, ConvertConfig,
                                              exclude=("model", "heal", "distill"),
                                              title=title.format("ConvertConfig")),
                    distill_flags=add_dataclass_flags(
                        cv, FinetuneConfig, prefix="distill", exclude=("seed",),
                        title=title.format("distillation FinetuneConfig") + " (--distill-"
                        "steps 0: no distillation, the default; before healing)"),
                    heal_flags=add_dataclass_flags(
                        cv, FinetuneConfig, prefix="heal", exclude=("seed",),
                        title=title.format("healing FinetuneConfig") + " (--heal-steps 0: "
                        "no healing, the default)"))
