"""``structlm cost | generate | train | study | demo``: the language-model commands."""

from __future__ import annotations

import argparse
import json
import os
from fractions import Fraction
from typing import Any

from structlm.cli.args import positive_int, prompt, temperature, top_p
from structlm.cli.dataclass_flags import add_dataclass_flags


def _cmd_cost(args: argparse.Namespace) -> int:
    from structlm.algebra import num_types
    from structlm.models import config_from_preset
    from structlm.models.cost import model_cost
    from structlm.nn.schedules import get_schedule

    q = num_types(args.algebra)  # refuses an unknown algebra
    if args.schedule:
        try:
            get_schedule(args.schedule, q)  # refuses an unknown schedule, dense too
        except ValueError as e:
            raise ValueError(f"--schedule: {e}") from None
    overrides = {"type_schedule": args.schedule} if args.schedule else {}
    cost = model_cost(config_from_preset(args.preset, args.algebra,
                                         structured_scores=args.structured_scores, **overrides))
    if args.json:
        print(json.dumps(cost))
        return 0
    print(f"preset {args.preset}, FFN algebra {args.algebra} (rho = {cost['rho_ffn']}), "
          f"structured attention scores {'on' if cost['structured_scores'] else 'off'}")
    print(f"trainable parameters      {cost['parameters']:,}")
    dec = cost["decode_macs_per_token"]
    print(f"decode MACs / token       dense {dec['dense']:,}  algebra {dec['algebra']:,}  "
          f"(ratio {cost['decode_ratio']} = {float(Fraction(cost['decode_ratio'])):.4f})")
    print(f"decode projections        algebra/dense = {cost['projection_mac_ratio']} "
          f"= {float(Fraction(cost['projection_mac_ratio'])):.4f}")
    print("training MACs / token     component: dense -> algebra")
    for name, v in cost["training_macs_per_token"].items():
        print(f"  {name:<24}{v['dense']:>16,} -> {v['algebra']:>16,}")
    sc = cost["scores"]
    if sc:
        def f(key: str) -> str:
            return f"{sc[key]} = {float(Fraction(sc[key])):.4f}"

        print(f"structured scores         rho_score {f('rho_score')} (schedule {sc['schedule']}, "
              f"causal context {sc['context']}); balanced limit {f('rho_score_balanced_limit')}")
        print(f"  attention speed-up bound forward {f('forward_bound')}, training "
              f"{f('training_bound')}; at the limit {f('forward_bound_limit')}, "
              f"{f('training_bound_limit')}")
    return 0


