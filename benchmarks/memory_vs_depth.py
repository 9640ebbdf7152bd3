"""Peak resident memory of structlm commands against model depth.

Usage::

    python benchmarks/memory_vs_depth.py --depths 4,8,16,32 \\
        --commands eval-ppl-whole,eval-ppl-streamed --out benchmarks/results/memory_vs_depth/ppl
    python benchmarks/memory_vs_depth.py --redraw --out PREFIX   # md and png from PREFIX.csv

For each depth, a random LLaMA of width ``--width`` (FFN 2.75×, 16 query / 4 KV heads,
SmolLM2's tokenizer and vocabulary) is saved to a temporary folder and each command runs
on it in its own process under ``/usr/bin/time -v``: its peak resident set ("Maximum
resident set size") and wall time are recorded beside the model's float32 weight bytes.
The commands (:data:`COMMANDS`):

* ``share-compress`` / ``share-compress-streamed``: ``share compress --method svd-llm-w
  --types all --target-reduction 0.2``, ``--calib-tokens`` calibration tokens of Austen,
  a small evaluation, with ``--stream off`` / ``--stream on``;
* ``eval-ppl-whole`` / ``eval-ppl-streamed``: ``eval ppl`` on ``--eval-tokens`` tokens of
  Austen with ``--stream off`` / ``--stream on`` (the model whole, or one decoder layer
  at a time: :mod:`structlm.hf.layer_stream`).

A pipeline whose peak is set by one layer gives a flat curve; one that holds the model
grows with depth. Writes ``<out>.csv`` (with the environment), ``<out>.md`` and
``<out>.png`` (drawn from the CSV).
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIELDS = ["command", "depth", "width", "parameters", "weights_gib", "peak_rss_gib",
          "peak_over_weights",
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


def _parameters(folder: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with __import__("torch").device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return sum(p.numel() for p in model.parameters())


def _peak_kib(stderr: str) -> int | None:
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    return int(m.group(1)) if m else None


def _arguments(command: str, folder: Path, out: Path, calib_tokens: int, eval_tokens: int,
               threads: int) -> list[str]:
    """The structlm command line of ``command`` on the model in ``folder``."""
    if command.startswith("share-compress"):
        stream = "on" if command.endswith("-streamed") else "off"
        return ["share", "compress", str(folder), "--method", "svd-llm-w", "--types", "all",
                "--target-reduction", "0.2", "--calib-tokens", str(calib_tokens),
                "--eval-tokens", "1024", "--second-corpus", "", "--threads", str(threads),
                "--stream", stream, "--out", str(out)]
    stream = {"eval-ppl-whole": "off", "eval-ppl-streamed": "on"}[command]
    return ["eval", "ppl", str(folder), "--corpus", "austen", "--tokens", str(eval_tokens),
            "--stream", stream, "--threads", str(threads), "--json"]


COMMANDS = ("share-compress", "share-compress-streamed", "eval-ppl-whole",
            "eval-ppl-streamed")


def measure(command: str, depth: int, width: int, calib_tokens: int, eval_tokens: int,
            threads: int, work: Path) -> dict:
    """One command at one depth under ``/usr/bin/time -v``: its peak and time."""
    import torch
    import transformers

    from structlm.bench.timing import _cpu_model

    folder = work / f"llama-{depth}"
    params = _model(folder, depth, width) if not folder.exists() else _parameters(folder)
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "structlm.cli",
           *_arguments(command, folder, work / f"{command}-{depth}", calib_tokens,
                       eval_tokens, threads)]
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    seconds = time.perf_counter() - t0
    peak = _peak_kib(run.stderr)
    weights = params * 4 / 2**30
    rss = peak * 1024 / 2**30 if peak is not None else float("nan")
    if run.returncode != 0:
        print(run.stderr[-2000:], file=sys.stderr)
    return {"command": command, "depth": depth, "width": width, "parameters": params,
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
    draw(out)


def draw(out: Path) -> None:
    """``out.md`` and ``out.png`` from ``out.csv``."""
    rows = list(csv.DictReader(open(out.with_suffix(".csv"))))
    for r in rows:  # a CSV written before the column existed measured share compress
        r["command"] = r.get("command") or "share-compress"
    commands = list(dict.fromkeys(r["command"] for r in rows))
    depths = list(dict.fromkeys(r["depth"] for r in rows))
    lines = ["# Peak memory against depth", "",
             f"`python benchmarks/memory_vs_depth.py --depths {','.join(depths)} --commands "
             f"{','.join(commands)} --out {out}` ({rows[0]['cpu']}, python "
             f"{platform.python_version()}, torch {rows[0]['torch']}, transformers "
             f"{rows[0]['transformers']}, {rows[0]['date']}). A random LLaMA of width "
             f"{rows[0]['width']}; each command one process, its peak resident set by "
             "`/usr/bin/time -v`. " + " ".join(_DESCRIBE[c] for c in commands), "",
             "| command | layers | parameters | float32 weights (GiB) | peak RSS (GiB) | "
             "peak / weights | seconds | exit |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['command']} | {r['depth']} | {int(r['parameters']):,} | "
              f"{r['weights_gib']} | {r['peak_rss_gib']} | {r['peak_over_weights']}× | "
              f"{r['seconds']} | {r['exit']} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        from structlm.plotting import pyplot, save_figure
    except ImportError:
        return
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for c in commands:
        mine = [r for r in rows if r["command"] == c]
        ax.plot([int(r["depth"]) for r in mine], [float(r["peak_rss_gib"]) for r in mine],
                "o-", label=f"{c}: peak RSS")
    first = [r for r in rows if r["command"] == commands[0]]
    ax.plot([int(r["depth"]) for r in first], [float(r["weights_gib"]) for r in first], "s--",
            color="grey", label="float32 weights")
    ax.set_xlabel("decoder layers")
    ax.set_ylabel("GiB")
    ax.set_title(f"peak memory, random LLaMA width {rows[0]['width']}")
    ax.legend()
    save_figure(fig, out.with_suffix(".png"))


_DESCRIBE = {
    "share-compress": "share-compress: `share compress --method svd-llm-w --types all "
                      "--target-reduction 0.2` (2,048 calibration tokens of Austen; "
                      "`--stream off` where the option exists).",
    "share-compress-streamed": "share-compress-streamed: the same with `--stream on` (one "
                               "layer at a time).",
    "eval-ppl-whole": "eval-ppl-whole: `eval ppl --stream off` (the model loaded whole).",
    "eval-ppl-streamed": "eval-ppl-streamed: `eval ppl --stream on` (one decoder layer at a "
                         "time).",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="4,8,16,32",
                    type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--commands", default="eval-ppl-whole,eval-ppl-streamed",
                    type=lambda s: s.split(","), help=f"some of {','.join(COMMANDS)}")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--redraw", action="store_true",
                    help="only redraw <out>.md and <out>.png from <out>.csv")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True, help="output prefix")
    args = ap.parse_args(argv)
    if args.redraw:
        draw(args.out)
        return 0
    if any(d < 1 for d in args.depths) or args.width % 16:
        ap.error("--depths must be >= 1 and --width a multiple of 16")
    bad = [c for c in args.commands if c not in COMMANDS]
    if bad:
        ap.error(f"--commands: unknown {bad}; expected some of {list(COMMANDS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="mem-depth-") as tmp:
        for depth in args.depths:
            for command in args.commands:
                row = measure(command, depth, args.width, args.calib_tokens,
                              args.eval_tokens, args.threads, Path(tmp))
                print(row, flush=True)
                rows.append(row)
                write(rows, args.out)  # after each run: an interrupted sweep keeps its rows
            shutil.rmtree(Path(tmp) / f"llama-{depth}")
    print(f"{args.out.with_suffix('.md')} written")
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
