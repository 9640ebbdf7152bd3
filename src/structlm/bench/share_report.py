"""The outputs of ``structlm bench share``, drawn from its CSV: the Markdown tables (memory,
peak memory, latency with the memory floor, the llama.cpp peers of the original model) and
the plot. Kept apart from the measurement (:mod:`structlm.bench.share`)."""

from __future__ import annotations

import csv
import os
from typing import Any

from structlm.bench.timing import write_csv_atomic

__all__ = ["markdown_from_csv", "plot_from_csv", "write_outputs"]

def _read(csv_path: str) -> list[dict[str, str]]:
    with open(csv_path, newline="") as fh:
        return list(csv.DictReader(fh))


def _amount(value: str, unit: str) -> str:
    return f"{float(value) / 2**20:.2f} MiB" if unit == "bytes" else f"{int(float(value)):,}"


def _gbps_cell(r: dict[str, str]) -> str:
    """``a → b (x% → y%)`` for a decode row; a dash for prefill rows and older CSVs."""
    if not r.get("original_gbps"):
        return "—"
    return (f"{float(r['original_gbps']):.1f} → {float(r['compressed_gbps']):.1f} "
            f"({float(r['original_pct_of_stream']):.0f}% → "
            f"{float(r['compressed_pct_of_stream']):.0f}%)")


