"""``structlm study``: config checks, a real tiny study end to end, resumption, one writer."""

from __future__ import annotations

import csv
import dataclasses
import fcntl
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from structlm.experiments.study.config import (
    ArmSpec,
    StudyConfig,
    load_study_config,
)
from structlm.experiments.study.run import run_study
from structlm.stats import WindowScores
from structlm.train.evaluate import split_loss, unigram_loss

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "study" / "tiny.yaml"


def _cfg(tmp_path: Path, **kw) -> StudyConfig:
    base = load_study_config(str(TINY), out_dir=str(tmp_path / "study"))
    return StudyConfig(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, **kw})


def test_shipped_study_configs_load() -> None:
    for path in sorted((ROOT / "configs" / "study").glob("*.yaml")):
        cfg = load_study_config(str(path))
        assert cfg.arms and all(r.type_counts() for r in (cfg.run_config(a, a.seeds[0])
                                                         for a in cfg.arms))


def test_every_arm_sees_the_same_tokens_and_schedule_of_learning_rate(tmp_path) -> None:
    cfg = _cfg(tmp_path)
    runs = [cfg.run_config(a, k) for a, k in cfg.runs()]
    shared = {(r.max_steps, r.batch_size, r.seq_len, r.lr, r.warmup_steps, r.data_dir,
               r.data_seed, r.tokenizer) for r in runs}
    assert len(shared) == 1
    assert len({r.out_dir for r in runs}) == len(runs)
    # first seeds of every arm first
    assert [a.name for a, _ in cfg.runs()[:len(cfg.arms)]] == [a.name for a in cfg.arms]


def test_mac_matched_width_and_equal_parameters(tmp_path) -> None:
    from structlm.models.cost import model_cost, parameter_count

    cfg = _cfg(tmp_path)
    arms = {a.name: a for a in cfg.arms}
    assert cfg.ffn_width(arms["dense-macs-q2x2"]) == 72  # 128 x 9/16
    ffn = {n: model_cost(cfg.model_config(a))["training_macs_per_token"]["ffn"]["algebra"]
           for n, a in arms.items()}
    assert ffn["dense-macs-q2x2"] == ffn["q2x2"] < ffn["dense"]
    params = {n: parameter_count(cfg.model_config(a)) for n, a in arms.items()}
    assert params["q2x2"] == params["dense"] == params["q2x2-scores"] > params["dense-macs-q2x2"]


@pytest.mark.parametrize(("change", "match"), [
    ({"arms": (ArmSpec("a"), ArmSpec("a", algebra="Q4"))}, r"arm names \['a'\] are used twice"),
    ({"arms": (ArmSpec("a"), ArmSpec("b"))}, "arms 'a' and 'b' train the same model"),
    ({"arms": (ArmSpec("a", ffn="mac-match:Q16"),)}, r"needs FFN width 128 x rho = 31/2"),
    ({"preset": "tiny"}, "under half"),
    ({"train": {"seed": 3}}, r"keys \['seed'\] cannot be set for the whole study"),
    ({"arms": (ArmSpec("q", algebra="Q2^2", type_schedule="block"),)},
     r"types \[1, 2, 3\].*seq_len=32"),
])
def test_bad_studies_are_refused_before_any_work(tmp_path, change, match) -> None:
    with pytest.raises(ValueError, match=match):
        _cfg(tmp_path, **change)
    assert not (tmp_path / "study").exists()


def test_unknown_yaml_keys_are_named(tmp_path) -> None:
    bad = tmp_path / "s.yaml"
    bad.write_text("out_dir: x\narms:\n  - {name: a, algebar: Q4}\n")
    with pytest.raises(ValueError, match=r"unknown ArmSpec keys \['algebar'\]"):
        load_study_config(str(bad))


def test_split_loss_scores_every_token_once_in_float64() -> None:
    from structlm.models import StructLMForCausalLM, config_from_preset

    torch.manual_seed(0)
    model = StructLMForCausalLM(config_from_preset("study-tiny", "Q2^2", type_schedule="block:2"))
    tokens = np.random.default_rng(0).integers(0, 512, 97).astype(np.uint16)
    got = split_loss(model, tokens, seq_len=10, batch_size=3, progress=False)
    assert got["tokens"] == 96 and got["windows"] == 10
    total = 0.0
    for s in range(0, 96, 10):
        w = torch.from_numpy(tokens[s:s + 11].astype(np.int64))[None]
        with torch.no_grad():
            logits = model(w[:, :-1]).logits.double()
        total += float(torch.nn.functional.cross_entropy(logits[0], w[0, 1:], reduction="sum"))
    assert got["loss"] == pytest.approx(total / 96, rel=1e-6)  # float32 logits, batched


def test_unigram_loss_known_answer() -> None:
    train = np.array([0, 0, 0, 1], dtype=np.uint16)
    val = np.array([5, 0, 1], dtype=np.uint16)  # scored: 0 and 1
    p = np.array([4, 2, 1]) / 7  # add-one over a 3-token vocabulary
    assert unigram_loss(train, val, 3) == pytest.approx(-(np.log(p[0]) + np.log(p[1])) / 2)


