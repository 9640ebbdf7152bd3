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
so the real bound is lower). **peers** (``peers``, optional): llama.cpp on the original
model's GGUF, timed in the batch-1 decode trials beside both models, a ``peer`` row each
(its speed, each model's speed over it, GB/s, greedy tokens against the original's).
**peak memory** (``peak_memory=True``): per model and batch,
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
from structlm.bench.llamacpp import PEER_ARMS
from structlm.bench.share_report import markdown_from_csv, plot_from_csv, write_outputs
from structlm.bench.timing import environment, interleaved_medians
from structlm.config import ConfigError, Distinct, NonEmpty, OneOf, Range, validated

__all__ = ["PEER_ARMS", "ShareBenchConfig", "greedy_decode", "markdown_from_csv", "measure",
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
    peers: Annotated[tuple[Annotated[str, OneOf(*PEER_ARMS)], ...], Distinct()] = ()
    """llama.cpp arms on the *original* model's GGUF (a built-in model only), timed at
    batch-1 decode in the same interleaved trials: ``llamacpp-f32`` is the same function as
    the original (its greedy tokens are checked against it), ``llamacpp-q8_0`` /
    ``llamacpp-f16`` what CPU users run. Needs ``pip install -e ".[peers]"``; skipped with
    a note without it."""

    def __post_init__(self) -> None:
        """Cross-field checks (each field's own range is checked by ``@validated``)."""
        from structlm.hf.adapters import parse_types
        from structlm.share.compress.methods import canonical_name
        from structlm.share.compress.ranks import METHODS

        # a former name ("svd"): its new one (the config is frozen)
        object.__setattr__(self, "method", canonical_name(self.method))
        if self.method not in METHODS:
            raise ConfigError(f"method: {self.method!r} is not valid: expected one of "
                              f"{list(METHODS)}")
        try:
            parse_types(self.types)
        except ValueError as e:
            raise ConfigError(f"types: {e}") from None
        if self.peers and 1 not in self.batches:
            raise ConfigError(f"peers {list(self.peers)} decode one sequence: batches "
                              f"{list(self.batches)} must include 1")
        if self.peers and not self.compressed:
            _require_builtin(self.model, self.peers)


def _require_builtin(model: str, peers: Sequence[str]) -> None:
    """``ConfigError`` unless ``model`` is a built-in model (the peers load its GGUF)."""
    from structlm.hf.loading import BUILTIN_MODELS

    if model.lower() not in BUILTIN_MODELS:
        raise ConfigError(f"peers {list(peers)} run the original model's GGUF file on "
                          f"llama.cpp: they need one of the built-in models "
                          f"{sorted(BUILTIN_MODELS)} as the original, got {model!r}")


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
    model, its fused decode step or a llama.cpp arm."""
    from structlm.bench.llamacpp import LlamaCppLM
    from structlm.hf.fused_decode import FusedDecoder

    if isinstance(runner, LlamaCppLM):
        return runner.timed_greedy_steps(ids, steps)[0]
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
    """Median seconds of the decode loop of each runner (a model, its fused step or a
    llama.cpp arm); the prefill
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
            report: dict[str, Any], model_id: str = "", progress: bool = False,
            peers: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Memory rows and, per batch size, prefill and decode rows for two ready models;
    ``ids`` is a token stream ``(N,)`` with ``N >= max(batches) * prompt_len``. ``peers``
    (:class:`~structlm.bench.llamacpp.LlamaCppLM` by name) are timed in the batch-1 decode
    trials beside both models: one ``peer`` row each (see :func:`_peer_row`)."""
    peers = peers or {}
    if peers and 1 not in cfg.batches:
        raise ValueError(f"peers {list(peers)} decode one sequence: batches "
                         f"{list(cfg.batches)} must include 1")
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
            **_decode_floor([], "memory", 0, cfg, 0.0, 0.0), **_peer_columns(),
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
            timed = runners + (list(peers.values()) if b == 1 else [])
            t_o, t_c, *t_p = (t / cfg.decode_tokens for t in _decode_medians(
                timed, x, cfg.decode_tokens, cfg.trials, cfg.warmup))
            unit, tokens = "s_per_token", b
        rows.append({**base, "phase": phase, "batch": b, "original": t_o, "compressed": t_c,
                     "unit": unit, "speedup": round(t_o / t_c, 4), "ideal_speedup": ideal,
                     "original_tok_s": round(tokens / t_o, 2),
                     "compressed_tok_s": round(tokens / t_c, 2),
                     **_decode_floor(models, phase, b, cfg, t_o, t_c)})
        if phase == "decode" and b == 1:
            rows += [_peer_row(rows[-1], name, peer, t, x, original, cfg)
                     for (name, peer), t in zip(peers.items(), t_p, strict=True)]
    stream.append(stream_read_gbps())
    add_stream_columns(rows, stream, (("original_gbps", "original_pct_of_stream"),
                                      ("compressed_gbps", "compressed_pct_of_stream"),
                                      ("peer_gbps", "peer_pct_of_stream")))
    return rows


def _peer_columns() -> dict[str, Any]:
    """The peer columns, blank (every row but a peer row)."""
    return {"peer": "", "peer_s_per_token": "", "peer_tok_s": "", "original_over_peer": "",
            "compressed_over_peer": "", "peer_bytes_per_step": "", "peer_gbps": "",
            "peer_greedy_agreement": ""}


def _peer_row(decode_row: dict[str, Any], name: str, peer: Any, t: float, ids: torch.Tensor,
              original: Any, cfg: ShareBenchConfig) -> dict[str, Any]:
    """A ``peer`` row: the batch-1 decode row's two models beside llama.cpp arm ``name``
    timed in the same trials (``*_over_peer``: that model's speed over the peer's, > 1 =
    faster than llama.cpp), its bytes per step (the GGUF's stored weights and a float16
    KV cache, llama.cpp's default) and its greedy tokens on the first prompt against the
    original's (``equal/total`` up to the first difference)."""
    from structlm.bench.bandwidth import gguf_bytes_per_token
    from structlm.hf.macs import kv_cache_bytes_per_token

    context = cfg.prompt_len + cfg.decode_tokens / 2
    step = int(gguf_bytes_per_token(peer.path)
               + kv_cache_bytes_per_token(original, context, 2))
    ref = greedy_decode(original, ids, cfg.decode_tokens)[0, :cfg.decode_tokens].tolist()
    got = peer.timed_greedy_steps(ids, cfg.decode_tokens)[1]
    equal = next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b),
                 len(ref))
    return {**decode_row, "phase": "peer", "item": name, "peer": name,
            "peer_s_per_token": t, "peer_tok_s": round(1 / t, 2),
            "original_over_peer": round(t / decode_row["original"], 4),
            "compressed_over_peer": round(t / decode_row["compressed"], 4),
            "peer_bytes_per_step": step, "peer_gbps": round(step / t / 1e9, 3),
            "peer_greedy_agreement": f"{equal}/{len(ref)}"}


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


