"""``run_analysis`` end to end on a tiny random LLaMA (no download, seconds): every
result field of tests 1–3 and the role classifier, and the report."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import torch

from structlm.hf.adapters import get_adapter
from structlm.hf.calibration import calibrate
from structlm.share.analysis import analyze
from tiny_models import tiny_llama


class _Split:
    def describe(self) -> dict[str, Any]:
        return {"calibration_documents": ["synthetic/1"], "evaluation_documents": []}


class _Loaded:
    def __init__(self, model: Any) -> None:
        self.model, self.tokenizer, self.model_id, self.note = model, None, "tiny-llama", ""


def _prepare_tiny(monkeypatch, tmp_path, seed: int, windows: int, token_seed: int) -> None:
    """``analyze.prepare`` replaced by a tiny random LLaMA (``seed``) calibrated on
    ``windows`` windows of 32 random tokens; no evaluation text."""
    model = tiny_llama(seed=seed)
    adapter = get_adapter(model)
    tokens = torch.randint(0, 89, (windows * 32,),
                           generator=torch.Generator().manual_seed(token_seed))

    def fake_prepare(*_a: Any, **_k: Any) -> SimpleNamespace:
        cal = calibrate(adapter, tokens, seq_len=32, batch_size=4, progress=False,
                        meta={"model": "tiny-llama", "corpus": "synthetic"})
        cal.meta["path"] = str(tmp_path / "cal.safetensors")
        return SimpleNamespace(loaded=_Loaded(model), adapter=adapter, split=_Split(),
                               calib_ids=tokens, eval_ids={}, calibration=cal)

    monkeypatch.setattr(analyze, "prepare", fake_prepare)


def test_run_analysis_on_a_tiny_llama(tmp_path, monkeypatch) -> None:
    _prepare_tiny(monkeypatch, tmp_path, seed=2, windows=8, token_seed=0)
    cfg = analyze.AnalysisConfig(seq_len=32, batch_size=4, eval_tokens=0, permutations=10,
                                 second_corpus="")
    res = analyze.run_analysis(cfg, tmp_path / "out", progress=False)
    fc = res["functional_covariances"]
    assert fc["primary"] == "uncentred" and fc["sink_tokens"] == 4
    assert fc["variants"] == ["uncentred", "centred", "sink_excluded"]
    assert fc["sink_pass_positions"] == 8 * (32 - 4)
    k = res["tests"]["k"]
    assert k["shape"] == [16, 32]  # GQA: 2 KV heads of 8
    for key in ("weight_subspaces", "functional_subspaces", "functional_subspaces_centred",
                "functional_subspaces_sink_excluded"):
        assert (k[key]["k_input"], k[key]["k_output"]) == (8, 4), key
        assert k[key]["verdict"] in ("lives", "fails")
    assert k["functional_subspaces"]["primary"] is True
    assert k["functional_subspaces_centred"]["primary"] is False
    drops = k["alignment"]["cheap_drop"]
    assert set(drops) == {"baseline", "real", "null_gaussian", "null_spectrum",
                          "excess_over_gaussian"}
    assert "norm_scaling_share_of_cheap_drop" not in k["alignment"]
    assert res["tests"]["mlp_in"]["weight_subspaces"]["k_output"] == 24  # 96 rows / 4
    assert set(res["roles"]["shape_only"]) == {"features", "attention_to_mlp",
                                               "mlp_to_attention"}
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert "cheap_drop" in saved["tests"]["q"]["alignment"]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| 3 functional subspaces (primary) | q |" in report
    assert "| 3 functional, centred | q |" in report
    assert "| 3 functional, sinks excluded | q |" in report
    assert "not comparable to the seed's 0.693" in report
    assert "shape-only control" in report and "drop from scale" in report
    # the sink pass was cached beside the calibration
    assert list(tmp_path.glob("cal.sinks-*.safetensors"))
    # without the sink pass: two variants, the third marked skipped
    cfg.sink_pass = False
    res = analyze.run_analysis(cfg, tmp_path / "out2", progress=False)
    assert res["functional_covariances"]["variants"] == ["uncentred", "centred"]
    assert "skipped" in res["tests"]["q"]["functional_subspaces_sink_excluded"]
    assert "skipped: sink_pass is off" in (tmp_path / "out2" / "report.md").read_text()


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
    """Stopped in the middle of tests 2–3, the analysis resumes from steps.json: the
    finished steps are not run again and every number equals an uninterrupted run's
    (the random generator is restored to where it was); another config in that folder
    is refused."""
    import pytest

    from structlm.share.analysis.steps import StepLogMismatchError

    _prepare_tiny(monkeypatch, tmp_path, seed=3, windows=6, token_seed=1)
    cfg = analyze.AnalysisConfig(seq_len=32, batch_size=4, eval_tokens=0, permutations=10,
                                 second_corpus="")
    whole = analyze.run_analysis(cfg, tmp_path / "whole", progress=False)

    real_tests = analyze._functional_tests
    calls: list[int] = []

    def stop_at_the_third(*a: Any, **k: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("stopped")
        return real_tests(*a, **k)

    monkeypatch.setattr(analyze, "_functional_tests", stop_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        analyze.run_analysis(cfg, tmp_path / "resumed", progress=False)
    steps = json.loads((tmp_path / "resumed" / "steps.json").read_text())["steps"]
    assert {"alignment:q", "subspaces:q", "subspaces:k"} <= set(steps)
    assert "subspaces:v" not in steps
    calls.clear()
    monkeypatch.setattr(analyze, "_functional_tests", lambda *a, **k: (
        calls.append(1), real_tests(*a, **k))[1])
    resumed = analyze.run_analysis(cfg, tmp_path / "resumed", progress=False)
    assert len(calls) == 4  # v, o, mlp_in, mlp_out: q and k were not run again
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
    other = analyze.AnalysisConfig(seq_len=32, batch_size=4, eval_tokens=0, permutations=10,
                                   second_corpus="", k_fraction=0.5)
    with pytest.raises(StepLogMismatchError, match="other content"):
        analyze.run_analysis(other, tmp_path / "resumed", progress=False)
