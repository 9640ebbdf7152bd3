"""Bad-input sweep over the ``structlm`` CLI: every case must end in a clear error.

    python benchmarks/bad_input_sweep.py [--out benchmarks/results/bad_input_sweep.md]

Each case runs ``structlm.cli.main(argv)`` in this process and is classed as

* ``clear``     — argparse's usage error, or ``structlm: error: <one line>`` with exit code 2;
* ``traceback`` — any other exception escaped (a bug: the message comes from deep inside);
* ``silent``    — the command succeeded although the input is bad.

Prints a table and the counts, writes them as Markdown, and exits non-zero if any case is
not ``clear``. Every case fails before heavy work (no training, no model download).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import traceback
from pathlib import Path


def _files(root: Path) -> dict[str, str]:
    """Config files and folders the cases point at."""
    def w(name: str, text: str) -> str:
        path = root / name
        path.write_text(text)
        return str(path)

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
        "garbage_model": str(garbage),
        "empty_model": str(empty),
    }


def _cases(f: dict[str, str]) -> list[list[str]]:
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


def _run(argv: list[str]) -> tuple[str, str]:
    from structlm.cli import main

    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = main(argv)
    except SystemExit as e:  # argparse
        msg = err.getvalue().strip().splitlines()
        return ("clear" if e.code == 2 and msg else "traceback"), (msg[-1] if msg else "")
    except BaseException as e:  # the point is to see what escapes
        tb = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{os.path.basename(tb.filename)}:{tb.lineno}"
        return "traceback", f"{type(e).__name__} at {where}: {e}"
    msg = err.getvalue().strip().splitlines()
    if rc == 2 and msg and msg[-1].startswith("structlm: error:"):
        return "clear", msg[-1]
    return "silent", f"exit {rc}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="", help="write the table as Markdown here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = _files(Path(tmp))
        for argv in _cases(files):
            kind, msg = _run(argv)
            shown = " ".join(a.replace(tmp, "TMP") for a in argv)
            rows.append((kind, shown, msg.replace(tmp, "TMP")))
            print(f"{kind:<9} structlm {shown}\n          {msg[:160]}", flush=True)
    counts = {k: sum(r[0] == k for r in rows) for k in ("clear", "traceback", "silent")}
    summary = (f"{len(rows)} cases: {counts['clear']} clear errors, {counts['traceback']} "
               f"tracebacks, {counts['silent']} silent")
    print(summary)
    if args.out:
        lines = ["# Bad-input sweep over the CLI", "",
                 "`python benchmarks/bad_input_sweep.py --out " + args.out + "`", "",
                 summary + ".", "", "| outcome | command | message |", "|---|---|---|"]
        lines += [f"| {k} | `structlm {a}` | {m.replace('|', '/')} |" for k, a, m in rows]
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0 if counts["clear"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
