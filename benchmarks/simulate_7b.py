"""Peak memory and time of ``share compress --stream on`` on a LLaMA-2-7B-shaped model.

Usage::

    python benchmarks/simulate_7b.py --layers 2,4,8 \\
        --out benchmarks/results/simulate_7b/basis_sharing_20

For each layer count, a checkpoint of LLaMA-2-7B's shapes (hidden 4,096, MLP 11,008, 32
heads of 128, vocabulary 32,000; random weights, N(0, 0.02²), norms at one) is written
shard by shard in bfloat16 (never the whole model in memory), with a 32,000-token BPE
trained on the built-in corpora, and one ``structlm share compress --method basis-sharing
--types all --target-reduction 0.2 --stream on`` process runs on it under
``/usr/bin/time -v`` (``--calib-tokens`` of Austen; the layers compute in float32). The
quality numbers of random weights mean nothing; the peak resident set and the time do.
From the time per layer (the slope over the layer counts) the script projects a whole
7B, 13B and 70B model on this CPU, scaling by each shape's multiply-adds per token.
Writes ``<out>.csv`` (with the environment) and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memory_vs_depth import _peak_kib  # a sibling script (benchmarks/ on sys.path)

SHAPE = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
         "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
         "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
"""LLaMA-2-7B's configuration (``meta-llama/Llama-2-7b-hf``)."""

MODELS = {  # layers, hidden, MLP, KV heads × head dim: the published LLaMA-2 shapes
    "7B": (32, 4096, 11008, 4096), "13B": (40, 5120, 13824, 5120),
    "70B": (80, 8192, 28672, 1024)}

FIELDS = ["layers", "parameters", "peak_rss_gib", "seconds", "compress_seconds", "exit",
          "calib_tokens", "cpu", "torch", "date"]


def _layer_macs(hidden: int, mlp: int, kv: int) -> int:
    """Multiply-adds per token of one decoder layer's projections."""
    return hidden * (2 * hidden + 2 * kv) + 3 * hidden * mlp


def write_model(folder: Path, layers: int, tokenizer: object) -> int:
    """The checkpoint, one shard per layer (bfloat16); returns its parameter count."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=layers, **SHAPE)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(layers)
    weight_map: dict[str, str] = {}
    groups: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, t in skeleton.state_dict().items():
        m = re.search(r"layers\.(\d+)\.", name)
        shard = f"model-layer-{int(m.group(1)):03d}.safetensors" if m else \
            f"model-{name.replace('.', '-')}.safetensors"
        groups.setdefault(shard, []).append((name, tuple(t.shape)))
    for shard, tensors in groups.items():
        out = {}
        for name, shape in tensors:
            out[name] = (torch.ones(shape) if name.endswith("norm.weight") else
                         torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
            weight_map[name] = shard
        save_file(out, str(folder / shard), metadata={"format": "pt"})
        del out
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(folder)
    tokenizer.save_pretrained(folder)  # type: ignore[attr-defined]
    return sum(t.numel() for t in skeleton.state_dict().values())


def _tokenizer(work: Path) -> object:
    from structlm.data.bpe import train_bpe
    from structlm.data.corpora import load_corpus

    texts = [d.text for c in ("austen", "shakespeare") for d in load_corpus(c)]
    return train_bpe(texts, SHAPE["vocab_size"], work / "bpe")


def measure(layers: int, calib_tokens: int, threads: int, work: Path, tok: object) -> dict:
    import torch

    from structlm.bench.timing import _cpu_model

    folder = work / f"llama2-7b-shape-{layers}"
    params = write_model(folder, layers, tok)
    out = work / f"out-{layers}"
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "structlm.cli", "share", "compress",
           str(folder), "--method", "basis-sharing", "--types", "all", "--target-reduction",
           "0.2", "--stream", "on", "--corpus", "austen", "--second-corpus", "",
           "--calib-tokens", str(calib_tokens), "--eval-tokens", "1024", "--threads",
           str(threads), "--out", str(out)]
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    seconds = time.perf_counter() - t0
    peak = _peak_kib(run.stderr)  # the one reader of /usr/bin/time -v's peak
    if run.returncode != 0:
        print(run.stderr[-3000:], file=sys.stderr)
    res = json.loads((out / "compress.json").read_text()) if run.returncode == 0 else {}
    return {"layers": layers, "parameters": params,
            "peak_rss_gib": round(peak / 2**20, 3) if peak is not None else float("nan"),
            "seconds": round(seconds, 1),
            "compress_seconds": round(res.get("compress_seconds", float("nan")), 1),
            "exit": run.returncode, "calib_tokens": calib_tokens, "cpu": _cpu_model(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def write(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    rows = list(csv.DictReader(open(out.with_suffix(".csv"))))
    lines = ["# `share compress --stream on` on a LLaMA-2-7B-shaped model", "",
             f"`python benchmarks/simulate_7b.py --layers "
             f"{','.join(r['layers'] for r in rows)} --out {out}` ({rows[0]['cpu']}, python "
             f"{platform.python_version()}, torch {rows[0]['torch']}, {rows[0]['date']}). "
             "Random weights in bfloat16 shards, computed in float32; Basis Sharing −20% on "
             f"every type; {rows[0]['calib_tokens']} calibration tokens of Austen. Peak "
             "resident set of the one process by `/usr/bin/time -v`.", "",
             "| layers | parameters | peak RSS (GiB) | seconds | compression (s) | exit |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['layers']} | {int(r['parameters']):,} | {r['peak_rss_gib']} | "
              f"{r['seconds']} | {r['compress_seconds']} | {r['exit']} |" for r in rows]
    ok = [r for r in rows if r["exit"] == "0"]
    if len(ok) >= 2:
        xs = [int(r["layers"]) for r in ok]
        ys = [float(r["seconds"]) for r in ok]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
            (x - mx) ** 2 for x in xs)
        fixed = my - slope * mx
        base = _layer_macs(4096, 11008, 4096)
        lines += ["", f"Time per layer (least-squares slope over the layer counts): "
                  f"**{slope:.0f} s**; fixed cost {fixed:.0f} s. Projected on this CPU, "
                  "same settings, scaled by each shape's multiply-adds per layer "
                  "(a projection, not a measurement):", "",
                  "| model | layers | per layer (s) | projected whole model |",
                  "|---|---:|---:|---:|"]
        for name, (n, h, m, kv) in MODELS.items():
            per = slope * _layer_macs(h, m, kv) / base
            lines.append(f"| LLaMA-2-{name} | {n} | {per:.0f} | "
                         f"{(fixed + n * per) / 3600:.1f} h |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True, help="output prefix")
    ap.add_argument("--work", type=Path, default=None,
                    help="where the checkpoints go (default: a temporary folder)")
    args = ap.parse_args(argv)
    if any(n < 2 or n % 2 for n in args.layers):
        ap.error("--layers: even counts >= 2 (Basis Sharing pairs layers)")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="sim7b-", dir=args.work) as tmp:
        tok = _tokenizer(Path(tmp))
        for n in args.layers:
            row = measure(n, args.calib_tokens, args.threads, Path(tmp), tok)
            print(row, flush=True)
            rows.append(row)
            write(rows, args.out)  # after each count: an interrupted sweep keeps its rows
            import shutil

            shutil.rmtree(Path(tmp) / f"llama2-7b-shape-{n}", ignore_errors=True)
            shutil.rmtree(Path(tmp) / f"out-{n}", ignore_errors=True)
    print(f"{args.out.with_suffix('.md')} written")
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
