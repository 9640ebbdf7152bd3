"""Peak resident memory of ``structlm share compress`` against model depth.

Usage::

    python benchmarks/share_memory_vs_depth.py --depths 4,8,16,24 \\
        --out benchmarks/results/share_memory_vs_depth

For each depth, a random LLaMA of width ``--width`` (FFN 2.75×, 16 query / 4 KV heads,
SmolLM2's tokenizer and vocabulary) is saved to a temporary folder and compressed by one
``structlm share compress`` process (``--method svd-llm-w --types all
--target-reduction 0.2``, ``--calib-tokens`` calibration tokens of Austen, a small
evaluation), run under ``/usr/bin/time -v``: its peak resident set ("Maximum resident set
size") and wall time are recorded beside the model's float32 weight bytes. A pipeline
whose peak is set by one layer gives a flat curve; one that holds the model several times
over grows with depth. Writes ``<out>.csv`` (with the environment), ``<out>.md`` and
``<out>.png`` (drawn from the CSV).
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIELDS = ["depth", "width", "parameters", "weights_gib", "peak_rss_gib", "peak_over_weights",
          "seconds", "exit", "calib_tokens", "cpu", "torch", "transformers", "date"]


def _model(folder: Path, depth: int, width: int) -> int:
    """A random LLaMA of ``depth`` layers saved with SmolLM2's tokenizer; its parameters."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from structlm.hf.loading import load_model

    tok = load_model("smollm2", weights=False).tokenizer
    torch.manual_seed(depth)
    cfg = LlamaConfig(num_hidden_layers=depth, hidden_size=width,
                      intermediate_size=int(width * 2.75), num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=len(tok),
                      max_position_embeddings=2048, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _peak_kib(stderr: str) -> int | None:
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    return int(m.group(1)) if m else None


def measure(depth: int, width: int, calib_tokens: int, threads: int, work: Path) -> dict:
    """One depth: build, compress under ``/usr/bin/time -v``, read the peak."""
    import torch
    import transformers

    from structlm.bench.timing import _cpu_model

    folder = work / f"llama-{depth}"
    params = _model(folder, depth, width)
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "structlm.cli", "share", "compress",
           str(folder), "--method", "svd-llm-w", "--types", "all", "--target-reduction",
           "0.2", "--calib-tokens", str(calib_tokens), "--eval-tokens", "1024",
           "--second-corpus", "", "--threads", str(threads), "--out", str(work / f"c-{depth}")]
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    seconds = time.perf_counter() - t0
    peak = _peak_kib(run.stderr)
    weights = params * 4 / 2**30
    rss = peak * 1024 / 2**30 if peak is not None else float("nan")
    if run.returncode != 0:
        print(run.stderr[-2000:], file=sys.stderr)
    return {"depth": depth, "width": width, "parameters": params,
            "weights_gib": round(weights, 3), "peak_rss_gib": round(rss, 3),
            "peak_over_weights": round(rss / weights, 2), "seconds": round(seconds, 1),
            "exit": run.returncode, "calib_tokens": calib_tokens, "cpu": _cpu_model(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def write(rows: list[dict], out: Path) -> None:
    """``out.csv``, ``out.md`` and ``out.png`` (from the CSV)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    rows = list(csv.DictReader(open(out.with_suffix(".csv"))))
    lines = ["# Peak memory of `share compress` against depth", "",
             f"`python benchmarks/share_memory_vs_depth.py --depths "
             f"{','.join(r['depth'] for r in rows)} --out {out}` ({rows[0]['cpu']}, python "
             f"{platform.python_version()}, torch {rows[0]['torch']}, transformers "
             f"{rows[0]['transformers']}, {rows[0]['date']}). A random LLaMA of width "
             f"{rows[0]['width']}, `--method svd-llm-w --types all --target-reduction 0.2`, "
             f"{rows[0]['calib_tokens']} calibration tokens; peak resident set of the one "
             "process by `/usr/bin/time -v`.", "",
             "| layers | parameters | float32 weights (GiB) | peak RSS (GiB) | peak / weights "
             "| seconds | exit |", "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['depth']} | {int(r['parameters']):,} | {r['weights_gib']} | "
              f"{r['peak_rss_gib']} | {r['peak_over_weights']}× | {r['seconds']} | "
              f"{r['exit']} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        from structlm.plotting import pyplot, save_figure
    except ImportError:
        return
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    d = [int(r["depth"]) for r in rows]
    ax.plot(d, [float(r["peak_rss_gib"]) for r in rows], "o-", label="peak RSS")
    ax.plot(d, [float(r["weights_gib"]) for r in rows], "s--", label="float32 weights")
    ax.set_xlabel("decoder layers")
    ax.set_ylabel("GiB")
    ax.set_title(f"share compress, random LLaMA width {rows[0]['width']}")
    ax.legend()
    save_figure(fig, out.with_suffix(".png"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="4,8,16,24",
                    type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True, help="output prefix")
    args = ap.parse_args(argv)
    if any(d < 1 for d in args.depths) or args.width % 16:
        ap.error("--depths must be >= 1 and --width a multiple of 16")
    rows = []
    with tempfile.TemporaryDirectory(prefix="mem-depth-") as tmp:
        for depth in args.depths:
            row = measure(depth, args.width, args.calib_tokens, args.threads, Path(tmp))
            print(row, flush=True)
            rows.append(row)
            write(rows, args.out)  # after each depth: an interrupted sweep keeps its rows
    print(f"{args.out.with_suffix('.md')} written")
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
