"""``run_analysis`` end to end on a tiny random LLaMA (no download, seconds): every
result field of tests 1–3 (test 3 over calibration draws) and the role classifier, the
report, test 3 alone, resuming per step and per (draw, type), and bad input."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from structlm import stats
from structlm.hf.adapters import get_adapter
from structlm.hf.calibration import calibrate
from structlm.hf.fingerprint import tensor_fingerprint
from structlm.share.analysis import analyze
from tiny_models import tiny_llama


class _Split:
    def describe(self) -> dict[str, Any]:
        return {"calibration_documents": ["synthetic/1"], "evaluation_documents": []}


class _Loaded:
    def __init__(self, model: Any) -> None:
        self.model, self.tokenizer, self.model_id, self.note = model, None, "tiny-llama", ""


def _prepare_tiny(monkeypatch, tmp_path, seed: int, windows: int, token_seed: int
                  ) -> list[int | None]:
    """``analyze.prepare`` replaced by a tiny random LLaMA (``seed``) calibrated on
    ``windows`` windows of 32 random tokens, another draw of them per ``calib_seed``; no
    evaluation text. Returns the list the calibration draws asked for are appended to."""
    model = tiny_llama(seed=seed)
    adapter = get_adapter(model)
    asked: list[int | None] = []

    def fake_prepare(*_a: Any, calib_seed: int | None = None, **_k: Any) -> SimpleNamespace:
        asked.append(calib_seed)
        draw = 0 if calib_seed is None else calib_seed
        tokens = torch.randint(0, 89, (windows * 32,),
                               generator=torch.Generator().manual_seed(token_seed + 1000 * draw))
        cal = calibrate(adapter, tokens, seq_len=32, batch_size=4, progress=False,
                        meta={"model": "tiny-llama", "corpus": "synthetic",
                              "calibration_tokens": tensor_fingerprint(tokens),
                              **({} if calib_seed is None else {"calib_seed": calib_seed})})
        cal.meta["path"] = str(tmp_path / f"cal{draw}.safetensors")
        return SimpleNamespace(loaded=_Loaded(model), adapter=adapter, split=_Split(),
                               calib_ids=tokens, eval_ids={}, calibration=cal)

    monkeypatch.setattr(analyze, "prepare", fake_prepare)
    return asked


def _cfg(**kw: Any) -> analyze.AnalysisConfig:
    return analyze.AnalysisConfig(seq_len=32, batch_size=4, eval_tokens=0, permutations=10,
                                  second_corpus="", **kw)


def test_run_analysis_on_a_tiny_llama(tmp_path, monkeypatch) -> None:
    asked = _prepare_tiny(monkeypatch, tmp_path, seed=2, windows=8, token_seed=0)
    cfg = _cfg()
    res = analyze.run_analysis(cfg, tmp_path / "out", progress=False)
    assert asked == [None, 1, 2]  # draw 0 is the analysis's own calibration
    fc = res["functional_covariances"]
    assert fc["primary"] == "centred" and fc["sink_tokens"] == 4
    assert fc["variants"] == ["centred", "uncentred", "sink_excluded"]
    assert fc["calib_seeds"] == [0, 1, 2]
    assert all(fc["draws"][d]["sink_pass_positions"] == 8 * (32 - 4) for d in "012")
    assert len({fc["draws"][d]["calibration_tokens"] for d in "012"}) == 3
    k = res["tests"]["k"]
    assert k["shape"] == [16, 32]  # GQA: 2 KV heads of 8
    w = k["weight_subspaces"]
    assert (w["k_input"], w["k_output"]) == (8, 4) and w["verdict"] in ("lives", "fails")
    assert w["draws"] == 1
    f = k["functional"]
    assert (f["k_input"], f["k_output"]) == (8, 4)
    assert f["primary"] == "centred" and f["threshold"] == 0.5 and f["calib_seeds"] == [0, 1, 2]
    for variant, v in f["variants"].items():
        assert v["primary"] == (variant == "centred")
        assert len(v["margin_per_draw"]) == 3 and v["margin"]["n"] == 3
        assert len(set(v["margin_per_draw"])) == 3, variant  # each draw its own numbers
        for m, sc, nu in zip(v["margin_per_draw"], v["score_per_draw"],
                             v["null_score_per_draw"], strict=True):
            assert m == pytest.approx((sc - nu) / (1 - nu))
        want, iv = stats.threshold_verdict(v["margin_per_draw"], 0.5)
        assert v["verdict"] == {"above": "lives", "below": "fails",
                                "undecided": "undecided"}[want]
        assert v["margin"]["lo"] == pytest.approx(iv.lo)
    # every draw its own nulls: seeded from the draw and type
    seeds = {f["draws"][d]["null_seed"] for d in "012"}
    assert seeds == {analyze.null_seed(0, d, "k") for d in range(3)} and len(seeds) == 3
    drops = res["tests"]["q"]["alignment"]["cheap_drop"]
    assert set(drops) == {"baseline", "real", "null_gaussian", "null_spectrum",
                          "excess_over_gaussian"}
    assert res["tests"]["mlp_in"]["weight_subspaces"]["k_output"] == 24  # 96 rows / 4
    assert set(res["roles"]["shape_only"]) == {"features", "attention_to_mlp",
                                               "mlp_to_attention"}
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert "cheap_drop" in saved["tests"]["q"]["alignment"]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| 3 functional subspaces (centred covariance, primary) | q | m = " in report
    assert "### centred covariance (primary)" in report
    assert "### sinks excluded" in report and "### uncentred E[x xᵀ]" in report
    assert "| type | m per draw | mean [95% interval] | score / null (means) | verdict |" \
        in report
    assert "(one null draw: no interval) |" in report  # tests 1-2
    assert "not comparable to the seed's 0.693" in report
    assert "shape-only control" in report and "drop from scale" in report
    for png in ("energy.png", "effective_ranks.png", "alignment_distance.png",
                "functional_margins.png"):
        assert (tmp_path / "out" / png).stat().st_size > 5_000, png
    # the sink pass was cached beside each draw's calibration
    assert {p.name.split(".")[0] for p in tmp_path.glob("cal*.sinks-*.safetensors")} == \
        {"cal0", "cal1", "cal2"}
    # without the sink pass: two variants, the third marked skipped
    cfg.sink_pass = False
    res = analyze.run_analysis(cfg, tmp_path / "out2", progress=False)
    assert res["functional_covariances"]["variants"] == ["centred", "uncentred"]
    assert "skipped" in res["tests"]["q"]["functional"]["variants"]["sink_excluded"]
    assert "skipped: sink_pass is off" in (tmp_path / "out2" / "report.md").read_text()


def test_test_3_alone_over_draws(tmp_path, monkeypatch) -> None:
    """``tests: [3]``: no perplexity, no tests 1–2, no role classifier; the same test 3
    numbers as a full run (its nulls are seeded by draw and type alone); one draw gives
    no verdict."""
    asked = _prepare_tiny(monkeypatch, tmp_path, seed=4, windows=6, token_seed=3)
    full = analyze.run_analysis(_cfg(), tmp_path / "full", progress=False)
    for name in ("evaluate_all", "_role_test", "_alignment_test", "_subspace_test"):
        if name != "_subspace_test":
            monkeypatch.setattr(analyze, name, lambda *a, _n=name, **k: pytest.fail(_n))
    real_sub = analyze._subspace_test
    monkeypatch.setattr(analyze, "_subspace_test", lambda *a, **k: (
        pytest.fail("test 2 ran") if a[5] is not None else real_sub(*a, **k)))
    asked.clear()
    alone = analyze.run_analysis(_cfg(tests=[3]), tmp_path / "alone", progress=False)
    assert asked == [None, 1, 2]
    assert "perplexity" not in alone and "roles" not in alone
    assert alone["analysis_tests"] == [3]
    for t, r in alone["tests"].items():
        assert set(r) == {"shape", "functional"}, t
        assert _diff(r["functional"], full["tests"][t]["functional"]) == [], t
    report = (tmp_path / "alone" / "report.md").read_text()
    assert "| 1 alignment" not in report and "role signature" not in report
    assert "## Test 3 over calibration draws" in report
    assert (tmp_path / "alone" / "functional_margins.png").exists()
    assert not (tmp_path / "alone" / "alignment_distance.png").exists()
    one = analyze.run_analysis(_cfg(tests=[3], calib_seeds=[0]), tmp_path / "one",
                               progress=False)
    v = one["tests"]["q"]["functional"]["variants"]["centred"]
    assert v["verdict"] == "no verdict: one draw: no interval" and v["margin"]["n"] == 1
    assert "(one draw: no interval)" in (tmp_path / "one" / "report.md").read_text()


def test_functional_verdict_and_margin_known_answers() -> None:
    th = analyze.Thresholds()
    assert analyze.functional_verdict([0.8, 0.82, 0.79], th)[0] == "lives"
    assert analyze.functional_verdict([0.1, 0.12, 0.09], th)[0] == "fails"
    assert analyze.functional_verdict([0.2, 0.8, 0.5], th)[0] == "undecided"
    assert analyze.functional_verdict([0.8, 0.8], th)[0] == "no verdict: 2 draws (needs 3)"
    v, iv = analyze.functional_verdict([0.9], th)
    assert v == "no verdict: one draw: no interval" and iv is not None and iv.n == 1
    assert analyze.functional_verdict([0.9, math.nan, 0.8], th) == (
        "no verdict: a null control scored 1 (no gap to close)", None)
    with pytest.raises(ValueError, match="at least one draw"):
        analyze.functional_verdict([], th)
    # the reviewer's cases: a null of 0.823 leaves a raw margin of at most 0.177 (the old
    # rule's 0.2 can never be met); normalised, SmolLM2 K and Qwen MLP-in both score 0.51
    assert analyze.normalised_margin(1.0, 0.823) == pytest.approx(1.0)
    assert analyze.normalised_margin(0.910, 0.823) == pytest.approx(0.4915, abs=1e-3)
    assert analyze.normalised_margin(0.901, 0.796) == pytest.approx(0.515, abs=1e-3)
    assert analyze.normalised_margin(0.808, 0.606) == pytest.approx(0.513, abs=1e-3)
    assert analyze.normalised_margin(0.5, 0.5) == 0.0
    assert math.isnan(analyze.normalised_margin(1.0, 1.0))


def test_bad_draws_and_tests_are_refused_at_the_boundary(tmp_path, capsys) -> None:
    from structlm.cli import main
    from structlm.config import ConfigError

    with pytest.raises(ConfigError, match=r"calib_seeds: .*repeat"):
        analyze.AnalysisConfig(calib_seeds=[0, 1, 1])
    with pytest.raises(ConfigError, match=r"calib_seeds: \[\] is empty"):
        analyze.AnalysisConfig(calib_seeds=[])
    with pytest.raises(ConfigError, match="tests"):
        analyze.AnalysisConfig(tests=[4])
    with pytest.raises(ConfigError, match="draws the windows of draw 0 again"):
        analyze.AnalysisConfig(seed=2, calib_seeds=[0, 2])
    for flags, message in ((["--calib-seeds", "0,1,0"], "repeat"),
                           (["--calib-seeds", ","], "empty"),
                           (["--tests", "3,5"], "not valid")):
        with pytest.raises(SystemExit) as e:
            main(["share", "analyze", "smollm2", *flags, "--out", str(tmp_path / "x")])
        assert e.value.code == 2, flags
        err = capsys.readouterr().err
        assert flags[0] in err and message in err, err
    assert not (tmp_path / "x").exists()


def _without_seconds(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _without_seconds(v) for k, v in x.items() if "seconds" not in k}
    if isinstance(x, list):
        return [_without_seconds(v) for v in x]
    return x


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where ``a`` and ``b`` differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in _diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b or (a != a and b != b) else [f"{path}: {a!r} != {b!r}"]


def test_an_interrupted_analysis_resumes_to_the_uninterrupted_numbers(tmp_path,
                                                                       monkeypatch) -> None:
    """Stopped in the middle of test 2 or of test 3's draws, the analysis resumes from
    steps.json: the finished steps are not run again and every number equals an
    uninterrupted run's (the random generator is restored to where it was); draws can be
    added to a folder later; another config in that folder is refused."""
    from structlm.share.analysis.steps import StepLogMismatchError

    asked = _prepare_tiny(monkeypatch, tmp_path, seed=3, windows=6, token_seed=1)
    cfg = _cfg()
    whole = analyze.run_analysis(cfg, tmp_path / "whole", progress=False)

    real_tests = analyze._functional_tests
    calls: list[int] = []

    def stop_at(n: int) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            calls.append(1)
            if len(calls) == n:
                raise KeyboardInterrupt("stopped")
            return real_tests(*a, **k)
        return run

    # inside test 3: draw 0 done for all six types, draw 1 for q
    monkeypatch.setattr(analyze, "_functional_tests", stop_at(8))
    with pytest.raises(KeyboardInterrupt):
        analyze.run_analysis(cfg, tmp_path / "resumed", progress=False)
    steps = json.loads((tmp_path / "resumed" / "steps.json").read_text())["steps"]
    assert {"alignment:q", "subspaces:mlp_out", "calibration:draw0", "calibration:draw1",
            "functional:draw0:mlp_out", "functional:draw1:q"} <= set(steps)
    assert "functional:draw1:k" not in steps and "calibration:draw2" not in steps
    calls.clear()
    asked.clear()
    monkeypatch.setattr(analyze, "_functional_tests", lambda *a, **k: (
        calls.append(1), real_tests(*a, **k))[1])
    resumed = analyze.run_analysis(cfg, tmp_path / "resumed", progress=False)
    assert len(calls) == 18 - 7 and asked == [None, 1, 2]
    assert _diff(_without_seconds(resumed), _without_seconds(whole)) == []
    # draws added later: [0, 1] first, then [0, 1, 2] runs draw 2 alone
    calls.clear()
    analyze.run_analysis(_cfg(calib_seeds=[0, 1]), tmp_path / "grown", progress=False)
    assert len(calls) == 12
    calls.clear()
    asked.clear()
    grown = analyze.run_analysis(cfg, tmp_path / "grown", progress=False)
    assert len(calls) == 6 and asked == [None, 2]  # draw 1 is not even prepared again
    assert _diff(_without_seconds(grown), _without_seconds(whole)) == []
    # test 3 alone first, then every test in the same folder: test 3 is not run again
    calls.clear()
    analyze.run_analysis(_cfg(tests=[3]), tmp_path / "t3_first", progress=False)
    assert len(calls) == 18
    calls.clear()
    asked.clear()
    then_all = analyze.run_analysis(cfg, tmp_path / "t3_first", progress=False)
    assert calls == [] and asked == [None]
    assert _diff(_without_seconds(then_all), _without_seconds(whole)) == []
    # inside test 2: q and k recorded, v not
    real_sub = analyze._subspace_test
    weight_calls: list[int] = []

    def stop_in_test_2(*a: Any, **k: Any) -> Any:
        if a[5] is not None:  # test 2 (test 3 passes no thresholds)
            weight_calls.append(1)
            if len(weight_calls) == 3:
                raise KeyboardInterrupt("stopped")
        return real_sub(*a, **k)

    monkeypatch.setattr(analyze, "_subspace_test", stop_in_test_2)
    with pytest.raises(KeyboardInterrupt):
        analyze.run_analysis(cfg, tmp_path / "in_test_2", progress=False)
    steps = json.loads((tmp_path / "in_test_2" / "steps.json").read_text())["steps"]
    assert {"subspaces:q", "subspaces:k"} <= set(steps) and "subspaces:v" not in steps
    monkeypatch.setattr(analyze, "_subspace_test", real_sub)
    resumed = analyze.run_analysis(cfg, tmp_path / "in_test_2", progress=False)
    assert _diff(_without_seconds(resumed), _without_seconds(whole)) == []
    # stopped inside test 1: right after o's first layer was recorded
    from structlm.share.analysis.steps import StepLog

    real_record = StepLog.record

    def stop_after_a_layer(self: Any, step: str, *a: Any) -> Any:
        out = real_record(self, step, *a)
        if step == "alignment:o:layer0":
            raise KeyboardInterrupt("stopped")
        return out

    monkeypatch.setattr(StepLog, "record", stop_after_a_layer)
    with pytest.raises(KeyboardInterrupt):
        analyze.run_analysis(cfg, tmp_path / "in_test_1", progress=False)
    monkeypatch.setattr(StepLog, "record", real_record)
    steps = json.loads((tmp_path / "in_test_1" / "steps.json").read_text())["steps"]
    assert {"alignment:o:start", "alignment:o:layer0"} <= set(steps)
    assert "alignment:o" not in steps and "alignment:o:layer2" not in steps
    real_align = analyze.align
    aligned: list[int] = []
    aligned.clear()
    monkeypatch.setattr(analyze, "align", lambda *a, **k: (aligned.append(1),
                                                           real_align(*a, **k))[1])
    resumed = analyze.run_analysis(cfg, tmp_path / "in_test_1", progress=False)
    assert len(aligned) == 3 + 2 * 6  # o's layer 2; mlp_in and mlp_out: 2 layers × 3 each
    assert _diff(_without_seconds(resumed), _without_seconds(whole)) == []
    other = _cfg(k_fraction=0.5)
    with pytest.raises(StepLogMismatchError, match="other content"):
        analyze.run_analysis(other, tmp_path / "resumed", progress=False)
