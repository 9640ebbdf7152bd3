"""``structlm share compress`` layer by layer: calibrate, evaluate the original, compress
and evaluate the compressed model, each with one layer (or unit of layers) resident.

The same text, windows and protocol as the whole-model run (:mod:`.run`): the windows are
drawn by :func:`~structlm.hf.pipeline.prepare` from the architecture and tokenizer alone;
the moments come from :func:`~structlm.hf.streamed_calibration.calibrate_streamed`
(cached in a folder keyed on the model's files and the calibration windows); perplexity
from :func:`~structlm.hf.layer_stream.streamed_perplexity`; the compressed folder from
:func:`~structlm.share.compress.streamed.compress_streamed`. Fine-tuning needs the whole
model for its gradients and is refused here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from structlm.hf.fingerprint import tensor_fingerprint
from structlm.hf.layer_stream import StreamedModel, open_streamed, streamed_perplexity
from structlm.hf.loading import model_content_key
from structlm.hf.pipeline import Prepared, prepare
from structlm.hf.streamed_calibration import calibrate_streamed
from structlm.share.compress.api import compress_, streamed_calibration_folder
from structlm.share.compress.apply import CompressionConfig

__all__ = ["evaluate_streamed", "original_perplexity", "results_header",
           "run_compress_streamed"]

_PROTOCOL = "streamed_perplexity float32 batch 4, every window scored on its own"
"""What an original model's cached perplexity was computed with (part of its key)."""


def evaluate_streamed(folder: Path, eval_ids: dict[str, torch.Tensor], progress: bool
                      ) -> dict[str, dict[str, Any]]:
    """Perplexity on every stream of the model in ``folder`` (plain or a sharded
    compressed folder), layer by layer: the records of
    :func:`~structlm.hf.pipeline.evaluate_all`."""
    return {name: streamed_perplexity(open_streamed(folder), ids, progress=progress).as_dict()
            for name, ids in eval_ids.items()}


def original_perplexity(source_key: str | None, folder: Path,
                        eval_ids: dict[str, torch.Tensor], progress: bool
                        ) -> dict[str, dict[str, Any]]:
    """:func:`evaluate_streamed` of the uncompressed model, cached on the weights' content
    key and the windows' content (every compression of one model on one text scores the
    same original: 25 min per stream on the 1.5B model here). No key (a model of unknown
    content): computed, not cached. An unreadable cache entry is computed again and
    replaced, never trusted."""
    from structlm.atomic import atomic_write_text
    from structlm.settings import cache_dir

    if source_key is None:
        return evaluate_streamed(folder, eval_ids, progress)
    key = hashlib.sha1(json.dumps(
        {"model_files": source_key, "protocol": _PROTOCOL,
         "windows": {n: tensor_fingerprint(ids) for n, ids in eval_ids.items()}},
        sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir("perplexity") / f"streamed-{key}.json"
    try:
        cached = json.loads(path.read_text())
        if set(cached) == set(eval_ids):
            return cached
    except (OSError, ValueError):
        pass
    res = evaluate_streamed(folder, eval_ids, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(res))
    return res


def run_compress_streamed(model: str, source: Path, ccfg: CompressionConfig, out: Path,
                          corpus: str, second_corpus: str, calib_tokens: int,
                          eval_tokens: int, seed: int, save: bool, progress: bool,
                          window: int) -> dict[str, Any]:
    """:func:`~structlm.share.compress.run.run_compress`'s results for the model in
    ``source``, streamed (the caller holds ``out``'s lock and writes the report)."""
    t0 = time.time()
    torch.manual_seed(seed)
    source_key = model_content_key(model)  # provenance and the calibration's key
    prep = prepare(model, corpus, second_corpus, calib_tokens=calib_tokens,
                   eval_tokens=eval_tokens, seed=seed, progress=progress, seq_len=window,
                   val_tokens=0, calibrate=False, weights=False)
    res = results_header(prep)
    cal_meta = {"model_files": source_key, "calibration_tokens":
                tensor_fingerprint(prep.calib_ids), "model": prep.loaded.model_id,
                "corpus": corpus, "calib_tokens": calib_tokens, "seed": seed,
                "documents": [d.name for d in prep.split.calibration],
                "sampling": "windows across documents"}
    where = streamed_calibration_folder(source_key, prep.calib_ids)
    cal = calibrate_streamed(StreamedModel(source), prep.calib_ids, where, seq_len=window,
                             meta=cal_meta, progress=progress)
    res["calibration"] = {**cal.meta, "path": str(where)}
    res["ppl_original"] = original_perplexity(source_key, source, prep.eval_ids, progress)
    t1 = time.time()
    res["compression"] = compress_(model, ccfg, cal, out=out / "model", progress=progress)
    res["compress_seconds"] = time.time() - t1
    res["ppl_compressed"] = evaluate_streamed(out / "model", prep.eval_ids, progress)
    if save:
        res["saved_to"] = str(out / "model")
    else:
        shutil.rmtree(out / "model")
    res["layer_streamed"] = True
    res["seconds"] = time.time() - t0
    return res


def results_header(prep: Prepared) -> dict[str, Any]:
    """The model and text fields every compress report starts with."""
    return {"model": prep.loaded.model_id, "model_note": prep.loaded.note,
            "family": prep.adapter.family,
            "model_type": getattr(prep.loaded.model.config, "model_type", ""),
            "architecture_notes": prep.adapter.notes, "split": prep.split.describe(),
            "text": prep.text}
