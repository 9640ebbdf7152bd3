"""Test 8, does it transfer to a second model? Two models' shared-basis results side by
side, finding by finding.

Each model brings the folder of ``structlm share analyze`` (tests 1–3 and the role
signature, ``results.json``) and of ``structlm experiment share`` (tests 4–6,
``experiment.json``). Texts are matched by role, not by name: each model is evaluated on
its own in-domain text and on an other-domain one (SmolLM2: Austen / Shakespeare; a code
model: Python source / English prose).

Rule (set before the second model ran): a finding **transfers** when both models give
the same verdict — the same pass/fail of a test against its null, the same transfer of
the role signature, the same best method before fine-tuning, the same winner by the
winner rule after it — and **does not transfer** when the verdicts differ. After
fine-tuning, where either model names no winner (ranges overlap, or one seed), the row
says whether the best means agree ("same best mean, not separated") or not ("other best
mean, not separated") and claims neither. A finding one model lacks is "not measured on
both". (Added 2026-12-05, after Qwen's SVD-LLM and Basis Sharing arms were fine-tuned and
before its `shared` arms were: after fine-tuning, both models' winner rules run over the
methods both fine-tuned at that budget on that text role, and a race with fewer than two
such methods is "not measured on both".) (Changed 2026-12-07 for test 3, after a review
showed its one-draw rule unsound and before the re-runs over calibration draws: each
model's test 3 verdict per matrix type is its interval rule over the draws — lives, fails
or undecided, on the normalised margin of the centred covariance — and the finding
**transfers** only when both verdicts are decided and equal, **does not transfer** when
both are decided and differ, and is **undecided** otherwise; results of one draw, older
ones included, say "one draw: no interval" and are undecided. After fine-tuning, the
winner rule is ``structlm.stats.rank_arms``, paired by test window: runs recorded without
per-window scores name no winner.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from structlm.atomic import atomic_write_text
from structlm.experiments.share.verdicts import ranking_text, tuned_arm
from structlm.share.analysis.analyze import FUNCTIONAL_PRIMARY, ONE_DRAW, normalised_margin
from structlm.stats import Interval

__all__ = ["ModelResults", "findings", "functional_finding", "load_results",
           "write_transfer_report"]

_TESTS = (("alignment", "1 alignment"), ("weight_subspaces", "2 weight subspaces"))
"""Tests read from one null draw (their verdicts carry no interval)."""

_FUNCTIONAL = "3 functional subspaces"

_DECIDED = ("lives", "fails")
"""Test 3's decided verdicts (the rest: undecided, one draw, no verdict)."""

_OLD_FUNCTIONAL_KEYS = {"centred": "functional_subspaces_centred",
                        "uncentred": "functional_subspaces",
                        "sink_excluded": "functional_subspaces_sink_excluded"}
"""Where results written before test 3 ran over draws keep each variant (one draw)."""


@dataclass
class ModelResults:
    """One model's analysis and experiment results."""

    label: str
    analysis: dict[str, Any]
    experiment: dict[str, Any]


def load_results(analysis_dir: str | Path, experiment_dir: str | Path) -> ModelResults:
    """Read ``results.json`` of an analysis folder and ``experiment.json`` of an experiment
    folder (a clear error naming a missing file)."""
    paths = (Path(analysis_dir) / "results.json", Path(experiment_dir) / "experiment.json")
    for p in paths:
        if not p.is_file():
            writer = ("structlm share analyze" if p.name == "results.json"
                      else "structlm experiment share")
            raise ValueError(f"{p} does not exist: give the folder written by {writer}")
    analysis, experiment = (json.loads(p.read_text()) for p in paths)
    return ModelResults(analysis.get("model", str(analysis_dir)), analysis, experiment)


def _role(res: dict[str, Any], role: str) -> str | None:
    """The evaluation text of ``role`` (``in_domain`` / ``other_domain``)."""
    return next((t for t in res["eval_texts"] if t.startswith(role + ":")), None)


