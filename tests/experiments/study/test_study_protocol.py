"""The study's protocol on constructed finished runs (no training): the sweep decides on
validation only, the report's verdicts come from :mod:`structlm.stats` on the test scores,
the gap between budgets is bootstrapped as one quantity, unequal budgets and old folders
are refused."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

from structlm.experiments.study.config import (
    PROTOCOL,
    ArmSpec,
    LrSweep,
    OldProtocolError,
    Run,
    StudyConfig,
    choose_rate,
    chosen_rates,
    load_study_config,
    validation_record,
)
from structlm.experiments.study.report import arm_of_runs, arm_stats, write_report
from structlm.experiments.study.report_tokens import gap_change
from structlm.hf.splits import TestWindowsError
from structlm.stats import Arm, UnequalBudgetError, WindowScores, compare

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "study" / "tiny.yaml"
W, T = 80, 32  # windows, tokens per window
BASE = 4.0 + 0.4 * np.random.default_rng(7).standard_normal(W)  # per-window difficulty


def _cfg(tmp_path: Path, **kw) -> StudyConfig:
    base = load_study_config(str(TINY), out_dir=str(tmp_path / "study"))
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    fields["train"] = {k: v for k, v in base.train.items() if k != "max_steps"}
    fields.update(budgets=(4, 6), arms=(ArmSpec("dense", seeds=(0, 1, 2)),
                                       ArmSpec("q2x2", algebra="Q2^2", seeds=(0, 1, 2))))
    fields.update(kw)
    return StudyConfig(**fields)


def _scores(offset: float, seed: int, noise: float = 0.02) -> WindowScores:
    rng = np.random.default_rng(1000 + seed)
    per_token = BASE + offset + 0.01 * rng.standard_normal() + noise * rng.standard_normal(W)
    return WindowScores(tuple(float(x) * T for x in per_token), (T,) * W, "test-windows")


def _finish(cfg: StudyConfig, run: Run, test: WindowScores | None, val_loss: float) -> Path:
    """A finished run's folder as the study writes it: ``final.json`` and ``metrics.csv``."""
    rc = cfg.run_config_of(run)
    folder = Path(rc.out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    tokens = run.steps * rc.batch_size * rc.seq_len
    summary = {
        "protocol": PROTOCOL, "arm": run.arm.name, "seed": run.seed, "algebra": run.arm.algebra,
        "steps": run.steps, "lr": run.lr, "init": run.arm.init, "val_parts": {},
        "budget": {"steps": run.steps, "tokens": tokens},
        "ffn_width": cfg.ffn_width(run.arm), "type_schedule": rc.model_schedule(),
        "structured_scores": False, "val_loss": val_loss, "val_tokens": 5000,
        "val_windows": 160,
        "validation": {"role": "validation", "loss": val_loss, "tokens": 5000, "windows": 160,
                       "parts": {}, "documents": ["v"]},
        "eval_seconds": 1.0, "train_tokens": tokens, "train_seconds": 2.0,
        "train_tokens_per_s": tokens / 2.0, "parameters": 51_776,
        "non_embedding_parameters": 30_000,
        "projection_macs_per_token": 32_768 if run.arm.is_dense else 22_016,
        "ffn_macs_per_token": 1, "decode_macs_per_token": 1, "training_macs_per_token": 1,
        "type_tokens_per_window": rc.type_counts(), "layers": 2,
    }
    if test is not None:
        summary["test"] = {"role": "test", "seq_len": rc.seq_len, "documents": ["t"],
                           "mean_nll": test.mean_nll, "tokens": sum(test.tokens),
                           "pooled": test.as_dict(),
                           "parts": {"bible": {**test.as_dict(), "mean_nll": test.mean_nll,
                                               "tokens": sum(test.tokens)}}}
    (folder / "final.json").write_text(json.dumps(summary))
    with (folder / "metrics.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["step", "lr", "train_loss", "val_loss", "tokens",
                                           "type_tokens", "seconds"])
        w.writeheader()
        for step in range(1, run.steps + 1):
            w.writerow({"step": step, "lr": run.lr, "train_loss": 6.0, "val_loss":
                        val_loss if step % 2 == 0 else "", "tokens": step * 128,
                        "type_tokens": "", "seconds": 0.5 * step})
    return folder / "final.json"


