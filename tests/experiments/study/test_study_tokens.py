"""``structlm study`` with token budgets, a learning-rate sweep, wide arms at equal MACs,
a structure-aware initialisation and per-part validation: config checks and a real tiny
study end to end."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

from structlm.data.tokens import TokenDataset
from structlm.experiments.study.config import (
    ArmSpec,
    LrSweep,
    StudyConfig,
    chosen_rates,
    load_study_config,
)
from structlm.experiments.study.run import run_study
from structlm.stats import WindowScores, windows_fingerprint
from structlm.train.evaluate import split_windows

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "study" / "tiny.yaml"
TOKENS = ROOT / "configs" / "study" / "cpu-tokens.yaml"


def _cfg(tmp_path: Path, **kw) -> StudyConfig:
    base = load_study_config(str(TINY), out_dir=str(tmp_path / "study"))
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    fields["train"] = {k: v for k, v in base.train.items() if k != "max_steps"}
    fields.update(corpus="bible+shakespeare", budgets=(4, 6),
                  lr_sweep=LrSweep(rates=(1e-3, 3e-3), budget=4, seed=0),
                  arms=(ArmSpec("dense", lr="sweep", seeds=(0, 1)),
                        ArmSpec("q2x2", algebra="Q2^2", lr="from:dense", seeds=(0, 1)),
                        ArmSpec("dense-macs-q2x2", ffn="mac-match:Q2^2", lr=2e-3),
                        ArmSpec("q2x2-wide", algebra="Q2^2", ffn="dense-macs", lr="sweep"),
                        ArmSpec("q2x2-varinit", algebra="Q2^2", init="variance-matched",
                                lr="from:dense", budgets=(6,))))
    fields.update(kw)
    return StudyConfig(**fields)


def test_shipped_token_study_plan() -> None:
    from structlm.models.cost import model_cost, parameter_count

    cfg = load_study_config(str(TOKENS))
    arms = {a.name: a for a in cfg.arms}
    assert cfg.all_budgets() == (250, 1000)
    assert cfg.ffn_width(arms["q2x2-wide"]) == 1820  # 1024 x 16/9, a multiple of 4
    ffn = {n: model_cost(cfg.model_config(a))["training_macs_per_token"]["ffn"]["algebra"]
           for n, a in arms.items()}
    assert abs(ffn["q2x2-wide"] - ffn["dense"]) <= 0.005 * ffn["dense"]
    assert ffn["dense-macs-q2x2"] == ffn["q2x2"] == ffn["q2x2-varinit"]
    params = {n: parameter_count(cfg.model_config(a)) for n, a in arms.items()}
    assert params["q2x2-wide"] > params["dense"] == params["q2x2"] > params["dense-macs-q2x2"]
    assert len(cfg.sweep_runs()) == 15
    main = cfg.main_runs({"dense": 1e-3, "q2x2": 2e-3, "q2x2-wide": 5e-4})
    sweep_folders = {cfg.run_config_of(r).out_dir for r in cfg.sweep_runs()}
    new = [r for r in main if cfg.run_config_of(r).out_dir not in sweep_folders]
    steps = sum(r.steps for r in new) + sum(r.steps for r in cfg.sweep_runs())
    assert steps == 17_500  # the plan written in the config's header
    assert {r.lr for r in main if r.arm.name == "dense-macs-q2x2"} == {1e-3}  # from: dense
    assert {r.lr for r in main if r.arm.name == "q2x2-varinit"} == {2e-3}  # from: q2x2


def test_shipped_verdicts_plan() -> None:
    """configs/study/cpu-verdicts.yaml: 3 seeds of every arm at both budgets, rates swept on
    a seed of their own, one thread per run; the plan written in its header."""
    cfg = load_study_config(str(ROOT / "configs" / "study" / "cpu-verdicts.yaml"))
    assert [a.name for a in cfg.arms] == ["dense", "q2x2", "dense-macs-q2x2", "q2x2-wide"]
    assert cfg.all_budgets() == (250, 1000) and cfg.train["threads"] == 1
    assert all(a.seeds == (0, 1, 2) and cfg.arm_budgets(a) == (250, 1000) for a in cfg.arms)
    sw = cfg.lr_sweep
    assert sw is not None and not sw.reuse and sw.seed == 100 and sw.budget == 250
    assert sw.rates == load_study_config(str(TOKENS)).lr_sweep.rates  # type: ignore[union-attr]
    main = cfg.main_runs({"dense": 2e-3, "q2x2": 4e-3, "q2x2-wide": 4e-3})
    assert {r.lr for r in main if r.arm.name == "dense-macs-q2x2"} == {2e-3}  # from: dense
    assert not {cfg.run_config_of(r).out_dir for r in cfg.sweep_runs()} & {
        cfg.run_config_of(r).out_dir for r in main}
    assert len(cfg.sweep_runs()) + len(main) == 39
    assert sum(r.steps for r in [*cfg.sweep_runs(), *main]) == 18_750
    assert any("q2x2-varinit" in n and "not re-derived" in n for n in cfg.notes)


@pytest.mark.parametrize(("change", "match"), [
    ({"lr_sweep": None}, "has lr: sweep but the study has no lr_sweep"),
    ({"lr_sweep": LrSweep(rates=(1e-3,), budget=5)}, r"lr_sweep.budget=5 is not among"),
    ({"budgets": (4,)}, r"budgets \[6\] are not among the study's budgets \[4\]"),
    ({"train": {"max_steps": 4}}, "both set the training length"),
    ({"arms": (ArmSpec("d", lr="from:e"),)}, "lr 'from:e' names no arm"),
    ({"arms": (ArmSpec("d", lr="from:e"), ArmSpec("e", algebra="Q4", lr="from:d"))},
     "is a cycle"),
    ({"arms": (ArmSpec("d", ffn="dense-macs"),), "lr_sweep": None},
     "a dense arm is that already"),
    ({"arms": (ArmSpec("d", lr="sweep", seeds=(1,)),)}, r"the sweep's seed 0 is not among"),
    ({"arms": (ArmSpec("d"), ArmSpec("e", lr=1.0))}, "lr_sweep is set but no arm"),
])
def test_bad_token_studies_are_refused_before_any_work(tmp_path, change, match) -> None:
    with pytest.raises(ValueError, match=match):
        _cfg(tmp_path, **change)
    assert not (tmp_path / "study").exists()


@pytest.mark.parametrize(("lr", "match"), [(-1e-3, "must be > 0"), ("best", "'sweep' or")])
def test_bad_arm_rates_are_named(lr, match) -> None:
    with pytest.raises(ValueError, match=match):
        ArmSpec("a", lr=lr)


def test_tiny_token_study_end_to_end_and_resume(tmp_path) -> None:
    cfg = _cfg(tmp_path)
    report = run_study(cfg, progress=False)
    out = tmp_path / "study"
    text = report.read_text()
    # the sweep ran every rate; the chosen rate is the lowest loss, reused as seed 0
    sweep = {r.lr: json.loads((Path(cfg.run_config_of(r).out_dir) / "final.json").read_text())
             for r in cfg.sweep_runs() if r.arm.name == "dense"}
    best = min(sweep, key=lambda k: (sweep[k]["val_loss"], k))
    assert chosen_rates(cfg)["dense"] == best
    runs = cfg.main_runs(chosen_rates(cfg))
    assert {r.lr for r in runs if r.arm.name in ("dense", "q2x2", "q2x2-varinit")} == {best}
    data = TokenDataset(out / "data")
    fingerprint = windows_fingerprint(np.concatenate(
        [split_windows(t, 32) for t in data.test_parts().values()]))
    dense0 = next(r for r in runs if r.arm.name == "dense" and r.steps == 4 and r.seed == 0)
    assert cfg.run_config_of(dense0).out_dir.endswith(f"dense/steps4-lr{best:g}/seed0")
    for r in runs:
        final = json.loads((Path(cfg.run_config_of(r).out_dir) / "final.json").read_text())
        assert (final["steps"], final["lr"], final["seed"]) == (r.steps, r.lr, r.seed)
        assert final["train_tokens"] == r.steps * 4 * 32
        parts = final["val_parts"]
        assert set(parts) == {"bible", "shakespeare"}
        pooled = sum(p["loss"] * p["tokens"] for p in parts.values()) / sum(
            p["tokens"] for p in parts.values())
        assert final["val_loss"] == pytest.approx(pooled, rel=1e-12)
        assert final["val_tokens"] >= cfg.min_val_tokens
        assert min(final["type_tokens_per_window"]) > 0
        # test scores, per part and pooled, on the same windows for every run
        test = final["test"]
        assert test["role"] == "test" and set(test["parts"]) == {"bible", "shakespeare"}
        pooled = WindowScores.from_dict(test["pooled"])
        per = [WindowScores.from_dict(test["parts"][p]) for p in ("bible", "shakespeare")]
        assert pooled.nll == per[0].nll + per[1].nll and pooled.windows == fingerprint
        assert set(final["validation"]["documents"]).isdisjoint(test["documents"])
    # a sweep run at a rate not chosen was never scored on the test text
    for r in cfg.sweep_runs():
        final = json.loads((Path(cfg.run_config_of(r).out_dir) / "final.json").read_text())
        assert ("test" in final) == (r.lr == chosen_rates(cfg)[r.arm.name])
    wide = next(r for r in runs if r.arm.name == "q2x2-wide")
    assert json.loads((Path(cfg.run_config_of(wide).out_dir) / "final.json").read_text())[
        "ffn_width"] == 228  # 128 x 16/9 rounded to a multiple of 4
    for section in ("## Learning-rate sweep (4 steps, seed 0)", "## 4 steps: 512 training",
                    "## 6 steps: 768 training", "## Gaps across token budgets",
                    "equal FFN MACs, more parameters", "| initialisation | q2x2-varinit | q2x2",
                    "| arm | bible | shakespeare | pooled |", "Rates taken from another arm",
                    "Test NLL per corpus part", "perplexity a / b"):
        assert section in text, section
    rows = list(csv.DictReader((out / "runs.csv").open()))
    assert len(rows) == len(runs)
    assert {"val_loss_bible", "val_loss_shakespeare", "steps", "lr", "test_nll",
            "test_nll_bible", "test_nll_shakespeare"} <= set(rows[0])
    for png in ("curves.png", "loss_vs_macs.png", "loss_vs_tokens.png"):
        assert os.path.getsize(out / png) > 1000
    # a rerun trains nothing: every run's result stays as it was
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*/seed*/final.json")}
    run_study(cfg, progress=False)
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*/seed*/final.json")} == stamps


def test_rates_may_be_added_to_a_running_sweep_but_not_dropped(tmp_path) -> None:
    import dataclasses

    from structlm.experiments.study.run import _check_same_study

    cfg = _cfg(tmp_path)
    out = tmp_path / "study"
    out.mkdir()
    _check_same_study(out, cfg)
    wider = dataclasses.replace(cfg, lr_sweep=LrSweep(rates=(1e-3, 3e-3, 6e-3), budget=4))
    _check_same_study(out, wider)  # the runs at the old rates stay valid
    narrower = dataclasses.replace(cfg, lr_sweep=LrSweep(rates=(3e-3, 6e-3), budget=4))
    with pytest.raises(ValueError, match=r"drop rates of the study started with"):
        _check_same_study(out, narrower)
    other = dataclasses.replace(wider, lr_sweep=LrSweep(rates=(1e-3, 3e-3, 6e-3), budget=6))
    with pytest.raises(ValueError, match=r"other shared settings \(\['lr_sweep'\]\)"):
        _check_same_study(out, other)


def test_a_folder_started_before_the_new_fields_is_refused_not_resumed(tmp_path) -> None:
    """The committed CPU study's study_config.json predates budgets, lr_sweep and the test
    split (protocol 1): the same config refuses it with a message that says why."""
    import shutil

    from structlm.experiments.study.config import OldProtocolError
    from structlm.experiments.study.run import _check_same_study

    cfg = load_study_config(str(ROOT / "configs" / "study" / "cpu.yaml"),
                            out_dir=str(tmp_path / "old"))
    (tmp_path / "old").mkdir()
    shutil.copy(ROOT / "benchmarks" / "results" / "study_cpu" / "study_config.json",
                tmp_path / "old" / "study_config.json")
    old = json.loads((tmp_path / "old" / "study_config.json").read_text())
    assert "budgets" not in old and "protocol" not in old  # written before them
    with pytest.raises(OldProtocolError, match="cannot be resumed under protocol 2"):
        _check_same_study(tmp_path / "old", cfg)
