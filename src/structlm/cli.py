"""``structlm`` command line.

    structlm algebra info NAME [--json]
    structlm algebra table [--json]
    structlm bench layer [--preset quick|small|target|full] [overrides...]
    structlm cost [--preset paper-110m] [--algebra Q2^2] [--json]
    structlm train CONFIG.yaml [CONFIG.yaml ...] [--max-steps N] [--plot PNG]
    structlm generate --prompt TEXT [--model DIR] [--max-new-tokens N] [...]
    structlm bench generate [--preset paper-110m] [--algebra Q2^2] [--modes fixed,paper]
    structlm bench share [MODEL] [--compressed DIR] [--method shared] [--batches 1,16] [...]
    structlm demo
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from fractions import Fraction

from .algebra import CATALOGUE_NAMES, AlgebraError, get_algebra, support_of

__all__ = ["algebra_facts", "algebra_table_markdown", "main"]


def algebra_facts(name: str) -> dict[str, object]:
    """Every fact ``structlm algebra info`` reports, computed from the tensor."""
    a = get_algebra(name)
    rank = a.rank
    facts: dict[str, object] = {
        "name": a.name,
        "dim": a.dim,
        "t": a.num_maximal_ideals,
        "rank_lower_bound": rank.lower_bound,
        "explicit_products": rank.explicit_products,
        "exact_rank": rank.exact,
        "rank_interval": list(rank.interval),
        "associative": a.is_associative,
        "has_unit": a.has_unit,
        "radical_dim": a.radical_dim,
        "q": a.q,
    }
    if a.unit is not None:
        facts["unit"] = [a.basis_names[i] for i, v in enumerate(a.unit) if v != 0] if all(
            v in (0.0, 1.0) for v in a.unit) else [float(v) for v in a.unit]
    try:
        s = support_of(a)
    except AlgebraError as err:
        facts["mac_ratio"] = None
        facts["layer_error"] = str(err)
    else:
        facts["mac_ratio"] = str(s.mac_ratio())
        facts["layer_triples"] = s.num_triples
        facts["dead_blocks"] = int((~s.used_blocks).sum())
    return facts


def _rank_text(f: dict[str, object]) -> str:
    if f["exact_rank"] is not None:
        return str(f["exact_rank"])
    lo, hi = f["rank_interval"]  # type: ignore[misc]
    return f"only known in [{lo}, {hi}]" if lo is not None else f"<= {hi} (t unknown)"


def algebra_table_markdown(names: Sequence[str] = CATALOGUE_NAMES) -> str:
    """The seed's table (SPEC §A.2) for the catalogue, as Markdown."""
    lines = [
        "| algebra | q | slots (dim) | t | block products of explicit algorithm | "
        "layer triples | equal-width MAC ratio | exact rank |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for n in names:
        f = algebra_facts(n)
        lines.append(
            f"| {f['name']} | {f['q']} | {f['dim']} | {f['t']} | {f['explicit_products']} | "
            f"{f.get('layer_triples', '-')} | {f['mac_ratio']} | {_rank_text(f)} |")
    return "\n".join(lines) + "\n"


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


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def _shapes(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for item in text.split(","):
        k, n = item.lower().split("x")
        out.append((int(k), int(n)))
    return tuple(out)


def _strs(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _temperature(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"temperature must be >= 0 (0 = greedy), got {value}")
    return value


def _top_p(text: str) -> float:
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"top-p must be in (0, 1], got {value}")
    return value


def _float(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _prompt(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("a prompt must not be empty")
    return text


def _generate_modes(text: str) -> tuple[str, ...]:
    modes = _strs(text)
    bad = [m for m in modes if m not in ("fixed", "paper")]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"unknown modes {bad or [text]}: expected a "
                                         "comma-separated subset of fixed,paper")
    return modes


def _cmd_bench_layer(args: argparse.Namespace) -> int:
    from .bench.layer import config_from_args, run_layer_bench

    cfg = config_from_args(
        args.preset, ms=args.m, shapes=args.shapes, algebras=args.algebras,
        schedules=args.schedules, modes=args.modes, trials=args.trials, threads=args.threads)
    out = args.out or f"bench-out/layer_{args.preset}"
    run_layer_bench(cfg, out)
    with open(out + ".md") as fh:
        print(fh.read())
    print(f"wrote {out}.csv, {out}.md, {out}.png")
    return 0


def _cmd_cost(args: argparse.Namespace) -> int:
    from .models import config_from_preset
    from .models.cost import model_cost

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


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from .data import gpt2_tokenizer
    from .models import StructLMForCausalLM, config_from_preset

    torch.set_num_threads(args.threads)
    tok = gpt2_tokenizer()
    if args.model:
        from transformers import AutoModelForCausalLM

        if not os.path.isfile(os.path.join(args.model, "config.json")):
            raise ValueError(f"--model {args.model!r}: no saved model there (expected a "
                             "folder with config.json and weights, as save_pretrained writes)")
        try:
            model = AutoModelForCausalLM.from_pretrained(args.model).eval()
        except Exception as e:  # a garbage config, truncated or mis-shaped weights
            raise ValueError(f"--model {args.model!r} cannot be loaded "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:300]})") from e
    else:
        _check_gpt2_preset(args.preset)
        torch.manual_seed(args.seed)
        model = StructLMForCausalLM(config_from_preset(args.preset, args.algebra)).eval()
        print(f"(random {args.preset} weights with {args.algebra} FFNs: pass --model DIR for a "
              "trained model)")
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
                             top_p=args.top_p, top_k=args.top_k, pad_token_id=tok.eos_token_id)
    for prompt, row in zip(args.prompt, out, strict=True):
        text = tok.decode(row[enc["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"### {prompt}\n{text}\n")
    return 0


def _check_gpt2_preset(preset: str) -> None:
    """Commands that tokenise with GPT-2 need a preset with its 50,257-token vocabulary."""
    from .models.presets import PRESETS

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: expected one of {sorted(PRESETS)}")
    vocab = PRESETS[preset]["vocab_size"]
    if vocab != 50257:
        ok = sorted(p for p, v in PRESETS.items() if v["vocab_size"] == 50257)
        raise ValueError(f"preset {preset!r} has a {vocab}-token vocabulary, but this command "
                         f"tokenises with GPT-2 (50,257 tokens): use one of {ok}, or --model "
                         "for a trained model with its own tokenizer")


def _cmd_bench_generate(args: argparse.Namespace) -> int:
    from .bench.generate import GenerateBenchConfig, run_generate_bench

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


def _cmd_bench_share(args: argparse.Namespace) -> int:
    from .bench.share import ShareBenchConfig, run_share_bench

    cfg = ShareBenchConfig(model=args.model, compressed=args.compressed or "",
                           method=args.method, types=args.types,
                           target_reduction=args.target_reduction, corpus=args.corpus,
                           calib_tokens=args.calib_tokens, batches=args.batches,
                           prompt_len=args.prompt_len, decode_tokens=args.decode_tokens,
                           trials=args.trials, warmup=args.warmup, threads=args.threads,
                           seed=args.seed, peak_memory=not args.no_peak_memory)
    run_share_bench(cfg, args.out)
    with open(args.out + ".md") as fh:
        print(fh.read())
    print(f"wrote {args.out}.csv, {args.out}.md, {args.out}.png")
    return 0


def _cmd_study(args: argparse.Namespace) -> int:
    from .train.study import run_study
    from .train.study_config import load_study_config

    cfg = load_study_config(args.config, out_dir=args.out, max_steps=args.max_steps,
                            threads=args.threads)
    report = run_study(cfg)
    print(report.read_text())
    print(f"wrote {report} (and runs.csv, arms.csv, curves.png, loss_vs_macs.png)")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from .train import load_config, train
    from .train.plot import plot_loss_curves

    runs = []
    for path in args.configs:
        cfg = load_config(path, max_steps=args.max_steps)
        metrics = train(cfg)
        runs.append((f"{cfg.algebra} ({os.path.basename(path)})", str(metrics)))
        print(f"{path}: metrics {metrics}, model {os.path.join(cfg.out_dir, 'model')}")
    if len(runs) > 1:
        out = args.plot or "loss_curves.png"
        plot_loss_curves(runs, out)
        print(f"wrote {out}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(args.out, steps=args.steps, algebra=args.algebra, share=not args.no_share)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``structlm`` command."""
    p = argparse.ArgumentParser(prog="structlm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    alg = sub.add_parser("algebra", help="facts about algebras").add_subparsers(
        dest="algebra_command", required=True)
    info = alg.add_parser("info", help="facts of one algebra (Q4, Q2^2, graph:3:0-1,1-2, ...)")
    info.add_argument("name")
    info.add_argument("--json", action="store_true", help="one JSON object")
    info.set_defaults(func=_cmd_algebra_info)
    table = alg.add_parser("table", help="the seed's table for the catalogue")
    table.add_argument("--json", action="store_true", help="a JSON list of info objects")
    table.set_defaults(func=_cmd_algebra_table)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench_command", required=True)
    layer = bench.add_parser("layer", help="dense F.linear vs AlgebraLinear (blocked)")
    layer.add_argument("--preset", default="quick", choices=["quick", "small", "target", "full"])
    layer.add_argument("--m", type=_ints, help="comma-separated batch sizes, e.g. 1,32,2048")
    layer.add_argument("--shapes", type=_shapes, help="KxN list, e.g. 1024x4096,4096x4096")
    layer.add_argument("--algebras", type=_strs, help="e.g. Q4,Q8,Q2^2")
    layer.add_argument("--schedules", type=_strs, help="cyclic,block")
    layer.add_argument("--modes", type=_strs, help="fwd,fwdbwd")
    layer.add_argument("--trials", type=int, help="interleaved trials per configuration")
    layer.add_argument("--threads", type=int, help="torch threads (default 2)")
    layer.add_argument("--out", help="output prefix (default bench-out/layer_<preset>)")
    layer.set_defaults(func=_cmd_bench_layer)

    tr = sub.add_parser("train", help="train (or resume) from YAML configs")
    tr.add_argument("configs", nargs="+", help="YAML files (see configs/)")
    tr.add_argument("--max-steps", type=int, default=None, help="override max_steps")
    tr.add_argument("--plot", default=None, help="combined loss plot when several configs")
    tr.set_defaults(func=_cmd_train)

    st = sub.add_parser("study", help="train a set of arms on the same data, tokens and seeds, "
                        "then report (resumes arm by arm)")
    st.add_argument("config", help="study YAML (see configs/study/)")
    st.add_argument("--out", default=None, help="override out_dir")
    st.add_argument("--max-steps", type=int, default=None, help="override train.max_steps")
    st.add_argument("--threads", type=int, default=None,
                    help="torch threads (runtime only: a run may resume with another value)")
    st.set_defaults(func=_cmd_study)

    cost = sub.add_parser("cost", help="parameters and MACs of a model preset")
    cost.add_argument("--preset", default="paper-110m")
    cost.add_argument("--algebra", default="Q2^2", help="FFN algebra (dense, Q4, Q2^2, ...)")
    cost.add_argument("--structured-scores", action="store_true",
                      help="count attention scores as structured (seed 000 appendix G)")
    cost.add_argument("--schedule", default="", help="type schedule (default: the preset's)")
    cost.add_argument("--json", action="store_true", help="one JSON object")
    cost.set_defaults(func=_cmd_cost)

    gen = sub.add_parser("generate", help="sample text with the KV cache")
    gen.add_argument("--model", default=None, help="a saved model folder (save_pretrained)")
    gen.add_argument("--preset", default="cpu-small")
    gen.add_argument("--algebra", default="Q2^2")
    gen.add_argument("--prompt", action="append", required=True, type=_prompt,
                     help="repeat for a batch")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=64)
    gen.add_argument("--temperature", type=_temperature, default=0.8, help="0 = greedy")
    gen.add_argument("--top-p", type=_top_p, default=0.95)
    gen.add_argument("--top-k", type=_positive_int, default=50)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--threads", type=int, default=2)
    gen.set_defaults(func=_cmd_generate)

    bgen = bench.add_parser("generate", help="dense vs algebra generation throughput")
    bgen.add_argument("--preset", default="paper-110m")
    bgen.add_argument("--algebra", default="Q2^2")
    bgen.add_argument("--dense-model", default=None)
    bgen.add_argument("--algebra-model", default=None)
    bgen.add_argument("--modes", type=_generate_modes, default=("fixed", "paper"))
    bgen.add_argument("--max-new-tokens", type=_positive_int, default=256)
    bgen.add_argument("--runs", type=_positive_int, default=4, help="the first is dropped")
    bgen.add_argument("--prompt", action="append", default=None, type=_prompt)
    bgen.add_argument("--threads", type=int, default=2)
    bgen.add_argument("--out", default="bench-out/generate")
    bgen.set_defaults(func=_cmd_bench_generate)

    bsh = bench.add_parser("share", help="memory and CPU latency (prefill, cached decode) of "
                           "a compressed model vs the original")
    bsh.add_argument("model", nargs="?", default="smollm2",
                     help="model to compress on the fly (ignored with --compressed)")
    bsh.add_argument("--compressed", default=None,
                     help="a folder written by 'structlm share compress' (its source model "
                     "is the original); default: compress MODEL on the fly")
    bsh.add_argument("--method", default="basis-sharing",
                     choices=["shared", "hybrid", "svd", "basis-sharing", "onesided-all-layers"])
    bsh.add_argument("--types", default="all", help="attn, mlp, all or q,k,v,o,mlp_in,mlp_out")
    bsh.add_argument("--target-reduction", type=float, default=0.4,
                     help="fraction of the compressed matrices' parameters to remove")
    bsh.add_argument("--corpus", default="austen", help="calibration and prompt text")
    bsh.add_argument("--calib-tokens", type=int, default=32768)
    bsh.add_argument("--batches", type=_ints, default=(1, 16), help="e.g. 1,16")
    bsh.add_argument("--prompt-len", type=int, default=128)
    bsh.add_argument("--decode-tokens", type=int, default=32)
    bsh.add_argument("--trials", type=int, default=7, help="interleaved trials (medians)")
    bsh.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    bsh.add_argument("--threads", type=int, default=2)
    bsh.add_argument("--seed", type=int, default=0)
    bsh.add_argument("--no-peak-memory", action="store_true",
                     help="skip the peak-memory runs (a fresh process per model and batch)")
    bsh.add_argument("--out", default="bench-out/share", help="output prefix")
    bsh.set_defaults(func=_cmd_bench_share)

    demo = sub.add_parser("demo", help="dense vs algebra LMs end to end (about 8 min on 2 cores)")
    demo.add_argument("--steps", type=int, default=100, help="training steps per model")
    demo.add_argument("--algebra", default="Q2^2")
    demo.add_argument("--out", default="demo-report")
    demo.add_argument("--no-share", action="store_true",
                      help="skip the shared-basis section (SmolLM2, ~2 min)")
    demo.set_defaults(func=_cmd_demo)

    from .cli_share import add_share_commands

    add_share_commands(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``structlm`` command."""
    from .config import RunError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (AlgebraError, ValueError, RunError, FileNotFoundError) as err:
        print(f"structlm: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