class _Data:
    """What :func:`write_report` reads of a token dataset."""

    vocab_size = 64

    def __init__(self) -> None:
        self.meta = {"train_documents": ["a", "b"], "train_tokens": 3000, "val_tokens": 500,
                     "val_documents": ["v"], "test_tokens": 500, "test_documents": ["t"]}

    def tokens(self, split: str) -> np.ndarray:
        n = {"train": 3000, "val": 500, "test": 500}[split]
        return (np.arange(n) * 7 % 64).astype(np.uint16)

    def test_parts(self) -> dict[str, np.ndarray]:
        return {"bible": self.tokens("test")}

    def val_parts(self) -> dict[str, np.ndarray]:
        return {"bible": self.tokens("val")}


def _finish_all(cfg: StudyConfig, offsets: dict[tuple[str, int], float]) -> None:
    for r in cfg.main_runs({}):
        _finish(cfg, r, _scores(offsets[(r.arm.name, r.steps)], r.seed), 5.0)


# ------------------------------------------------------------------ the sweep's decision
def test_the_sweep_chooses_on_validation_and_never_reads_test_scores(tmp_path) -> None:
    cfg = _cfg(tmp_path, lr_sweep=LrSweep(rates=(1e-3, 3e-3), budget=4, seed=0),
               arms=(ArmSpec("dense", lr="sweep", seeds=(0, 1)),
                     ArmSpec("q2x2", algebra="Q2^2", lr="from:dense", seeds=(0, 1))))
    # validation picks 1e-3; the test scores would pick 3e-3 (far lower NLL)
    finals = {r.lr: _finish(cfg, r, _scores(2.0 if r.lr == 1e-3 else -2.0, 0),
                            5.0 if r.lr == 1e-3 else 5.1) for r in cfg.sweep_runs()}
    assert chosen_rates(cfg) == {"dense": 1e-3}
    tests = {lr: json.loads(p.read_text())["test"] for lr, p in finals.items()}
    assert min(tests, key=lambda lr: tests[lr]["mean_nll"]) == 3e-3  # what test would pick
    assert {r.lr for r in cfg.main_runs(chosen_rates(cfg))} == {1e-3}
    # handing the decision test scores (or a record of unknown role) is refused
    with pytest.raises(TestWindowsError, match=r"the test role at lr 0\.001"):
        choose_rate(tests)
    with pytest.raises(TestWindowsError, match="unknown role"):
        choose_rate({1e-3: {"loss": 5.0}, 3e-3: {"loss": 5.1}})
    with pytest.raises(TestWindowsError):
        choose_rate({1e-3: {**tests[1e-3], "role": "test", "loss": 1.0}})
    records = {lr: validation_record(json.loads(p.read_text())) for lr, p in finals.items()}
    assert choose_rate(records) == 1e-3
    # a final.json of protocol 1 (no validation record) takes part in no decision
    old = json.loads(finals[1e-3].read_text())
    del old["validation"], old["protocol"]
    finals[1e-3].write_text(json.dumps(old))
    with pytest.raises(OldProtocolError, match="no validation record"):
        chosen_rates(cfg)


def test_a_sweep_without_reuse_keeps_its_seed_out_of_the_verdicts(tmp_path) -> None:
    sweep = LrSweep(rates=(1e-3, 3e-3), budget=4, seed=100, reuse=False)
    cfg = _cfg(tmp_path, lr_sweep=sweep,
               arms=(ArmSpec("dense", lr="sweep", seeds=(0, 1)),))
    folders = {cfg.run_config_of(r).out_dir for r in cfg.sweep_runs()}
    main = cfg.main_runs({"dense": 1e-3})
    assert {r.seed for r in main} == {0, 1}
    assert not folders & {cfg.run_config_of(r).out_dir for r in main}
    with pytest.raises(ValueError, match="reuse: false keeps the sweep's runs out"):
        _cfg(tmp_path, lr_sweep=LrSweep(rates=(1e-3,), budget=4, seed=0, reuse=False),
             arms=(ArmSpec("dense", lr="sweep", seeds=(0, 1)),))


