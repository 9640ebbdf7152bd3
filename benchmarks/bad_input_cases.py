"""The bad-input sweep's cases: one bad input each, across every command.

A case is the command line, a piece of text its error must contain (the flag, key or
value at fault, or what is wrong: else it is *unclear*), and the fixtures whose content
must be unchanged afterwards (else work was *lost*). Every case fails before heavy work.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    """One bad input."""

    argv: tuple[str, ...]
    expect: str = ""
    protect: tuple[str, ...] = ()


def c(*argv: str, expect: str = "", protect: tuple[str, ...] = ()) -> Case:
    return Case(tuple(argv), expect, protect)


def _lost_work(f: dict[str, str]) -> list[Case]:
    """Outputs over inputs, damaged or foreign checkpoints, folders another writer holds."""
    m, cf = f["ctx64"], ("--corpus", f["texts"])
    over = "overlaps the input"
    cases = [
        c("share", "compress", m, "--out", m, *cf, expect=over, protect=("ctx64",)),
        c("share", "compress", m, "--out", m + "/sub", *cf, expect=over, protect=("ctx64",)),
        c("share", "compress", m, "--out", f["models"], *cf, expect=over, protect=("ctx64",)),
        c("share", "compress", m, "--out", f["afile"], *cf, expect="is a file",
          protect=("afile",)),
        c("share", "compress", m, "--out", f["locked"], *cf, expect="another process",
          protect=("locked",)),
        c("share", "compress", f["selfref"], "--out", f["locked"] + "-2", expect="names itself",
          protect=("selfref",)),
        c("share", "analyze", m, "--out", m, *cf, "--seq-len", "32", expect=over,
          protect=("ctx64",)),
        c("share", "analyze", m, "--out", f["locked"], *cf, "--seq-len", "32",
          expect="another process", protect=("locked",)),
        c("convert", m, "--algebra", "Q2^2", "--targets", "mlp", "--out", m, *cf, expect=over,
          protect=("ctx64",)),
        c("convert", m, "--algebra", "Q2^2", "--targets", "mlp", "--out", m + "/x", *cf,
          expect=over, protect=("ctx64",)),
        c("convert", m, "--algebra", "Q2^2", "--targets", "mlp", "--out", f["models"], *cf,
          expect=over, protect=("ctx64",)),
        c("convert", m, "--algebra", "Q2^2", "--targets", "mlp", "--out", f["afile"], *cf,
          expect="afile", protect=("afile",)),
        c("experiment", "share", m, "--out", m, expect=over, protect=("ctx64",)),
        c("experiment", "share", m, "--out", f["locked"], "--budget-tolerance", "0.2",
          expect="another process", protect=("locked",)),  # (the tiny budgets then pass)
        c("experiment", "share", m, "--out", f["afile"], expect="is a file",
          protect=("afile",)),
        c("experiment", "convert", m, "--out", m + "/x", expect=over, protect=("ctx64",)),
        c("experiment", "convert", m, "--out", f["locked"], "--mac-tolerance", "0.5",
          expect="another process", protect=("locked",)),
        c("experiment", "convert", m, "--out", f["afile"], expect="is a file",
          protect=("afile",)),
        c("experiment", "study", f["study_out_file"], expect="afile", protect=("afile",)),
        c("train", f["train_out_file"], expect="afile", protect=("afile",)),
        c("train", f["yaml_base"], "--out-dir", f["locked"], expect="another process",
          protect=("locked",)),
        c("train", f["yaml_data_changed"], expect="--restart",
          protect=("run_data_changed",)),
        c("train", f["yaml_edited"], expect="built from other input", protect=("run_edited",)),
        c("train", f["yaml_no_config"], expect="different config (lr:",
          protect=("run_no_config",)),
    ]
    named = {"garbage_marker": "COMPLETE holds 'zz'", "empty_marker": "COMPLETE holds ''",
             "state_missing": "state.pt is missing", "model_truncated": "model.safetensors is",
             "state_truncated": "state.pt is"}
    cases += [c("train", f[f"yaml_{k}"], expect=v, protect=(f"run_{k}",))
              for k, v in named.items()]
    return cases


def _train(f: dict[str, str]) -> list[Case]:
    cases = [c("train", f[k], expect=k.split("_", 1)[1].rsplit("_", 1)[0])
             for k in sorted(f) if k.startswith("train_") and k not in (
                 "train_out_file", "train_duplicate_key")]
    cases += [c("train", f[k], expect=k.split("_", 1)[1].rsplit("_", 1)[0])
              for k in sorted(f) if k.startswith("override_")]
    y = f["yaml_base"]
    cases += [
        c("train", f["train_duplicate_key"], expect="duplicate key"),
        c("train", y, "--threads", "0", expect="--threads"),
        c("train", y, "--threads", "-1", expect="--threads"),
        c("train", y, "--lr", "inf", expect="--lr"),
        c("train", y, "--lr=-1e-3", expect="--lr"),
        c("train", y, "--grad-clip", "-1", expect="--grad-clip"),
        c("train", y, "--warmup-steps", "-5", expect="--warmup-steps"),
        c("train", y, "--min-lr-ratio", "5", expect="--min-lr-ratio"),
        c("train", y, "--seq-len", "100000", expect="seq_len"),
        c("train", y, "--val-fraction", "0", expect="--val-fraction"),
        c("train", y, "--batch-size", "0", expect="--batch-size"),
        c("train", y, "--parallel", "mpi", expect="--parallel"),
        c("train", y, "--out-dir", f["afile"], expect="afile", protect=("afile",)),
        c("train", y, "--tokenizer", "bpe:1", expect="bpe:1"),
        c("train", y, "--corpus", f["afile"] + "-nope", expect="nope"),
        c("train", y, "--heldout", f["afile"] + "-nope", expect="nope"),
        c("train", y, "--preset", "paper-110m", "--seq-len", "4096", expect="seq_len"),
    ]
    return cases


def _generate(f: dict[str, str]) -> list[Case]:
    g = ("generate", "--prompt", "hi")
    return [
        c(*g, "--threads", "0", expect="--threads"),
        c(*g, "--top-k", "0", expect="--top-k"),
        c(*g, "--temperature", "nan", expect="temperature"),
        c(*g, "--model", f["notok"], expect="no tokenizer files"),
        c(*g, "--model", f["nan"], expect="non-finite weights"),
        c(*g, "--model", f["missing_tensor"], expect="lacks 1 tensors"),
        c(*g, "--model", f["relabelled"], expect="does not describe the saved weights"),
        c(*g, "--model", f["afile"], expect="no saved model there"),
        c(*g, "--model", f["ctx64"], "--max-new-tokens", "100", expect="context of 64"),
        c(*g, "--algebra", "Q7", expect="Q7"),
        c(*g, "--preset", "nope", expect="nope"),
        c("generate", "--prompt", "hi", "--prompt", "", expect="must not be empty"),
    ]


def _eval(f: dict[str, str]) -> list[Case]:
    e = ("eval", "ppl", f["ctx64"])
    return [
        c(*e, "--window", "100", expect="--window 100"),
        c(*e, "--window", "1", expect="--window"),
        c(*e, "--batch-size", "-1", expect="--batch-size"),
        c(*e, "--batch-size", "0", expect="--batch-size"),
        c(*e, "--tokens", "0", expect="--tokens"),
        c(*e, "--threads", "0", expect="--threads"),
        c(*e, "--eval-fraction", "0", expect="--eval-fraction"),
        c(*e, "--eval-fraction", "1", expect="--eval-fraction"),
        c(*e, "--stride", "0", expect="--stride"),
        c(*e, "--window", "32", "--stride", "8", expect="--stride"),
        c(*e, "--split", "train", expect="--split"),
        c(*e, "--sampling", "random", expect="--sampling"),
        c(*e, "--window", "32", "--corpus", "nope-corpus", expect="nope-corpus"),
        c("eval", "ppl", f["notok"], "--window", "32", expect="no tokenizer files"),
        c("eval", "ppl", f["missing_tensor"], "--window", "32", expect="lacks"),
        c("eval", "ppl", f["afile"] + "-nope", expect="nope"),
        *[c(*e, "--window", "32", "--split", "all", "--corpus", f[f"jsonl_{k}"],
            expect=f"jsonl_{k}.jsonl, line 2: {v}")
          for k, v in (("numeric", "field 'text'"), ("array", "expected a JSON object"),
                       ("broken", "not valid JSON"), ("prompt_number", "field 'prompt'"))],
    ]


def _share(f: dict[str, str]) -> list[Case]:
    a, cp = ("share", "analyze", "smollm2"), ("share", "compress", "smollm2")
    an = ("share", "analyze", f["ctx64"], "--corpus", f["texts"])
    cases = [c(*a, "--config", f[k], expect=k.split("_", 1)[1].rsplit("_", 1)[0])
             for k in sorted(f) if k.startswith("analyze_") and k != "analyze_duplicate_key"]
    cases += [
        c(*a, "--config", f["analyze_duplicate_key"], expect="duplicate key"),
        c(*a, "--energy", "0", expect="--energy"), c(*a, "--energy", "1.5", expect="--energy"),
        c(*a, "--permutations", "0", expect="--permutations"),
        c(*a, "--batch-size", "0", expect="--batch-size"),
        c(*a, "--eig-floor", "-1", expect="--eig-floor"),
        c(*a, "--eval-fraction", "0", expect="--eval-fraction"),
        c(*a, "--seq-len", "100000", expect="seq_len"),
        c(*a, "--threads", "0", expect="--threads"),
        c(*a, "--types", "bogus", expect="bogus"),
        c(*a, "--layers", "99", expect="99"),
        c(*a, "--layers", "0,1,99", expect="99"),
        c(*a, "--k-fraction", "0", expect="--k-fraction"),
        c(*a, "--calib-tokens", "0", expect="--calib-tokens"),
        c(*a, "--reference-layer", "-1", expect="reference"),
        c(*an, "--seq-len", "100", expect="seq_len"),
        c("share", "analyze", f["gpt2r"], "--seq-len", "32", expect="tokenizer"),
        c("share", "analyze", f["notok"], "--seq-len", "32", expect="tokenizer"),
        c(*cp, "--group-size", "0", expect="--group-size"),
        c("share", "compress", f["ctx64"], "--group-size", "100", "--corpus", f["texts"],
          "--out", f["locked"] + "-g", expect="group"),
        c(*cp, "--finetune-steps", "-1", expect="--finetune-steps"),
        c(*cp, "--finetune-warmup", "-3", expect="--finetune-warmup"),
        c(*cp, "--finetune-batch-size", "0", expect="--finetune-batch-size"),
        c(*cp, "--finetune-seq-len", "0", expect="--finetune-seq-len"),
        c(*cp, "--finetune-lr", "nan", expect="--finetune-lr"),
        c(*cp, "--finetune-grad-clip", "-1", expect="--finetune-grad-clip"),
        c(*cp, "--eig-floor", "-1", expect="--eig-floor"),
        c(*cp, "--target-reduction", "1.5", expect="--target-reduction"),
        c(*cp, "--target-reduction", "0", expect="--target-reduction"),
        c(*cp, "--k-fraction", "2", expect="--k-fraction"),
        c(*cp, "--types", "", expect="types"),
        c(*cp, "--calib-tokens", "-5", expect="--calib-tokens"),
        c(*cp, "--threads", "-1", expect="--threads"),
        c(*cp, "--config", f["compress_finetune_list"], expect="finetune"),
        c(*cp, "--config", f["compress_finetune_bad"], expect="steps"),
        c(*cp, "--config", f["compress_method_bad"], expect="bogus"),
        c("share", "compress", f["notok"], "--out", f["locked"] + "-n", expect="tokenizer"),
        c("share", "compress", f["afile"] + "-nope", "--out", f["locked"] + "-m",
          expect="nope"),
    ]
    return cases


def _convert(f: dict[str, str]) -> list[Case]:
    cv = ("convert", "smollm2", "--out", f["locked"] + "-c")
    x = ("experiment", "convert", "smollm2", "--out", f["locked"] + "-x")
    return [
        c(*cv, "--algebra", "Q7", expect="Q7"), c(*cv, "--targets", "", expect="targets"),
        c(*cv, "--targets", "bogus", expect="bogus"),
        c(*cv, "--schedule", "weird", expect="weird"),
        c(*cv, "--heal-lr", "nan", expect="--heal-lr"),
        c(*cv, "--heal-steps", "-1", expect="--heal-steps"),
        c(*cv, "--heal-batch-size", "0", expect="--heal-batch-size"),
        c(*cv, "--heal-grad-clip", "1e-12", expect="--heal-grad-clip"),
        c(*cv, "--eval-tokens", "-1", expect="--eval-tokens"),
        c(*cv, "--init", "zeros", expect="--init"),
        c(*cv, "--calib-tokens", "100", expect="--calib-tokens"),
        c(*cv, "--distill-steps", "-1", expect="--distill-steps"),
        c(*cv, "--permute", "--targets", "attn", expect="groups"),
        c(*cv, "--groups", "heads", "--targets", "mlp", expect="groups"),
        c(*cv, "--groups", "rows", expect="--groups"),
        c(*cv, "--threads", "0", expect="--threads"),
        c("convert", f["notok"], "--out", f["locked"] + "-c", "--eval-tokens", "100",
          expect="tokenizer"),  # text is used: a tokenizer is needed (without: converted)
        c("convert", f["gpt2r"], "--out", f["locked"] + "-c", "--targets", "mlp",
          "--init", "calibrated", expect="gpt2r' has no tokenizer"),  # calibration: text
        c(*x, "--seeds", "0,0", expect="--seeds"),
        c(*x, "--algebras", "Q2^2,Q2^2", expect="--algebras"),
        c(*x, "--targets", "", expect="targets"),
        c(*x, "--targets", "mlp,mlp", expect="--targets"),
        c(*x, "--baselines", "prune", "--targets", "attn", expect="prune"),
        c(*x, "--baselines", "bogus", expect="bogus"),
        c(*x, "--mac-tolerance", "-1", expect="--mac-tolerance"),
        c(*x, "--heal-lr", "nan", expect="--heal-lr"),
        c(*x, "--heal-steps", "-1", expect="--heal-steps"),
        c(*x, "--algebras", "Q7", expect="Q7"),
        c(*x, "--algebras", "Q2^2,Q0", expect="Q0"),
        c(*x, "--schedule", "weird", expect="weird"),
        c(*x, "--calib-tokens", "0", expect="--calib-tokens"),
        c(*x, "--variants", "calibrated+bogus", expect="calibrated+bogus"),
        c(*x, "--variants", "calibrated+distill", expect="distill"),
        c(*x, "--seed-variants", "calibrated", expect="seed_variants"),
        c(*x, "--attn-algebras", "Q8", expect="attn_algebras"),
        c(*x, "--plateau-change", "2", expect="--plateau-change"),
        c(*x, "--threads", "0", expect="--threads"),
        c(*x, "--config", f["missing"], expect="missing.yaml"),
    ]


def _experiments(f: dict[str, str]) -> list[Case]:
    s = ("experiment", "share", "smollm2", "--out", f["locked"] + "-s")
    return [
        c(*s, "--seeds", "0,0", expect="--seeds"),
        c(*s, "--reductions", "0.4,0.4", expect="--reductions"),
        c(*s, "--methods", "", expect="methods"),
        c(*s, "--methods", "bogus", expect="bogus"),
        c(*s, "--scope-reduction", "1.5", expect="--scope-reduction"),
        c(*s, "--types", "bogus", expect="bogus"),
        c(*s, "--budget-tolerance", "-1", expect="--budget-tolerance"),
        c(*s, "--finetune-steps", "-1", expect="--finetune-steps"),
        c(*s, "--finetune-lr", "inf", expect="--finetune-lr"),
        c(*s, "--group-size", "0", expect="--group-size"),
        c(*s, "--group-size", "2.5", expect="--group-size"),
        c(*s, "--residual-rank", "-1", expect="--residual-rank"),
        c(*s, "--calib-tokens", "0", expect="--calib-tokens"),
        c(*s, "--eval-tokens", "0", expect="--eval-tokens"),
        c(*s, "--threads", "0", expect="--threads"),
        c(*s, "--calib-seeds", "0,0", expect="--calib-seeds"),
        c(*s, "--finetune-methods", "hybrid", "--methods", "svd-llm-w",
          expect="finetune_methods"),
        c("experiment", "transfer", "--analysis", f["locked"] + "-nope", f["locked"],
          "--experiment", f["locked"], f["locked"], "--out", f["locked"] + "-t",
          expect="results.json does not exist"),
        c("experiment", "study", f["study_no_arms"], expect="arms"),
        c("experiment", "study", f["study_bad_arm"], expect="Q7"),
        c("experiment", "study", f["study_arm_field"], expect="lr"),
        c("experiment", "study", f["study_no_arms"], "--threads", "0", expect="--threads"),
        # lengths beyond the model's context (64 positions): refused before any work
        c("convert", f["ctx64"], "--out", f["locked"] + "-h", "--corpus", f["texts"],
          "--heal-steps", "1", "--heal-seq-len", "1000", expect="--heal-seq-len"),
        c("share", "compress", f["ctx64"], "--out", f["locked"] + "-w", "--corpus",
          f["texts"], expect="longer than the context"),
        # budgets a tiny model's ranks cannot meet: refused before any calibration
        c("experiment", "share", f["ctx64"], "--out", f["locked"] + "-b", "--methods",
          "svd-llm-w", "--reductions", "0.4", "--types", "attn", expect="cannot be met"),
        c("experiment", "convert", f["ctx64"], "--out", f["locked"] + "-c", "--algebras",
          "graph:4:0-1", "--targets", "attn", expect="cannot meet their MAC budget"),
        c("experiment", "demo", "--steps", "0", expect="--steps"),
        c("experiment", "demo", "--algebra", "Q7", expect="Q7"),
        c("demo", "--steps", "-3", expect="--steps"),
    ]


def _bench_and_more(f: dict[str, str]) -> list[Case]:
    bg = ("bench", "generate", "--out", f["locked"] + "-b")
    return [
        c(*bg, "--dense-model", f["q22_s"], "--algebra-model", f["dense_s"],
          expect="swapped"),
        c(*bg, "--dense-model", f["dense_s"], expect="come together"),
        c(*bg, "--dense-model", f["dense_s"], "--algebra-model", f["q22_s"], "--tokenizer",
          f["afile"] + "-nope", expect="nope"),
        c(*bg, "--tokenizer", "/nonexistent", expect="/nonexistent"),
        c(*bg, "--dense-model", f["dense_s"], "--algebra-model", f["nan"],
          expect="non-finite"),
        c(*bg, "--max-new-tokens", "0", expect="--max-new-tokens"),
        c(*bg, "--threads", "0", expect="--threads"),
        c(*bg, "--algebra", "Q7", expect="Q7"),
        c(*bg, "--model", "smollm2", "--targets", "bogus", expect="bogus"),
        c(*bg, "--modes", "fixed,fixed", expect="modes"),
        c("bench", "layer", "--trials", "0", expect="--trials"),
        c("bench", "layer", "--threads", "0", expect="--threads"),
        c("bench", "layer", "--algebras", "Q7", expect="Q7"),
        c("bench", "layer", "--ms", "0", expect="--ms"),
        c("bench", "layer", "--preset", "nope", expect="nope"),
        c("bench", "train", "--trials", "0", expect="--trials"),
        c("bench", "train", "--batch-size", "0", expect="--batch-size"),
        c("bench", "train", "--algebra", "Q7", expect="Q7"),
        c("bench", "train", "--threads", "-1", expect="--threads"),
        c("bench", "share", "--trials", "0", expect="--trials"),
        c("bench", "share", "--threads", "0", expect="--threads"),
        c("bench", "share", "--target-reduction", "2", expect="--target-reduction"),
        c("bench", "share", f["notok"], expect="tokenizer"),
        c("routes", "smollm2", "--batch", "0", expect="--batch"),
        c("routes", "smollm2", "--tokens", "0", expect="--tokens"),
        c("routes", "smollm2", "--threads", "0", expect="--threads"),
        c("routes", "smollm2", "--convert", "Q7", expect="Q7"),
        c("routes", "smollm2", "--convert", "Q2^2", "--targets", "bogus", expect="bogus"),
        c("routes", f["afile"] + "-nope", expect="nope"),
        c("routes", f["missing_tensor"], expect="lacks"),
        c("cost", "--schedule", "bogus", expect="bogus"),
        c("cost", "--algebra", "", expect="algebra"),
        c("algebra", "info", "graph:100000:0-1", expect="100,000"),
        c("algebra", "info", "graph:0:", expect="graph"),
        c("algebra", "info", "Q0", expect="Q0"),
        c("algebra", "info", "Q2^0", expect="Q2^0"),
    ]


def new_cases(f: dict[str, str]) -> list[Case]:
    """Every case beyond the original 50 (``bad_input_sweep._cases``)."""
    return [*_lost_work(f), *_train(f), *_generate(f), *_eval(f), *_share(f), *_convert(f),
            *_experiments(f), *_bench_and_more(f)]
