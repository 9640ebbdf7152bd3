"""Kill-and-rerun sweep over every writing command of the ``structlm`` CLI: a run killed
with SIGKILL at a random point, then rerun as a user would, must end as an uninterrupted
run does, leave its input as it was, and leave nothing behind.

    python benchmarks/kill_rerun_sweep.py [--out benchmarks/results/kill_rerun_sweep.md]
                                          [--cases compress,train] [--seeds 2]

Fixtures (built offline in seconds with ``bad_input_fixtures``' texts and the tests' tiny
LLaMA): a 3-layer random LLaMA with its own 300-token BPE tokenizer (512 positions) and a
folder of four text documents. Every run gets its own *slot* folder holding its output
(``SLOT/out``), its ``STRUCTLM_CACHE`` (``SLOT/cache``) and its YAML config, so nothing
outside the sweep's temporary root is written, and A's cache never helps B.

For each case (a command line, below) and each kill seed:

1. the reference: one uninterrupted run into slot A (its wall time ``W``; once per case);
2. a run into slot B killed (``os.killpg``, SIGKILL, the whole process group) after a
   seeded uniform time in ``[F, 0.95 W]`` (``F``: the reference's first output, when the
   start-up imports are over), then the same command rerun to completion into B;
3. checks —
   * ``rerun rc``: the rerun exits 0 (a refusal is recorded with its last line; a Python
     traceback in its output counts as a traceback);
   * ``equal``: B's output equals A's. Compared: the set of files and folders (``.lock``
     aside); every ``*.json`` as parsed JSON, without keys that are timings or the
     environment (``TIMING`` below); every ``*.csv`` row by row, without such columns;
     every ``*.safetensors`` tensor by tensor (names, dtypes, shapes, exact values) and its
     metadata; every other file byte for byte, except ``*.png``, ``*.md`` (both show
     timings), ``*.pt`` (pickled optimiser/RNG state; the checkpoint's weights are in
     its ``model.safetensors``) and ``generate.csv`` (a decode-speed benchmark). The slot
     path is replaced by ``SLOT`` in every string first. Numbers must be equal exactly.
   * ``input intact``: the model folder and the corpus hash as before, and their parent
     folders hold no new entries;
   * ``leftovers``: after the rerun, files or folders in B's output that A's lacks, and
     anything in slot B (beside the output, inside it, in its cache) whose name looks
     temporary (``LEFTOVER``: ``*.tmp*``, ``.tmp-*``, ``tmp-*``, ``*.partial``,
     ``*.incomplete``, ``*~``). ``.lock`` files are by design and not counted.

Writes a Markdown table, prints a summary line, and exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bad_input_fixtures import TEXTS, _texts  # noqa: E402  (also puts tests/ on the path)

TIMING = re.compile(r"(seconds|_s$|per_s|gbps|^env_|date|^ci95$|^runs_kept$|^stream_|"
                    r"^pct_of_stream$|^speedup_vs_dense$|^achieved_)")
LEFTOVER = re.compile(r"(\.tmp|^tmp-|\.partial$|\.incomplete$|~$)")
SKIP_SUFFIXES = {".png", ".md", ".pt"}
SKIP_NAMES = {".lock", "generate.csv"}
RUN_TIMEOUT = 600


def fixtures(root: Path) -> dict[str, Path]:
    """The tiny LLaMA with its own tokenizer, and a corpus big enough for every case."""
    from structlm.data.bpe import train_bpe
    from tiny_models import tiny_llama

    model = root / "inputs" / "models" / "llama"
    tok = train_bpe([t * 5 for t in TEXTS.values()], 300, root / "bpe")
    tiny_llama(vocab_size=300, max_position_embeddings=512).save_pretrained(model)
    tok.save_pretrained(model)
    corpus = Path(_texts(root / "inputs" / "corpora" / "texts", repeat=600))
    return {"model": model, "corpus": corpus}


FT = ["--finetune-steps", "2", "--finetune-seq-len", "32", "--finetune-eval-every", "2",
      "--finetune-eval-tokens", "64", "--finetune-eval-window", "32", "--finetune-warmup", "0"]
HEAL = [a.replace("finetune", "heal") for a in FT]


def case_argv(name: str, m: str, t: str, slot: Path) -> list[str]:
    """The command line of case ``name`` writing into ``slot/out`` (YAMLs into ``slot``)."""
    import yaml

    out = str(slot / "out")
    text = ["--corpus", t, "--second-corpus", "", "--threads", "1", "--out", out]
    if name in ("compress", "compress-finetune"):
        return ["share", "compress", m, *text, "--calib-tokens", "512", "--eval-tokens", "128",
                *(FT if name == "compress-finetune" else ["--finetune-steps", "0"])]
    if name == "convert-heal":
        return ["convert", m, *text, "--algebra", "Q2^2", "--targets", "mlp",
                "--eval-tokens", "64", *HEAL]
    if name == "analyze":
        return ["share", "analyze", m, *text, "--seq-len", "32", "--calib-tokens", "256",
                "--eval-tokens", "64", "--permutations", "10", "--calib-seeds", "0"]
    if name == "experiment-share":
        return ["experiment", "share", m, *text, "--calib-tokens", "512", "--eval-tokens", "64",
                "--methods", "svd-llm-w", "--reductions", "0.25", "--types", "attn",
                "--seeds", "0", "--multi-seed-reductions", "", "--no-seed-regime",
                "--no-scope", *FT]
    if name == "experiment-convert":
        return ["experiment", "convert", m, *text, "--calib-tokens", "512", "--eval-tokens",
                "64", "--algebras", "Q2^2", "--targets", "mlp", "--baselines", "prune",
                "--variants", "copy", "--no-dense-control", "--plateau-steps", "1",
                "--mac-tolerance", "0.05", *HEAL]
    train = dict(seq_len=16, batch_size=2, warmup_steps=1, eval_batches=1, threads=1)
    if name == "train":
        cfg = dict(out_dir=out, corpus=t, preset="tiny", algebra="Q2^2", tokenizer="bpe:300",
                   max_steps=6, eval_every=3, save_every=3, **train)
        (slot / "train.yaml").write_text(yaml.safe_dump(cfg))
        return ["train", str(slot / "train.yaml")]
    if name == "study":  # configs/study/tiny.yaml cut down to two arms of 4 steps
        cfg = dict(out_dir=out, preset="study-tiny", corpus=t, tokenizer="bpe:300",
                   train=dict(max_steps=4, eval_every=2, save_every=2, **train),
                   min_val_tokens=500, eval_batch_size=4, generation_tokens=4,
                   generation_runs=2, arms=[{"name": "dense", "algebra": "dense"},
                                            {"name": "q2x2", "algebra": "Q2^2"}])
        (slot / "study.yaml").write_text(yaml.safe_dump(cfg))
        return ["experiment", "study", str(slot / "study.yaml"), "--threads", "1"]
    raise KeyError(name)


CASES = ("compress", "compress-finetune", "convert-heal", "train", "analyze", "study",
         "experiment-share", "experiment-convert")


def _env(slot: Path) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", "STRUCTLM_CACHE": str(slot / "cache"),
            "PYTHONUNBUFFERED": "1"}


def run(argv: list[str], slot: Path, kill_at: float | None = None
        ) -> tuple[int, float, str, float]:
    """Runs ``structlm argv`` in its own session (cwd ``slot``); with ``kill_at``, SIGKILLs
    its process group after that many seconds. Returns (exit code, seconds, output,
    seconds until its first output: when the start-up imports are over); exit code
    ``None`` is reported as -9 when the kill landed."""
    log = slot / f"log-{time.time_ns()}.txt"
    t0 = time.perf_counter()
    first = math.nan
    with open(log, "w") as fh:
        p = subprocess.Popen([sys.executable, "-m", "structlm.cli", *argv], cwd=slot,
                             env=_env(slot), stdout=fh, stderr=subprocess.STDOUT,
                             start_new_session=True)
        limit = kill_at if kill_at is not None else RUN_TIMEOUT
        rc: int | None = None
        while rc is None and time.perf_counter() - t0 < limit:
            rc = p.poll()
            if math.isnan(first) and log.stat().st_size > 0:
                first = time.perf_counter() - t0
            if rc is None:
                time.sleep(0.05)
        if rc is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = -9
        try:  # children left in the group (none expected) go too
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    seconds = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    log.unlink()
    return rc, seconds, text, first if not math.isnan(first) else 0.5


def tree_hash(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def listing(out: Path) -> set[str]:
    if not out.is_dir():
        return set()
    return {str(p.relative_to(out)) + ("/" if p.is_dir() else "") for p in out.rglob("*")
            if p.name != ".lock"}


def _norm(x: Any, slot: str) -> Any:
    if isinstance(x, dict):
        return {k: _norm(v, slot) for k, v in x.items() if not TIMING.search(str(k))}
    if isinstance(x, list):
        return [_norm(v, slot) for v in x]
    if isinstance(x, str):
        return x.replace(slot, "SLOT")
    return x


def _first_diff(a: Any, b: Any, where: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k, "<missing>") != b.get(k, "<missing>"):
                return _first_diff(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{where}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            if u != v:
                return _first_diff(u, v, f"{where}[{i}]")
    return f"{where}: {str(a)[:60]} vs {str(b)[:60]}"


def _csv(path: Path, slot: str) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return [_norm(row, slot) for row in csv.DictReader(fh)]


def _safetensors(path: Path, slot: str) -> tuple[Any, dict[str, Any]]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        meta = _norm(fh.metadata() or {}, slot)
        return meta, {k: fh.get_tensor(k) for k in fh.keys()}


def compare(a_slot: Path, b_slot: Path) -> list[str]:
    """What differs between the outputs of slots A and B (empty: equal)."""
    import torch

    a_out, b_out = a_slot / "out", b_slot / "out"
    diffs = [f"missing in B: {p}" for p in sorted(listing(a_out) - listing(b_out))]
    for pa in sorted(p for p in a_out.rglob("*") if p.is_file()):
        rel = pa.relative_to(a_out)
        pb = b_out / rel
        if (pa.name in SKIP_NAMES or pa.suffix in SKIP_SUFFIXES or not pb.is_file()):
            continue
        if pa.suffix == ".json":
            ja = _norm(json.loads(pa.read_text()), str(a_slot))
            jb = _norm(json.loads(pb.read_text()), str(b_slot))
            if ja != jb:
                diffs.append(f"{rel}{_first_diff(ja, jb)}")
        elif pa.suffix == ".csv":
            ca, cb = _csv(pa, str(a_slot)), _csv(pb, str(b_slot))
            if ca != cb:
                diffs.append(f"{rel}{_first_diff(ca, cb)}")
        elif pa.suffix == ".safetensors":
            (ma, ta), (mb, tb) = _safetensors(pa, str(a_slot)), _safetensors(pb, str(b_slot))
            if ma != mb:
                diffs.append(f"{rel} metadata{_first_diff(ma, mb)}")
            if sorted(ta) != sorted(tb):
                diffs.append(f"{rel}: tensor names differ")
            for k in sorted(set(ta) & set(tb)):
                x, y = ta[k], tb[k]
                if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                    d = ((x.double() - y.double()).abs().max().item()
                         if x.shape == y.shape else float("nan"))
                    diffs.append(f"{rel}:{k} differs (max |diff| {d:.3g})")
        elif pa.read_bytes().replace(str(a_slot).encode(), b"SLOT") != \
                pb.read_bytes().replace(str(b_slot).encode(), b"SLOT"):
            diffs.append(f"{rel}: bytes differ")
    return diffs


def leftovers(a_slot: Path, b_slot: Path) -> list[str]:
    """Paths (relative to slot B) that B's output has and A's lacks, and every name in
    slot B that looks temporary."""
    extra = {"out/" + p for p in listing(b_slot / "out") - listing(a_slot / "out")}
    temp = {str(p.relative_to(b_slot)) for p in b_slot.rglob("*") if LEFTOVER.search(p.name)}
    return sorted({p.rstrip("/") for p in extra | temp})


def _last_line(text: str) -> str:
    lines = [ln for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def sweep_case(name: str, seeds: int, root: Path, inputs: dict[str, Path]) -> list[dict]:
    m, t = str(inputs["model"]), str(inputs["corpus"])
    guard = {k: tree_hash(p) for k, p in inputs.items()}
    beside = {k: sorted(os.listdir(p.parent)) for k, p in inputs.items()}
    a = root / name / "A"
    a.mkdir(parents=True)
    rc, wall, text, first = run(case_argv(name, m, t, a), a)
    print(f"{name}: reference rc {rc} in {wall:.1f} s", flush=True)
    rows = []
    if rc != 0:
        return [dict(case=name, kill="-", killed="reference failed", rerun=str(rc), equal="no",
                     intact="?", left="-", detail=_last_line(text), traceback="Traceback"
                     in text)]
    for seed in range(seeds):
        b = root / name / f"B{seed}"
        b.mkdir(parents=True)
        argv = case_argv(name, m, t, b)
        # a kill while the command works: after its start-up (first output), before the end
        kill_at = random.Random(f"{seed}:{name}").uniform(first, max(first + 0.1, 0.95 * wall))
        krc, _, ktext, _ = run(argv, b, kill_at=kill_at)
        at = re.sub(r"\s+", " ", _last_line(ktext))[:60].replace("|", "/")
        killed = f"killed after: {at or '(no output)'}" if krc == -9 else \
            f"finished first (rc {krc})"
        rrc, rsec, text, _ = run(argv, b)
        diffs = compare(a, b) if rrc == 0 else ["rerun failed"]
        left = leftovers(a, b)
        intact = (all(tree_hash(p) == guard[k] for k, p in inputs.items())
                  and all(sorted(os.listdir(p.parent)) == beside[k] for k, p in inputs.items()))
        row = dict(case=name, kill=f"{kill_at:.1f} s", killed=killed, rerun=str(rrc),
                   equal="yes" if not diffs else "no", intact="yes" if intact else "no",
                   left=", ".join(left) or "none", traceback="Traceback" in text,
                   detail=(_last_line(text) if rrc != 0 else "; ".join(diffs[:3])))
        print(f"  seed {seed}: kill {row['kill']} ({killed}), rerun rc {rrc} in {rsec:.1f} s,"
              f" equal {row['equal']}, intact {row['intact']}, left {row['left']}"
              + (f"\n    {row['detail'][:300]}" if row["detail"] else ""), flush=True)
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="", help="write the table as Markdown here")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: "
                    + ", ".join(CASES))
    ap.add_argument("--seeds", type=int, default=2, help="kill points per case")
    ap.add_argument("--keep", default="", help="keep the work folder here (debugging)")
    args = ap.parse_args()
    names = [c for c in args.cases.split(",") if c]
    if bad := [c for c in names if c not in CASES]:
        ap.error(f"unknown cases {bad}; known: {', '.join(CASES)}")
    if args.seeds < 1:
        ap.error("--seeds must be >= 1")
    t0 = time.time()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kill-rerun-") as tmp:
        root = Path(args.keep).resolve() if args.keep else Path(tmp)
        inputs = fixtures(root)
        print(f"fixtures built in {time.time() - t0:.0f} s", flush=True)
        for name in names:
            rows += sweep_case(name, args.seeds, root / "work", inputs)
    n = len(rows)
    failed = sum(r["rerun"] != "0" for r in rows)
    unequal = sum(r["equal"] != "yes" for r in rows)
    changed = sum(r["intact"] != "yes" for r in rows)
    left = sum(r["left"] != "none" for r in rows)
    tracebacks = sum(bool(r["traceback"]) for r in rows)
    summary = (f"{n} cases, {failed} reruns failed, {unequal} unequal, {changed} input changed,"
               f" {left} left behind, {tracebacks} tracebacks")
    print(summary, f"({time.time() - t0:.0f} s)")
    if args.out:
        lines = ["# Kill-and-rerun sweep over the CLI's writing commands", "",
                 f"`python benchmarks/kill_rerun_sweep.py --out {args.out}`", "",
                 summary + ".", "", "Each row: a run killed (SIGKILL to its process group) "
                 "after *kill*, then rerun into the same folder; compared with an "
                 "uninterrupted run (see the script's docstring for what is compared).", "",
                 "| case | kill time | killed run | rerun rc | equal? | input intact? | "
                 "leftovers | detail |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['case']} | {r['kill']} | {r['killed']} | {r['rerun']} | {r['equal']} "
                  f"| {r['intact']} | {r['left']} | {r['detail'].replace('|', '/')[:300]} |"
                  for r in rows]
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0 if n and not (failed or unequal or changed or left or tracebacks) else 1


if __name__ == "__main__":
    sys.exit(main())