def functional_finding(tests: dict[str, Any]) -> tuple[str, str] | None:
    """Test 3's verdict of one matrix type and the numbers behind it, from the primary
    (centred) variant: over draws (lives / fails / undecided, the margin's interval), or
    from a results file written before the draws (one draw: its margin, no interval);
    ``None`` when test 3 was not run."""
    f = tests.get("functional")
    if f is not None:
        v = f["variants"][f["primary"]]
        if "skipped" in v:
            return None
        iv = (Interval(**v["margin"]).text() if v.get("margin")
              else ", ".join(f"{x:.3f}" for x in v["margin_per_draw"]))
        verdict_ = ONE_DRAW if v["verdict"].endswith(ONE_DRAW) else v["verdict"]
        return verdict_, (f"m = {iv}, {f['primary']}; score {v['score_mean']:.3f} vs null "
                          f"{v['null_score_mean']:.3f}")
    for variant in (FUNCTIONAL_PRIMARY, "uncentred"):  # older files: one draw per variant
        d = tests.get(_OLD_FUNCTIONAL_KEYS[variant])
        if d and "skipped" not in d:
            m = normalised_margin(d["score"], d["null_score"])
            return ONE_DRAW, (f"m = {m:.3f}, {variant}, older results (one draw); score "
                              f"{d['score']:.3f} vs null {d['null_score']:.3f}")
    return None


def _test_rows(m: ModelResults) -> dict[str, tuple[str, str]]:
    """Finding -> (verdict, the numbers behind it)."""
    out = {}
    for t, tests in m.analysis["tests"].items():
        for key, name in _TESTS:
            d = tests.get(key)
            if not d:
                continue
            if key == "alignment":
                med = d["median"]
                num = (f"cheap-move residual {med['real']['perm_diag']:.3f} vs null "
                       f"{med['null_gaussian']['perm_diag']:.3f}; one null draw")
            else:
                num = (f"score {d['score']:.3f} vs null {d['null_score']:.3f}; one null "
                       "draw")
            out[f"test {name}, {t}"] = (d["verdict"], num)
        f = functional_finding(tests)
        if f is not None:
            out[f"test {_FUNCTIONAL}, {t}"] = f
    for key, name in (("attention_to_mlp", "attention → MLP"),
                      ("mlp_to_attention", "MLP → attention")):
        d = (m.analysis.get("roles") or {}).get(key)
        if d:
            out[f"role signature {name}"] = (
                "transfers" if d["transfers"] else "does not transfer",
                f"accuracy {d['accuracy']:.3f}, p = {d['p_value']:.3f}")
    return out


def _compression_rows(m: ModelResults) -> tuple[dict[str, tuple[str, str]],
                                                 dict[str, dict[str, Any]]]:
    """Per budget and text role: the best method before fine-tuning (finding -> verdict and
    numbers) and the fine-tuned results the winner rule reads after it (finding -> method
    -> seed statistics; decided in :func:`findings` over the methods both models tuned)."""
    res = m.experiment
    out: dict[str, tuple[str, str]] = {}
    races: dict[str, dict[str, Any]] = {}
    for role, label in (("in_domain", "in-domain"), ("other_domain", "other-domain")):
        text = _role(res, role)
        if text is None:
            continue
        for red in sorted({e["reduction"] for e in res["whole_model"]}):
            at = [e for e in res["whole_model"] if e["reduction"] == red]
            best = min(at, key=lambda e: e["analytic"][text])
            out[f"−{red:.0%}, {label}: best before fine-tuning"] = (
                best["method"], f"{best['analytic'][text]:.2f} (original "
                                f"{res['ppl_original'][text]:.2f})")
            tuned = {e["method"]: e for e in at if e["finetuned"].get(text)}
            if tuned:
                races[f"−{red:.0%}, {label}: after fine-tuning"] = {"text": text,
                                                                     "entries": tuned}
        shared = next((e for e in res["whole_model"] if e["method"] == "shared"
                       and e["arms"][0].get("token_macs_ratio") is not None), None)
        if shared is not None and role == "in_domain":
            r = shared["arms"][0]["token_macs_ratio"]
            out[f"shared at −{shared['reduction']:.0%}: MACs per token vs the original"] = (
                "more" if r > 1 else "fewer", f"{r:.2f}×")
    return out, races


