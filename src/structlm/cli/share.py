"""``structlm eval ppl``, ``structlm share analyze | compress | experiment`` and
``structlm bench share``: the shared-basis commands."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..share.compress.ranks import METHODS
from ..share.configs import read_yaml
from .args import ints, layer_list


def _given(raw: dict[str, Any], args: argparse.Namespace, keys: tuple[str, ...]) -> None:
    """Copy into ``raw`` the command-line options among ``keys`` that were given."""
    for key in keys:
        if getattr(args, key) is not None:
            raw[key] = getattr(args, key)


def _cmd_eval_ppl(args: argparse.Namespace) -> int:
    import torch

    from ..share.loading import load_model
    from ..share.perplexity import perplexity
    from ..share.text import (
        sample_windows,
        split_corpus,
        token_stream,
        tokenize_documents,
        windows_for_scored_tokens,
    )

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    split = split_corpus(args.corpus, args.eval_fraction, args.seed)
    docs = {"evaluation": split.evaluation, "calibration": split.calibration,
            "all": split.calibration + split.evaluation}[args.split]
    bos = loaded.tokenizer.bos_token_id if args.bos else None
    if args.bos and bos is None:
        raise ValueError(f"--bos: the tokenizer of {args.model!r} has no BOS token")
    text: dict[str, Any] = {"sampling": args.sampling}
    if args.sampling == "windows" and args.stride is not None:
        raise ValueError("--stride applies to --sampling head (windows are scored whole)")
    if args.sampling == "windows":  # the reports' protocol (share.pipeline.prepare)
        sample = sample_windows(docs, tokenize_documents(loaded.tokenizer, docs),
                                windows_for_scored_tokens(args.tokens, args.window),
                                args.window, args.seed + 1)
        ids = sample.windows
        text = sample.describe()
    else:
        ids = token_stream(loaded.tokenizer, docs, args.tokens)
    res = perplexity(loaded.model, ids, window=args.window, stride=args.stride, bos_id=bos,
                     batch_size=args.batch_size, progress=not args.json)
    out: dict[str, Any] = {"model": loaded.model_id, "corpus": args.corpus, "split": args.split,
                           "documents": [d.name for d in docs], "text": text,
                           **res.as_dict()}
    if loaded.note:
        out["note"] = loaded.note
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{loaded.model_id} on {args.corpus} ({args.split} split, {res.tokens} tokens, "
              f"window {res.window}, stride {res.stride}, bos={res.bos}): "
              f"ppl {res.ppl:.3f} (nll {res.nll:.4f})")
        if loaded.note:
            print(f"note: {loaded.note}")
    return 0


def _cmd_share_analyze(args: argparse.Namespace) -> int:
    import torch

    from ..share.analysis.analyze import AnalysisConfig, run_analysis

    torch.set_num_threads(args.threads)
    raw = read_yaml(args.config)
    raw["model"] = args.model
    _given(raw, args, ("corpus", "second_corpus", "types", "calib_tokens", "eval_tokens",
                       "permutations", "seed", "reference_layer", "layers"))
    cfg = AnalysisConfig.from_dict(raw)
    res = run_analysis(cfg, args.out)
    print((args.out.rstrip("/") + "/report.md") + f" written ({res['seconds']:.0f} s)")
    return 0


def _cmd_share_compress(args: argparse.Namespace) -> int:
    import torch

    from ..share.compress import CompressionConfig
    from ..share.compress.finetune import FinetuneConfig
    from ..share.compress.run import run_compress

    torch.set_num_threads(args.threads)
    raw = read_yaml(args.config)
    ft_raw = raw.pop("finetune", {}) or {}
    _given(raw, args, ("method", "types", "target_reduction", "residual_rank", "k_fraction",
                       "group_size", "update"))
    ccfg = CompressionConfig.from_dict(raw)
    if args.finetune_steps is not None:
        ft_raw["steps"] = args.finetune_steps
    ft = FinetuneConfig(**ft_raw) if ft_raw.get("steps") else None
    res = run_compress(args.model, ccfg, args.out, corpus=args.corpus,
                       second_corpus=args.second_corpus, calib_tokens=args.calib_tokens,
                       eval_tokens=args.eval_tokens, ft=ft, seed=args.seed)
    c = res["compression"]
    print(f"{ccfg.method} on {ccfg.types}: {c['ratio']:.2f}x fewer stored parameters in the "
          f"compressed matrices; ppl " + ", ".join(
              f"{k}: {v['ppl']:.2f} -> {res['ppl_compressed'][k]['ppl']:.2f}"
              for k, v in res["ppl_original"].items()))
    print(f"{args.out.rstrip('/')}/report.md written ({res['seconds']:.0f} s)")
    return 0


def _cmd_share_experiment(args: argparse.Namespace) -> int:
    import torch

    from ..share.compress.experiment import ExperimentConfig, run_experiment

    torch.set_num_threads(args.threads)
    raw = read_yaml(args.config)
    raw["model"] = args.model
    _given(raw, args, ("second_model", "calib_tokens", "eval_tokens", "corpus", "second_corpus"))
    if args.seeds is not None:
        raw["seeds"] = [int(s) for s in args.seeds.split(",")]
    if args.reductions is not None:
        raw["reductions"] = [float(r) for r in args.reductions.split(",")]
    if args.methods is not None:
        raw["methods"] = args.methods.split(",")
    if args.finetune_steps is not None:
        raw.setdefault("finetune", {})["steps"] = args.finetune_steps
    cfg = ExperimentConfig.from_dict(raw)
    res = run_experiment(cfg, args.out, analytic_only=args.analytic_only)
    print(f"{args.out.rstrip('/')}/report.md written ({res['seconds'] / 60:.1f} min)")
    return 0


def _cmd_bench_share(args: argparse.Namespace) -> int:
    from ..bench.share import ShareBenchConfig, run_share_bench

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


def add_share_commands(sub: Any, bench: Any) -> None:
    """Register ``eval`` and ``share`` on the top-level subparsers and ``share`` on
    ``bench``'s."""
    ev = sub.add_parser("eval", help="evaluate pretrained models").add_subparsers(
        dest="eval_command", required=True)
    ppl = ev.add_parser("ppl", help="perplexity under the documented protocol "
                        "(structlm.share.perplexity)")
    ppl.add_argument("model", help="smollm2 (built in), a local folder, or a hub id")
    ppl.add_argument("--corpus", default="austen", help="austen, shakespeare, bible, a path")
    ppl.add_argument("--split", default="evaluation", choices=["evaluation", "calibration", "all"])
    ppl.add_argument("--eval-fraction", type=float, default=0.25,
                     help="documents held out for evaluation")
    ppl.add_argument("--tokens", type=int, default=16384,
                     help="tokens to score (windows: at least this many)")
    ppl.add_argument("--sampling", default="windows", choices=["windows", "head"],
                     help="windows: drawn across all documents (seeded; what every report "
                          "uses); head: the first --tokens tokens in document order")
    ppl.add_argument("--window", type=int, default=512)
    ppl.add_argument("--stride", type=int, default=None,
                     help="new tokens scored per window (default window-1)")
    ppl.add_argument("--bos", action="store_true", help="put BOS in front of every window")
    ppl.add_argument("--batch-size", type=int, default=4)
    ppl.add_argument("--seed", type=int, default=0)
    ppl.add_argument("--threads", type=int, default=2)
    ppl.add_argument("--json", action="store_true", help="one JSON object")
    ppl.set_defaults(func=_cmd_eval_ppl)

    share = sub.add_parser("share", help="shared functional bases (Part B)").add_subparsers(
        dest="share_command", required=True)
    an = share.add_parser("analyze", help="tests 1-3 with null controls + role classifier")
    an.add_argument("model", help="smollm2 (built in), a local folder, or a hub id")
    an.add_argument("--corpus", default=None, help="calibration corpus (default austen)")
    an.add_argument("--second-corpus", default=None,
                    help="different-domain corpus for perplexity (default shakespeare; '' skips)")
    an.add_argument("--config", default=None, help="YAML with AnalysisConfig fields")
    an.add_argument("--layers", type=layer_list, default=None, help="e.g. 0-5 or 0,10,20")
    an.add_argument("--types", default=None, help="all, attn, mlp or q,k,v,o,mlp_in,mlp_out")
    an.add_argument("--calib-tokens", type=int, default=None)
    an.add_argument("--eval-tokens", type=int, default=None, help="0 skips perplexity")
    an.add_argument("--permutations", type=int, default=None)
    an.add_argument("--reference-layer", type=int, default=None)
    an.add_argument("--seed", type=int, default=None)
    an.add_argument("--threads", type=int, default=2)
    an.add_argument("--out", default="share-report")
    an.set_defaults(func=_cmd_share_analyze)

    cp = share.add_parser("compress", help="compress with shared bases or a baseline, "
                          "evaluate, (fine-tune,) save")
    cp.add_argument("model", help="smollm2 (built in), a local folder, or a hub id")
    cp.add_argument("--config", default=None,
                    help="YAML with CompressionConfig fields (+ a 'finetune' mapping)")
    cp.add_argument("--method", default=None, choices=list(METHODS),
                    help="shared (the seed's), hybrid, svd (SVD-LLM), basis-sharing "
                         "(Wang et al. 2024), onesided-all-layers")
    cp.add_argument("--types", default=None, help="attn, mlp, all or q,k,v,o,mlp_in,mlp_out")
    cp.add_argument("--target-reduction", type=float, default=None,
                    help="fraction of the compressed matrices' parameters to remove")
    cp.add_argument("--k-fraction", type=float, default=None, help="k = this × hidden size")
    cp.add_argument("--residual-rank", type=int, default=None, help="hybrid residual rank")
    cp.add_argument("--group-size", type=int, default=None,
                    help="basis-sharing: consecutive layers per basis (default 2)")
    cp.add_argument("--update", action="store_true", default=None,
                    help="basis-sharing: the paper's closed-form coefficient update")
    cp.add_argument("--finetune-steps", type=int, default=None, help="0 = none")
    cp.add_argument("--corpus", default="austen")
    cp.add_argument("--second-corpus", default="shakespeare")
    cp.add_argument("--calib-tokens", type=int, default=32768)
    cp.add_argument("--eval-tokens", type=int, default=16384,
                    help="scored tokens per text, windows across held-out documents")
    cp.add_argument("--seed", type=int, default=0)
    cp.add_argument("--threads", type=int, default=2)
    cp.add_argument("--out", default="share-compressed")
    cp.set_defaults(func=_cmd_share_compress)

    ex = share.add_parser("experiment", help="tests 4-9 end to end (long: hours on 2 cores "
                          "with the defaults; resumes arm by arm)")
    ex.add_argument("model", help="smollm2 (built in), a local folder, or a hub id")
    ex.add_argument("--config", default=None, help="YAML with ExperimentConfig fields")
    ex.add_argument("--second-model", default=None, help="test 8's larger model")
    ex.add_argument("--corpus", default=None)
    ex.add_argument("--second-corpus", default=None)
    ex.add_argument("--calib-tokens", type=int, default=None)
    ex.add_argument("--eval-tokens", type=int, default=None)
    ex.add_argument("--seeds", default=None, help="e.g. 0,1,2")
    ex.add_argument("--reductions", default=None, help="whole-model regime, e.g. 0.2,0.4")
    ex.add_argument("--methods", default=None,
                    help="e.g. shared,hybrid,svd,basis-sharing,onesided-all-layers")
    ex.add_argument("--finetune-steps", type=int, default=None)
    ex.add_argument("--analytic-only", action="store_true",
                    help="stop after compressing and evaluating every arm (no fine-tuning)")
    ex.add_argument("--threads", type=int, default=2)
    ex.add_argument("--out", default="share-experiment")
    ex.set_defaults(func=_cmd_share_experiment)

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
    bsh.add_argument("--batches", type=ints, default=(1, 16), help="e.g. 1,16")
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
