"""One arm of ``structlm experiment share``: a compressed copy of the model (sharing the
dense parameters, checked unchanged), its analytic evaluation, its fine-tuning (curve on
the validation windows, the test windows scored once at the end), and the cache of
finished arms in ``arms.json`` that makes the experiment resumable."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from structlm.atomic import atomic_write_text, clean_json
from structlm.experiments.share.config import ExperimentConfig
from structlm.experiments.share.rate_probe import best_validation, probe_finetune
from structlm.hf.adapters import MatrixType, get_adapter
from structlm.hf.finetune import FinetuneConfig, finetune
from structlm.hf.pipeline import Prepared, evaluate_all, validation_windows
from structlm.share.compress import (
    CompressionConfig,
    TypeRanks,
    compress_model,
    get_method,
    plan_types,
)

__all__ = ["ArmCache", "calib_seed", "finetune_budget", "token_macs_ratio"]


def _evaluate(model: Any, prep: Prepared) -> dict[str, dict[str, Any]]:
    """The test windows of every text, scored once: perplexity and the per-window NLLs
    every verdict is computed from (:mod:`structlm.stats`)."""
    return evaluate_all(model, prep.eval_ids, progress=False)


def _ppls(ev: dict[str, dict[str, Any]]) -> dict[str, float]:
    return {k: v["ppl"] for k, v in ev.items()}


def finetune_budget(ft: FinetuneConfig) -> dict[str, Any]:
    """What a fine-tuned arm was trained with: steps, tokens and the checkpoint rule
    (compared arms must have equal budgets)."""
    return {"steps": ft.steps, "tokens": ft.steps * ft.batch_size * ft.seq_len,
            "checkpoint": "best validation" if ft.keep_best else "last step"}


def _parameter_state(p: torch.nn.Parameter) -> tuple[Any, ...]:
    """What an arm must leave unchanged in a shared parameter: its storage, dtype,
    device and shape (``.data`` swaps and ``.to`` do not bump the version counter) and
    its version counter (in-place writes)."""
    return (p.data_ptr(), p.dtype, p.device, tuple(p.shape), p._version)


def _parameter_sharing_copy(model: Any) -> tuple[Any, Callable[[], None]]:
    """A copy of ``model``'s module tree that shares its parameters (buffers are copied),
    and a check that raises if any shared parameter was changed since, then gives each
    its ``requires_grad`` flag back.

    Compression replaces modules (the copy's dense weights are only read) and fine-tuning
    trains only the new modules' factors, so an arm needs no second copy of the weights:
    on Qwen2.5-Coder-0.5B that copy was 2.5 GB of a peak that did not fit beside the
    other experiments. Every arm calls the check after its work (storage, dtype, device,
    shape and version counter of every shared parameter: exact and free), so a method
    that wrote into a weight it was given fails loudly instead of corrupting the next
    arm's source; fine-tuning freezes every parameter of its copy, the shared ones too,
    and the check restores their flags."""
    params = list(model.parameters())
    states = [_parameter_state(p) for p in params]
    flags = [p.requires_grad for p in params]
    copied = copy.deepcopy(model, memo={id(p): p for p in params})

    def check() -> None:
        changed = [i for i, (p, st) in enumerate(zip(params, states, strict=True))
                   if _parameter_state(p) != st]
        if changed:
            raise AssertionError(f"{len(changed)} parameters of the source model were "
                                 f"changed by an arm (first: #{changed[0]})")
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)

    return copied, check


def _compress(prep: Prepared, ccfg: CompressionConfig, progress: bool = False
              ) -> tuple[Any, dict[str, Any], Callable[[], None]]:
    """A compressed copy of the model (deterministic: no seed involved) sharing the
    uncompressed parameters with the source, and the check that they stayed unchanged."""
    model, check = _parameter_sharing_copy(prep.loaded.model)
    assert prep.calibration is not None
    rep = compress_model(get_adapter(model), prep.calibration, ccfg, progress=progress,
                         calib_tokens=prep.calib_ids)
    check()
    return model, rep, check


def _analytic(prep: Prepared, ccfg: CompressionConfig, progress: bool = False
              ) -> dict[str, Any]:
    """Compress a fresh copy and evaluate it before any training (a random start is
    drawn with seed 0)."""
    t0 = time.time()
    torch.manual_seed(0)
    model, rep, check = _compress(prep, ccfg, progress)
    out: dict[str, Any] = {
        "method": ccfg.method, "types": ccfg.types, "reduction": ccfg.target_reduction,
        "ratio": rep["ratio"], "stored_parameters": rep["stored_parameters"],
        "original_parameters": rep["original_parameters"],
        "energy_kept": {t: d["mean_energy_kept"] for t, d in rep["types"].items()},
        "ranks": {t: {"k_out": d["k_out"], "k_in": d["k_in"], "r": d["r"],
                      "method": d["method"], "groups": len(d["group_sizes"])}
                  for t, d in rep["types"].items()},
        "stored_by_type": {t: [d["stored_parameters"], d["original_parameters"]]
                           for t, d in rep["types"].items()},
        "residual_share_of_basis_error": {
            t: sum(d["residual_share_of_basis_error"]) / len(d["residual_share_of_basis_error"])
            for t, d in rep["types"].items() if "residual_share_of_basis_error" in d},
        "analytic_seconds": time.time() - t0}
    out["eval_analytic"] = _evaluate(model, prep)
    out["ppl_analytic"] = _ppls(out["eval_analytic"])
    out["analytic_seconds"] = time.time() - t0
    check()
    if "update" in rep:
        out["update"] = rep["update"]
    return out


def token_macs_ratio(prep: Prepared, ccfg: CompressionConfig, arm: dict[str, Any]) -> float:
    """Decoder projection MACs per token of the compressed model (one row, the modules'
    own order) over the original's, from the arm's recorded ranks: every linear type of
    every layer counted, the uncompressed ones at ``out·in``."""
    ad = prep.adapter
    L = ad.num_layers
    dense = {t: L * ad.layers[0].weight(t).numel() for t in MatrixType}
    now = dict(dense)
    for plan in plan_types(ad, ccfg):
        r = arm["ranks"][plan.type.value]
        out, inn = plan.shape
        now[plan.type] = get_method(r["method"]).token_macs(
            out, inn, TypeRanks(r["k_out"], r["k_in"], r["r"]), [len(g) for g in plan.groups],
            plan.parts)
    return sum(now.values()) / sum(dense.values())


def _tuned(prep: Prepared, ccfg: CompressionConfig, ft: FinetuneConfig, seed: int,
           progress: bool, state_path: Path | None = None,
           continue_from: Path | None = None, score_test: bool = True) -> dict[str, Any]:
    """Compress a fresh copy, fine-tune it with ``seed`` (resuming from ``state_path``
    if a killed run left one, else continuing a shorter run's ``continue_from`` state if
    given) with its curve on the validation windows, then score the test windows once at
    the run's checkpoint (the best validation one with ``keep_best``); ``score_test``
    False (the rate probe) leaves the test windows unread."""
    t0 = time.time()
    torch.manual_seed(seed)  # a random start (``lowrank-random``) is the run's own
    model, _, check = _compress(prep, ccfg, progress)
    torch.manual_seed(seed)
    ftc = dataclasses.replace(ft, seed=seed)
    curve = finetune(model, prep.train_ids, validation_windows(prep, ft.eval_tokens), ftc,
                     progress, state_path=state_path, prefix=prep.window_prefix,
                     continue_from=continue_from)
    check()
    out = {"seed": seed, "finetune": dataclasses.asdict(ftc), "curve": curve,
           "budget": finetune_budget(ft),
           "selected_step": best_validation(curve)[1] if ft.keep_best else ft.steps}
    if score_test:
        out["eval_finetuned"] = _evaluate(model, prep)
        out["ppl_finetuned"] = _ppls(out["eval_finetuned"])
    out["finetune_seconds"] = time.time() - t0
    return out


class ArmCache:
    """Finished arms in ``arms.json`` next to the report, written atomically after each
    one, so a killed experiment resumes where it stopped. The analytic part of an arm is
    keyed by the compression config (it does not depend on the seed); a fine-tuned part by
    the compression config, the fine-tuning config and the seed. A fine-tuning run in
    progress keeps its state in ``finetune-state/<hash of its key>.pt`` beside
    ``arms.json`` (every few steps), so a kill mid-run loses minutes, not the run."""

    def __init__(self, path: Path, cfg: ExperimentConfig) -> None:
        self.path = path
        self.base = {"calib_tokens": cfg.calib_tokens, "eval_tokens": cfg.eval_tokens,
                     "corpus": cfg.corpus, "second_corpus": cfg.second_corpus,
                     "val_tokens": cfg.val_tokens,
                     "protocol": "windows across documents; validation tails held out"}
        self.done: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        self.keep_states = cfg.keep_finetune_states

    def _key(self, prep: Prepared, ccfg: CompressionConfig, **extra: Any) -> str:
        draw = calib_seed(prep)
        if draw:  # the first draw's keys predate the field: they stay as they were
            extra = {**extra, "calib_seed": draw}
        return json.dumps({**self.base, "model": prep.loaded.model_id,
                           "compression": ccfg.legacy_dict(), **extra}, sort_keys=True)

    def state_path(self, key: str, final: bool = False) -> Path:
        """Where the fine-tuning run of ``key`` keeps its resumable state (``final``: where
        a finished run's state is kept with ``keep_finetune_states``)."""
        return self.path.parent / ("finetune-final" if final else "finetune-state") / (
            hashlib.sha1(key.encode()).hexdigest()[:16] + ".pt")

    def _get(self, key: str, make: Any, label: str, progress: bool) -> dict[str, Any]:
        if key not in self.done:
            if progress:
                print(f"[arm] {label}", flush=True)
            self.done[key] = clean_json(make())
            atomic_write_text(self.path, json.dumps(self.done))
        self._settle_state(key)  # also after a kill between the write and the move
        return self.done[key]

    def _settle_state(self, key: str) -> None:
        """A recorded run's state: kept in ``finetune-final/`` (``keep_finetune_states``)
        or deleted — the state is spent."""
        state = self.state_path(key)
        if not state.exists():
            return
        if self.keep_states:
            self.state_path(key, final=True).parent.mkdir(exist_ok=True)
            os.replace(state, self.state_path(key, final=True))
        state.unlink(missing_ok=True)

    def analytic(self, prep: Prepared, ccfg: CompressionConfig,
                 progress: bool) -> dict[str, Any]:
        label = f"{ccfg.method} on {ccfg.types} at {ccfg.target_reduction or ccfg.k_fraction}"
        return self._get(self._key(prep, ccfg, part="analytic"),
                         lambda: _analytic(prep, ccfg, progress), label + " (analytic)", progress)

    def tuned(self, prep: Prepared, ccfg: CompressionConfig, ft: FinetuneConfig, seed: int,
              progress: bool) -> dict[str, Any] | None:
        """The fine-tuned part (``None`` if it is not done and ``run`` is False)."""
        key = self.tuned_key(prep, ccfg, ft, seed)
        label = (f"{ccfg.method} on {ccfg.types} at "
                 f"{ccfg.target_reduction or ccfg.k_fraction}, fine-tuned, seed {seed}")
        return self._get(key, lambda: _tuned(prep, ccfg, ft, seed, progress,
                                             self.state_path(key)), label, progress)

    def tuned_key(self, prep: Prepared, ccfg: CompressionConfig, ft: FinetuneConfig,
                  seed: int) -> str:
        """The key of one fine-tuning run in ``arms.json``."""
        return self._key(prep, ccfg, part="finetuned", seed=seed,
                         finetune=dataclasses.asdict(ft))

    def has_tuned(self, prep: Prepared, ccfg: CompressionConfig, ft: FinetuneConfig,
                  seed: int) -> bool:
        return self.tuned_key(prep, ccfg, ft, seed) in self.done

    def continuation_key(self, prep: Prepared, ccfg: CompressionConfig, ft: FinetuneConfig,
                         seed: int, to_steps: int) -> str:
        """The key of the run continued to ``to_steps``."""
        return self.tuned_key(prep, ccfg, dataclasses.replace(ft, steps=to_steps), seed)

    def continued(self, prep: Prepared, ccfg: CompressionConfig, ft: FinetuneConfig,
                  seed: int, to_steps: int, progress: bool, run: bool
                  ) -> dict[str, Any] | None:
        """The ``ft.steps`` run continued to ``to_steps`` (``None`` when it is not done
        and ``run`` is False). It starts from the run's kept final state, or from step 0
        where none was kept. Whether runs are continued is the experiment's decision
        (every whole-model run or none: equal budgets)."""
        key = self.continuation_key(prep, ccfg, ft, seed, to_steps)
        if key not in self.done and not run:
            return None
        short_key = self.tuned_key(prep, ccfg, ft, seed)
        longer = dataclasses.replace(ft, steps=to_steps)
        final = self.state_path(short_key, final=True)
        label = (f"{ccfg.method} on {ccfg.types} at {ccfg.target_reduction}, fine-tuned, "
                 f"seed {seed}, continued {ft.steps} -> {to_steps} steps")
        return self._get(key, lambda: _tuned(prep, ccfg, longer, seed, progress,
                                             self.state_path(key),
                                             final if final.exists() else None),
                         label, progress)

    def probe_key(self, prep: Prepared, ccfg: CompressionConfig, ft: FinetuneConfig,
                  seed: int) -> str:
        """The key of one learning-rate probe run."""
        return self._key(prep, ccfg, part="lr_probe", seed=seed,
                         finetune=dataclasses.asdict(ft))

    def probe(self, prep: Prepared, ccfg: CompressionConfig, ft: FinetuneConfig, rate: float,
              steps: int, seed: int, progress: bool, run: bool) -> dict[str, Any] | None:
        """One probe run at ``rate`` (its curve; the test windows are not scored), or
        ``None`` when it is not done and ``run`` is False."""
        pft = probe_finetune(ft, rate, steps)
        key = self.probe_key(prep, ccfg, pft, seed)
        if key not in self.done and not run:
            return None
        label = (f"{ccfg.method} on {ccfg.types} at {ccfg.target_reduction}, rate probe "
                 f"{rate:g}, seed {seed}")
        return self._get(key, lambda: _tuned(prep, ccfg, pft, seed, progress,
                                             self.state_path(key), score_test=False),
                         label, progress)


def calib_seed(prep: Prepared) -> int:
    """The calibration draw ``prep`` was prepared with (the split's seed, 0, unless
    another draw was asked for)."""
    return int(prep.calibration.meta.get("calib_seed", 0)) if prep.calibration else 0
