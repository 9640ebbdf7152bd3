"""``structlm share experiment``: the seed's tests 4–9 end to end on one model.

Every arm starts from a fresh copy of the same loaded model, uses the same calibration,
the same evaluation streams and the same perplexity function:

* **test 4** — analytic reconstruction: each method at each target reduction of the
  attention matrices' parameters, perplexity before any training, with the energy kept
  (the "energy captured vs perplexity" plot);
* **tests 5/6** — fine-tuning at equal budget: cores of the shared bases (and the
  hybrid's residuals), the free factors of per-layer SVD, the one-sided coefficients —
  over several seeds (mean ± sample std), training curves kept;
* **test 7** — shared bases on attention only, MLP only, all;
* **test 8** — the same attention compression on a second model, if one is given
  (none is obtainable offline here: the report says so);
* **test 9** — the hybrid (shared + rank-r residual) on MLP and on all matrices.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..adapters import get_adapter
from ..configs import dataclass_from_dict
from ..pipeline import Prepared, evaluate_all, prepare
from ..report import atomic_write_text, clean_json
from .apply import CompressionConfig, compress_model, solve_ranks
from .finetune import FinetuneConfig, finetune

__all__ = ["ExperimentConfig", "run_experiment"]


@dataclass
class ExperimentConfig:
    """Budgets of the experiment (defaults: about 3 h on 2 cores for SmolLM2, estimated from
    the 87 min of configs/share/experiment-reduced.yaml)."""

    model: str = "smollm2"
    corpus: str = "austen"
    second_corpus: str = "shakespeare"
    second_model: str = ""
    """Test 8's larger model ("" = not run)."""
    calib_tokens: int = 32768
    eval_tokens: int = 4096
    reductions: list[float] = field(default_factory=lambda: [0.2, 0.4])
    methods: list[str] = field(default_factory=lambda: ["shared", "hybrid", "svd", "onesided"])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    residual_rank: int = 32
    scope_reduction: float = 0.4
    """Reduction used for tests 7 and 9."""
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ExperimentConfig:
        return dataclass_from_dict(cls, raw, {"finetune": FinetuneConfig})


def _arm(prep: Prepared, ccfg: CompressionConfig, ft: FinetuneConfig | None,
         seed: int, progress: bool) -> dict[str, Any]:
    """Compress a fresh copy, evaluate, optionally fine-tune and evaluate again."""
    model = copy.deepcopy(prep.loaded.model)
    adapter = get_adapter(model)
    torch.manual_seed(seed)
    assert prep.calibration is not None
    rep = compress_model(adapter, prep.calibration, ccfg)
    out: dict[str, Any] = {
        "method": ccfg.method, "types": ccfg.types, "reduction": ccfg.target_reduction,
        "seed": seed, "ratio": rep["ratio"], "stored_parameters": rep["stored_parameters"],
        "original_parameters": rep["original_parameters"],
        "energy_kept": {t: d["mean_energy_kept"] for t, d in rep["types"].items()},
        "ranks": {t: [d["k"], d["r"]] for t, d in rep["types"].items()},
        "residual_share_of_basis_error": {
            t: sum(d["residual_share_of_basis_error"]) / len(d["residual_share_of_basis_error"])
            for t, d in rep["types"].items() if "residual_share_of_basis_error" in d},
        "ppl_analytic": {k: v["ppl"] for k, v in
                         evaluate_all(model, prep.eval_ids, progress=False).items()}}
    if ft is not None and ft.steps > 0:
        in_domain = next(iter(prep.eval_ids.values()))
        ftc = dataclasses.replace(ft, seed=seed)
        out["curve"] = finetune(model, prep.calib_ids, in_domain[: ft.eval_tokens], ftc,
                                progress)
        out["ppl_finetuned"] = {k: v["ppl"] for k, v in
                                evaluate_all(model, prep.eval_ids, progress=False).items()}
    del model
    return out


