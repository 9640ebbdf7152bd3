"""The statistics behind every verdict structlm prints.

Every evaluation keeps its **per-window** negative log-likelihoods (:class:`WindowScores`),
so two arms scored on the same windows are compared *paired by window*. An arm is the
runs of one setting (:class:`Arm`: fine-tuning seeds, calibration draws), all scored on
the same windows, under one training budget.

**The comparison** (:func:`compare`): the difference of the arms' mean NLL per token,
``D = M_a − M_b`` (nats; ``exp(D)`` is the perplexity ratio), with a 95% interval from a
hierarchical bootstrap: each replicate resamples each arm's runs (within its strata — the
calibration draws — with replacement) and then the windows (with replacement, the same
windows for both arms: paired). Two corrections make it hold its level with the 2–6 runs
per arm an experiment can afford (a plain percentile bootstrap of 3 runs is too narrow: the
resampled mean of ``n`` runs has ``(n − 1)/n`` of the true variance, and the normal
quantile ignores that the variance itself is estimated from a few runs):

* resampled runs are spread around their stratum's mean by ``sqrt(n/(n − 1))``, so the
  bootstrap variance of the run mean is the unbiased ``s²/n``;
* the interval is ``D ± t_ν · SE`` with ``SE`` the bootstrap standard deviation and ``ν``
  the Welch–Satterthwaite degrees of freedom of the run and window components.

A difference is declared only when the interval excludes zero; otherwise "no difference
shown", with the smallest difference the comparison could have detected (80% power,
:attr:`Comparison.detectable`). An arm with one run and not marked ``deterministic`` has no
run-to-run variance to estimate: no verdict. Deterministic arms (a compression without
fine-tuning, the original model: no seed) carry only the window component; their verdict is
about the text sampled, conditional on the calibration draw.

Arms compared must have been scored on the same windows (:class:`UnpairedWindowsError`)
under the same budget — steps and tokens (:class:`UnequalBudgetError`): a verdict between
unequal budgets is refused, not printed.

**Among several arms** (:func:`rank_arms`): an arm wins only if its interval against every
other arm lies below zero (an intersection–union test: no multiplicity correction needed
for the claim "lower than each of the others").

**Statistics over calibration draws** (:func:`mean_interval`, :func:`threshold_verdict`):
a Student-t interval of a statistic measured once per draw (the analysis tests' scores
against their nulls).

The false-positive rates of these rules, measured by A/A simulation
(:func:`aa_false_positive_rate`) and on a real model, are in docs/testing.md; the suite
asserts them (tests/test_stats.py).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats as sps

__all__ = ["LEVEL", "Arm", "Comparison", "Ranking", "UnequalBudgetError",
           "UnpairedWindowsError", "WindowScores", "aa_false_positive_rate", "compare",
           "mean_interval", "rank_arms", "threshold_verdict", "windows_fingerprint"]

LEVEL = 0.95
"""Coverage of every interval structlm prints."""

BOOTSTRAP_REPLICATES = 4000
"""Bootstrap replicates per comparison (seeded: a report is reproducible)."""

POWER = 0.80
"""Power at which :attr:`Comparison.detectable` is computed."""


class UnequalBudgetError(ValueError):
    """Two arms that a verdict would compare were trained under different budgets."""


class UnpairedWindowsError(ValueError):
    """Two evaluations that a paired comparison needs were not scored on the same windows."""


def windows_fingerprint(windows: Any) -> str:
    """A content key of evaluation windows (any array of token ids: ``(n, w)``): the
    pairing check of :func:`compare`."""
    arr = np.ascontiguousarray(np.asarray(windows, dtype=np.int64))
    h = hashlib.sha1(str(arr.shape).encode())
    h.update(arr.tobytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class WindowScores:
    """One evaluation: the summed NLL (nats) and the scored tokens of every window, and
    the windows' fingerprint."""

    nll: tuple[float, ...]
    """Summed negative log-likelihood per window (float64 sums)."""
    tokens: tuple[int, ...]
    """Scored tokens per window."""
    windows: str
    """:func:`windows_fingerprint` of the windows scored."""

    def __post_init__(self) -> None:
        if len(self.nll) != len(self.tokens) or not self.nll:
            raise ValueError(f"per-window scores need one token count per window and at "
                             f"least one window, got {len(self.nll)} and {len(self.tokens)}")
        if any(t < 1 for t in self.tokens):
            raise ValueError("every window must score at least one token")
        if not all(math.isfinite(x) for x in self.nll):
            raise ValueError("per-window NLLs must be finite (a non-finite evaluation is an "
                             "error, never a score)")

    @property
    def mean_nll(self) -> float:
        """NLL per token over all windows."""
        return math.fsum(self.nll) / sum(self.tokens)

    def as_dict(self) -> dict[str, Any]:
        """Compact JSON form (``window_nll``, ``window_tokens``, ``windows_sha1``); equal
        token counts are stored once."""
        toks: int | list[int] = (self.tokens[0] if len(set(self.tokens)) == 1
                                 else list(self.tokens))
        return {"window_nll": list(self.nll), "window_tokens": toks,
                "windows_sha1": self.windows}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WindowScores:
        """Read :meth:`as_dict` back (also an evaluation record that holds those keys
        beside others)."""
        nll = tuple(float(x) for x in d["window_nll"])
        toks = d["window_tokens"]
        tokens = tuple([int(toks)] * len(nll) if isinstance(toks, int) else
                       (int(t) for t in toks))
        return cls(nll, tokens, str(d["windows_sha1"]))

    @classmethod
    def has_scores(cls, d: Any) -> bool:
        """Whether an evaluation record carries per-window scores."""
        return isinstance(d, Mapping) and "window_nll" in d and "windows_sha1" in d


