"""``structlm share analyze``: tests 1–3 with null controls, the role classifier, and
the base model's perplexity, on one pretrained model — one report folder.

Thresholds are part of :class:`AnalysisConfig` and are written into the report before
any test runs (``config.json``), so verdicts are decided by numbers fixed in advance.
"""

from __future__ import annotations

import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from .adapters import MATRIX_TYPES, MatrixType, ModelAdapter, parse_types
from .alignment import MOVES, align
from .configs import dataclass_from_dict
from .linalg import psd_sqrt, random_like_spectrum, thin_svd
from .pipeline import evaluate_all, prepare
from .roles import FEATURE_NAMES, role_features, transfer_test
from .subspaces import functional_matrices, subspace_scores

__all__ = ["AnalysisConfig", "Thresholds", "run_analysis"]


@dataclass
class Thresholds:
    """Decision thresholds, fixed before the run."""

    alignment_max_residual: float = 0.5
    """Test 1 lives if the median cheap-move (perm + diagonal) residual is at most this..."""
    alignment_min_margin: float = 0.1
    """...and at least this far below the null's."""
    subspace_min_score: float = 0.5
    """Tests 2/3 live if the mean score is at least this..."""
    subspace_min_margin: float = 0.2
    """...and at least this far above the null control's score."""
    classifier_max_p: float = 0.05
    """The role signature transfers if accuracy beats the majority rate with p ≤ this."""


@dataclass
class AnalysisConfig:
    """One analysis run (every field settable from the CLI or a YAML file)."""

    model: str = "smollm2"
    corpus: str = "austen"
    """Calibration corpus; its held-out documents are the in-domain evaluation text."""
    second_corpus: str = "shakespeare"
    """A different-domain corpus for perplexity only ("" to skip)."""
    eval_fraction: float = 0.25
    calib_tokens: int = 32768
    seq_len: int = 512
    batch_size: int = 4
    eval_tokens: int = 8192
    """Tokens per corpus for perplexity (0 skips perplexity)."""
    types: str = "all"
    layers: list[int] | None = None
    """Layers to analyse (``None``: all)."""
    reference_layer: int | None = None
    """Test 1's reference layer (``None``: the middle of ``layers``)."""
    k_fraction: float = 0.25
    """Subspace size k = k_fraction × min(out, in) (d/4 for square matrices)."""
    energy: float = 0.9
    eig_floor: float = 1e-8
    permutations: int = 500
    seed: int = 0
    thresholds: Thresholds = field(default_factory=Thresholds)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> AnalysisConfig:
        return dataclass_from_dict(cls, raw, {"thresholds": Thresholds})


def _median(xs: list[float]) -> float:
    return float(np.median(xs)) if xs else float("nan")


