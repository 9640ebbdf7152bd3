"""``structlm share analyze``: tests 1–3 with null controls, the role classifier, and
the base model's perplexity, on one pretrained model — one report folder.

Tests 1 and 2 read the weights once, against one null draw (their verdicts carry no
interval). Test 3 is measured once per **calibration draw** (``calib_seeds``: windows
drawn from the same calibration documents; each draw redraws its own nulls with a seed
derived from the draw): per draw and matrix type, the normalised margin
``m = (score − null) / (1 − null)`` — the share of the gap between the null control and
the ceiling that the real matrices close — and over the draws a Student-t 95% interval
(:func:`structlm.stats.mean_interval`); the verdict (:func:`functional_verdict`) is
"lives" when the interval lies above ``Thresholds.functional_min_margin``, "fails" when
below, "undecided" otherwise.

Test 3 runs on three input covariances (:data:`FUNCTIONAL_VARIANTS`): the centred one
(primary), the calibration's uncentred ``E[x xᵀ]``, and the uncentred one without the
attention-sink positions (a second pass over the calibration windows,
:mod:`structlm.share.analysis.sinks`).

``tests: [3]`` runs test 3 alone over the draws: no perplexity, no tests 1–2, no role
classifier. Every step (test 3: per draw and type) is recorded in ``steps.json``; a
stopped run resumes at the first unfinished one, and draws can be added to a folder
later (the draws and the tests asked for are not part of its key).

Thresholds are part of :class:`AnalysisConfig` and are written into the report before
any test runs (``config.json``), so verdicts are decided by numbers fixed in advance.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from structlm.atomic import atomic_write_text
from structlm.folders import check_apart, run_folder_lock
from structlm.hf.adapters import MATRIX_TYPES, SITE_OF, MatrixType, parse_types
from structlm.hf.calibration import Calibration
from structlm.hf.fingerprint import tensor_fingerprint
from structlm.hf.linalg import psd_sqrt, random_like_spectrum, random_orthonormal, thin_svd
from structlm.hf.pipeline import Prepared, evaluate_all, prepare
from structlm.share.analysis.alignment import (
    DROP_PARTS,
    MOVES,
    align,
    drop_split,
    row_signature,
)
from structlm.share.analysis.config import AnalysisConfig, Thresholds
from structlm.share.analysis.roles import (
    FEATURE_NAMES,
    SHAPE_FEATURE_NAMES,
    role_features,
    shape_features,
    transfer_test,
)
from structlm.share.analysis.sinks import calibration_windows, sink_excluded_second_moments
from structlm.share.analysis.steps import StepLog, StepLogMismatchError
from structlm.share.analysis.subspaces import functional_matrices, per_side_k, subspace_scores
from structlm.share.compress.io import source_chain
from structlm.stats import Interval, threshold_verdict

__all__ = ["FUNCTIONAL_PRIMARY", "FUNCTIONAL_VARIANTS", "AnalysisConfig", "Thresholds",
           "functional_draw", "functional_summary", "functional_verdict", "normalised_margin",
           "null_seed", "run_analysis"]

FUNCTIONAL_VARIANTS = ("centred", "uncentred", "sink_excluded")
"""Input covariances of test 3: ``E[x xᵀ] − μμᵀ`` (centred), ``E[x xᵀ]`` over every
position (the calibration's), and ``E[x xᵀ]`` without the first ``sink_tokens``
positions of every window (attention-sink positions excluded)."""

FUNCTIONAL_PRIMARY = "centred"
"""The variant whose verdict is test 3's headline: the uncentred second moment's mean
direction collapses the functional effective ranks to 1–2 and lifts real and null scores
alike (SmolLM2 Q: 0.910 vs null 0.823)."""

ONE_DRAW = "one draw: no interval"
"""What a verdict read from a single draw says."""

STEPS_VERSION = 2
"""Version of what a step computes (bump when a step's result would change: a folder
with steps of another version is refused, not mixed). 2: test 2 alone in
``subspaces:<t>``; test 3 per draw in ``functional:draw<k>:<t>``."""


def _median(xs: list[float]) -> float:
    return float(np.median(xs)) if xs else float("nan")


def _alignment_test(weights: Mapping[int, torch.Tensor], ref: int, gen: torch.Generator,
                    th: Thresholds, bar: Any, row_blocks: int = 1,
                    recorded: dict[int, Any] | None = None,
                    record: Callable[[int, Any], None] | None = None) -> dict[str, Any]:
    """Test 1 for one matrix type: every layer (and its Gaussian and same-spectrum nulls)
    aligned to ``weights[ref]``; medians per move, the cheap-move drop from the ``scale``
    baseline split into permutation and diagonal parts (``cheap_drop``), locality, and
    the verdict. ``bar``: anything with ``update(n)``.

    ``weights``: layer → matrix in layer order, read when indexed (a dict of a model in
    memory, or :class:`~structlm.hf.layer_stream.StreamedWeights`): two layers at a time
    are read, given their nulls and aligned (the Hungarian solver is single-threaded and
    releases the GIL), so the memory is two layers' matrices and nulls, not every
    layer's. The nulls are drawn from ``gen`` in layer order, each layer's before the
    next's, so the draws never depend on the pace or on what was recorded.

    ``recorded``: layers whose alignments a stopped run already finished (their nulls
    are drawn, not aligned); ``record(layer, result)`` is called as each other layer
    finishes, in layer order."""
    R = weights[ref].double()
    recorded = recorded or {}
    others = [layer for layer in weights if layer != ref]
    ref_sig = row_signature(R, row_blocks)  # once per reference, not per alignment

    def nulls_of(W: torch.Tensor) -> dict[str, torch.Tensor]:
        g = torch.randn(W.shape, generator=gen, dtype=torch.float64)
        return {"null_gaussian": g * (W.double().norm() / g.norm()),
                "null_spectrum": random_like_spectrum(W, gen)}

    def run(W: torch.Tensor, nulls: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
        return {"real": align(R, W, row_blocks, ref_sig),
                **{kind: align(R, N, row_blocks, ref_sig) for kind, N in nulls.items()}}

    results: dict[int, Any] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for a in range(0, len(others), 2):
            jobs = []
            for layer in others[a:a + 2]:
                W = weights[layer]
                nulls = nulls_of(W)  # drawn for a recorded layer too: the same stream
                if layer in recorded:
                    results[layer] = recorded[layer]
                    bar.update(1)
                else:
                    jobs.append((layer, pool.submit(run, W, nulls)))
                del W, nulls
            for layer, fut in jobs:
                results[layer] = fut.result()
                if record is not None:
                    record(layer, results[layer])
                bar.update(1)
            del jobs
    per_layer: dict[str, dict[str, Any]] = {
        str(layer): {"distance": abs(layer - ref), **results[layer]} for layer in others}
    summary = {kind: {m: _median([v[kind][m] for v in per_layer.values()]) for m in MOVES}
               for kind in ("real", "null_gaussian", "null_spectrum")}
    real, null = summary["real"], summary["null_gaussian"]
    # the cheap-move drop from the scale baseline, split into its permutation and its
    # diagonal part, with the nulls' drops through the same moves beside it
    drops: dict[str, Any] = {"baseline": "scale"}
    for kind in ("real", "null_gaussian", "null_spectrum"):
        drops[kind] = drop_split([v[kind] for v in per_layer.values()])
    drops["excess_over_gaussian"] = {p: drops["real"][p] - drops["null_gaussian"][p]
                                     for p in DROP_PARTS}
    dists = sorted({v["distance"] for v in per_layer.values()})
    near = [v["real"]["rot1"] for v in per_layer.values() if v["distance"] <= 2]
    far_cut = max(3, (max(dists) + 1) // 2) if dists else 3
    far = [v["real"]["rot1"] for v in per_layer.values() if v["distance"] >= far_cut]
    lives = (real["perm_diag"] <= th.alignment_max_residual
             and null["perm_diag"] - real["perm_diag"] >= th.alignment_min_margin)
    return {"reference_layer": ref, "per_layer": per_layer, "median": summary,
            "cheap_drop": drops,
            "locality": {"near_rot1": _median(near), "far_rot1": _median(far),
                         "gradient": _median(far) - _median(near) if near and far
                         else float("nan"), "far_from_distance": far_cut},
            "verdict": "lives" if lives else "fails"}


Matrices = list[torch.Tensor] | Callable[[], list[torch.Tensor]]
"""One matrix per layer, or a function that builds them when they are needed (so the
real and the null matrices of a 4,864-wide type are never in memory together)."""


def _subspace_test(real: Matrices, null: Matrices, ks: dict[str, int], shape: tuple[int, int],
                   gen: torch.Generator, th: Thresholds | None, energy: float
                   ) -> dict[str, Any]:
    """Scores of ``real`` and ``null`` (``shape``: each matrix's) on both sides (``ks``: k
    per side) and test 2's one-draw verdict (none when ``th`` is ``None``: test 3's
    verdict is over draws, :func:`functional_summary`).

    The random bases are drawn first (input side real, null; output side real, null);
    then the real matrices are built, their SVDs serve both sides, and both are freed
    before the null's are built."""
    dims = {"input": int(shape[1]), "output": int(shape[0])}
    rand = {(side, kind): random_orthonormal(dims[side], ks[side], gen)
            for side in ("input", "output") for kind in ("real", "null")}
    out: dict[str, Any] = {"input": {}, "output": {}}
    for kind, make in (("real", real), ("null", null)):
        mats = make() if callable(make) else make
        svds = [thin_svd(W) for W in mats]  # once for both sides
        for side in ("input", "output"):
            out[side][kind] = subspace_scores(mats, ks[side], side, gen, energy, svds,
                                              rand[(side, kind)])
        del svds, mats
    score = float(np.mean([out[s]["real"]["score"] for s in ("input", "output")]))
    nscore = float(np.mean([out[s]["null"]["score"] for s in ("input", "output")]))
    out.update(score=score, null_score=nscore, k_input=ks["input"], k_output=ks["output"])
    if th is not None:
        lives = score >= th.subspace_min_score and score - nscore >= th.subspace_min_margin
        out.update(verdict="lives" if lives else "fails", draws=1)
    return out