@dataclass(frozen=True)
class Arm:
    """The runs of one setting, scored on the same windows under one budget."""

    name: str
    runs: tuple[WindowScores, ...]
    budget: Mapping[str, Any] = field(default_factory=dict)
    """What it was trained with (e.g. ``{"steps": 600, "tokens": 307200}``); compared arms
    must have equal budgets."""
    strata: tuple[str, ...] | None = None
    """Per run, its stratum (the calibration draw): runs are resampled within strata and
    the arm's mean is the mean of its strata's means. ``None``: one stratum."""
    deterministic: bool = False
    """No seed involved (a compression evaluated without training, the original model):
    the arm has no run-to-run variance."""

    def __post_init__(self) -> None:
        if not self.runs:
            raise ValueError(f"arm {self.name!r} has no runs")
        if self.strata is not None and len(self.strata) != len(self.runs):
            raise ValueError(f"arm {self.name!r}: {len(self.strata)} strata for "
                             f"{len(self.runs)} runs")
        fps = {r.windows for r in self.runs}
        if len(fps) > 1:
            raise UnpairedWindowsError(f"arm {self.name!r}: its runs were scored on "
                                       f"different windows ({sorted(fps)})")
        if len({len(r.nll) for r in self.runs}) > 1 or len({r.tokens for r in self.runs}) > 1:
            raise UnpairedWindowsError(f"arm {self.name!r}: its runs scored different "
                                       "window counts or token counts")

    @property
    def windows(self) -> str:
        return self.runs[0].windows

    @property
    def n_runs(self) -> int:
        return len(self.runs)

    def groups(self) -> list[np.ndarray]:
        """Per stratum, the ``(n_h, W)`` matrix of per-token NLLs (float64)."""
        toks = np.asarray(self.runs[0].tokens, dtype=np.float64)
        rows = np.asarray([r.nll for r in self.runs], dtype=np.float64) / toks  # (n, W)
        labels = self.strata or ("",) * len(self.runs)
        order = list(dict.fromkeys(labels))
        return [rows[[i for i, s in enumerate(labels) if s == h]] for h in order]

    @property
    def mean_nll(self) -> float:
        """Mean over strata of the strata's mean per-token NLL."""
        toks = np.asarray(self.runs[0].tokens, dtype=np.float64)
        return float(np.mean([(g @ toks).mean() / toks.sum() for g in self.groups()]))

    @property
    def ppl(self) -> float:
        return math.exp(self.mean_nll)

    def run_ppls(self) -> list[float]:
        """Each run's perplexity (for the tables)."""
        return [math.exp(r.mean_nll) for r in self.runs]


