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
such methods is "not measured on both".)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from structlm.atomic import atomic_write_text
from structlm.experiments.share.report import verdict

__all__ = ["ModelResults", "findings", "load_results", "write_transfer_report"]

_TESTS = (("alignment", "1 alignment"), ("weight_subspaces", "2 weight subspaces"),
          ("functional_subspaces", "3 functional subspaces"))


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
                       f"{med['null_gaussian']['perm_diag']:.3f}")
            else:
                num = f"score {d['score']:.3f} vs null {d['null_score']:.3f}"
            out[f"test {name}, {t}"] = (d["verdict"], num)
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
            tuned = {e["method"]: e["finetuned"][text] for e in at
                     if e["finetuned"].get(text)}
            if tuned:
                races[f"−{red:.0%}, {label}: after fine-tuning"] = tuned
        shared = next((e for e in res["whole_model"] if e["method"] == "shared"
                       and e["arms"][0].get("token_macs_ratio") is not None), None)
        if shared is not None and role == "in_domain":
            r = shared["arms"][0]["token_macs_ratio"]
            out[f"shared at −{shared['reduction']:.0%}: MACs per token vs the original"] = (
                "more" if r > 1 else "fewer", f"{r:.2f}×")
    return out, races


def _race(tuned: dict[str, Any], methods: list[str]) -> tuple[str, str]:
    """The winner rule over ``methods`` of one model's fine-tuned results: the best
    method (``*`` where the rule separates no winner) and the numbers behind it."""
    among = {k: tuned[k] for k in methods}
    v = verdict(among)
    best = min(among, key=lambda k: among[k]["mean"])
    return (best + ("" if "wins" in v else " *"),
            f"among {', '.join(methods)}: {v}; {best} {among[best]['mean']:.2f}")


def findings(a: ModelResults, b: ModelResults) -> list[dict[str, str]]:
    """Every finding of either model with both verdicts and whether it transfers."""
    rows = []
    (ca, races_a), (cb, races_b) = _compression_rows(a), _compression_rows(b)
    fa, fb = {**_test_rows(a), **ca}, {**_test_rows(b), **cb}
    # after fine-tuning, each race over the methods both models fine-tuned at that budget
    # on that text role: a winner over a method the other model never fine-tuned there
    # would compare different races; fewer than two such methods is no race
    for key in dict.fromkeys([*races_a, *races_b]):
        common = sorted(set(races_a.get(key, {})) & set(races_b.get(key, {})))
        if len(common) >= 2:
            fa[key], fb[key] = _race(races_a[key], common), _race(races_b[key], common)
        else:
            fa.setdefault(key, None)  # keeps the row: "not measured on both"
    for key in dict.fromkeys([*fa, *fb]):
        va, vb = fa.get(key), fb.get(key)
        if va is None or vb is None:
            status = "not measured on both"
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
             f"({len(rows)} in all; the rest are not separated or not measured on both). "
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