def normalised_margin(score: float, null_score: float) -> float:
    """``(score − null) / (1 − null)``: the share of the gap between the null control and
    the ceiling (a score of 1) that the real matrices close; NaN when the null is at the
    ceiling (no gap to close)."""
    gap = 1.0 - null_score
    return (score - null_score) / gap if gap > 1e-12 else float("nan")


def _covariance(cal: Calibration, sink: Mapping[tuple[int, str], torch.Tensor] | None,
                layer: int, site: str, variant: str) -> torch.Tensor:
    """One input covariance variant of one (layer, site) (float64)."""
    if variant == "sink_excluded":
        if sink is None:
            raise ValueError("the sink-excluded variant needs the sink pass's moments")
        return sink[(layer, site)].double()
    C = cal.second_moments[(layer, site)].double()
    if variant == "uncentred":
        return C
    if variant == "centred":
        mu = cal.means[(layer, site)].double()
        return C - torch.outer(mu, mu)
    raise ValueError(f"unknown covariance variant {variant!r}: expected one of "
                     f"{FUNCTIONAL_VARIANTS}")


def _functional_tests(W: list[torch.Tensor], null: Callable[[int], torch.Tensor],
                      cal: Calibration, sink: Mapping[tuple[int, str], torch.Tensor] | None,
                      layers: list[int], site: str, ks: dict[str, int], gen: torch.Generator,
                      cfg: AnalysisConfig, bar: Any) -> dict[str, Any]:
    """Test 3 of one calibration draw on every covariance variant (``sink``: the
    sink-excluded moments, ``None`` when that pass is off), one variant at a time, keyed
    by variant: scores, null scores and the normalised margin (no verdict: that is over
    draws). ``W``: the real matrices (any float dtype); ``null(i)``: the null of ``W[i]``,
    float64. ``bar``: anything with ``update(n)``, one per layer and variant.

    Memory: a root no larger than its functional matrix (``in ≤ out``) is kept for every
    layer and the real and null matrices are built one list at a time; a wider root (a
    4,864-wide MLP input's is 189 MB) is computed, applied to the real and the null
    matrix, and dropped."""
    res: dict[str, Any] = {}
    out, inn = W[0].shape
    n = len(W)
    for variant in FUNCTIONAL_VARIANTS:
        if variant == "sink_excluded" and sink is None:
            res[variant] = {"covariance": variant, "primary": variant == FUNCTIONAL_PRIMARY,
                            "skipped": "sink_pass is off"}
            continue

        def root(i: int, variant: str = variant) -> torch.Tensor:
            r = psd_sqrt(_covariance(cal, sink, layers[i], site, variant), cfg.eig_floor)
            bar.update(1)
            return r

        real: Matrices
        nulls: Matrices
        if inn <= out:
            roots = [root(i) for i in range(n)]
            real = lambda roots=roots: functional_matrices(W, roots)  # noqa: E731
            nulls = lambda roots=roots: [null(i).double() @ roots[i]  # noqa: E731
                                         for i in range(n)]
        else:
            real, nulls = [], []
            for i in range(n):
                r = root(i)
                real += functional_matrices([W[i]], [r])
                nulls.append(null(i) @ r)
                del r
        s = _subspace_test(real, nulls, ks, (out, inn), gen, None, cfg.energy)
        del real, nulls
        s.update(covariance=variant, primary=variant == FUNCTIONAL_PRIMARY,
                 margin=normalised_margin(s["score"], s["null_score"]))
        res[variant] = s
    return res