@dataclass(frozen=True)
class Comparison:
    """``a`` against ``b``: ``diff = M_a − M_b`` nats per token and its interval."""

    a: str
    b: str
    diff: float
    lo: float
    hi: float
    se: float
    df: float
    detectable: float
    """The smallest |difference| the comparison would detect with 80% power (nats)."""
    n_runs: tuple[int, int]
    n_windows: int
    verdict: str
    """``"a lower"``, ``"b lower"``, ``"no difference shown"`` or ``"no verdict: …"``."""
    components: Mapping[str, float]
    """The variance of ``diff`` by source: ``runs a``, ``runs b``, ``windows``."""

    @property
    def ratio(self) -> tuple[float, float, float]:
        """Perplexity ratio ``ppl_a / ppl_b`` and its interval."""
        return math.exp(self.diff), math.exp(self.lo), math.exp(self.hi)

    @property
    def decided(self) -> bool:
        return self.verdict in ("a lower", "b lower")

    @property
    def lower(self) -> str | None:
        """The arm declared lower, if any."""
        return self.a if self.verdict == "a lower" else self.b if self.verdict == "b lower" \
            else None

    def interval_text(self) -> str:
        """``Δ −0.052 [−0.081, −0.023] nats, ppl ×0.949 [0.922–0.977]``."""
        r, rlo, rhi = self.ratio
        return (f"Δ {self.diff:+.4f} [{self.lo:+.4f}, {self.hi:+.4f}] nats, ppl ×{r:.3f} "
                f"[{rlo:.3f}–{rhi:.3f}]")

    def text(self) -> str:
        """One line: the verdict and the interval."""
        if self.verdict.startswith("no verdict"):
            return f"{self.a} vs {self.b}: {self.verdict} ({self.interval_text()})"
        if self.decided:
            return f"**{self.lower} lower**: {self.a} − {self.b} {self.interval_text()}"
        return (f"{self.a} vs {self.b}: no difference shown ({self.interval_text()}; "
                f"detectable ≈ {self.detectable:.4f} nats)")

    def as_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "diff": self.diff, "lo": self.lo, "hi": self.hi,
                "ppl_ratio": list(self.ratio), "se": self.se, "df": self.df,
                "detectable": self.detectable, "n_runs": list(self.n_runs),
                "n_windows": self.n_windows, "verdict": self.verdict,
                "components": dict(self.components)}


def _check_pair(a: Arm, b: Arm) -> None:
    if a.windows != b.windows:
        raise UnpairedWindowsError(f"{a.name!r} and {b.name!r} were scored on different "
                                   f"windows ({a.windows} vs {b.windows}): no paired "
                                   "comparison")
    if a.runs[0].tokens != b.runs[0].tokens:
        raise UnpairedWindowsError(f"{a.name!r} and {b.name!r} scored different tokens "
                                   "per window")
    if dict(a.budget) != dict(b.budget):
        raise UnequalBudgetError(f"{a.name!r} ({dict(a.budget)}) and {b.name!r} "
                                 f"({dict(b.budget)}) were trained under different budgets: "
                                 "no verdict between them")


def _run_component(arm: Arm, toks: np.ndarray) -> tuple[float, float]:
    """The variance of the arm's mean from its runs (``s²/n`` per stratum, strata averaged)
    and its degrees of freedom (``n − strata``); ``(0, inf)`` for a deterministic arm."""
    if arm.deterministic:
        return 0.0, math.inf
    groups = arm.groups()
    H = len(groups)
    var, dof = 0.0, 0
    for g in groups:
        means = (g @ toks) / toks.sum()
        if len(means) < 2:
            return math.nan, 0.0
        var += float(np.var(means, ddof=1)) / len(means) / H**2
        dof += len(means) - 1
    return var, float(dof)