# ------------------------------------------------------------------ the report's verdicts
def test_the_report_prints_stats_verdicts_with_intervals(tmp_path) -> None:
    cfg = _cfg(tmp_path, notes=("q2x2-varinit is not re-derived here.",))
    # q2x2 is 0.2 nats/token above dense at 4 steps, identical to it at 6 steps
    _finish_all(cfg, {("dense", 4): 0.0, ("q2x2", 4): 0.2, ("dense", 6): 0.0,
                      ("q2x2", 6): 0.0})
    for r in cfg.main_runs({}):  # identical runs: q2x2's scores are dense's, seed by seed
        if r.steps == 6 and r.arm.name == "q2x2":
            _finish(cfg, r, _scores(0.0, r.seed), 5.0)
    st = {b: arm_stats(cfg, b) for b in (4, 6)}
    c4 = compare(st[4]["q2x2"]["scores"], st[4]["dense"]["scores"])
    assert c4.verdict == "b lower" and c4.lo > 0.1 and c4.hi < 0.3
    assert c4.diff == pytest.approx(0.2, abs=0.02)
    c6 = compare(st[6]["q2x2"]["scores"], st[6]["dense"]["scores"])
    assert c6.diff == 0 and c6.verdict == "no difference shown"
    text = write_report(cfg, _Data()).read_text()
    rows = [line for line in text.splitlines() if line.startswith("| equal parameters |")]
    assert len(rows) == 3  # the 4-step and 6-step tables, the gaps across budgets
    assert "**dense lower**" in rows[0]
    assert f"{c4.diff:+.4f} [{c4.lo:+.4f}, {c4.hi:+.4f}]" in rows[0]
    assert f"{c4.detectable:.4f}" in rows[0]
    assert "no difference shown" in rows[1] and "+0.0000 [" in rows[1]
    assert "**the gap fell**" in rows[2]  # +0.2 → 0: paired by window and seed
    assert "Verdict rule" in text and "hierarchical bootstrap" in text
    assert "## Scope\n\n- q2x2-varinit is not re-derived here." in text
    assert "ranges" not in text.lower().replace("seed range", "")  # no range rule left
    runs = list(csv.DictReader((tmp_path / "study" / "runs.csv").open()))
    assert len(runs) == 12 and {"test_nll", "val_loss", "test_windows"} <= set(runs[0])


def test_no_verdict_before_every_planned_seed(tmp_path) -> None:
    cfg = _cfg(tmp_path, budgets=(4,))
    for r in cfg.main_runs({}):
        if r.seed < 2 or r.arm.name == "dense":
            _finish(cfg, r, _scores(0.3 if r.arm.name == "q2x2" else 0.0, r.seed), 5.0)
    text = write_report(cfg, _Data()).read_text()
    row = next(line for line in text.splitlines() if line.startswith("| equal parameters"))
    assert "pending: 2/3 and 3/3 seeds done" in row and "lower" not in row


def test_unequal_budgets_are_refused(tmp_path) -> None:
    cfg = _cfg(tmp_path)
    _finish_all(cfg, {(a, b): 0.0 for a in ("dense", "q2x2") for b in (4, 6)})
    st = {b: arm_stats(cfg, b) for b in (4, 6)}
    assert dict(st[4]["dense"]["scores"].budget) == {"steps": 4, "tokens": 4 * 4 * 32}
    with pytest.raises(UnequalBudgetError, match="different budgets"):
        compare(st[4]["q2x2"]["scores"], st[6]["dense"]["scores"])
    with pytest.raises(UnequalBudgetError):
        gap_change((st[4]["q2x2"]["scores"], st[6]["q2x2"]["scores"]),
                   (st[6]["dense"]["scores"], st[4]["dense"]["scores"]),
                   ((0, 1, 2), (0, 1, 2)), ((0, 1, 2), (0, 1, 2)))
    runs = st[4]["dense"]["runs"] + st[6]["dense"]["runs"]
    with pytest.raises(ValueError, match="different budgets"):
        arm_of_runs("dense", runs)


# ------------------------------------------------------------------ the gap across budgets
def _arm(name: str, offset: float, seeds: tuple[int, ...], steps: int, shift: int = 0) -> Arm:
    return Arm(name, tuple(_scores(offset, s + shift) for s in seeds),
               budget={"steps": steps, "tokens": steps * 10})