def _null_maker(W: list[torch.Tensor], gen: torch.Generator) -> Callable[[int], torch.Tensor]:
    """Gaussian nulls of ``W`` scaled to each matrix's norm, drawn from ``gen`` now (it
    advances exactly as if they were kept) but not kept: ``null(i)`` draws ``W[i]``'s
    again from the generator state recorded before it (float64; 24 of Qwen2.5's
    9,728 × 896 MLP-in would be 1.7 GB)."""
    states = []
    for w in W:
        states.append(gen.get_state())
        torch.randn(w.shape, generator=gen, dtype=torch.float64)

    def null(i: int) -> torch.Tensor:
        g = torch.Generator().set_state(states[i])
        x = torch.randn(W[i].shape, generator=g, dtype=torch.float64)
        return x * (W[i].double().norm() / x.norm())
    return null


def _resumable_alignment(log: StepLog, t: MatrixType, weights: dict[int, torch.Tensor],
                         ref: int, gen: torch.Generator, cfg: AnalysisConfig, bar: Any,
                         row_blocks: int) -> dict[str, Any]:
    """Test 1 of type ``t`` through the step log: the generator's state before the
    type's nulls (``alignment:<t>:start``), each layer as it finishes
    (``alignment:<t>:layer<i>``), then the type's result (``alignment:<t>``). A run
    stopped inside the type restores the start state, draws the same nulls and runs only
    the unfinished layers."""
    name = f"alignment:{t.value}"
    if log.done(name):
        bar.update(len(weights) - 1)
        return log.get(name)
    if log.done(f"{name}:start"):
        log.restore_gen(log.get(f"{name}:start"))
    else:
        log.record(f"{name}:start", log.gen_state(), 0.0)
    recorded = {int(k): v for k, v in log.prefixed(f"{name}:layer").items()}
    last = [time.time()]

    def record(layer: int, result: Any) -> None:
        now = time.time()
        log.record(f"{name}:layer{layer}", result, now - last[0])
        last[0] = now

    res = _alignment_test(weights, ref, gen, cfg.thresholds, bar, row_blocks, recorded,
                          record)
    return log.record(name, res, time.time() - last[0])