def run_share_bench(cfg: ShareBenchConfig, out_prefix: str, progress: bool = True
                    ) -> list[dict[str, Any]]:
    """Load (or compress) the models, :func:`measure`, :func:`write_outputs`; the rows.
    The llama.cpp peers are loaded first, so a missing GGUF or a failing quantiser is
    reported before any compression work."""
    from structlm.share.compress.io import MANIFEST

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    manifest: dict[str, Any] | None = None
    if cfg.compressed:
        path = Path(cfg.compressed) / MANIFEST
        if not path.is_file():
            raise ValueError(f"{cfg.compressed} is not a compressed model folder "
                             f"(no {MANIFEST})")
        manifest = json.loads(path.read_text())
        if cfg.peers:
            _require_builtin(manifest["source_model"], cfg.peers)
    peers, notes = _load_peers(cfg, manifest["source_model"] if manifest else cfg.model)
    try:
        loaded, compressed, report, ids = _models(cfg, manifest, progress)
        rows = measure(loaded.model, compressed, ids, cfg, report, loaded.model_id, progress,
                       peers)
    finally:
        for peer in peers.values():
            peer.close()
    for r in rows:
        r["notes"] = " | ".join(notes)
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


def _models(cfg: ShareBenchConfig, manifest: dict[str, Any] | None, progress: bool
            ) -> tuple[Any, Any, dict[str, Any], torch.Tensor]:
    """``(loaded original, compressed model, compression report, token stream)``: the
    folder ``cfg.compressed`` (its ``manifest``) and its source model, or the model
    compressed on the fly."""
    from structlm.hf.text import split_corpus, token_stream
    from structlm.share.compress import CompressionConfig, compress_model, load_compressed
    from structlm.share.compress.io import load_source

    need = max(2, max(cfg.batches) * cfg.prompt_len)
    if manifest is not None:
        compressed = load_compressed(cfg.compressed).model
        loaded, report = load_source(cfg.compressed), manifest["compression"]  # by content
        if loaded.tokenizer is None:
            raise ValueError(f"source model {manifest['source_model']!r} has no tokenizer")
        docs = split_corpus(cfg.corpus, 0.25, cfg.seed).evaluation
        return loaded, compressed.eval(), report, token_stream(loaded.tokenizer, docs, need)
    from structlm.hf.adapters import get_adapter
    from structlm.hf.pipeline import prepare

    ccfg = CompressionConfig(method=cfg.method, types=cfg.types,
                             target_reduction=cfg.target_reduction)
    prep = prepare(cfg.model, cfg.corpus, calib_tokens=cfg.calib_tokens, eval_tokens=need,
                   seed=cfg.seed, progress=progress)
    assert prep.calibration is not None
    compressed = copy.deepcopy(prep.loaded.model)
    report = compress_model(get_adapter(compressed), prep.calibration, ccfg,
                            progress=progress, calib_tokens=prep.calib_ids)
    return (prep.loaded, compressed.eval(), report,
            next(iter(prep.eval_ids.values())).reshape(-1))


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


def _load_peers(cfg: ShareBenchConfig, model: str) -> tuple[dict[str, Any], list[str]]:
    """The llama.cpp arms of ``cfg.peers`` on built-in ``model``'s GGUF, keyed by their
    config names (``llamacpp-f32``), and the report's notes (llama.cpp absent: no arms, a
    note saying how to install it). Their greedy tokens are checked in :func:`measure`,
    on the benchmark's own token ids."""
    if not cfg.peers:
        return {}, []
    from structlm.bench.llamacpp import peer_arms

    n_ctx = cfg.prompt_len + cfg.decode_tokens + 64
    arms, _, notes = peer_arms(model, tuple(p.removeprefix("llamacpp-") for p in cfg.peers),
                               cfg.threads, n_ctx, None, None, None, 0)
    by_name = {f"llama.cpp {p.removeprefix('llamacpp-')}": p for p in cfg.peers}
    return {by_name[label]: arm for label, arm in arms.items()}, notes