def markdown_from_csv(csv_path: str) -> str:
    """Memory and latency tables, the environment, a plain sentence on where the
    compressed model is slower and, with peer rows, the llama.cpp table, from a
    share-bench CSV."""
    rows = _read(csv_path)  # never empty: write_csv_atomic refuses no rows
    r0 = rows[0]
    env = {k[4:]: v for k, v in r0.items() if k.startswith("env_")}
    lines = [f"# {r0['model']}: compressed ({r0['method']}, types {r0['types']}, target "
             f"reduction {r0['target_reduction']}) vs original", "",
             "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()), "",
             "| memory | original | compressed | original / compressed |", "|---|---:|---:|---:|"]
    for r in (r for r in rows if r["phase"] == "memory"):
        lines.append(f"| {r['item']} | {_amount(r['original'], r['unit'])} | "
                     f"{_amount(r['compressed'], r['unit'])} | "
                     f"{float(r['memory_ratio']):.3f}× |")
    lines += ["", "Parameters count each distinct tensor once; *weights read per token* "
              "counts every use (a shared basis once per layer that uses it) — the ideal "
              "speed-up below is its ratio. The KV cache is the same for both models (K and "
              "V keep their output size)."]
    peak = [r for r in rows if r["phase"] == "peak_memory"]
    if peak:
        lines += ["", "| peak memory (fresh process per model) | batch | original | compressed "
                  "| original / compressed |", "|---|---:|---:|---:|---:|"]
        for r in peak:
            lines.append(f"| {r['item'].replace('_', ' ')} | {r['batch']} | "
                         f"{_amount(r['original'], 'bytes')} | "
                         f"{_amount(r['compressed'], 'bytes')} | "
                         f"{float(r['memory_ratio']):.3f}× |")
        lines += ["", "Each model in a fresh process: resident set after loading (parameters, "
                  "libraries, runtime); peak = the high-water mark over loading and one prefill "
                  f"of (batch, {r0['prompt_len']}) plus {r0['decode_tokens']} cached decode "
                  "steps; at the end, the resident set split into anonymous memory and "
                  "file-backed pages (memory-mapped safetensors weights: page cache, "
                  "reclaimable and shared between processes)."]
    lines += ["", "| phase | batch | original ms | compressed ms | per | tokens/s orig → comp | "
              "speed-up | ideal | GB/s orig → comp (% of stream) |",
              "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    slower = []
    for r in (r for r in rows if r["phase"] in ("prefill", "decode")):
        sp = float(r["speedup"])
        per = "new token" if r["unit"] == "s_per_token" else "call"
        lines.append(f"| {r['phase']} | {r['batch']} | {float(r['original']) * 1e3:.3f} | "
                     f"{float(r['compressed']) * 1e3:.3f} | {per} | "
                     f"{float(r['original_tok_s']):.1f} → {float(r['compressed_tok_s']):.1f} | "
                     f"{sp:.3f}× | {float(r['ideal_speedup']):.3f}× | {_gbps_cell(r)} |")
        if sp < 1:
            slower.append(f"{r['phase']} at batch {r['batch']} ({sp:.2f}×)")
    verdict = ("**The compressed model is slower** (speed-up < 1) for " + ", ".join(slower)
               + ".") if slower else "The compressed model is not slower in any measurement."
    lines += ["", f"Speed-up = original time / compressed time (medians of {r0['trials']} "
              "interleaved trials; decode in seconds per new token with its prefill untimed); "
              "ideal = weights read per token, original / compressed (a speed-up above it "
              "would mean an unfair baseline). Both models run on the project's fastest "
              "dense path (the compiled few-row kernel at cached decode, `F.linear` "
              "otherwise), the compressed model's factor products included; decode path: "
              + _decode_path_text(r0.get("decode_path", "hf")) + ". GB/s = bytes "
              "per decode step (weights read once, the KV cache of every sequence at the mean "
              "context) / time; % of the stream read bandwidth measured in the same run"
              + (f" ({r0['stream_read_gbps']} GB/s)" if r0.get("stream_read_gbps") else "")
              + ". " + verdict]
    lines += _peer_lines([r for r in rows if r["phase"] == "peer"])
    if r0.get("notes"):
        lines += ["", "Notes: " + r0["notes"]]
    return "\n".join(lines) + "\n"


def _peer_lines(peers: list[dict[str, str]]) -> list[str]:
    """The llama.cpp table: each peer's batch-1 decode beside both models (same trials)."""
    if not peers:
        return []
    r0 = peers[0]

    def gbps(r: dict[str, str], arm: str) -> str:
        return f"{float(r[arm + '_gbps']):.1f} ({float(r[arm + '_pct_of_stream']):.0f}%)"

    lines = ["", "| batch-1 decode, same trials | tokens/s | speed over the original's | "
             "the compressed model's speed over this | GB/s (% of stream) | greedy tokens "
             "equal to the original's |", "|---|---:|---:|---:|---:|---|",
             f"| original (structlm) | {float(r0['original_tok_s']):.1f} | 1 | "
             f"{float(r0['speedup']):.3f}× | "
             f"{gbps(r0, 'original')} | — |"]
    for r in peers:
        lines.append(f"| {r['peer'].replace('llamacpp-', 'llama.cpp ')} | "
                     f"{float(r['peer_tok_s']):.1f} | "
                     f"{float(r['original']) / float(r['peer_s_per_token']):.3f}× "
                     f"| {float(r['compressed_over_peer']):.3f}× | {gbps(r, 'peer')} | "
                     f"{r['peer_greedy_agreement']} |")
    note = ("llama.cpp runs the original model's GGUF (`f32`: the same weights, so the same "
            "function; `q8_0` / `f16`: what CPU users run, not the same function), timed in "
            "the same interleaved trials as the batch-1 decode row (prefill untimed, greedy "
            "steps); its bytes per step are the GGUF's stored weights and a float16 KV cache "
            "(llama.cpp's default). A compressed-model ratio above 1: it decodes faster than "
            "that arm.")
    return [*lines, "", note]

def _decode_path_text(path: str) -> str:
    if path == "fused":
        return ("the fused step for both (one compiled call per token, the weights copied "
                "into one buffer in read order, advised for huge pages; peak memory is "
                "measured on the model's own forward, without that copy)")
    return f"the models' own forward per token ({path})"


def plot_from_csv(csv_path: str, png_path: str) -> None:
    """Two panels from the CSV: speed-up per phase × batch (line at 1.0) and memory bars."""
    from structlm.plotting import pyplot

    plt = pyplot()

    rows = _read(csv_path)
    lat = [r for r in rows if r["phase"] in ("prefill", "decode")]
    mem = [r for r in rows if r["phase"] == "memory" and r["unit"] == "bytes"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    sp = [float(r["speedup"]) for r in lat]
    a1.bar(range(len(lat)), sp, color=["tab:green" if v >= 1 else "tab:red" for v in sp])
    a1.scatter(range(len(lat)), [float(r["ideal_speedup"]) for r in lat], marker="_", s=400,
               color="k", label="ideal (weights read)", zorder=3)
    a1.legend(fontsize=7)
    a1.axhline(1.0, color="k", lw=1, ls="--")
    a1.set_xticks(range(len(lat)), [f"{r['phase']}\nB={r['batch']}" for r in lat])
    a1.set(ylabel="speed-up (original / compressed time)",
           title="latency (< 1: compressed is slower)")
    pos = range(len(mem))
    for off, key in ((-0.2, "original"), (0.2, "compressed")):
        a2.bar([p + off for p in pos], [float(r[key]) / 2**20 for r in mem], 0.4, label=key)
    a2.set_xticks(list(pos), [r["item"].replace("_", "\n") for r in mem])
    a2.set(ylabel="MiB", title="parameter memory")
    a2.legend()
    r = rows[0]
    fig.suptitle(f"{r['model']} {r['method']} ({r['types']}) — {r['env_cpu']}, torch "
                 f"{r['env_torch']}, {r['env_threads']} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path + ".tmp.png", dpi=120)
    plt.close(fig)
    os.replace(png_path + ".tmp.png", png_path)


def write_outputs(rows: list[dict[str, Any]], out_prefix: str) -> None:
    """``<out_prefix>.csv`` (atomic), then ``.md`` and ``.png`` drawn from the CSV."""
    os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
    write_csv_atomic(out_prefix + ".csv", rows)
    with open(out_prefix + ".md.tmp", "w") as fh:
        fh.write(markdown_from_csv(out_prefix + ".csv"))
    os.replace(out_prefix + ".md.tmp", out_prefix + ".md")
    plot_from_csv(out_prefix + ".csv", out_prefix + ".png")
