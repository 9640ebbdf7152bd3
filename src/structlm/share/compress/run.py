"""``structlm share compress``: calibrate, compress, evaluate (before, after, after
fine-tuning), save the compressed model and a report."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from structlm.atomic import atomic_write_text, clean_json
from structlm.folders import check_apart, run_folder_lock
from structlm.hf.adapters import get_adapter
from structlm.hf.finetune import FinetuneConfig, finetune
from structlm.hf.layer_stream import stream_folder
from structlm.hf.loading import load_model, model_content_key, model_context
from structlm.hf.pipeline import evaluate_all, prepare, validation_windows
from structlm.share.compress.api import compress_
from structlm.share.compress.apply import CompressionConfig, plan_types
from structlm.share.compress.io import (
    MANIFEST,
    remove_leftovers,
    save_compressed,
    source_chain,
)
from structlm.share.compress.run_streamed import results_header, run_compress_streamed
from structlm.share.compress.streamed import why_not_streamed

__all__ = ["run_compress"]

WINDOW = 512
"""Tokens per calibration and evaluation window."""


def run_compress(model: str, ccfg: CompressionConfig, out_dir: str | Path,
                 corpus: str = "austen", second_corpus: str = "shakespeare",
                 calib_tokens: int = 32768, eval_tokens: int = 16384,
                 ft: FinetuneConfig | None = None, seed: int = 0, save: bool = True,
                 progress: bool = True, stream: str = "auto") -> dict[str, Any]:
    """Compress ``model`` under ``ccfg``; writes ``compress.json``, ``report.md`` and (with
    ``save``) the model folder ``model/`` into ``out_dir``; returns the results.

    ``stream``: ``on`` runs every step one layer (or Basis Sharing group) at a time, the
    weights read from disk (:mod:`.run_streamed`; no fine-tuning), ``off`` holds the
    model, ``auto`` streams a model whose weights exceed 2 GiB when no fine-tuning is
    asked for (:func:`structlm.hf.layer_stream.stream_folder`).

    ``out_dir`` must lie apart from every folder ``model`` reads (a compressed model's
    sources too) and is locked for the run (one writer).

    Raises:
        ValueError: an output overlapping an input (before anything is loaded); ``stream
            on`` with fine-tuning or for a model that cannot stream.
        RunError: another process writes ``out_dir``.
    """
    out = Path(out_dir)
    check_apart(out, source_chain(model))  # before anything is loaded or written
    tuned = ft is not None and ft.steps > 0
    if tuned and stream == "on":
        raise ValueError("fine-tuning holds the whole model for its gradients: it cannot "
                         "run layer by layer (--stream off, or no fine-tuning steps)")
    with run_folder_lock(out, "share compress output"):
        _check_context(model, ft)  # before any work
        streamed = None if tuned else stream_folder(model, stream)
        if streamed is not None and (streamed / MANIFEST).is_file():
            raise ValueError(f"{model!r} is a compressed folder: compress the model it was "
                             "compressed from (its manifest names it)")
        if streamed is not None:  # a method that cannot stream: refused, or run whole
            adapter = get_adapter(load_model(model, weights=False).model)
            why = why_not_streamed(ccfg, plan_types(adapter, ccfg), adapter.num_layers)
            if why is not None and stream == "on":
                raise ValueError(f"--stream on: {why} (use --stream off)")
            if why is not None:
                streamed = None
        for left in remove_leftovers(out / "model"):  # a killed save's, under the lock
            print(f"{out}: removed {left.name}, left by an interrupted save", flush=True)
        if streamed is not None:
            res = run_compress_streamed(model, streamed, ccfg, out, corpus, second_corpus,
                                        calib_tokens, eval_tokens, seed, save, progress,
                                        WINDOW)
            atomic_write_text(out / "compress.json", json.dumps(clean_json(res), indent=1))
            atomic_write_text(out / "report.md", _markdown(res))
            return res
        return _run(model, ccfg, out, corpus, second_corpus, calib_tokens, eval_tokens, ft,
                    seed, save, progress)


def _check_context(model: str, ft: FinetuneConfig | None) -> None:
    """The fine-tuning windows fit the model's context (read from the architecture alone),
    before any work (the calibration and evaluation windows are checked by ``prepare``
    before it reads any text)."""
    context = model_context(load_model(model, weights=False).model)
    if context is None:
        return
    if ft is not None and ft.steps > 0 and ft.seq_len + 1 > context:
        raise ValueError(f"finetune.seq_len (--finetune-seq-len) {ft.seq_len}: fine-tuning "
                         f"feeds windows of seq_len + 1 = {ft.seq_len + 1} tokens, beyond the "
                         f"context of model {model!r} ({context} positions): use at most "
                         f"{context - 1}")


def _run(model: str, ccfg: CompressionConfig, out: Path, corpus: str, second_corpus: str,
         calib_tokens: int, eval_tokens: int, ft: FinetuneConfig | None, seed: int,
         save: bool, progress: bool) -> dict[str, Any]:
    t0 = time.time()
    torch.manual_seed(seed)
    source_key = model_content_key(model) if save else None  # provenance, by content
    tuned = ft is not None and ft.steps > 0
    prep = prepare(model, corpus, second_corpus, calib_tokens=calib_tokens,
                   eval_tokens=eval_tokens, seed=seed, progress=progress, seq_len=WINDOW,
                   val_tokens=ft.eval_tokens if tuned and ft is not None else 0)
    assert prep.calibration is not None
    res = {**results_header(prep), "calibration": dict(prep.calibration.meta)}
    res["ppl_original"] = evaluate_all(prep.loaded.model, prep.eval_ids, progress=progress)
    t1 = time.time()
    res["compression"] = compress_(prep.loaded.model, ccfg, prep.calibration,
                                   calib_tokens=prep.calib_ids, progress=progress)
    res["compress_seconds"] = time.time() - t1
    res["ppl_compressed"] = evaluate_all(prep.loaded.model, prep.eval_ids, progress=progress)
    if tuned and ft is not None:
        res["finetune"] = {"config": dataclasses.asdict(ft),
                           "curve": finetune(prep.loaded.model, prep.train_ids,
                                             validation_windows(prep, ft.eval_tokens), ft,
                                             progress, prefix=prep.window_prefix)}
        res["ppl_finetuned"] = evaluate_all(prep.loaded.model, prep.eval_ids,
                                            progress=progress)
    if save:
        save_compressed(prep.loaded, res["compression"], out / "model", res["calibration"],
                        source_key=source_key)
        res["saved_to"] = str(out / "model")
    res["seconds"] = time.time() - t0
    atomic_write_text(out / "compress.json", json.dumps(clean_json(res), indent=1))
    atomic_write_text(out / "report.md", _markdown(res))
    return res


def _markdown(res: dict[str, Any]) -> str:
    c = res["compression"]
    cfg = c["config"]
    lines = [f"# Compression of {res['model']} ({cfg['method']}, types {cfg['types']})", ""]
    if res.get("model_note"):
        lines += [f"**Note:** {res['model_note']}.", ""]
    if res.get("architecture_notes"):
        lines += [f"**Architecture** (`{res.get('model_type', '')}`): "
                  f"{res['architecture_notes']}.", ""]
    lines += [f"Stored parameters of the compressed matrices: {c['stored_parameters']:,} of "
              f"{c['original_parameters']:,} ({c['ratio']:.2f}× smaller, reduction "
              f"{c['reduction']:.1%}); whole model {c['model_parameters_after']:,} of "
              f"{c['model_parameters_before']:,}.", "",
              "| type | method | k | r | shape | original | stored | ratio | energy kept |",
              "|---|---|---|---|---|---|---|---|---|"]
    for t, d in c["types"].items():
        lines.append(f"| {t} | {d['method']} | {d['k']} | {d['r']} | {d['shape'][0]}×"
                     f"{d['shape'][1]} | {d['original_parameters']:,} | "
                     f"{d['stored_parameters']:,} | {d['ratio']:.2f}× | "
                     f"{d['mean_energy_kept']:.3f} |")
    lines += ["", "| text | original ppl | compressed ppl | fine-tuned ppl |",
              "|---|---|---|---|"]
    for name, p in res["ppl_original"].items():
        ftp = res.get("ppl_finetuned", {}).get(name, {}).get("ppl")
        lines.append(f"| {name} | {p['ppl']:.2f} | {res['ppl_compressed'][name]['ppl']:.2f} | "
                     f"{'—' if ftp is None else f'{ftp:.2f}'} |")
    lines += ["", f"Total time {res['seconds']:.0f} s (compression itself "
              f"{res['compress_seconds']:.1f} s)"
              + ("; every step one layer (or unit of layers) at a time, the weights read "
                 "from disk." if res.get("layer_streamed") else "."), ""]
    return "\n".join(lines)
