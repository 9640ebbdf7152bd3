"""Bad-input sweep over the ``structlm`` CLI: every case must end in a clear error, and
nothing may be lost.

    python benchmarks/bad_input_sweep.py [--out benchmarks/results/bad_input_sweep.md]

Each case (the 50 below, and ``bad_input_cases.new_cases`` over the fixtures of
``bad_input_fixtures``: tiny models, a partly trained run and damaged copies of it, bad
configs, a folder another writer holds) runs ``structlm.cli.main(argv)`` in this process
and is classed as

* ``clear``     — argparse's usage error, or ``structlm: error: <one line>`` with exit
  code 2, naming what the case expects (the flag, key or value at fault);
* ``unclear``   — a clear error that does not name it;
* ``traceback`` — any other exception escaped (a bug: the message comes from deep inside);
* ``silent``    — the command succeeded, or was still working after a minute, although
  the input is bad;
* ``lost``      — a file the case protects (an input model, a run's checkpoint, a file
  given as an output folder) changed or disappeared, whatever the exit.

Prints a table and the counts, writes them as Markdown, and exits non-zero if any case is
not ``clear``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bad_input_cases import Case, new_cases
from bad_input_fixtures import build, hold_lock

CLASSES = ("clear", "unclear", "traceback", "silent", "lost")
CASE_SECONDS = 60


def _old_files(root: Path) -> dict[str, str]:
    """Config files and folders the cases point at."""
    def w(name: str, text: str) -> str:
        path = root / name
        path.write_text(text)
        return str(path)

    root.mkdir(parents=True, exist_ok=True)
    garbage = root / "garbage-model"
    garbage.mkdir()
    (garbage / "config.json").write_text("{ not json")
    empty = root / "empty-model"
    empty.mkdir()
    return {
        "missing": str(root / "missing.yaml"),
        "syntax": w("syntax.yaml", "lr: [1, 2\nmax_steps: 3\n"),
        "list": w("list.yaml", "- lr\n- 3\n"),
        "lr_word": w("lr_word.yaml", "lr: fast\n"),
        "steps0": w("steps0.yaml", "max_steps: 0\n"),
        "unknown": w("unknown.yaml", "learning_rate: 0.1\n"),
        "val0": w("val0.yaml", "val_fraction: 0\n"),
        "batch_frac": w("batch_frac.yaml", "batch_size: 2.5\n"),
        "untrained": w("untrained.yaml", "algebra: Q2^2\ntype_schedule: block\nseq_len: 64\n"),
        "bad_tok": w("bad_tok.yaml", "tokenizer: bpe:10\n"),
        "override": w("override.yaml", "model_overrides: {hiden_size: 8}\n"),
        "study_dup": w("study_dup.yaml", "out_dir: x\narms:\n  - {name: a}\n  - {name: a}\n"),
        "study_same": w("study_same.yaml", "out_dir: x\narms:\n  - {name: a}\n  - {name: b}\n"),
        "study_nodir": w("study_nodir.yaml", "arms:\n  - {name: a}\n"),
        "study_nosweep": w("study_nosweep.yaml", "out_dir: x\narms:\n  - {name: a, lr: sweep}\n"),
        "study_wide_dense": w("study_wide_dense.yaml",
                              "out_dir: x\narms:\n  - {name: a, ffn: dense-macs}\n"),
        "study_budgets": w("study_budgets.yaml", "out_dir: x\nbudgets: [10]\ntrain: "
                           "{max_steps: 5}\narms:\n  - {name: a}\n"),
        "study_init": w("study_init.yaml", "out_dir: x\narms:\n  - {name: a, algebra: Q4, "
                        "init: scaled}\n"),
        "garbage_model": str(garbage),
        "empty_model": str(empty),
    }


def _old_cases(f: dict[str, str]) -> list[list[str]]:
    return [
        ["algebra", "info", "Q1024"], ["algebra", "info", "Q2^8"], ["algebra", "info", "bogus"],
        ["algebra", "info", "graph:3:0-5"],
        ["cost", "--preset", "nope"], ["cost", "--preset", "tiny", "--algebra", "Q3"],
        ["cost", "--algebra", "Q7"], ["cost", "--schedule", "weird"],
        ["generate", "--prompt", ""], ["generate", "--prompt", "hi", "--temperature", "-1"],
        ["generate", "--prompt", "hi", "--top-p", "2"],
        ["generate", "--prompt", "hi", "--max-new-tokens", "0"],
        ["generate", "--preset", "tiny", "--prompt", "hi"],
        ["generate", "--model", f["missing"], "--prompt", "hi"],
        ["generate", "--model", f["empty_model"], "--prompt", "hi"],
        ["generate", "--model", f["garbage_model"], "--prompt", "hi"],
        ["generate", "--prompt", "hi", "--max-new-tokens", "600"],
        ["bench", "generate", "--modes", "bogus"], ["bench", "generate", "--runs", "0"],
        ["bench", "generate", "--preset", "study-cpu"],
        ["train", f["missing"]], ["train", f["syntax"]], ["train", f["list"]],
        ["train", f["lr_word"]], ["train", f["steps0"]], ["train", f["unknown"]],
        ["train", f["val0"]], ["train", f["batch_frac"]], ["train", f["untrained"]],
        ["train", f["bad_tok"]], ["train", f["override"]],
        ["experiment", "study", f["missing"]], ["experiment", "study", f["study_dup"]],
        ["experiment", "study", f["study_same"]], ["experiment", "study", f["study_nodir"]],
        ["experiment", "study", f["study_dup"], "--max-steps", "0"],
        ["experiment", "study", f["study_nosweep"]], ["experiment", "study", f["study_wide_dense"]],
        ["experiment", "study", f["study_budgets"]], ["experiment", "study", f["study_init"]],
        ["share", "analyze", "smollm2", "--layers", "0,0,1"],
        ["share", "analyze", "smollm2", "--layers", "5-2"],
        ["share", "analyze", "smollm2", "--config", f["missing"]],
        ["share", "analyze", "smollm2", "--config", f["list"]],
        ["share", "compress", "smollm2", "--config", f["unknown"]],
        ["experiment", "share", "smollm2", "--config", f["syntax"]],
        # config flags derived from the dataclasses: parsed like YAML values
        ["train", f["unknown"], "--lr", "fast"], ["train", f["steps0"], "--max-steps", "2.5"],
        ["experiment", "share", "smollm2", "--seeds", "0,a"],
        ["experiment", "share", "smollm2", "--reductions", "0.2,1.5"],
        ["share", "compress", "smollm2", "--finetune-steps", "many"],
        ["share", "compress", "smollm2", "--method", "bogus"],
        ["bench", "share", "--method", "bogus"], ["bench", "share", "--batches", "1,0"],
    ]


class _TooLong(BaseException):
    pass


def _on_alarm(signum: int, frame: object) -> None:
    raise _TooLong


def _run(argv: list[str]) -> tuple[str, str]:
    from structlm.cli import main

    err, out = io.StringIO(), io.StringIO()
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(CASE_SECONDS)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = main(argv)
    except SystemExit as e:  # argparse
        msg = err.getvalue().strip().splitlines()
        return ("clear" if e.code == 2 and msg else "traceback"), (msg[-1] if msg else "")
    except _TooLong:
        return "silent", f"still working after {CASE_SECONDS} s: not refused before work"
    except BaseException as e:  # the point is to see what escapes
        tb = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{os.path.basename(tb.filename)}:{tb.lineno}"
        return "traceback", f"{type(e).__name__} at {where}: {e}"
    finally:
        signal.alarm(0)
    msg = err.getvalue().strip().splitlines()
    if rc == 2 and msg and msg[-1].startswith("structlm: error:"):
        return "clear", msg[-1]
    return "silent", f"exit {rc}"


def _snapshot(paths: list[str]) -> dict[str, str]:
    """Every file under ``paths`` → its content hash (what a case must leave as it was)."""
    out: dict[str, str] = {}
    for top in map(Path, paths):
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file()
                                                    and p.name != ".lock")
        for p in files:
            out[str(p)] = hashlib.sha1(p.read_bytes()).hexdigest()
    return out


def _classify(case: Case, f: dict[str, str]) -> tuple[str, str]:
    protect = [f[k] for k in case.protect]
    before = _snapshot(protect)
    kind, msg = _run(list(case.argv))
    after = _snapshot(protect)
    changed = sorted(set(before) ^ set(after) | {p for p in before if before[p] != after.get(p)})
    if changed:
        return "lost", f"changed or removed: {', '.join(changed[:3])} ({msg})"
    if kind == "clear" and case.expect and case.expect.lower() not in msg.lower():
        return "unclear", f"does not name {case.expect!r}: {msg}"
    return kind, msg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="", help="write the table as Markdown here")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        files = {**_old_files(Path(tmp) / "old"), **build(Path(tmp))}
        print(f"fixtures built in {time.time() - t0:.0f} s", flush=True)
        cases = [Case(tuple(a)) for a in _old_cases(files)] + new_cases(files)
        lock = hold_lock(files["locked"])  # another writer of that folder
        here = os.getcwd()
        os.chdir(tmp)  # a default output folder a case creates lands in the fixtures
        try:
            for case in cases:
                kind, msg = _classify(case, files)
                shown = " ".join(a.replace(tmp, "TMP") for a in case.argv)
                rows.append((kind, shown, msg.replace(tmp, "TMP")))
                print(f"{kind:<9} structlm {shown}\n          {msg.replace(tmp, 'TMP')[:200]}",
                      flush=True)
        finally:
            lock.close()
            os.chdir(here)
    counts = {k: sum(r[0] == k for r in rows) for k in CLASSES}
    summary = (f"{len(rows)} cases: {counts['clear']} clear errors, {counts['unclear']} "
               f"unclear, {counts['traceback']} tracebacks, {counts['silent']} silent, "
               f"{counts['lost']} lost work")
    print(summary, f"({time.time() - t0:.0f} s)")
    if args.out:
        lines = ["# Bad-input sweep over the CLI", "",
                 "`python benchmarks/bad_input_sweep.py --out " + args.out + "`", "",
                 summary + ".", "", "Classes: " + ", ".join(CLASSES) + " (see the script's "
                 "docstring). TMP is the sweep's temporary folder of fixtures.", "",
                 "| outcome | command | message |", "|---|---|---|"]
        lines += [f"| {k} | `structlm {a}` | {m.replace('|', '/')} |" for k, a, m in rows]
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0 if counts["clear"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