class _ArmCache:
    """Finished arms in ``arms.json`` next to the report, written atomically after each
    arm, so a killed experiment resumes where it stopped (keyed by everything that
    determines an arm's result)."""

    def __init__(self, path: Path, cfg: ExperimentConfig) -> None:
        self.path = path
        self.base = {"calib_tokens": cfg.calib_tokens, "eval_tokens": cfg.eval_tokens,
                     "corpus": cfg.corpus, "second_corpus": cfg.second_corpus,
                     "finetune": dataclasses.asdict(cfg.finetune)}
        self.done: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}

    def run(self, prep: Prepared, ccfg: CompressionConfig, ft: FinetuneConfig | None,
            seed: int, progress: bool) -> dict[str, Any]:
        # keyed by the solved ranks, not by how they were derived (target, budget mode)
        ranks = {t.value: k for t, k in solve_ranks(prep.adapter, ccfg).items()}
        comp = {"method": ccfg.method, "types": ccfg.types, "ranks": ranks,
                "residual_rank": ccfg.residual_rank if ccfg.method == "hybrid" else 0,
                "eig_floor": ccfg.eig_floor, "target_reduction": ccfg.target_reduction}
        key = json.dumps({**self.base, "model": prep.loaded.model_id, "seed": seed,
                          "compression": comp}, sort_keys=True)
        if key not in self.done:
            self.done[key] = clean_json(_arm(prep, ccfg, ft, seed, progress))
            atomic_write_text(self.path, json.dumps(self.done))
        elif progress:
            print(f"[resume] reusing {ccfg.method}/{ccfg.types}/{ccfg.target_reduction}/seed "
                  f"{seed} from {self.path}", flush=True)
        return self.done[key]


def _summary(arms: list[dict[str, Any]], key: str, name: str) -> dict[str, float]:
    vals = [a[key][name] for a in arms if key in a]
    if not vals:
        return {}
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1
            else 0.0, "min": min(vals), "max": max(vals), "n": len(vals)}


def run_experiment(cfg: ExperimentConfig, out_dir: str | Path, progress: bool = True
                   ) -> dict[str, Any]:
    """Run tests 4–9; writes ``experiment.json``, ``report.md`` and plots."""
    from .experiment_report import write_experiment_report

    t0 = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=1))
    cache = _ArmCache(out / "arms.json", cfg)
    prep = prepare(cfg.model, cfg.corpus, cfg.second_corpus, calib_tokens=cfg.calib_tokens,
                   eval_tokens=cfg.eval_tokens, progress=progress)
    res: dict[str, Any] = {"model": prep.loaded.model_id, "model_note": prep.loaded.note,
                           "split": prep.split.describe(), "eval_texts": list(prep.eval_ids),
                           "calibration": dict(prep.calibration.meta if prep.calibration
                                               else {})}
    res["ppl_original"] = {k: v["ppl"] for k, v in
                           evaluate_all(prep.loaded.model, prep.eval_ids, progress=False).items()}
    in_name = next(iter(prep.eval_ids))
    # tests 4-6: attention at each reduction, each method, analytic then fine-tuned
    res["attention"] = []
    for red in cfg.reductions:
        for method in cfg.methods:
            ccfg = CompressionConfig(method=method, types="attn", target_reduction=red,
                                     residual_rank=cfg.residual_rank)
            arms = [cache.run(prep, ccfg, cfg.finetune, s, progress) for s in cfg.seeds]
            res["attention"].append({
                "method": method, "reduction": red, "arms": arms,
                "analytic": arms[0]["ppl_analytic"],
                "finetuned": _summary(arms, "ppl_finetuned", in_name)})
            if progress:
                ft = res["attention"][-1]["finetuned"]
                print(f"[attn {red:.0%} {method}] analytic {arms[0]['ppl_analytic'][in_name]:.2f}"
                      + (f", fine-tuned {ft['mean']:.2f} ± {ft['std']:.2f}" if ft else ""),
                      flush=True)
    # tests 7 and 9: scope (shared and hybrid) at one reduction, one seed
    res["scope"] = []
    for method in ("shared", "hybrid"):
        for types in ("attn", "mlp", "all"):
            ccfg = CompressionConfig(method=method, types=types,
                                     target_reduction=cfg.scope_reduction,
                                     residual_rank=cfg.residual_rank)
            res["scope"].append(cache.run(prep, ccfg, cfg.finetune, cfg.seeds[0], progress))
    # test 8: a second model
    if cfg.second_model:
        sub = dataclasses.replace(cfg, model=cfg.second_model, second_model="")
        p2 = prepare(sub.model, sub.corpus, sub.second_corpus, calib_tokens=sub.calib_tokens,
                     eval_tokens=sub.eval_tokens, progress=progress)
        ccfg = CompressionConfig(method="shared", types="attn",
                                 target_reduction=cfg.scope_reduction)
        res["second_model"] = {
            "model": p2.loaded.model_id,
            "ppl_original": {k: v["ppl"] for k, v in
                             evaluate_all(p2.loaded.model, p2.eval_ids, progress=False).items()},
            "arm": cache.run(p2, ccfg, cfg.finetune, cfg.seeds[0], progress)}
    else:
        res["second_model"] = {"skipped": "no second model given (none is obtainable offline "
                                          "here); pass --second-model, e.g. gpt2-medium"}
    res["seconds"] = time.time() - t0
    atomic_write_text(out / "experiment.json", json.dumps(clean_json(res), indent=1))
    write_experiment_report(res, cfg, out)
    return res