def _boot_means(groups: list[np.ndarray], deterministic: bool, idx: np.ndarray,
                toks: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``(B,)`` bootstrap means of one arm: runs resampled within strata (spread
    corrected by ``sqrt(n/(n−1))``), then the windows ``idx`` ``(B, W)`` (the same for
    both arms). A replicate's mean is ``Σ_k t c_k / Σ_k t`` over its windows ``k``, with
    ``c = centre + mean of the resampled runs' deviations``, computed per run as sums of
    gathered ``t·dev`` so no ``(B, n, W)`` array is formed."""
    B = idx.shape[0]
    denom = np.take(toks, idx).sum(1)  # (B,)
    out = np.zeros(B)
    for g in groups:
        n = g.shape[0]
        centre = g.mean(0)  # (W,)
        mean = np.take(centre * toks, idx).sum(1)  # (B,)
        if not deterministic and n >= 2:
            dev = (g - centre) * (toks * math.sqrt(n / (n - 1)))  # (n, W), token-weighted
            per_run = np.stack([np.take(d, idx).sum(1) for d in dev], 1)  # (B, n)
            pick = rng.integers(0, n, size=(B, n)) + n * np.arange(B)[:, None]
            runs = np.bincount(pick.ravel(), minlength=B * n).reshape(B, n)  # (B, n)
            mean = mean + (per_run * runs).sum(1) / n
        out += mean / denom
    return out / len(groups)


_MEMO: OrderedDict[str, Comparison] = OrderedDict()
_MEMO_SIZE = 1024


def _arm_key(arm: Arm) -> bytes:
    """A content key of ``arm``: its name, budget, strata, determinism and every run's
    scores (a report rewritten after each finished run compares the same arms again)."""
    h = hashlib.sha1(json.dumps([arm.name, dict(arm.budget), arm.strata, arm.deterministic],
                                sort_keys=True, default=str).encode())
    for r in arm.runs:
        h.update(np.asarray(r.nll, dtype=np.float64).tobytes())
        h.update(np.asarray(r.tokens, dtype=np.int64).tobytes())
        h.update(r.windows.encode())
    return h.digest()


def compare(a: Arm, b: Arm, level: float = LEVEL, replicates: int = BOOTSTRAP_REPLICATES,
            seed: int = 0) -> Comparison:
    """``a`` against ``b``, paired by window (module docstring). Raises
    :class:`UnpairedWindowsError` or :class:`UnequalBudgetError` instead of comparing
    what cannot be compared. Deterministic in its inputs: a comparison already made in
    this process (same arms by content, level, replicates and seed) is returned again."""
    _check_pair(a, b)
    key = hashlib.sha1(_arm_key(a) + _arm_key(b) + repr((level, replicates, seed)).encode()
                       ).hexdigest()
    if key in _MEMO:
        _MEMO.move_to_end(key)
        return _MEMO[key]
    out = _compare(a, b, level, replicates, seed)
    _MEMO[key] = out
    while len(_MEMO) > _MEMO_SIZE:
        _MEMO.popitem(last=False)
    return out


def _compare(a: Arm, b: Arm, level: float, replicates: int, seed: int) -> Comparison:
    """:func:`compare` without the memo."""
    if replicates < 100:
        raise ValueError(f"replicates must be >= 100, got {replicates}")
    toks = np.asarray(a.runs[0].tokens, dtype=np.float64)
    W = len(toks)
    diff = a.mean_nll - b.mean_nll
    va, da = _run_component(a, toks)
    vb, db = _run_component(b, toks)
    ga, gb = a.groups(), b.groups()
    per_window = (np.mean([g.mean(0) for g in ga], 0)
                  - np.mean([g.mean(0) for g in gb], 0))  # (W,) run-averaged differences
    w_weights = toks / toks.mean()
    vw = float(np.var(per_window * w_weights, ddof=1)) / W if W > 1 else 0.0
    comps = {"runs a": va, "runs b": vb, "windows": vw}
    missing = [x.name for x, v in ((a, va), (b, vb)) if math.isnan(v)]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, W, size=(replicates, W))  # (B, W): the same windows, both arms
    boot = (_boot_means(ga, a.deterministic, idx, toks, rng)
            - _boot_means(gb, b.deterministic, idx, toks, rng))
    se = float(np.std(boot, ddof=1))
    parts = [(v, d) for v, d in ((va, da), (vb, db), (vw, W - 1.0)) if v > 0 and d > 0
             and math.isfinite(v)]
    total = sum(v for v, _ in parts)
    denom = sum(v * v / d for v, d in parts if math.isfinite(d))
    df = total * total / denom if denom > 0 else math.inf
    if missing:
        q = sps.norm.ppf(0.5 + level / 2)
        lo, hi = diff - q * se, diff + q * se
        verdict = (f"no verdict: one run of {', '.join(missing)} (no run-to-run variance "
                   "to compare against)")
        return Comparison(a.name, b.name, diff, lo, hi, se, df, math.nan,
                          (a.n_runs, b.n_runs), W, verdict, comps)
    q = float(sps.t.ppf(0.5 + level / 2, df)) if math.isfinite(df) else \
        float(sps.norm.ppf(0.5 + level / 2))
    qp = float(sps.t.ppf(POWER, df)) if math.isfinite(df) else float(sps.norm.ppf(POWER))
    lo, hi = diff - q * se, diff + q * se
    verdict = "a lower" if hi < 0 else "b lower" if lo > 0 else "no difference shown"
    return Comparison(a.name, b.name, diff, lo, hi, se, df, (q + qp) * se,
                      (a.n_runs, b.n_runs), W, verdict, comps)


@dataclass(frozen=True)
class Ranking:
    """Every pair of several arms, and the winner if one is lower than each other arm."""

    arms: tuple[str, ...]
    pairs: tuple[Comparison, ...]
    winner: str | None
    best: str
    """The lowest mean (named whatever the verdict)."""

    def text(self) -> str:
        """The verdict line."""
        if self.winner is not None:
            return f"**{self.winner} lowest** (its interval against every other excludes zero)"
        undecided = [c for c in self.pairs if self.best in (c.a, c.b) and not c.decided]
        others = [c.b if c.a == self.best else c.a for c in undecided]
        return (f"no winner shown: best mean {self.best}, not separated from "
                f"{', '.join(others) or '—'}")

    def as_dict(self) -> dict[str, Any]:
        return {"arms": list(self.arms), "winner": self.winner, "best": self.best,
                "pairs": [c.as_dict() for c in self.pairs]}


def rank_arms(arms: Sequence[Arm], level: float = LEVEL,
              replicates: int = BOOTSTRAP_REPLICATES) -> Ranking:
    """All pairwise comparisons (the lower mean first in each pair); the winner is the arm
    declared lower than every other one."""
    if len(arms) < 2:
        raise ValueError("ranking needs at least two arms")
    names = [x.name for x in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must be distinct, got {names}")
    order = sorted(arms, key=lambda x: x.mean_nll)
    pairs = [compare(x, y, level, replicates, seed=i) for i, (x, y) in
             enumerate((order[i], order[j]) for i in range(len(order))
                       for j in range(i + 1, len(order)))]
    best = order[0].name
    wins = [c for c in pairs if c.a == best and c.verdict == "a lower"]
    winner = best if len(wins) == len(order) - 1 else None
    return Ranking(tuple(names), tuple(pairs), winner, best)


@dataclass(frozen=True)
class Interval:
    """A statistic's mean over draws and its Student-t interval."""

    mean: float
    lo: float
    hi: float
    n: int

    def text(self, nd: int = 3) -> str:
        if self.n < 2:
            return f"{self.mean:.{nd}f} (one draw: no interval)"
        return f"{self.mean:.{nd}f} [{self.lo:.{nd}f}, {self.hi:.{nd}f}] (n={self.n})"


def mean_interval(values: Sequence[float], level: float = LEVEL) -> Interval:
    """Mean of a statistic measured once per draw, with its Student-t interval (``n − 1``
    degrees of freedom); one value gives an interval of zero width marked by ``n = 1``."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0 or not np.isfinite(x).all():
        raise ValueError(f"need finite values, got {list(values)}")
    m = float(x.mean())
    if x.size < 2:
        return Interval(m, m, m, 1)
    h = float(sps.t.ppf(0.5 + level / 2, x.size - 1)) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return Interval(m, m - h, m + h, int(x.size))


def threshold_verdict(values: Sequence[float], threshold: float, level: float = LEVEL,
                      min_draws: int = 3) -> tuple[str, Interval]:
    """``"above"`` when the interval of the mean lies above ``threshold``, ``"below"``
    when it lies below, else ``"undecided"``; ``"too few draws"`` under ``min_draws``."""
    iv = mean_interval(values, level)
    if iv.n < min_draws:
        return "too few draws", iv
    if iv.lo > threshold:
        return "above", iv
    if iv.hi < threshold:
        return "below", iv
    return "undecided", iv


def aa_false_positive_rate(n_a: int, n_b: int, n_windows: int, trials: int, run_sd: float,
                           window_sd: float, noise_sd: float, seed: int = 0,
                           strata: int = 1, replicates: int = 1000,
                           tail_df: float = 4.0) -> float:
    """The share of A/A comparisons (both arms from the same distribution) that
    :func:`compare` declares different. Each window has a difficulty (Student-t with
    ``tail_df`` degrees of freedom, scale ``window_sd``) shared by both arms; each run
    adds an offset (``run_sd``) and a run × window interaction (``noise_sd``); with
    ``strata`` > 1 each stratum adds its own offset (``run_sd``) shared by its runs in
    both arms (a calibration draw)."""
    rng = np.random.default_rng(seed)
    hits = 0
    toks = (255,) * n_windows
    for trial in range(trials):
        base = 3.5 + window_sd * rng.standard_t(tail_df, n_windows)  # (W,)
        draw = run_sd * rng.standard_normal(strata)

        def arm(name: str, n: int, base: np.ndarray = base, draw: np.ndarray = draw) -> Arm:
            labels = [str(i % strata) for i in range(n * strata)]
            runs = []
            for lab in labels:
                y = (base + draw[int(lab)] + run_sd * rng.standard_normal()
                     + noise_sd * rng.standard_normal(n_windows))
                runs.append(WindowScores(tuple(float(v) * 255 for v in y), toks, "aa"))
            return Arm(name, tuple(runs), strata=tuple(labels) if strata > 1 else None)

        c = compare(arm("a", n_a), arm("b", n_b), replicates=replicates, seed=trial)
        hits += c.decided
    return hits / trials