def test_the_gap_change_is_bootstrapped_paired_by_window_and_seed() -> None:
    seeds = (0, 1, 2)
    moved = gap_change((_arm("a", 0.20, seeds, 4), _arm("a", 0.05, seeds, 6, 20)),
                       (_arm("b", 0.0, seeds, 4, 10), _arm("b", 0.0, seeds, 6, 30)),
                       (seeds, seeds), (seeds, seeds), replicates=1000)
    assert moved.verdict == "fell" and moved.hi < 0
    assert moved.change == pytest.approx(-0.15, abs=0.02)
    assert moved.paired_seeds == (True, True) and "**the gap fell**" in moved.text()
    still = gap_change((_arm("a", 0.2, seeds, 4), _arm("a", 0.2, seeds, 6, 20)),
                       (_arm("b", 0.0, seeds, 4, 10), _arm("b", 0.0, seeds, 6, 30)),
                       (seeds, seeds), (seeds, seeds), replicates=1000)
    assert still.verdict == "no change shown" and still.lo < 0 < still.hi
    assert math.isfinite(still.detectable) and still.detectable > 0
    # other seeds at the two budgets: resampled on their own, not paired
    other = gap_change((_arm("a", 0.2, seeds, 4), _arm("a", 0.2, (3, 4, 5), 6)),
                       (_arm("b", 0.0, seeds, 4, 10), _arm("b", 0.0, seeds, 6, 10)),
                       (seeds, (3, 4, 5)), (seeds, seeds), replicates=1000)
    assert other.paired_seeds == (False, True)
    one = gap_change((_arm("a", 0.2, (0,), 4), _arm("a", 0.2, (0,), 6)),
                     (_arm("b", 0.0, seeds, 4), _arm("b", 0.0, seeds, 6)),
                     ((0,), (0,)), (seeds, seeds), replicates=200)
    assert one.verdict.startswith("no verdict")


def test_the_gap_change_holds_its_level_when_nothing_moved() -> None:
    """A/A: all four arms from one distribution (shared window difficulty, a seed effect
    shared by a seed's runs at both budgets, run × window noise): few false changes."""
    rng = np.random.default_rng(3)
    hits, trials = 0, 120
    for trial in range(trials):
        base = 4.0 + 0.4 * rng.standard_t(4, 40)

        def arm(name: str, steps: int, seed_fx: np.ndarray, base: np.ndarray = base) -> Arm:
            runs = tuple(WindowScores(tuple(float(x) * T for x in base + fx + 0.01 * rng.
                                            standard_normal() + 0.03 * rng.standard_normal(40)),
                                      (T,) * 40, "w") for fx in seed_fx)
            return Arm(name, runs, budget={"steps": steps})

        fa, fb = 0.02 * rng.standard_normal(3), 0.02 * rng.standard_normal(3)
        g = gap_change((arm("a", 4, fa), arm("a", 6, fa)), (arm("b", 4, fb), arm("b", 6, fb)),
                       ((0, 1, 2), (0, 1, 2)), ((0, 1, 2), (0, 1, 2)), replicates=400,
                       seed=trial)
        hits += g.verdict in ("fell", "rose")
    assert hits / trials <= 0.10


# ------------------------------------------------------------------ old folders
def test_an_old_protocol_folder_is_refused_with_a_clear_message(tmp_path) -> None:
    from structlm.experiments.study.run import _check_same_study, run_study

    cfg = load_study_config(str(ROOT / "configs" / "study" / "cpu-tokens.yaml"),
                            out_dir=str(tmp_path / "old"))
    (tmp_path / "old").mkdir()
    shutil.copy(ROOT / "benchmarks" / "results" / "study_cpu_tokens" / "study_config.json",
                tmp_path / "old" / "study_config.json")
    with pytest.raises(OldProtocolError, match=r"protocol 1 .*cannot be resumed under "
                                               r"protocol 2.*report\.md stays as written"):
        _check_same_study(tmp_path / "old", cfg)
    with pytest.raises(OldProtocolError):
        run_study(cfg, progress=False)
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == [".lock",
                                                                    "study_config.json"]
    # a committed protocol-1 run (no test scores) is refused by the report, not misread
    old = ROOT / "benchmarks" / "results" / "study_cpu_tokens" / "runs"
    shutil.copytree(old, tmp_path / "old" / "runs")
    with pytest.raises(OldProtocolError, match="no validation record"):
        arm_stats(cfg, 250)
