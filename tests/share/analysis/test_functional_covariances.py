"""Test 3's input covariance variants: uncentred, centred, attention-sink positions left
out (known answers on synthetic data and on a tiny random LLaMA)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from structlm.hf.adapters import get_adapter
from structlm.hf.calibration import Calibration, CovarianceAccumulator, calibrate
from structlm.hf.linalg import effective_rank, psd_sqrt
from structlm.share.analysis import sinks
from structlm.share.analysis.analyze import (
    FUNCTIONAL_VARIANTS,
    AnalysisConfig,
    _covariance,
    _functional_tests,
)
from structlm.share.analysis.subspaces import functional_matrices, per_side_k
from tiny_models import tiny_llama


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _calibration(x: torch.Tensor) -> Calibration:
    acc = CovarianceAccumulator(x.shape[-1])
    acc.update(x)
    cal = Calibration(meta={})
    cal.second_moments[(0, "attn_in")] = acc.second_moment()
    cal.means[(0, "attn_in")] = acc.mean()
    return cal


def test_centred_covariance_removes_a_dominant_mean_direction() -> None:
    """Inputs with a huge common mean (an attention-sink-like direction): the uncentred
    second moment makes every functional matrix rank 1; the centred one is the sample
    covariance and gives back the spread of the inputs."""
    g = _gen(0)
    d = 24
    mu = 40.0 * torch.randn(d, generator=g, dtype=torch.float64)
    A = torch.randn(d, d, generator=g, dtype=torch.float64)
    x = mu + torch.randn(4000, d, generator=g, dtype=torch.float64) @ A
    cal = _calibration(x)
    covs = {v: _covariance(cal, None, 0, "attn_in", v) for v in ("uncentred", "centred")}
    with pytest.raises(ValueError, match="sink-excluded variant needs"):
        _covariance(cal, None, 0, "attn_in", "sink_excluded")
    torch.testing.assert_close(covs["centred"], torch.cov(x.T, correction=0))
    torch.testing.assert_close(covs["uncentred"], x.T @ x / x.shape[0])
    W = torch.randn(16, d, generator=g, dtype=torch.float64)
    ranks = {v: effective_rank(functional_matrices([W], [psd_sqrt(c)])[0])
             for v, c in covs.items()}
    assert ranks["uncentred"] == 1 and ranks["centred"] >= 6


def _reference_sink_moments(adapter: Any, tokens: torch.Tensor, seq_len: int,
                            sink: int) -> dict[tuple[int, str], torch.Tensor]:
    """Every input captured in full, then averaged by hand over positions ≥ ``sink``."""
    seen: dict[tuple[int, str], list[torch.Tensor]] = {}
    handles = []
    for i in range(adapter.num_layers):
        for site in ("attn_in", "mlp_out"):
            def hook(_m: Any, args: tuple[Any, ...], key: tuple[int, str] = (i, site)) -> None:
                seen.setdefault(key, []).append(args[0].detach().double())
            handles.append(adapter.layers[i].site_module(site).register_forward_pre_hook(hook))
    seqs = tokens[: tokens.numel() // seq_len * seq_len].view(-1, seq_len)
    with torch.no_grad():
        adapter.model(input_ids=seqs, use_cache=False)
    for h in handles:
        h.remove()
    out = {}
    for key, xs in seen.items():
        x = torch.cat(xs)[:, sink:].reshape(-1, xs[0].shape[-1])
        out[key] = x.T @ x / x.shape[0]
    return out


def test_sink_excluded_moments_match_a_hand_computed_reference(tmp_path, monkeypatch) -> None:
    model = tiny_llama(seed=1)
    adapter = get_adapter(model)
    tokens = torch.randint(0, 89, (3 * 16 + 5,), generator=_gen(1))  # 3 windows + remainder
    got = sinks.sink_excluded_second_moments(
        adapter, tokens, 16, 2, [0, 1, 2], ("attn_in", "mlp_out"), 4,
        cache_meta={"model": "tiny"}, calibration_path=str(tmp_path / "cal.safetensors"),
        progress=False)
    want = _reference_sink_moments(adapter, tokens, 16, 4)
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key])
    # (n, w) windows (how the pipeline hands them over) give the same windows
    windows = sinks.sink_excluded_second_moments(
        adapter, tokens[:48].view(3, 16), 512, 2, [0, 1, 2], ("attn_in", "mlp_out"), 4,
        progress=False)
    for key in want:
        torch.testing.assert_close(windows[key], want[key])
    # the first positions matter: all-position moments (the calibration's) differ
    cal = calibrate(adapter, tokens, seq_len=16, batch_size=2, sites=("attn_in",),
                    progress=False)
    assert not torch.allclose(cal.second_moments[(1, "attn_in")], got[(1, "attn_in")])
    # cached beside the calibration: a second call does not run the model
    monkeypatch.setattr(sinks, "_accumulate", lambda *a, **k: pytest.fail("not cached"))
    again = sinks.sink_excluded_second_moments(
        adapter, tokens, 16, 2, [0, 1, 2], ("attn_in", "mlp_out"), 4,
        cache_meta={"model": "tiny"}, calibration_path=str(tmp_path / "cal.safetensors"),
        progress=False)
    for key in want:
        torch.testing.assert_close(again[key], got[key])
    with pytest.raises(ValueError, match="sink_tokens"):
        sinks.sink_excluded_second_moments(adapter, tokens, 16, 2, [0], ("attn_in",), 16)


def test_functional_tests_report_every_variant_with_its_own_verdict() -> None:
    g = _gen(2)
    d, layers = 20, 4
    W = [torch.randn(12, d, generator=g, dtype=torch.float64) for _ in range(layers)]
    nulls = [torch.randn(12, d, generator=g, dtype=torch.float64) for _ in range(layers)]
    cal = Calibration(meta={})
    sink = {}
    for i in range(layers):
        B = torch.randn(d, d, generator=g, dtype=torch.float64)
        cal.second_moments[(i, "attn_in")] = B @ B.T / d + 0.1 * torch.eye(d, dtype=torch.float64)
        cal.means[(i, "attn_in")] = torch.randn(d, generator=g, dtype=torch.float64)
        sink[(i, "attn_in")] = cal.second_moments[(i, "attn_in")] * 0.5
    cfg = AnalysisConfig()
    bar = SimpleNamespace(n=0)
    bar.update = lambda k: setattr(bar, "n", bar.n + k)
    res = _functional_tests(W, lambda i: nulls[i], cal, sink, list(range(layers)), "attn_in",
                            per_side_k(W[0].shape, cfg.k_fraction), g, cfg, bar)
    assert bar.n == 3 * layers  # one root per layer and variant
    assert set(res) == set(FUNCTIONAL_VARIANTS)
    for variant in FUNCTIONAL_VARIANTS:
        r = res[variant]
        assert r["covariance"] == variant and r["primary"] == (variant == "centred")
        assert "verdict" not in r  # one draw: the verdict is over draws
        assert r["margin"] == pytest.approx((r["score"] - r["null_score"])
                                            / (1 - r["null_score"]))
        assert (r["k_input"], r["k_output"]) == (5, 3)
        assert len(r["output"]["real"]["effective_rank"]) == layers
    # the sink-excluded moments are half the uncentred ones: the same subspaces, scores
    assert res["sink_excluded"]["input"]["real"]["own"] == \
        pytest.approx(res["uncentred"]["input"]["real"]["own"])
    # each variant's functional matrices are W_l C_l^{1/2} with that layer's own C
    M0 = functional_matrices([W[0]], [psd_sqrt(cal.second_moments[(0, "attn_in")])])[0]
    own0 = float(torch.linalg.svdvals(M0)[:5].pow(2).sum() / M0.pow(2).sum())
    assert res["uncentred"]["input"]["real"]["own"][0] == pytest.approx(own0)
    res = _functional_tests(W, lambda i: nulls[i], cal, None, list(range(layers)), "attn_in",
                            {"input": 5, "output": 3}, g, cfg, bar)
    assert "skipped" in res["sink_excluded"]


@pytest.mark.parametrize("out", [7, 20, 33])  # wide (roots dropped), square, tall (kept)
def test_both_memory_routes_give_the_direct_computation(out: int) -> None:
    """Roots kept per layer (``in ≤ out``) or applied and dropped (``in > out``): the
    same numbers as :func:`_subspace_test` on ``W_l C_l^{1/2}`` built by hand."""
    from structlm.share.analysis.analyze import _subspace_test

    g = _gen(5)
    d, layers = 20, 3
    W = [torch.randn(out, d, generator=g, dtype=torch.float32) for _ in range(layers)]
    nulls = [torch.randn(out, d, generator=g, dtype=torch.float64) for _ in range(layers)]
    cal = Calibration(meta={})
    for i in range(layers):
        B = torch.randn(d, d, generator=g, dtype=torch.float64)
        cal.second_moments[(i, "mlp_out")] = B @ B.T / d
        cal.means[(i, "mlp_out")] = torch.randn(d, generator=g, dtype=torch.float64)
    cfg = AnalysisConfig(sink_pass=False)
    ks = per_side_k((out, d), cfg.k_fraction)
    state = g.get_state()
    bar = SimpleNamespace(update=lambda k: None)
    res = _functional_tests(W, lambda i: nulls[i], cal, None, list(range(layers)), "mlp_out",
                            ks, g, cfg, bar)
    g2 = torch.Generator().set_state(state)
    for variant in ("centred", "uncentred"):  # FUNCTIONAL_VARIANTS order
        roots = []
        for i in range(layers):
            C = cal.second_moments[(i, "mlp_out")]
            if variant == "centred":
                mu = cal.means[(i, "mlp_out")]
                C = C - torch.outer(mu, mu)
            roots.append(psd_sqrt(C, cfg.eig_floor))
        want = _subspace_test(functional_matrices(W, roots), functional_matrices(nulls, roots),
                              ks, (out, d), g2, cfg.thresholds, cfg.energy)
        got = res[variant]
        for side in ("input", "output"):
            for kind in ("real", "null"):
                assert got[side][kind]["score"] == pytest.approx(want[side][kind]["score"],
                                                                 abs=1e-9)
        assert got["score"] == pytest.approx(want["score"], abs=1e-12)
        assert got["null_score"] == pytest.approx(want["null_score"], abs=1e-12)