def _alignment_test(weights: dict[int, torch.Tensor], ref: int, gen: torch.Generator,
                    th: Thresholds, bar: Any, row_blocks: int = 1) -> dict[str, Any]:
    R = weights[ref]
    jobs: list[tuple[int, str, torch.Tensor]] = []
    for layer, W in weights.items():  # nulls drawn first, in a fixed order (reproducible)
        if layer == ref:
            continue
        g = torch.randn(W.shape, generator=gen, dtype=torch.float64)
        jobs += [(layer, "real", W), (layer, "null_gaussian", g * (W.double().norm() / g.norm())),
                 (layer, "null_spectrum", random_like_spectrum(W, gen))]
    per_layer: dict[str, dict[str, Any]] = {
        str(layer): {"distance": abs(layer - ref)} for layer in weights if layer != ref}

    def run(job: tuple[int, str, torch.Tensor]) -> tuple[int, str, dict[str, float]]:
        return job[0], job[1], align(R, job[2], row_blocks)

    # the Hungarian solver is single-threaded and releases the GIL: two at a time
    with ThreadPoolExecutor(max_workers=2) as pool:
        for layer, kind, res in pool.map(run, jobs):
            per_layer[str(layer)][kind] = res
            if kind == "null_spectrum":
                bar.update(1)
    summary = {kind: {m: _median([v[kind][m] for v in per_layer.values()]) for m in MOVES}
               for kind in ("real", "null_gaussian", "null_spectrum")}
    real, null = summary["real"], summary["null_gaussian"]
    drop = real["raw"] - real["perm_diag"]
    scaling_share = (real["raw"] - real["scale"]) / drop if drop > 1e-12 else float("nan")
    dists = sorted({v["distance"] for v in per_layer.values()})
    near = [v["real"]["rot1"] for v in per_layer.values() if v["distance"] <= 2]
    far_cut = max(3, (max(dists) + 1) // 2) if dists else 3
    far = [v["real"]["rot1"] for v in per_layer.values() if v["distance"] >= far_cut]
    lives = (real["perm_diag"] <= th.alignment_max_residual
             and null["perm_diag"] - real["perm_diag"] >= th.alignment_min_margin)
    return {"reference_layer": ref, "per_layer": per_layer, "median": summary,
            "norm_scaling_share_of_cheap_drop": scaling_share,
            "locality": {"near_rot1": _median(near), "far_rot1": _median(far),
                         "gradient": _median(far) - _median(near) if near and far
                         else float("nan"), "far_from_distance": far_cut},
            "verdict": "lives" if lives else "fails"}


def _subspace_test(real: list[torch.Tensor], null: list[torch.Tensor], k: int,
                   gen: torch.Generator, th: Thresholds, energy: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    svd_real = [thin_svd(W) for W in real]  # once for both sides
    svd_null = [thin_svd(W) for W in null]
    for side in ("input", "output"):
        out[side] = {"real": subspace_scores(real, k, side, gen, energy, svd_real),
                     "null": subspace_scores(null, k, side, gen, energy, svd_null)}
    score = float(np.mean([out[s]["real"]["score"] for s in ("input", "output")]))
    nscore = float(np.mean([out[s]["null"]["score"] for s in ("input", "output")]))
    lives = score >= th.subspace_min_score and score - nscore >= th.subspace_min_margin
    out.update(score=score, null_score=nscore, k=k, verdict="lives" if lives else "fails")
    return out


def _role_test(adapter: ModelAdapter, layers: list[int], permutations: int,
               seed: int, th: Thresholds) -> dict[str, Any]:
    feats: dict[MatrixType, np.ndarray] = {
        t: np.stack([role_features(W) for W in adapter.weights(t, layers)])
        for t in MATRIX_TYPES}

    def stack(types: list[MatrixType]) -> tuple[np.ndarray, np.ndarray]:
        X = np.concatenate([feats[t] for t in types])
        y = np.concatenate([np.full(len(feats[t]), int(adapter.writes_residual(t)))
                            for t in types])
        return X, y

    attn = stack([MatrixType.Q, MatrixType.K, MatrixType.V, MatrixType.O])
    mlp = stack([MatrixType.MLP_IN, MatrixType.MLP_OUT])
    res = {"features": list(FEATURE_NAMES),
           "attention_to_mlp": transfer_test(*attn, *mlp, permutations, seed),
           "mlp_to_attention": transfer_test(*mlp, *attn, permutations, seed)}
    for key in ("attention_to_mlp", "mlp_to_attention"):
        r = res[key]
        r["transfers"] = bool(r["accuracy"] > r["majority_rate"]
                              and r["p_value"] <= th.classifier_max_p)
    return res


def run_analysis(cfg: AnalysisConfig, out_dir: str | Path, progress: bool = True
                 ) -> dict[str, Any]:
    """Run the analysis and write ``results.json``, ``report.md`` and plots to
    ``out_dir``; returns the results."""
    from .report import write_report

    t0 = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    if cfg.layers is not None and len(cfg.layers) < 3:
        raise ValueError(f"layers must hold at least 3 indices, got {cfg.layers}")
    prep = prepare(cfg.model, cfg.corpus, cfg.second_corpus, cfg.eval_fraction,
                   cfg.calib_tokens, cfg.eval_tokens, cfg.seq_len, cfg.batch_size, cfg.seed,
                   layers=cfg.layers, progress=progress)
    loaded, adapter, cal = prep.loaded, prep.adapter, prep.calibration
    assert cal is not None
    types = parse_types(cfg.types)
    layers = list(range(adapter.num_layers)) if cfg.layers is None else list(cfg.layers)
    bad = [i for i in layers if not 0 <= i < adapter.num_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range [0, {adapter.num_layers})")
    ref = layers[len(layers) // 2] if cfg.reference_layer is None else cfg.reference_layer
    if ref not in layers:
        raise ValueError(f"reference_layer {ref} is not among the analysed layers {layers}")
    results: dict[str, Any] = {"model": loaded.model_id, "model_note": loaded.note,
                               "family": adapter.family, "num_layers": adapter.num_layers,
                               "hidden_size": adapter.hidden_size, "layers": layers,
                               "types": [t.value for t in types],
                               "split": prep.split.describe()}
    # perplexity of the unmodified model (same protocol as every compressed model)
    results["perplexity"] = evaluate_all(loaded.model, prep.eval_ids, cfg.seq_len,
                                         cfg.batch_size, progress)
    results["calibration"] = dict(cal.meta)
    # tests 1-3 per matrix type
    results["tests"] = {}
    bar = tqdm(total=len(types) * (len(layers) - 1), desc="test 1 (alignment)",
               unit="matrix", disable=not progress)
    weights = {t: dict(zip(layers, adapter.weights(t, layers), strict=True)) for t in types}
    for t in types:
        results["tests"][t.value] = {"shape": list(weights[t][ref].shape),
                                     "alignment": _alignment_test(
                                         weights[t], ref, gen, cfg.thresholds, bar,
                                         adapter.row_blocks(t))}
    bar.close()
    for t in tqdm(types, desc="tests 2-3 (subspaces)", unit="type", disable=not progress):
        W = [weights[t][i].double() for i in layers]
        nulls = []
        for w in W:
            g = torch.randn(w.shape, generator=gen, dtype=torch.float64)
            nulls.append(g * (w.norm() / g.norm()))
        k = max(1, round(cfg.k_fraction * min(W[0].shape)))
        roots = [psd_sqrt(cal.C(i, t), cfg.eig_floor) for i in layers]
        res = results["tests"][t.value]
        res["weight_subspaces"] = _subspace_test(W, nulls, k, gen, cfg.thresholds, cfg.energy)
        res["functional_subspaces"] = _subspace_test(
            functional_matrices(W, roots), functional_matrices(nulls, roots), k, gen,
            cfg.thresholds, cfg.energy)
    if set(types) == set(MATRIX_TYPES):
        results["roles"] = _role_test(adapter, layers, cfg.permutations, cfg.seed,
                                      cfg.thresholds)
    else:
        results["roles"] = {"skipped": "needs all six matrix types"}
    results["seconds"] = time.time() - t0
    write_report(results, cfg, out)
    return results
