"""Memory and CPU latency of a compressed model (``structlm share compress``) vs the original.

**memory**: parameters and bytes of the *unique* tensors of each model (tied and shared
tensors once), and the compressed matrices vs the dense ones they replace; **prefill**: one
forward of a ``(B, prompt_len)`` batch of real token ids with the KV cache on (last-position
logits only, as ``generate`` does); **decode**: ``decode_tokens`` greedy cached single-token
steps after an untimed prefill, a fresh cache each trial. The models alternate order every
trial (medians kept). Beside each measured speed-up, the **ideal**: the ratio of weight
elements read per token (:func:`weights_read_per_token`: a shared basis is read again by
every layer that uses it, the input embedding is one row) — the bound for a
bandwidth-bound decode and, as every weight element is one multiply–accumulate per
token, for a compute-bound prefill (attention over the cache costs both models the same,
so the real bound is lower). **peak memory** (``peak_memory=True``): per model and batch,
a fresh process loads the model, runs the same prefill + decode loop and reports the
resident set after loading, the peak over loading and running, and the resident set at
the end split into anonymous and file-backed pages (:mod:`.peak_memory`; one process per
model, since an in-process high-water mark mostly sees the allocator reusing memory the
other model's run freed).
Fairness: both models' plain ``nn.Linear`` s are put on the project's fastest dense
path (:func:`~structlm.hf.decode.use_decode_kernels_`: the compiled few-row kernel
at cached decode, ``F.linear`` otherwise), and the compressed model's factor products
take the same path (:func:`~structlm.nn.fast_linear`), so neither model is credited with
a kernel the other lacks.
CSV with the environment; Markdown and plot drawn from the CSV.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
from tqdm import tqdm

from structlm.bench.bandwidth import add_stream_columns, stream_read_gbps
from structlm.bench.greedy import decode_steps, greedy_decode, prefill
from structlm.bench.timing import environment, interleaved_medians, write_csv_atomic
from structlm.config import ConfigError, Distinct, NonEmpty, OneOf, Range, validated

__all__ = ["ShareBenchConfig", "greedy_decode", "markdown_from_csv", "measure",
           "peak_memory_rows", "plot_from_csv", "run_share_bench", "unique_parameters",
           "weights_read_per_token", "write_outputs"]


@dataclass(frozen=True)
@validated
class ShareBenchConfig:
    """What to compare: ``compressed`` is a folder written by ``structlm share compress``
    (its source model is the original), or ``""`` to compress ``model`` on the fly."""

    model: Annotated[str, NonEmpty()] = "smollm2"
    compressed: str = ""
    """A folder written by structlm share compress (its source model is the original);
    empty: compress the model on the fly."""
    method: Annotated[str, NonEmpty()] = "basis-sharing"
    """Method used when compressing on the fly."""
    types: Annotated[str, NonEmpty()] = "all"
    """Matrix types compressed on the fly: attn, mlp, all or q,k,v,o,mlp_in,mlp_out."""
    target_reduction: Annotated[float, Range(gt=0, lt=1)] = 0.4
    """Fraction of the compressed matrices' parameters removed on the fly."""
    corpus: Annotated[str, NonEmpty()] = "austen"
    """Calibration and prompt text."""
    calib_tokens: Annotated[int, Range(ge=1)] = 32768
    """Calibration tokens for compressing on the fly."""
    batches: Annotated[tuple[Annotated[int, Range(ge=1)], ...], NonEmpty(), Distinct()] = (
        1, 16)
    """Batch sizes timed."""
    prompt_len: Annotated[int, Range(ge=1)] = 128
    """Prompt tokens per sequence (prefill)."""
    decode_tokens: Annotated[int, Range(ge=1)] = 32
    """Cached decode steps timed after the prefill."""
    trials: Annotated[int, Range(ge=1)] = 7
    """Interleaved trials per cell (medians reported)."""
    warmup: Annotated[int, Range(ge=0)] = 1
    """Untimed rounds first."""
    threads: Annotated[int, Range(ge=1)] = 2
    """Torch threads."""
    seed: Annotated[int, Range(ge=0)] = 0
    """Seed of the prompts and of the calibration windows."""
    decode: Annotated[str, OneOf("fused", "hf")] = "fused"
    """How both models decode: ``fused`` (one compiled call per token,
    :mod:`structlm.hf.fused_decode`; a family it does not run falls back to ``hf``, said in
    the ``decode_path`` column) or ``hf`` (the model's forward per token, projections on
    the decode kernel)."""
    peak_memory: bool = True
    """Measure peak resident memory in a fresh process per model and batch."""

    def __post_init__(self) -> None:
        """Cross-field checks (each field's own range is checked by ``@validated``)."""
        from structlm.hf.adapters import parse_types
        from structlm.share.compress.ranks import METHODS

        if self.method not in METHODS:
            raise ConfigError(f"method: {self.method!r} is not valid: expected one of "
                              f"{list(METHODS)}")
        try:
            parse_types(self.types)
        except ValueError as e:
            raise ConfigError(f"types: {e}") from None


