"""Shared steps of the Part B commands: load a model, split its text three ways
(calibration and fine-tuning text, validation text for every decision, test text for the
verdicts: :mod:`structlm.hf.splits`), tokenise, calibrate (cached), and evaluate
perplexity on every stream with the one protocol."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from structlm.data.corpora import Document
from structlm.hf.adapters import ModelAdapter, get_adapter
from structlm.hf.bos import BosDecision, decide_bos
from structlm.hf.calibration import Calibration, load_or_calibrate
from structlm.hf.fingerprint import model_fingerprint, tensor_fingerprint
from structlm.hf.loading import LoadedModel, load_model, model_context
from structlm.hf.perplexity import perplexity
from structlm.hf.splits import Role, Windows, holdout_tail
from structlm.hf.text import (
    CorpusSplit,
    sample_windows,
    split_corpus,
    tokenize_documents,
    windows_for_scored_tokens,
)
from structlm.settings import cache_dir

__all__ = ["VALIDATION_FRACTION", "Prepared", "evaluate_all", "prepare",
           "validation_windows"]

VALIDATION_FRACTION = 0.1
"""The share of every calibration document held out at its end as validation text."""


@dataclass
class Prepared:
    """A loaded model with its text streams and calibration."""

    loaded: LoadedModel
    adapter: ModelAdapter
    split: CorpusSplit
    calib_ids: torch.Tensor
    """Calibration windows ``(n, seq_len)`` drawn across the heads of all calibration
    documents (their validation tails left out)."""
    train_ids: torch.Tensor
    """The heads of every calibration document as one stream (fine-tuning draws from it;
    the validation tails are not in it)."""
    eval_ids: dict[str, torch.Tensor] = field(default_factory=dict)
    """The **test** windows: ``in_domain:<corpus>`` / ``other_domain:<corpus>`` → windows
    ``(n, seq_len)`` drawn across all evaluation documents of that corpus; scored once per
    finished arm, never read by a decision."""
    validation: Windows | None = None
    """Validation windows drawn across the calibration documents' tails (every decision
    reads these: :func:`structlm.hf.splits.require_validation`)."""
    calibration: Calibration | None = None
    text: dict[str, Any] = field(default_factory=dict)
    """Exactly which text was used: per stream, the windows drawn from each document."""
    window_prefix: list[int] = field(default_factory=list)
    """The ids the tokenizer puts before every input (every window starts with them;
    fine-tuning windows too)."""
    bos: BosDecision | None = None
    """The model's BOS decision (:func:`structlm.hf.bos.decide_bos`): whether every
    window starts with BOS; ``None`` when no text was prepared."""


def _cache_dir() -> Path:
    return cache_dir("calibration")


def check_layers(layers: list[int], num_layers: int | None = None) -> None:
    """Refuse repeated or out-of-range layer indices (a layer compared with itself, or
    an index error deep inside calibration)."""
    from collections import Counter

    dup = sorted(i for i, n in Counter(layers).items() if n > 1)
    if dup:
        raise ValueError(f"layers {list(layers)} repeat {dup}: every compared layer must be "
                         "distinct")
    bad = [i for i in layers if i < 0 or (num_layers is not None and i >= num_layers)]
    if bad:
        where = f"[0, {num_layers})" if num_layers is not None else ">= 0"
        raise ValueError(f"layers {bad} are out of range: expected indices in {where}")


def prepare(model: str, corpus: str, second_corpus: str = "", eval_fraction: float = 0.25,
            calib_tokens: int = 32768, eval_tokens: int = 8192, seq_len: int = 512,
            batch_size: int = 4, seed: int = 0, layers: list[int] | None = None,
            calibrate: bool = True, progress: bool = True,
            calib_seed: int | None = None, val_fraction: float = VALIDATION_FRACTION,
            val_tokens: int = 8192, text: bool = True, weights: bool = True) -> Prepared:
    """Load ``model``, split ``corpus`` by document, draw ``calib_tokens // seq_len``
    calibration windows across all calibration documents and enough evaluation windows
    to score ``eval_tokens`` tokens across all evaluation documents (in-domain and, if
    given, ``second_corpus``'s evaluation part), seeded by ``seed``; calibrate ``layers``
    (cached on disk, keyed on the model's weights and the exact calibration tokens).
    ``calib_seed`` (default ``seed``) draws the calibration windows alone: another draw
    from the same calibration documents, the split and evaluation windows unchanged.

    The last ``val_fraction`` of every calibration document's tokens is held out: enough
    validation windows to score ``val_tokens`` tokens are drawn across these tails (0: none),
    and neither the calibration windows nor the fine-tuning stream read them.

    ``text=False``: the model alone (no tokenizer needed, no corpus read, no windows
    drawn, nothing calibrated), for a caller that uses no text. ``weights=False``: the
    architecture and tokenizer without the weights (a caller that streams the model layer
    by layer, :mod:`structlm.hf.layer_stream`, and calibrates it itself)."""
    if not weights and calibrate:
        raise ValueError("prepare(weights=False) cannot calibrate: the weights are not read "
                         "(pass calibrate=False and calibrate the streamed model)")
    loaded = load_model(model, weights=weights)
    if not text:
        adapter = get_adapter(loaded.model)
        if layers is not None:
            check_layers(layers, adapter.num_layers)
        return Prepared(loaded, adapter, CorpusSplit(corpus, [], []),
                        torch.empty((0, seq_len), dtype=torch.long),
                        torch.empty(0, dtype=torch.long))
    if loaded.tokenizer is None:
        raise ValueError(f"model {model!r} has no tokenizer: text experiments need one")
    if calib_tokens < seq_len:
        raise ValueError(f"calib_tokens={calib_tokens} is fewer than one window of "
                         f"seq_len={seq_len}")
    context = model_context(loaded.model)
    if context is not None and seq_len > context:
        raise ValueError(f"windows of seq_len={seq_len} tokens are longer than the context "
                         f"of model {model!r} ({context} positions): the model would be "
                         "scored and calibrated beyond the positions it was trained for")
    adapter = get_adapter(loaded.model)
    if layers is not None:
        check_layers(layers, adapter.num_layers)
    split = split_corpus(corpus, eval_fraction, seed)
    calib_tok, tails = holdout_tail(tokenize_documents(loaded.tokenizer, split.calibration),
                                    val_fraction)
    bos = decide_bos(loaded.tokenizer, model=repr(model))  # the model's convention
    prefix = bos.prefix()  # the tokenizer's own prefix, BOS first where it puts BOS
    calib = sample_windows(split.calibration, calib_tok, calib_tokens // seq_len, seq_len,
                           seed if calib_seed is None else calib_seed, prefix)
    prep = Prepared(loaded, adapter, split, calib.windows, torch.cat(calib_tok),
                    window_prefix=prefix, bos=bos)
    prep.text["calibration:" + corpus] = {**calib.describe(), "part": (
        f"the first {1 - val_fraction:.0%} of each calibration document's tokens")}
    if val_tokens:
        tail_docs = [Document(f"{d.name} (last {val_fraction:.0%})", "")
                     for d in split.calibration]
        val = sample_windows(tail_docs, tails, windows_for_scored_tokens(val_tokens, seq_len),
                             seq_len, seed + 2, prefix)
        used = tuple(n for n, c in val.per_document.items() if c)
        overlap = {d.name for d in split.calibration} & {d.name for d in split.evaluation}
        assert not overlap, f"validation and test documents overlap: {sorted(overlap)}"
        prep.validation = Windows(val.windows, Role.VALIDATION, "validation:" + corpus, used)
        prep.text["validation:" + corpus] = {**val.describe(), "part": (
            f"the last {val_fraction:.0%} of each calibration document's tokens (no "
            "calibration window or fine-tuning batch reads them)")}
    if eval_tokens:
        n_eval = windows_for_scored_tokens(eval_tokens, seq_len)
        texts = [("in_domain:" + corpus, split.evaluation)]
        if second_corpus:
            texts.append(("other_domain:" + second_corpus,
                          split_corpus(second_corpus, eval_fraction, seed).evaluation))
        for name, docs in texts:
            ev = sample_windows(docs, tokenize_documents(loaded.tokenizer, docs), n_eval,
                                seq_len, seed + 1, prefix)
            prep.eval_ids[name] = ev.windows
            prep.text[name] = ev.describe()
    for described in prep.text.values():  # every text's record states its BOS
        described["bos"] = bos.as_dict()
    if calibrate:
        # keyed on content: the model's weights and the exact token windows (text, its
        # tokenizer and the draw); the names are kept in the record only
        content = {"model_weights": model_fingerprint(loaded.model),
                   "calibration_tokens": tensor_fingerprint(prep.calib_ids)}
        meta = {**content, "model": loaded.model_id, "corpus": corpus,
                "calib_tokens": calib_tokens, "seed": seed,
                **({} if calib_seed is None else {"calib_seed": calib_seed}),
                "documents": [d.name for d in split.calibration],
                "sampling": "windows across documents"}
        key = hashlib.sha1(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]
        path = _cache_dir() / f"{key}.safetensors"
        prep.calibration = load_or_calibrate(path, adapter, prep.calib_ids, meta,
                                             layers=layers, seq_len=seq_len,
                                             batch_size=batch_size, progress=progress)
        prep.calibration.meta["path"] = str(path)
    return prep


def evaluate_all(model: Any, eval_ids: dict[str, torch.Tensor], window: int = 512,
                 batch_size: int = 4, progress: bool = True,
                 bos_token: int | None = None) -> dict[str, dict[str, Any]]:
    """Perplexity of ``model`` on every stream (one protocol, float64 sums); each record
    says whether every scored window started with BOS (``bos_token``, default the model
    config's BOS id: :func:`structlm.hf.perplexity.perplexity`)."""
    return {name: perplexity(model, ids, window=window, batch_size=batch_size,
                             progress=progress, bos_token=bos_token).as_dict()
            for name, ids in eval_ids.items()}


def validation_windows(prep: Prepared, n_tokens: int) -> Windows:
    """Evenly spread validation windows scoring at least ``n_tokens`` tokens (all of them
    if there are fewer): what a fine-tuning curve and its decisions read."""
    if prep.validation is None:
        raise ValueError("this preparation drew no validation windows (val_tokens=0)")
    return prep.validation.spread(n_tokens)
