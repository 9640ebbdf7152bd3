"""``structlm eval ppl``, ``structlm share analyze | compress | experiment`` and
``structlm bench share``: the shared-basis commands. Their config flags are derived from
the config dataclasses (:mod:`.dataclass_flags`); a flag overrides the YAML's key."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from structlm.cli.args import MODEL_HELP, fraction, layer_list, positive_int, window
from structlm.cli.dataclass_flags import add_dataclass_flags
from structlm.config import ConfigError, dataclass_from_dict, read_yaml


def model_limits(spec: str) -> tuple[int, int | None]:
    """``(decoder layers, context positions or None)`` of model ``spec`` from its
    architecture only (the weights are neither read nor initialised): what a config is
    checked against before any work starts."""
    from structlm.hf.adapters import get_adapter
    from structlm.hf.loading import load_model, model_context

    model = load_model(spec, weights=False).model
    return get_adapter(model).num_layers, model_context(model)


def _cmd_eval_ppl(args: argparse.Namespace) -> int:
    import sys

    import torch

    from structlm.hf.bos import decide_bos
    from structlm.hf.layer_stream import open_streamed, stream_folder, streamed_perplexity
    from structlm.hf.loading import (
        FOLDER_FORMATS,
        load_architecture,
        load_model,
        model_context,
    )
    from structlm.hf.perplexity import perplexity
    from structlm.hf.text import (
        corpus_documents,
        sample_windows,
        split_corpus,
        token_stream,
        tokenize_documents,
        windows_for_scored_tokens,
    )

    torch.set_num_threads(args.threads)
    streamed = stream_folder(args.model, args.stream)  # refuses --stream on, before work
    if streamed is not None and args.sampling != "windows":
        if args.stream == "on":
            raise ValueError("--stream on scores --sampling windows (layer by layer); "
                             "--sampling head runs the model whole: use --stream off")
        streamed = None
    if streamed is not None and any((streamed / m).is_file() for m in FOLDER_FORMATS):
        loaded = load_architecture(streamed)  # a compressed folder's config and tokenizer
        loaded.model_id = args.model
    else:
        loaded = load_model(args.model, weights=streamed is None)
    context = model_context(loaded.model)
    if context is not None and args.window > context:
        raise ConfigError(f"--window {args.window} is beyond the context of model "
                          f"{args.model!r} ({context} positions)")
    if loaded.tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer files (tokenizer.json, "
                         "tokenizer_config.json, ...): eval ppl tokenises text; save the "
                         "model's tokenizer into the folder")
    if args.sampling == "windows" and args.stride is not None:
        raise ValueError("--stride applies to --sampling head (windows are scored whole)")
    # one BOS decision for every sampling mode: the tokenizer's convention, or the flag
    bos = decide_bos(loaded.tokenizer, args.bos, model=repr(args.model))
    if bos.warning:
        print(f"structlm: warning: {bos.warning}", file=sys.stderr)
    if args.split == "all":  # nothing is split: one document is enough
        docs = corpus_documents(args.corpus)
    else:
        split = split_corpus(args.corpus, args.eval_fraction, args.seed)
        docs = split.evaluation if args.split == "evaluation" else split.calibration
    text: dict[str, Any] = {"sampling": args.sampling}
    if args.sampling == "windows":  # the reports' protocol (hf.pipeline.prepare)
        sample = sample_windows(docs, tokenize_documents(loaded.tokenizer, docs),
                                windows_for_scored_tokens(args.tokens, args.window),
                                args.window, args.seed + 1, prefix=bos.prefix())
        ids, put_in_front = sample.windows, None  # BOS (if any) is each window's first id
        text = sample.describe()
    else:
        ids, put_in_front = token_stream(loaded.tokenizer, docs, args.tokens), bos.bos_id
    if streamed is not None:
        res = streamed_perplexity(open_streamed(streamed), ids, batch_size=args.batch_size,
                                  progress=not args.json,
                                  bos_token=loaded.tokenizer.bos_token_id)
    else:
        res = perplexity(loaded.model, ids, window=args.window, stride=args.stride,
                         bos_id=put_in_front, batch_size=args.batch_size,
                         progress=not args.json, bos_token=loaded.tokenizer.bos_token_id)
    if (res.bos, res.bos_id) != (bos.applied, bos.bos_id):  # the record is read from the ids
        raise RuntimeError(f"the scored windows {'start' if res.bos else 'do not start'} "
                           f"with BOS {res.bos_id}, but the decision was: {bos.reason}")
    out: dict[str, Any] = {"model": loaded.model_id, "corpus": args.corpus, "split": args.split,
                           "documents": [d.name for d in docs], "text": text,
                           "layer_streamed": streamed is not None,
                           **res.as_dict(), "bos_decision": bos.as_dict()}
    if loaded.note:
        out["note"] = loaded.note
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{loaded.model_id} on {args.corpus} ({args.split} split, {res.tokens} tokens, "
              f"window {res.window}, stride {res.stride}, "
              f"bos={res.bos_id if res.bos else 'none'}): "
              f"ppl {res.ppl:.3f} (nll {res.nll:.4f})")
        print(f"  {bos.reason}")
        if loaded.note:
            print(f"note: {loaded.note}")
    return 0


def _cmd_share_analyze(args: argparse.Namespace) -> int:
    import torch

    from structlm.share.analysis.analyze import AnalysisConfig, run_analysis

    torch.set_num_threads(args.threads)
    raw = {**read_yaml(args.config), "model": args.model, **args.flags.values(args)}
    cfg = AnalysisConfig.from_dict(raw)
    cfg.check_model(*model_limits(cfg.model))  # before any work
    res = run_analysis(cfg, args.out)
    for t, r in res["tests"].items():  # test 3's headline: the primary variant's verdict
        f = r.get("functional")
        if f and "skipped" not in f["variants"][f["primary"]]:
            v = f["variants"][f["primary"]]
            m = v["margin"]
            span = (f"m = {m['mean']:.3f}" + (f" [{m['lo']:.3f}, {m['hi']:.3f}]"
                                              if m["n"] > 1 else "") if m else "m = n/a")
            print(f"test 3 {t} ({f['primary']}): {span} over {len(v['margin_per_draw'])} "
                  f"draw{'s' if len(v['margin_per_draw']) > 1 else ''}: {v['verdict']}")
    print((args.out.rstrip("/") + "/report.md") + f" written ({res['seconds']:.0f} s)")
    return 0


def _cmd_share_compress(args: argparse.Namespace) -> int:
    import torch

    from structlm.hf.finetune import FinetuneConfig
    from structlm.share.compress import CompressionConfig
    from structlm.share.compress.run import run_compress

    torch.set_num_threads(args.threads)
    raw = read_yaml(args.config)
    ft_yaml = raw.pop("finetune", None) or {}
    if not isinstance(ft_yaml, dict):
        raise ConfigError(f"{args.config}: finetune: {ft_yaml!r} is not a mapping of "
                          "FinetuneConfig keys")
    ft_raw = {**ft_yaml, **args.ft_flags.values(args)}
    ccfg = CompressionConfig.from_dict({**raw, **args.flags.values(args)},
                                       where=args.config or "")
    bs, hy = args.bs_flags.values(args), args.hybrid_flags.values(args)
    if bs or hy:  # the flags override the YAML's options, field by field
        ccfg = dataclasses.replace(
            ccfg, basis_sharing=dataclasses.replace(ccfg.basis_sharing, **bs),
            hybrid=dataclasses.replace(ccfg.hybrid, **hy))
    ft = dataclass_from_dict(FinetuneConfig, ft_raw, where="finetune") if ft_raw else None
    if ft is not None and not ft_raw.get("steps"):  # no steps given: no fine-tuning
        ft = None
    ccfg.check_model(model_limits(args.model)[0])  # before any work
    res = run_compress(args.model, ccfg, args.out, corpus=args.corpus,
                       second_corpus=args.second_corpus, calib_tokens=args.calib_tokens,
                       eval_tokens=args.eval_tokens, ft=ft, seed=args.seed,
                       stream=args.stream)
    c = res["compression"]
    print(f"{ccfg.method} on {ccfg.types}: {c['ratio']:.2f}x fewer stored parameters in the "
          "compressed matrices")
    for k, v in res["ppl_original"].items():
        line = (f"  perplexity {k} ({v['tokens']} tokens, "
                f"bos={v.get('bos_id') if v.get('bos') else 'none'}): original {v['ppl']:.2f} "
                f"-> compressed {res['ppl_compressed'][k]['ppl']:.2f}")
        if "ppl_finetuned" in res:
            line += f" -> fine-tuned {res['ppl_finetuned'][k]['ppl']:.2f}"
        print(line)
    print(f"{args.out.rstrip('/')}/report.md written ({res['seconds']:.0f} s)")
    return 0


def _cmd_share_self_contain(args: argparse.Namespace) -> int:
    from structlm.share.compress.io import make_self_contained

    for folder in args.folders:
        changed = make_self_contained(folder)
        print(f"{folder}: " + ("now self-contained (config, tokenizer and weights inside; "
                               "the source model is no longer read)" if changed else
                               "already self-contained, nothing to do"))
    return 0


def _cmd_bench_share(args: argparse.Namespace) -> int:
    from structlm.bench.share import ShareBenchConfig, run_share_bench
    from structlm.bench.timing import warn_if_passive_wait

    cfg = dataclass_from_dict(ShareBenchConfig, {"model": args.model,
                                                 **args.flags.values(args)})
    warn_if_passive_wait()
    run_share_bench(cfg, args.out)
    with open(args.out + ".md") as fh:
        print(fh.read())
    print(f"wrote {args.out}.csv, {args.out}.md, {args.out}.png")
    return 0


_YAML_TITLE = "{} fields (a flag given overrides the YAML's key; lists are comma-separated)"


def add_share_commands(sub: Any, bench: Any) -> None:
    """Register ``eval`` and ``share`` on the top-level subparsers and ``share`` on
    ``bench``'s."""
    ev = sub.add_parser("eval", help="evaluate pretrained models").add_subparsers(
        dest="eval_command", required=True)
    ppl = ev.add_parser("ppl", help="perplexity under the documented protocol "
                        "(structlm.hf.perplexity)")
    ppl.add_argument("model", help=MODEL_HELP)
    ppl.add_argument("--corpus", default="austen", help="austen, shakespeare, bible, a path")
    ppl.add_argument("--split", default="evaluation", choices=["evaluation", "calibration", "all"])
    ppl.add_argument("--eval-fraction", type=fraction, default=0.25,
                     help="documents held out for evaluation (> 0 and < 1)")
    ppl.add_argument("--tokens", type=positive_int, default=16384,
                     help="tokens to score (windows: at least this many)")
    ppl.add_argument("--sampling", default="windows", choices=["windows", "head"],
                     help="windows: drawn across all documents (seeded; what every report "
                          "uses); head: the first --tokens tokens in document order")
    ppl.add_argument("--window", type=window, default=512,
                     help="tokens per scored window (>= 2, at most the model's context)")
    ppl.add_argument("--stride", type=positive_int, default=None,
                     help="new tokens scored per window (default window-1)")
    ppl.add_argument("--bos", action=argparse.BooleanOptionalAction, default=None,
                     help="BOS in front of every window, in every sampling mode (default: "
                          "exactly when the model's tokenizer puts BOS before its inputs, "
                          "e.g. Gemma's); --no-bos leaves it out, with a warning where the "
                          "tokenizer puts one")
    ppl.add_argument("--batch-size", type=positive_int, default=4)
    ppl.add_argument("--stream", default="auto", choices=["auto", "on", "off"],
                     help="run the model one decoder layer at a time, its weights read from "
                          "disk per layer (same numbers, memory set by one layer; "
                          "--sampling windows); auto: for stored weights over 2 GiB")
    ppl.add_argument("--seed", type=int, default=0)
    ppl.add_argument("--threads", type=positive_int, default=2)
    ppl.add_argument("--json", action="store_true", help="one JSON object")
    ppl.set_defaults(func=_cmd_eval_ppl)

    share = sub.add_parser("share", help="shared functional bases (Part B)").add_subparsers(
        dest="share_command", required=True)
    from structlm.bench.share import ShareBenchConfig
    from structlm.hf.finetune import FinetuneConfig
    from structlm.share.analysis.analyze import AnalysisConfig
    from structlm.share.compress import CompressionConfig
    from structlm.share.compress.methods import BasisSharingOptions, HybridOptions

    an = share.add_parser("analyze", help="tests 1-3 with null controls + role classifier "
                          "(--tests 3 --calib-seeds 0,1,2: test 3 alone over calibration "
                          "draws)")
    an.add_argument("model", help=MODEL_HELP)
    an.add_argument("--config", default=None, help="YAML with AnalysisConfig fields")
    an.add_argument("--threads", type=positive_int, default=2)
    an.add_argument("--out", default="share-report")
    an.set_defaults(func=_cmd_share_analyze, flags=add_dataclass_flags(
        an, AnalysisConfig, exclude=("model",), parse={"layers": layer_list},
        title=_YAML_TITLE.format("AnalysisConfig")))

    cp = share.add_parser("compress", help="compress with shared bases or a baseline, "
                          "evaluate, (fine-tune,) save")
    cp.add_argument("model", help=MODEL_HELP)
    cp.add_argument("--config", default=None,
                    help="YAML with CompressionConfig fields (+ a 'finetune' mapping)")
    cp.add_argument("--corpus", default="austen", help="calibration and in-domain text")
    cp.add_argument("--second-corpus", default="shakespeare", help="other-domain text")
    cp.add_argument("--calib-tokens", type=positive_int, default=32768)
    cp.add_argument("--eval-tokens", type=positive_int, default=16384,
                    help="scored tokens per text, windows across held-out documents")
    cp.add_argument("--seed", type=int, default=0)
    cp.add_argument("--threads", type=positive_int, default=2)
    cp.add_argument("--stream", default="auto", choices=["auto", "on", "off"],
                    help="calibrate, compress and evaluate one layer (or Basis Sharing "
                         "group) at a time, the weights read from disk per layer: peak "
                         "memory set by one layer, not by depth; no fine-tuning. auto: for "
                         "stored weights over 2 GiB, without fine-tuning, with a method "
                         "that streams (svd-llm-w, basis-sharing without update)")
    cp.add_argument("--out", default="share-compressed")
    cp.set_defaults(func=_cmd_share_compress,
                    flags=add_dataclass_flags(cp, CompressionConfig,
                                              title=_YAML_TITLE.format("CompressionConfig")),
                    bs_flags=add_dataclass_flags(
                        cp, BasisSharingOptions, title="basis-sharing options (YAML: under "
                        "basis_sharing)"),
                    hybrid_flags=add_dataclass_flags(
                        cp, HybridOptions, title="hybrid options (YAML: under hybrid)"),
                    ft_flags=add_dataclass_flags(
                        cp, FinetuneConfig, prefix="finetune",
                        title="FinetuneConfig fields (--finetune-steps 0 = no fine-tuning)"))

    sc = share.add_parser("self-contain", help="make compressed folders written by an "
                          "earlier structlm self-contained (copy the source's config and "
                          "tokenizer in)")
    sc.add_argument("folders", nargs="+", help="compressed model folders (run where they were "
                    "written: their source model is read once)")
    sc.set_defaults(func=_cmd_share_self_contain)

    bsh = bench.add_parser("share", help="memory and CPU latency (prefill, cached decode) of "
                           "a compressed model vs the original")
    bsh.add_argument("model", nargs="?", default="smollm2",
                     help="model to compress on the fly (ignored with --compressed)")
    bsh.add_argument("--out", default="bench-out/share", help="output prefix")
    bsh.set_defaults(func=_cmd_bench_share,
                     flags=add_dataclass_flags(bsh, ShareBenchConfig, exclude=("model",)))