def _race(entries: dict[str, dict[str, Any]], methods: list[str], text: str
          ) -> tuple[str, str]:
    """The winner rule (:func:`structlm.stats.rank_arms`, paired by test window) over
    ``methods`` of one model's fine-tuned entries on ``text``: the best mean (``*`` where no
    winner is shown, or the runs carry no per-window scores) and the verdict behind it."""
    among = [entries[k] for k in methods]
    line, ranking = ranking_text([tuned_arm(e, text) for e in among], methods)
    best = min(methods, key=lambda k: entries[k]["finetuned"][text]["mean"])
    won = ranking is not None and ranking.winner is not None
    return (best + ("" if won else " *"),
            f"among {', '.join(methods)}: {line}; {best} "
            f"{entries[best]['finetuned'][text]['mean']:.2f}")


def findings(a: ModelResults, b: ModelResults) -> list[dict[str, str]]:
    """Every finding of either model with both verdicts and whether it transfers."""
    rows = []
    (ca, races_a), (cb, races_b) = _compression_rows(a), _compression_rows(b)
    fa, fb = {**_test_rows(a), **ca}, {**_test_rows(b), **cb}
    # after fine-tuning, each race over the methods both models fine-tuned at that budget
    # on that text role: a winner over a method the other model never fine-tuned there
    # would compare different races; fewer than two such methods is no race
    for key in dict.fromkeys([*races_a, *races_b]):
        ea = races_a.get(key, {}).get("entries", {})
        eb = races_b.get(key, {}).get("entries", {})
        common = sorted(set(ea) & set(eb))
        if len(common) >= 2:
            fa[key] = _race(ea, common, races_a[key]["text"])
            fb[key] = _race(eb, common, races_b[key]["text"])
        else:
            fa.setdefault(key, None)  # keeps the row: "not measured on both"
    for key in dict.fromkeys([*fa, *fb]):
        va, vb = fa.get(key), fb.get(key)
        if va is None or vb is None:
            status = "not measured on both"
        elif key.startswith(f"test {_FUNCTIONAL},"):  # test 3: the interval rule's verdicts
            status = ("undecided" if va[0] not in _DECIDED or vb[0] not in _DECIDED
                      else "transfers" if va[0] == vb[0] else "does not transfer")
        elif va[0].endswith(" *") or vb[0].endswith(" *"):  # a best mean, no winner
            same = va[0].removesuffix(" *") == vb[0].removesuffix(" *")
            status = f"{'same' if same else 'other'} best mean, not separated"
        else:
            status = "transfers" if va[0] == vb[0] else "does not transfer"
        rows.append({"finding": key, "a": va[0] if va else "—", "a_numbers": va[1] if va else "",
                     "b": vb[0] if vb else "—", "b_numbers": vb[1] if vb else "",
                     "status": status})
    return rows


def write_transfer_report(a: ModelResults, b: ModelResults, out: str | Path) -> Path:
    """``report.md`` and ``findings.json`` in ``out``: the two models side by side."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = findings(a, b)
    texts = {m.label: [_role(m.experiment, r) for r in ("in_domain", "other_domain")]
             for m in (a, b)}
    n = {s: sum(r["status"] == s for r in rows) for s in ("transfers", "does not transfer")}
    lines = [f"# Test 8: does it transfer? {a.label} and {b.label}", "",
             ("Rule" + (__doc__ or "").split("Rule", 1)[1].split("\n\n")[0]).strip(), "",
             "Text roles:", "",
             *(f"- **{m}**: in-domain `{t[0]}`, other-domain `{t[1]}`."
               for m, t in texts.items()), "",
             *(f"Note on {m.label}: {m.analysis.get('model_note', '')}." for m in (a, b)
               if m.analysis.get("model_note")), "",
             f"{n['transfers']} findings transfer, {n['does not transfer']} do not "
             f"({len(rows)} in all; the rest are not separated, undecided or not measured "
             "on both). "
             "After fine-tuning, each row's winner rule runs over the methods both models "
             "fine-tuned at that budget on that text (named in the row), and `*` marks a best "
             "mean that the rule does not separate.", "",
             f"| finding | {a.label} | {b.label} | transfers? |", "|---|---|---|---|"]
    def cell(verdict_: str, numbers: str) -> str:
        return f"{verdict_} ({numbers})" if numbers else verdict_

    for r in rows:
        lines.append(f"| {r['finding']} | {cell(r['a'], r['a_numbers'])} | "
                     f"{cell(r['b'], r['b_numbers'])} | {r['status']} |")
    atomic_write_text(out / "findings.json", json.dumps(rows, indent=1))
    atomic_write_text(out / "report.md", "\n".join([*lines, ""]))
    return out / "report.md"