def unique_parameters(module: torch.nn.Module) -> tuple[int, int]:
    """``(parameters, bytes)`` of the distinct tensors of ``module``: a tensor reachable
    under several names (tied embeddings, a shared basis) counts once, by its storage."""
    views: dict[tuple[int, int], int] = {}  # (storage ptr, offset) -> numel
    storages: dict[int, int] = {}  # storage ptr -> bytes
    for _, p in module.named_parameters(remove_duplicate=False):
        st = p.untyped_storage()
        views[(st.data_ptr(), p.storage_offset())] = p.numel()
        storages[st.data_ptr()] = st.nbytes()
    return sum(views.values()), sum(storages.values())


def weights_read_per_token(model: torch.nn.Module) -> int:
    """Parameter elements one token's forward reads: every use of a tensor counts (a
    basis shared by several layers is read by each; a tied head reads the embedding
    matrix), except the input embedding, which is a row lookup."""
    total = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None:
        total -= emb.weight.numel() - emb.weight.shape[1]
    return total


def _timed_decode(runner: Any, ids: torch.Tensor, steps: int) -> float:
    """Seconds of ``steps`` greedy decode steps after an untimed prefill of ``ids``, on a
    model or its fused decode step."""
    from structlm.hf.fused_decode import FusedDecoder

    if isinstance(runner, FusedDecoder):
        token = runner.prefill(ids, steps + 1).argmax(-1)  # (B,)
        t0 = time.perf_counter()
        runner.greedy_steps(token, ids.shape[1], steps)
        return time.perf_counter() - t0
    cache, token = prefill(runner, ids)
    t0 = time.perf_counter()
    decode_steps(runner, cache, token, steps)
    return time.perf_counter() - t0


def _decode_medians(runners: Sequence[Any], ids: torch.Tensor, steps: int, trials: int,
                    warmup: int) -> list[float]:
    """Median seconds of the decode loop of each model (or its fused step); the prefill
    is untimed, a fresh cache every trial, the order alternates per trial."""
    times: list[list[float]] = [[] for _ in runners]
    for i in range(warmup + trials):
        order = range(len(runners)) if i % 2 == 0 else reversed(range(len(runners)))
        for j in order:
            dt = _timed_decode(runners[j], ids, steps)
            if i >= warmup:
                times[j].append(dt)
    return [statistics.median(t) for t in times]


def _runners(models: Sequence[Any], decode: str) -> tuple[list[Any], str]:
    """Each model's decode runner (its fused step where it runs, else the model) and the
    decode path both take (``fused``, ``hf``, or ``hf (fused: <why not>)``)."""
    if decode == "hf":
        return list(models), "hf"
    from structlm.hf.fused_decode import fused_decoders

    decoders, why = fused_decoders(dict(enumerate(models)))
    if decoders is None:  # both arms on one path: the fairness rule
        return list(models), f"hf (fused: {'; '.join(why.values())})"
    return list(decoders.values()), "fused"


