"""``structlm routes MODEL``: which path (kernel, layout, module) every layer of a model
takes for a prefill and cached decode steps (:func:`structlm.hf.routes.explain_routes`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from structlm.cli.args import non_negative_int, positive_int


def _cmd_routes(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from structlm.hf.loading import load_model
    from structlm.hf.routes import explain_routes, format_routes

    torch.set_num_threads(args.threads)
    model = load_model(args.model).model
    if args.convert:
        from structlm.convert import AlgebraConfig, convert_

        convert_(model, AlgebraConfig(args.convert, targets=args.targets))
    if args.decode_kernels:
        from structlm.hf.decode import use_decode_kernels_

        use_decode_kernels_(model)
    rows = explain_routes(model, batch=args.batch, tokens=args.tokens,
                          decode_steps=args.decode_steps)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    else:
        print(format_routes(rows, by_layer=args.by_layer))
    return 0


def add_routes_command(sub: Any) -> None:
    """Register ``routes`` on the top-level subparsers."""
    r = sub.add_parser("routes", help="which path every layer takes for a prefill and "
                       "cached decode steps (the route decision, with reasons)")
    r.add_argument("model", help="smollm2 or qwen2.5-coder (built in), a local folder "
                   "(a converted or compressed one too), or a hub id")
    r.add_argument("--batch", type=positive_int, default=1, help="sequences")
    r.add_argument("--tokens", type=positive_int, default=8, help="prompt tokens (prefill)")
    r.add_argument("--decode-steps", type=non_negative_int, default=1,
                   help="cached decode steps")
    r.add_argument("--convert", default="", help="convert_ to this algebra first (e.g. Q2^2)")
    r.add_argument("--targets", default="mlp", help="targets of --convert")
    r.add_argument("--decode-kernels", action="store_true",
                   help="put the plain nn.Linear layers on the few-row kernel first "
                   "(use_decode_kernels_, as the generate benchmark does for both arms)")
    r.add_argument("--by-layer", action="store_true", help="one row per module (default: "
                   "layers merged, x N)")
    r.add_argument("--threads", type=positive_int, default=2)
    r.add_argument("--json", action="store_true", help="one JSON list")
    r.set_defaults(func=_cmd_routes)
