"""A Hugging Face model's decode: ``torch.compile`` against the fused decode step.

``python benchmarks/decode_compiled_vs_fused.py [--model smollm2] [--max-new-tokens 128]
[--runs 4] [--out benchmarks/results/decode_compiled_vs_fused]``

Three arms on the same model, prompt and greedy decoding: ``transformers``' ``generate``
eager, ``generate`` with a static cache and ``model.forward`` compiled by
``torch.compile`` (inductor on the CPU; the first call's time, compilation included, is
reported apart), and :class:`structlm.hf.fused_decode.FusedDecoder`. Checks that every
arm's tokens equal eager's, then times ``runs`` interleaved rounds (order alternating),
medians of new tokens per second (prefill included in every arm). Writes CSV (with the
environment) and a Markdown table drawn from it.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

import torch

from structlm.bench.timing import environment, write_csv_atomic
from structlm.hf.fused_decode import FusedDecoder
from structlm.hf.loading import load_model

PROMPT = "Write a short function that returns the sum of a list of numbers."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench-out/decode_compiled_vs_fused")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1 or args.runs < 1 or args.threads < 1:
        ap.error("--max-new-tokens, --runs and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    if loaded.tokenizer is None:
        ap.error(f"model {args.model!r} has no tokenizer")
    model, n = loaded.model.eval(), args.max_new_tokens
    ids = loaded.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    kw = dict(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    fused = FusedDecoder(model)
    rows = []
    with torch.no_grad():
        reference = model.generate(ids, **kw)
        eager_forward = model.forward
        compiled_forward = torch.compile(model.forward)
        t0 = time.perf_counter()
        model.forward = compiled_forward
        compiled_first = model.generate(ids, cache_implementation="static", **kw)
        first_s = time.perf_counter() - t0
        model.forward = eager_forward

        def eager() -> torch.Tensor:
            return model.generate(ids, **kw)

        def compiled() -> torch.Tensor:
            model.forward = compiled_forward
            try:
                return model.generate(ids, cache_implementation="static", **kw)
            finally:
                model.forward = eager_forward

        def fused_step() -> torch.Tensor:
            return fused.generate(ids, max_new_tokens=n, eos_token_id=None)

        arms = {"hf generate (eager)": eager, "hf generate, static cache, torch.compile":
                compiled, "fused step": fused_step}
        equal = {name: bool(torch.equal(f(), reference)) for name, f in arms.items()}
        equal["hf generate, static cache, torch.compile"] &= bool(
            torch.equal(compiled_first, reference))
        times: dict[str, list[float]] = {name: [] for name in arms}
        for r in range(args.runs):
            order = list(arms) if r % 2 == 0 else list(arms)[::-1]
            for name in order:
                t0 = time.perf_counter()
                arms[name]()
                times[name].append(time.perf_counter() - t0)
    env = environment()
    for name, ts in times.items():
        rows.append({"arm": name, "model": args.model, "new_tokens": n, "runs": args.runs,
                     "tokens_per_s": round(n / statistics.median(ts), 2),
                     "per_run_tokens_per_s": ";".join(f"{n / t:.2f}" for t in ts),
                     "tokens_equal_eager": equal[name],
                     "first_call_s": round(first_s, 1) if "compile" in name else "",
                     **{f"env_{k}": v for k, v in env.items()}})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(str(out) + ".csv", rows)
    (out.with_suffix(".md")).write_text(markdown_from_csv(str(out) + ".csv"))
    print((out.with_suffix(".md")).read_text())
    return 0


def markdown_from_csv(path: str) -> str:
    """The Markdown table of a run's CSV."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    env = {k[4:]: v for k, v in rows[0].items() if k.startswith("env_")}
    lines = [f"Environment: {env}", "",
             f"{rows[0]['model']}, greedy, {rows[0]['new_tokens']} new tokens, batch 1, "
             f"medians of {rows[0]['runs']} interleaved runs (prefill included).", "",
             "| arm | tokens/s | per run | tokens equal eager's | first call (compile) |",
             "|---|---:|---|---|---:|"]
    for r in rows:
        first = f"{r['first_call_s']} s" if r["first_call_s"] else "—"
        lines.append(f"| {r['arm']} | {r['tokens_per_s']} | {r['per_run_tokens_per_s']} | "
                     f"{r['tokens_equal_eager']} | {first} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
