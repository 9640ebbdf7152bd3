"""Shared steps of the Part B commands: load a model, split its text, tokenise the
evaluation streams, calibrate (cached), and evaluate perplexity on every stream with
the one protocol."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .adapters import ModelAdapter, get_adapter
from .calibration import Calibration, load_or_calibrate
from .loading import LoadedModel, load_model
from .perplexity import perplexity
from .text import CorpusSplit, split_corpus, token_stream

__all__ = ["Prepared", "evaluate_all", "prepare"]


@dataclass
class Prepared:
    """A loaded model with its text streams and calibration."""

    loaded: LoadedModel
    adapter: ModelAdapter
    split: CorpusSplit
    calib_ids: torch.Tensor
    eval_ids: dict[str, torch.Tensor] = field(default_factory=dict)
    """``in_domain:<corpus>`` / ``other_domain:<corpus>`` → token stream."""
    calibration: Calibration | None = None


def _cache_dir() -> Path:
    root = os.environ.get("STRUCTLM_CACHE", os.path.join(Path.home(), ".cache", "structlm"))
    return Path(root) / "calibration"


def prepare(model: str, corpus: str, second_corpus: str = "", eval_fraction: float = 0.25,
            calib_tokens: int = 32768, eval_tokens: int = 8192, seq_len: int = 512,
            batch_size: int = 4, seed: int = 0, layers: list[int] | None = None,
            calibrate: bool = True, progress: bool = True) -> Prepared:
    """Load ``model``, split ``corpus`` by document, tokenise ``calib_tokens`` of the
    calibration part and ``eval_tokens`` of each evaluation part (in-domain and, if
    given, ``second_corpus``), and calibrate ``layers`` (cached on disk by model, corpus,
    documents, token count and seed)."""
    loaded = load_model(model)
    if loaded.tokenizer is None:
        raise ValueError(f"model {model!r} has no tokenizer: text experiments need one")
    adapter = get_adapter(loaded.model)
    split = split_corpus(corpus, eval_fraction, seed)
    prep = Prepared(loaded, adapter, split,
                    token_stream(loaded.tokenizer, split.calibration, calib_tokens))
    if eval_tokens:
        prep.eval_ids["in_domain:" + corpus] = token_stream(loaded.tokenizer, split.evaluation,
                                                            eval_tokens)
        if second_corpus:
            other = split_corpus(second_corpus, eval_fraction, seed).evaluation
            prep.eval_ids["other_domain:" + second_corpus] = token_stream(
                loaded.tokenizer, other, eval_tokens)
    if calibrate:
        meta = {"model": loaded.model_id, "corpus": corpus, "calib_tokens": calib_tokens,
                "seed": seed, "documents": [d.name for d in split.calibration]}
        key = hashlib.sha1(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]
        path = _cache_dir() / f"{key}.safetensors"
        prep.calibration = load_or_calibrate(path, adapter, prep.calib_ids, meta,
                                             layers=layers, seq_len=seq_len,
                                             batch_size=batch_size, progress=progress)
        prep.calibration.meta["path"] = str(path)
    return prep


def evaluate_all(model: Any, eval_ids: dict[str, torch.Tensor], window: int = 512,
                 batch_size: int = 4, progress: bool = True) -> dict[str, dict[str, Any]]:
    """Perplexity of ``model`` on every stream (one protocol, float64 sums)."""
    return {name: perplexity(model, ids, window=window, batch_size=batch_size,
                             progress=progress).as_dict()
            for name, ids in eval_ids.items()}