def _check_gpt2_preset(preset: str) -> None:
    """Commands that tokenise with GPT-2 need a preset with its 50,257-token vocabulary."""
    from structlm.models.presets import PRESETS

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: expected one of {sorted(PRESETS)}")
    vocab = PRESETS[preset]["vocab_size"]
    if vocab != 50257:
        ok = sorted(p for p, v in PRESETS.items() if v["vocab_size"] == 50257)
        raise ValueError(f"preset {preset!r} has a {vocab}-token vocabulary, but this command "
                         f"tokenises with GPT-2 (50,257 tokens): use one of {ok}, or --model "
                         "for a trained model with its own tokenizer")


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    if args.model:
        from structlm.hf.loading import (
            BUILTIN_MODELS,
            FOLDER_FORMATS,
            check_tokenizer_fits,
            load_model,
        )

        if args.model.lower() not in BUILTIN_MODELS and not any(
                os.path.isfile(os.path.join(args.model, name))
                for name in ("config.json", *FOLDER_FORMATS)):
            raise ValueError(f"--model {args.model!r}: no saved model there (expected a "
                             "folder with config.json and weights, as save_pretrained writes, "
                             "or a folder structlm share compress wrote) and not a built-in "
                             f"name ({', '.join(sorted(BUILTIN_MODELS))})")
        try:  # refuses missing, mis-shaped and non-finite weights by name
            loaded = load_model(args.model)
        except (ValueError, OSError) as e:
            raise ValueError(f"--model {args.model!r} cannot be loaded: "
                             f"{str(e).splitlines()[0][:400]}") from e
        except Exception as e:  # a garbage config or truncated weights
            raise ValueError(f"--model {args.model!r} cannot be loaded "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:300]})") from e
        model, tok = loaded.model, loaded.tokenizer  # the folder's own tokenizer
        if tok is None:
            raise ValueError(f"--model {args.model!r} has no tokenizer files (tokenizer.json, "
                             "tokenizer_config.json, ...): save the tokenizer the model was "
                             "trained with into the folder")
        check_tokenizer_fits(tok, model, f"--model {args.model!r}")
    else:
        from structlm.data import gpt2_tokenizer
        from structlm.models import StructLMForCausalLM, config_from_preset

        tok = gpt2_tokenizer()
        _check_gpt2_preset(args.preset)
        torch.manual_seed(args.seed)
        model = StructLMForCausalLM(config_from_preset(args.preset, args.algebra)).eval()
        print(f"(random {args.preset} weights with {args.algebra} FFNs: pass --model DIR for a "
              "trained model)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    enc = tok(list(args.prompt), return_tensors="pt", padding=True)
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    need = enc["input_ids"].shape[1] + args.max_new_tokens
    if context and need > context:
        raise ValueError(f"the longest prompt ({enc['input_ids'].shape[1]} tokens) plus "
                         f"--max-new-tokens {args.max_new_tokens} = {need} exceeds the model's "
                         f"context of {context} positions")
    torch.manual_seed(args.seed)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=args.max_new_tokens,
                             do_sample=args.temperature > 0, temperature=args.temperature or None,
                             top_p=args.top_p, top_k=args.top_k, pad_token_id=tok.pad_token_id)
    for given, row in zip(args.prompt, out, strict=True):
        text = tok.decode(row[enc["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"### {given}\n{text}\n")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from structlm.train import load_config, train
    from structlm.train.plot import plot_loss_curves

    runs = []
    for path in args.configs:
        cfg = load_config(path, **args.flags.values(args))
        metrics = train(cfg, restart=args.restart)
        runs.append((f"{cfg.algebra} ({os.path.basename(path)})", str(metrics)))
        print(f"{path}: metrics {metrics}, model {os.path.join(cfg.out_dir, 'model')}")
    if len(runs) > 1:
        out = args.plot or "loss_curves.png"
        plot_loss_curves(runs, out)
        print(f"wrote {out}")
    return 0


def add_lm_commands(sub: Any) -> None:
    """Register the language-model commands on the top-level subparsers."""
    tr = sub.add_parser("train", help="train (or resume) from YAML configs")
    tr.add_argument("configs", nargs="+", help="YAML files (see configs/)")
    tr.add_argument("--plot", default=None, help="combined loss plot when several configs")
    tr.add_argument("--restart", action="store_true",
                    help="start over from step 0: the run's checkpoints and metrics are "
                    "moved to out_dir/discarded-<time>/, never deleted")
    from structlm.train.loop import TrainConfig

    tr.set_defaults(func=_cmd_train, flags=add_dataclass_flags(
        tr, TrainConfig, title="TrainConfig fields (override every given YAML)"))

    cost = sub.add_parser("cost", help="parameters and MACs of a model preset")
    cost.add_argument("--preset", default="paper-110m")
    cost.add_argument("--algebra", default="Q2^2", help="FFN algebra (dense, Q4, Q2^2, ...)")
    cost.add_argument("--structured-scores", action="store_true",
                      help="count attention scores as structured (seed 000 appendix G)")
    cost.add_argument("--schedule", default="", help="type schedule (default: the preset's)")
    cost.add_argument("--json", action="store_true", help="one JSON object")
    cost.set_defaults(func=_cmd_cost)

    gen = sub.add_parser("generate", help="sample text with the KV cache")
    gen.add_argument("--model", default=None,
                     help="a saved model folder (save_pretrained, convert, share compress) "
                          "or a built-in name (smollm2, qwen2.5-coder, qwen2.5-coder-1.5b; "
                          "held whole in memory)")
    gen.add_argument("--preset", default="cpu-small")
    gen.add_argument("--algebra", default="Q2^2")
    gen.add_argument("--prompt", action="append", required=True, type=prompt,
                     help="repeat for a batch")
    gen.add_argument("--max-new-tokens", type=positive_int, default=64)
    gen.add_argument("--temperature", type=temperature, default=0.8, help="0 = greedy")
    gen.add_argument("--top-p", type=top_p, default=0.95)
    gen.add_argument("--top-k", type=positive_int, default=50)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--threads", type=positive_int, default=2)
    gen.set_defaults(func=_cmd_generate)