def _role_test(weights_of: Callable[[MatrixType], Mapping[int, torch.Tensor]],
               writes_residual: Callable[[MatrixType], bool], permutations: int,
               seed: int, th: Thresholds) -> dict[str, Any]:
    """The role classifier's two transfer directions, on the shape-free features and,
    as a control, on the shapes alone. ``weights_of(t)``: type ``t``'s matrices by layer,
    read one at a time (both feature sets are taken from each matrix as it is read)."""
    attn_types = [MatrixType.Q, MatrixType.K, MatrixType.V, MatrixType.O]
    mlp_types = [MatrixType.MLP_IN, MatrixType.MLP_OUT]
    featurizers = {"role": role_features, "shape": shape_features}
    rows: dict[str, dict[MatrixType, list[Any]]] = {k: {} for k in featurizers}
    for t in MATRIX_TYPES:
        mats = weights_of(t)
        for k in featurizers:
            rows[k][t] = []
        for i in mats:
            W = mats[i]
            for k, featurize in featurizers.items():
                rows[k][t].append(featurize(W))
            del W

    def transfers(kind: str, names: tuple[str, ...]) -> dict[str, Any]:
        feats = {t: np.stack(rows[kind][t]) for t in MATRIX_TYPES}

        def stack(types: list[MatrixType]) -> tuple[np.ndarray, np.ndarray]:
            X = np.concatenate([feats[t] for t in types])
            y = np.concatenate([np.full(len(feats[t]), int(writes_residual(t)))
                                for t in types])
            return X, y

        attn, mlp = stack(attn_types), stack(mlp_types)
        res: dict[str, Any] = {
            "features": list(names),
            "attention_to_mlp": transfer_test(*attn, *mlp, permutations, seed),
            "mlp_to_attention": transfer_test(*mlp, *attn, permutations, seed)}
        for key in ("attention_to_mlp", "mlp_to_attention"):
            r = res[key]
            r["transfers"] = bool(r["accuracy"] > r["majority_rate"]
                                  and r["p_value"] <= th.classifier_max_p)
        return res

    res = transfers("role", FEATURE_NAMES)
    # the shape-only control: what the shapes alone score in the same transfer test
    res["shape_only"] = transfers("shape", SHAPE_FEATURE_NAMES)
    return res