def test_tiny_study_end_to_end_and_resume(tmp_path) -> None:
    cfg = _cfg(tmp_path)
    report = run_study(cfg, progress=False)
    out = tmp_path / "study"
    text = report.read_text()
    fingerprints = set()
    for arm in cfg.arms:
        assert f"| {arm.name} |" in text
        for k in arm.seeds:
            final = json.loads((out / "runs" / arm.name / f"seed{k}" / "final.json").read_text())
            assert final["val_tokens"] >= cfg.min_val_tokens
            assert min(final["type_tokens_per_window"]) > 0
            # the test text, scored once per run: per-window sums, keyed on the windows
            scores = WindowScores.from_dict(final["test"]["pooled"])
            assert len(scores.nll) == -(-final["test"]["tokens"] // 32)  # windows of 32
            assert scores.mean_nll == pytest.approx(final["test"]["mean_nll"], rel=1e-12)
            assert final["validation"]["role"] == "validation" and final["protocol"] == 2
            fingerprints.add(scores.windows)
    assert len(fingerprints) == 1  # every run scored on the same test windows
    assert "equal FFN MACs" in text and "equal parameters" in text
    assert "a − b, test NLL [95% interval]" in text
    assert "Generation throughput" in text
    rows = list(csv.DictReader((out / "runs.csv").open()))
    assert len(rows) == sum(len(a.seeds) for a in cfg.arms)
    assert all(os.path.getsize(out / p) > 1000 for p in ("curves.png", "loss_vs_macs.png"))
    # an interrupted study: one run lost its result; a rerun redoes that run only
    victim = out / "runs" / "q2x2" / "seed1"
    keep = out / "runs" / "dense" / "seed0" / "final.json"
    before = keep.stat().st_mtime_ns
    loss = json.loads((victim / "final.json").read_text())["val_loss"]
    (victim / "final.json").unlink()
    run_study(cfg, progress=False)
    assert keep.stat().st_mtime_ns == before
    assert json.loads((victim / "final.json").read_text())["val_loss"] == loss


def test_one_writer_and_one_study_per_folder(tmp_path) -> None:
    cfg = _cfg(tmp_path)
    out = tmp_path / "study"
    out.mkdir()
    with open(out / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        with pytest.raises(RuntimeError, match="another process"):
            run_study(cfg, progress=False)
    (out / "study_config.json").write_text(json.dumps({**dataclasses.asdict(cfg),
                                                       "corpus": "austen", "arms": [],
                                                       "protocol": 2}))
    with pytest.raises(ValueError, match=r"other shared settings \(\['corpus'\]\)"):
        run_study(cfg, progress=False)


def test_verdicts_come_from_stats_and_wait_for_every_seed() -> None:
    from structlm.experiments.study.report import comparison_cells, pair_comparison
    from structlm.stats import Arm

    base = np.random.default_rng(0).normal(5.0, 0.3, 50)

    def arm(name: str, offset: float, n: int, planned: int) -> dict:
        runs = tuple(WindowScores(tuple(float(x) * 20 for x in base + offset + 0.01 * k
                                        + 0.02 * np.random.default_rng(k).standard_normal(50)),
                                  (20,) * 50, "w") for k in range(n))
        return {"n": n, "planned": planned, "scores": Arm(name, runs, budget={"steps": 4})}

    pending = pair_comparison(arm("a", 0.0, 1, 3), arm("b", 0.2, 3, 3))
    assert pending.startswith("pending: 1/3 and 3/3")
    assert comparison_cells(pending)[2] == pending
    lower = comparison_cells(pair_comparison(arm("a", 0.0, 3, 3), arm("b", 0.2, 3, 3)))
    assert lower[2] == "**a lower**" and lower[0].startswith("-0.2")
    same = comparison_cells(pair_comparison(arm("a", 0.0, 3, 3), arm("b", 0.0, 3, 3)))
    assert same[2] == "no difference shown" and same[0].startswith("+0.0000 [")
    one = comparison_cells(pair_comparison(arm("a", 0.0, 1, 1), arm("b", 0.2, 1, 1)))
    assert one[2].startswith("no verdict: one run of a, b")


def test_iso_quality_interpolates_in_log_macs_and_bounds_outside_the_dense_range() -> None:
    from structlm.experiments.study.report import iso_quality

    def s(algebra: str, macs: int, mean: float) -> dict:
        return {"arm": ArmSpec(name=f"{algebra}-{macs}", algebra=algebra),
                "projection_macs": macs, "mean": mean}

    stats = {"d1": s("dense", 100, 6.0), "d2": s("dense", 400, 5.0),
             "inside": s("Q2^2", 150, 5.5), "worse": s("Q4", 120, 6.2),
             "better": s("Q4", 120, 4.9)}
    dense, rows = iso_quality(stats)
    assert dense == [(100, 6.0), (400, 5.0)]
    by = {r["arm"]: r for r in rows}
    assert by["inside"]["dense_macs_at_loss"] == pytest.approx(200.0)  # halfway in log MACs
    assert by["inside"]["ratio"] == pytest.approx(0.75) and by["inside"]["bound"] is None
    assert by["worse"]["dense_macs_at_loss"] is None
    assert (by["worse"]["bound"], by["worse"]["bound_macs"]) == ("below", 100)
    assert (by["better"]["bound"], by["better"]["bound_macs"]) == ("above", 400)