@torch.no_grad()
def measure(original: Any, compressed: Any, ids: torch.Tensor, cfg: ShareBenchConfig,
            report: dict[str, Any], model_id: str = "", progress: bool = False
            ) -> list[dict[str, Any]]:
    """Memory rows and, per batch size, prefill and decode rows for two ready models;
    ``ids`` is a token stream ``(N,)`` with ``N >= max(batches) * prompt_len``."""
    need = max(cfg.batches) * cfg.prompt_len
    if ids.numel() < need:
        raise ValueError(f"{ids.numel()} ids are fewer than max(batches) × prompt_len = {need}")
    limit = getattr(original.config, "max_position_embeddings", None)
    if limit is not None and cfg.prompt_len + cfg.decode_tokens + 1 > limit:
        raise ValueError(f"prompt_len + decode_tokens + 1 exceeds the model's {limit} positions")
    torch.set_num_threads(cfg.threads)
    from structlm.hf.decode import use_decode_kernels_

    original.eval()
    compressed.eval()
    for m in (original, compressed):  # the fastest dense path for both (fairness rule)
        use_decode_kernels_(m)
    rc = report.get("config", {})
    base = {"model": model_id, "method": rc.get("method", cfg.method),
            "types": rc.get("types", cfg.types), "target_reduction": rc.get("target_reduction"),
            "phase": "", "item": "", "batch": "", "prompt_len": cfg.prompt_len,
            "decode_tokens": cfg.decode_tokens, "original": 0.0, "compressed": 0.0,
            "unit": "", "memory_ratio": "", "speedup": "", "ideal_speedup": "",
            "original_tok_s": "",
            "compressed_tok_s": "", "trials": cfg.trials,
            **_decode_floor([], "memory", 0, cfg, 0.0, 0.0),
            **{f"env_{k}": v for k, v in environment().items()}}
    (po, bo), (pc, bc) = unique_parameters(original), unique_parameters(compressed)
    mem = [("parameters", po, pc, "count"), ("parameter_bytes", bo, bc, "bytes")]
    if "original_parameters" in report and "stored_parameters" in report:
        dense = report["original_parameters"] * next(original.parameters()).element_size()
        # the factors' bytes = everything held minus the untouched tensors (bo - dense)
        mem.append(("compressed_matrices_bytes", dense, bc - (bo - dense), "bytes"))
    read_o, read_c = weights_read_per_token(original), weights_read_per_token(compressed)
    mem.append(("weights_read_per_token", read_o, read_c, "count"))
    rows = [{**base, "phase": "memory", "item": item, "original": o, "compressed": c,
             "unit": unit, "memory_ratio": round(o / max(c, 1), 4)} for item, o, c, unit in mem]
    ideal = round(read_o / read_c, 4)
    models = [original, compressed]
    runners, path = _runners(models, cfg.decode)
    for r in rows:
        r["decode_path"] = path
    base["decode_path"] = path
    stream = [stream_read_gbps()]  # the memory floor, before and after the timed rows
    grid = [(phase, b) for b in cfg.batches for phase in ("prefill", "decode")]
    for phase, b in tqdm(grid, desc="share bench", disable=not progress, unit="meas"):
        x = ids[: b * cfg.prompt_len].view(b, cfg.prompt_len)  # (B, T)
        if phase == "prefill":
            t_o, t_c = interleaved_medians([lambda m=m, x=x: prefill(m, x) for m in models],
                                           cfg.trials, cfg.warmup)
            unit, tokens = "s_per_call", b * cfg.prompt_len
        else:
            t_o, t_c = _decode_medians(runners, x, cfg.decode_tokens, cfg.trials, cfg.warmup)
            t_o, t_c = t_o / cfg.decode_tokens, t_c / cfg.decode_tokens
            unit, tokens = "s_per_token", b
        rows.append({**base, "phase": phase, "batch": b, "original": t_o, "compressed": t_c,
                     "unit": unit, "speedup": round(t_o / t_c, 4), "ideal_speedup": ideal,
                     "original_tok_s": round(tokens / t_o, 2),
                     "compressed_tok_s": round(tokens / t_c, 2),
                     **_decode_floor(models, phase, b, cfg, t_o, t_c)})
    stream.append(stream_read_gbps())
    add_stream_columns(rows, stream, (("original_gbps", "original_pct_of_stream"),
                                      ("compressed_gbps", "compressed_pct_of_stream")))
    return rows