def null_seed(seed: int, draw: int, matrix_type: str) -> int:
    """The seed of test 3's nulls and random bases for one calibration draw and matrix
    type: derived from the analysis's ``seed``, the draw and the type only, so every draw
    redraws its own nulls and a resumed or extended run draws exactly the same ones."""
    h = hashlib.sha256(f"structlm analysis test 3:{seed}:{draw}:{matrix_type}".encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1


def functional_draw(W: list[torch.Tensor], cal: Calibration,
                    sink: Mapping[tuple[int, str], torch.Tensor] | None, layers: list[int],
                    site: str, ks: dict[str, int], seed: int, cfg: AnalysisConfig,
                    bar: Any) -> dict[str, Any]:
    """Test 3 of one matrix type on one calibration draw (``cal``, ``sink``): Gaussian
    nulls of ``W`` (each scaled to its matrix's norm) and the random bases drawn from a
    generator seeded with ``seed`` (:func:`null_seed`), then every covariance variant
    (:func:`_functional_tests`); keyed by variant, with ``null_seed``."""
    gen = torch.Generator().manual_seed(seed)
    null = _null_maker(W, gen)
    return {"null_seed": seed,
            **_functional_tests(W, null, cal, sink, layers, site, ks, gen, cfg, bar)}


def functional_verdict(values: Sequence[float], th: Thresholds
                       ) -> tuple[str, Interval | None]:
    """Test 3's verdict on the normalised margins of the draws: ``"lives"`` when their
    Student-t 95% interval lies above ``th.functional_min_margin``, ``"fails"`` when it
    lies below, ``"undecided"`` otherwise (:func:`structlm.stats.threshold_verdict`);
    ``"no verdict: …"`` with fewer than ``th.functional_min_draws`` draws or a null at
    the ceiling. The interval is ``None`` only in that last case."""
    if not values:
        raise ValueError("test 3's verdict needs at least one draw")
    if not all(math.isfinite(v) for v in values):
        return "no verdict: a null control scored 1 (no gap to close)", None
    v, iv = threshold_verdict(values, th.functional_min_margin,
                              min_draws=th.functional_min_draws)
    if v == "too few draws":
        return (f"no verdict: {ONE_DRAW}" if iv.n == 1 else
                f"no verdict: {iv.n} draws (needs {th.functional_min_draws})"), iv
    return {"above": "lives", "below": "fails", "undecided": "undecided"}[v], iv


def functional_summary(draws: Mapping[str, Mapping[str, Any]], seeds: Sequence[int],
                       th: Thresholds) -> dict[str, Any]:
    """Test 3 of one matrix type over the calibration draws ``seeds`` (``draws``: draw ->
    :func:`functional_draw`'s result): per variant the margins, scores and null scores per
    draw, the margin's mean and 95% interval and the verdict (``variants``), and the
    per-draw details (``draws``)."""
    if not seeds:
        raise ValueError("test 3 needs at least one calibration draw")
    per = [draws[str(s)] for s in seeds]
    variants: dict[str, Any] = {}
    for variant in FUNCTIONAL_VARIANTS:
        rs = [d[variant] for d in per]
        if any("skipped" in r for r in rs):
            variants[variant] = {"covariance": variant,
                                 "primary": variant == FUNCTIONAL_PRIMARY,
                                 "skipped": next(r["skipped"] for r in rs if "skipped" in r)}
            continue
        margins = [float(r["margin"]) for r in rs]
        verdict, iv = functional_verdict(margins, th)
        variants[variant] = {
            "covariance": variant, "primary": variant == FUNCTIONAL_PRIMARY,
            "margin_per_draw": margins, "score_per_draw": [float(r["score"]) for r in rs],
            "null_score_per_draw": [float(r["null_score"]) for r in rs],
            "margin": None if iv is None else dataclasses.asdict(iv),
            "score_mean": float(np.mean([r["score"] for r in rs])),
            "null_score_mean": float(np.mean([r["null_score"] for r in rs])),
            "verdict": verdict}
    first = next((per[0][v] for v in FUNCTIONAL_VARIANTS if "k_input" in per[0][v]), {})
    return {"primary": FUNCTIONAL_PRIMARY, "statistic": "(score - null) / (1 - null)",
            "threshold": th.functional_min_margin, "min_draws": th.functional_min_draws,
            "level": 0.95, "calib_seeds": list(seeds), "k_input": first.get("k_input"),
            "k_output": first.get("k_output"), "variants": variants,
            "draws": {str(s): d for s, d in zip(seeds, per, strict=True)}}


def _sink_pass(cfg: AnalysisConfig, prep: Prepared, layers: list[int], types: list[MatrixType],
               progress: bool) -> dict[str, Any]:
    """The sink-excluded second moments (``moments``; ``None`` when the pass is off) and
    a description of the covariance variants."""
    cal = prep.calibration
    assert cal is not None
    info: dict[str, Any] = {"primary": FUNCTIONAL_PRIMARY, "variants": list(FUNCTIONAL_VARIANTS),
                            "sink_tokens": cfg.sink_tokens if cfg.sink_pass else None,
                            "moments": None}
    if not cfg.sink_pass:
        info["variants"] = [v for v in FUNCTIONAL_VARIANTS if v != "sink_excluded"]
        return info
    t0 = time.time()
    sites = tuple(sorted({SITE_OF[t] for t in types}))
    meta = {k: cal.meta.get(k) for k in ("model", "corpus", "calib_tokens", "seed",
                                           "documents")}  # the draw: by its tokens' hash
    info["moments"] = sink_excluded_second_moments(
        prep.adapter, prep.calib_ids, cfg.seq_len, cfg.batch_size, layers, sites,
        cfg.sink_tokens, cache_meta=meta, calibration_path=cal.meta.get("path"),
        progress=progress)
    n_windows, width = calibration_windows(prep.calib_ids, cfg.seq_len).shape
    info.update(sink_pass_windows=n_windows,
                sink_pass_positions=n_windows * (width - cfg.sink_tokens),
                sink_pass_seconds=time.time() - t0)
    return info


def _prepare_draw(cfg: AnalysisConfig, draw: int, progress: bool) -> Prepared:
    """The model and calibration draw ``draw`` (> 0) alone: windows drawn with seed
    ``draw`` from the same calibration documents (no evaluation or validation text)."""
    return prepare(cfg.model, cfg.corpus, "", cfg.eval_fraction, cfg.calib_tokens, 0,
                   cfg.seq_len, cfg.batch_size, cfg.seed, layers=cfg.layers,
                   progress=progress, calib_seed=draw, val_tokens=0)


def _functional_step(draw: int, t: MatrixType) -> str:
    return f"functional:draw{draw}:{t.value}"


def _functional_over_draws(cfg: AnalysisConfig, log: StepLog, prep0: list[Prepared],
                           layers: list[int], types: list[MatrixType], progress: bool
                           ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Test 3 of every type on every calibration draw of ``cfg.calib_seeds``, each
    (draw, type) a step of ``log`` (``functional:draw<k>:<type>``), each draw's
    preparation and sink pass one more (``calibration:draw<k>``). Draw 0 is the
    calibration of the one preparation in ``prep0``, run first and then dropped from the
    list (its model is not held while another draw's is loaded); a draw whose types are
    all recorded is not prepared again. Returns the per-type summaries
    (:func:`functional_summary`) and, per draw, its calibration."""
    n_variants = len(FUNCTIONAL_VARIANTS) - (not cfg.sink_pass)
    pending = {d: [t for t in types if not log.done(_functional_step(d, t))]
               for d in cfg.calib_seeds}
    bar = tqdm(total=sum(map(len, pending.values())) * len(layers) * n_variants,
               desc="test 3 (functional subspaces, per draw)", unit="root",
               disable=not progress)
    for d in sorted(cfg.calib_seeds, key=lambda d: d != 0):  # draw 0 first
        if not pending[d]:
            prep0.clear() if d == 0 else None
            continue
        s0 = time.time()
        prep = prep0.pop() if d == 0 else _prepare_draw(cfg, d, progress)
        cal = prep.calibration
        assert cal is not None
        fingerprint = cal.meta.get("calibration_tokens")
        for t in types:  # a recorded type of this draw must come from the same windows
            step = _functional_step(d, t)
            if log.done(step) and log.get(step).get("calibration_tokens") != fingerprint:
                raise StepLogMismatchError(
                    f"{log.path}: draw {d}'s recorded test 3 read other calibration windows "
                    "than this run draws: use another output folder")
        info = _sink_pass(cfg, prep, layers, types, progress)
        sink = info.pop("moments")
        name = f"calibration:draw{d}"
        if not log.done(name):
            info.update(calib_seed=d, calibration_tokens=fingerprint,
                        tokens_used=cal.meta.get("tokens_used"))
            log.record(name, info, time.time() - s0 if d else info.get(
                "sink_pass_seconds", 0.0))
        for t in pending[d]:
            t1 = time.time()
            W = prep.adapter.weights(t, layers)  # as loaded; float64 when used
            ks = per_side_k(W[0].shape, cfg.k_fraction)
            res = functional_draw(W, cal, sink, layers, SITE_OF[t], ks,
                                  null_seed(cfg.seed, d, t.value), cfg, bar)
            res["calibration_tokens"] = fingerprint
            log.record(_functional_step(d, t), res, time.time() - t1)
            del W, res
        del prep, cal, sink
        prep0.clear()  # draw 0 not asked for, or done: its model need not stay
    bar.close()
    summaries = {t.value: functional_summary(
        {str(d): log.get(_functional_step(d, t)) for d in cfg.calib_seeds},
        cfg.calib_seeds, cfg.thresholds) for t in types}
    draws = {str(d): log.get(f"calibration:draw{d}") for d in cfg.calib_seeds}
    return summaries, draws


def run_analysis(cfg: AnalysisConfig, out_dir: str | Path, progress: bool = True
                 ) -> dict[str, Any]:
    """Run the analysis and write ``results.json``, ``report.md`` and plots to
    ``out_dir``; returns the results."""
    t0 = time.time()
    out = Path(out_dir)
    check_apart(out, source_chain(cfg.model), "analysis folder")
    with run_folder_lock(out, "analysis"):  # one writer per report folder
        return _run_analysis_locked(cfg, out, t0, progress)


def _log_config(cfg: AnalysisConfig) -> dict[str, Any]:
    """What the step log is keyed on: the configuration without the tests and draws asked
    for (each step is named by its test, draw and type, so a folder can run more of them
    later)."""
    return {k: v for k, v in dataclasses.asdict(cfg).items()
            if k not in ("tests", "calib_seeds")}


def _run_analysis_locked(cfg: AnalysisConfig, out: Path, t0: float, progress: bool
                         ) -> dict[str, Any]:
    """:func:`run_analysis` under the folder's lock: the model and text are prepared (a
    model or text that cannot be used fails here), then the thresholds are fixed in
    ``config.json`` before any test runs."""
    from structlm.share.analysis.report import write_report

    tests = set(cfg.tests)
    whole = bool(tests & {1, 2})  # perplexity and the role classifier go with tests 1-2
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    prep = prepare(cfg.model, cfg.corpus, cfg.second_corpus, cfg.eval_fraction,
                   cfg.calib_tokens, cfg.eval_tokens, cfg.seq_len, cfg.batch_size, cfg.seed,
                   layers=cfg.layers, progress=progress)
    atomic_write_text(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
    t_prepare = time.time() - t0
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
                               "family": adapter.family, "model_type": getattr(
                                   loaded.model.config, "model_type", ""),
                               "architecture_notes": adapter.notes,
                               "num_layers": adapter.num_layers,
                               "hidden_size": adapter.hidden_size, "layers": layers,
                               "types": [t.value for t in types],
                               "analysis_tests": sorted(tests),
                               "split": prep.split.describe()}
    # every step below is recorded in steps.json as it finishes: a resumed run starts at
    # the first unfinished one, with the random generator where it was
    log = StepLog(out / "steps.json", {
        "config": _log_config(cfg), "version": STEPS_VERSION,
        "model_weights": cal.meta.get("model_weights"),
        "calibration_tokens": cal.meta.get("calibration_tokens"),
        "eval_tokens": {k: tensor_fingerprint(v) for k, v in sorted(prep.eval_ids.items())}},
        gen)

    def step(name: str, run: Any) -> Any:
        if log.done(name):
            return log.get(name)
        s0 = time.time()
        return log.record(name, run(), time.time() - s0)

    if whole:  # perplexity of the unmodified model (same protocol as every compressed model)
        results["perplexity"] = step("perplexity", lambda: evaluate_all(
            loaded.model, prep.eval_ids, cfg.seq_len, cfg.batch_size, progress))
    results["calibration"] = dict(cal.meta)
    results["tests"] = {t.value: {} for t in types}
    for t in types:
        results["tests"][t.value]["shape"] = list(adapter.weights(t, [ref])[0].shape)
    weights = {t: dict(zip(layers, adapter.weights(t, layers), strict=True)) for t in types
               } if whole else {}
    if 1 in tests:
        bar = tqdm(total=len(types) * (len(layers) - 1), desc="test 1 (alignment)",
                   unit="matrix", disable=not progress)
        for t in types:
            results["tests"][t.value]["alignment"] = _resumable_alignment(
                log, t, weights[t], ref, gen, cfg, bar, adapter.row_blocks(t))
        bar.close()
    if 2 in tests:
        for t in types:
            def subspaces(t: MatrixType = t) -> dict[str, Any]:
                W = [weights[t][i] for i in layers]  # as loaded; float64 when used
                null = _null_maker(W, gen)
                shape = (int(W[0].shape[0]), int(W[0].shape[1]))
                return {"weight_subspaces": _subspace_test(
                    lambda: [w.double() for w in W],
                    lambda: [null(i) for i in range(len(W))],
                    per_side_k(shape, cfg.k_fraction), shape, gen, cfg.thresholds,
                    cfg.energy)}
            results["tests"][t.value].update(step(f"subspaces:{t.value}", subspaces))
            del weights[t]  # the type is done: its matrices need not stay
    weights.clear()  # test 3 reads each draw's matrices when it needs them
    t_roles = time.time()
    if whole and set(types) == set(MATRIX_TYPES):
        results["roles"] = _role_test(
            lambda t: dict(zip(layers, adapter.weights(t, layers), strict=True)),
            adapter.writes_residual, cfg.permutations, cfg.seed, cfg.thresholds)
    elif whole:
        results["roles"] = {"skipped": "needs all six matrix types"}
    t_roles = time.time() - t_roles
    if 3 in tests:
        held = [prep]  # handed over: test 3 drops draw 0's model before loading another
        del prep, loaded, adapter, cal
        summaries, draws = _functional_over_draws(cfg, log, held, layers, types, progress)
        for t in types:
            results["tests"][t.value]["functional"] = summaries[t.value]
        results["functional_covariances"] = {
            "primary": FUNCTIONAL_PRIMARY,
            "variants": [v for v in FUNCTIONAL_VARIANTS
                         if cfg.sink_pass or v != "sink_excluded"],
            "sink_tokens": cfg.sink_tokens if cfg.sink_pass else None,
            "calib_seeds": list(cfg.calib_seeds), "draws": draws}
        results["functional_draw_seconds"] = {
            str(d): log.seconds.get(f"calibration:draw{d}", 0.0) + sum(
                log.seconds.get(_functional_step(d, t), 0.0) for t in types)
            for d in cfg.calib_seeds}
    # compute time: every step over all runs, plus this run's preparation and roles
    results["seconds"] = log.total_seconds() + t_prepare + t_roles
    write_report(results, cfg, out)
    return results