def _decode_floor(models: Sequence[Any], phase: str, batch: int, cfg: ShareBenchConfig,
                  t_o: float, t_c: float) -> dict[str, Any]:
    """A decode row's bytes per step (the weights each module reads once, the KV cache of
    every sequence at the mean context) and GB/s of both models; blank for prefill rows
    (compute-bound: their floor is not the bytes)."""
    if phase != "decode":  # (also the blank columns of the memory rows)
        return {"original_bytes_per_step": "", "compressed_bytes_per_step": "",
                "original_gbps": "", "compressed_gbps": ""}
    from structlm.hf.macs import decode_bytes_per_token, kv_cache_bytes_per_token

    context = cfg.prompt_len + cfg.decode_tokens / 2
    out: dict[str, Any] = {}
    for arm, model, t in zip(("original", "compressed"), models, (t_o, t_c), strict=True):
        size = next(model.parameters()).element_size()
        step = int(decode_bytes_per_token(model, context)
                   + (batch - 1) * kv_cache_bytes_per_token(model, context, size))
        out[f"{arm}_bytes_per_step"] = step
        out[f"{arm}_gbps"] = round(step / t / 1e9, 3)
    return out


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
    """Memory and latency tables, the environment and a plain sentence on where the
    compressed model is slower, from a share-bench CSV."""
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
    return "\n".join(lines) + "\n"


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


def run_share_bench(cfg: ShareBenchConfig, out_prefix: str, progress: bool = True
                    ) -> list[dict[str, Any]]:
    """Load (or compress) the models, :func:`measure`, :func:`write_outputs`; the rows."""
    from structlm.hf.loading import load_model
    from structlm.hf.text import split_corpus, token_stream
    from structlm.share.compress import CompressionConfig, compress_model, load_compressed
    from structlm.share.compress.io import MANIFEST

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    need = max(2, max(cfg.batches) * cfg.prompt_len)
    if cfg.compressed:
        compressed = load_compressed(cfg.compressed).model  # raises without a manifest
        manifest = json.loads((Path(cfg.compressed) / MANIFEST).read_text())
        loaded, report = load_model(manifest["source_model"]), manifest["compression"]
        if loaded.tokenizer is None:
            raise ValueError(f"source model {manifest['source_model']!r} has no tokenizer")
        docs = split_corpus(cfg.corpus, 0.25, cfg.seed).evaluation
        ids = token_stream(loaded.tokenizer, docs, need)
    else:
        from structlm.hf.adapters import get_adapter
        from structlm.hf.pipeline import prepare

        ccfg = CompressionConfig(method=cfg.method, types=cfg.types,
                                 target_reduction=cfg.target_reduction)
        prep = prepare(cfg.model, cfg.corpus, calib_tokens=cfg.calib_tokens, eval_tokens=need,
                       seed=cfg.seed, progress=progress)
        assert prep.calibration is not None
        loaded, ids = prep.loaded, next(iter(prep.eval_ids.values())).reshape(-1)
        compressed = copy.deepcopy(loaded.model)
        report = compress_model(get_adapter(compressed), prep.calibration, ccfg,
                                calib_tokens=prep.calib_ids)
    rows = measure(loaded.model, compressed.eval(), ids, cfg, report, loaded.model_id, progress)
    if cfg.peak_memory:
        source = loaded.source or loaded.model_id
        if cfg.compressed:
            rows += peak_memory_rows(rows[0], source, cfg.compressed, cfg, progress)
        else:
            from structlm.share.compress import save_compressed

            parent = Path(os.path.abspath(out_prefix)).parent
            parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=parent, prefix=".bench-model-") as tmp:
                save_compressed(dataclasses.replace(loaded, model=compressed), report,
                                Path(tmp) / "model")
                rows += peak_memory_rows(rows[0], source, str(Path(tmp) / "model"), cfg,
                                         progress)
    write_outputs(rows, out_prefix)
    return rows


def peak_memory_rows(base: dict[str, Any], source: str, compressed_dir: str,
                     cfg: ShareBenchConfig, progress: bool = False) -> list[dict[str, Any]]:
    """Rows of peak resident memory, original vs compressed, per batch (fresh processes)."""
    from structlm.bench.peak_memory import measure_peak_memory

    rows = []
    for b in tqdm(cfg.batches, desc="peak memory", disable=not progress, unit="batch"):
        o, c = (measure_peak_memory(source, d, b, cfg.prompt_len, cfg.decode_tokens,
                                    cfg.threads, cfg.seed) for d in ("", compressed_dir))
        rows += [{**base, "phase": "peak_memory", "item": item, "batch": b,
                  "original": o[item], "compressed": c[item], "unit": "bytes",
                  "memory_ratio": round(o[item] / max(c[item], 1), 4), "speedup": "",
                  "ideal_speedup": "", "original_tok_s": "", "compressed_tok_s": ""}
                 for item in ("resident_after_load", "peak_load_and_run", "anonymous_after_run",
                              "file_backed_after_run")]
    return rows
