"""``structlm experiment study CONFIG.yaml``: train every arm of a study, evaluate, report.

Runs go in a fixed order (the learning-rate sweep's runs first; then per budget,
ascending, the first seed of every arm, then the further seeds); each run is an ordinary
resumable :func:`~structlm.train.loop.train` run in ``OUT/runs/<arm>/seed<k>`` (a
one-budget study without a sweep) or ``OUT/runs/<arm>/steps<N>-lr<rate>/seed<k>``, so an
interrupted study restarted with the same command continues where it stopped (a run
mid-way resumes from its last checkpoint). One process writes a study folder at a time
(a lock file). The report is rewritten after every run.

The protocol (:data:`~structlm.experiments.study.config.PROTOCOL`): the token data is
split three ways by document (train / validation / test, every corpus part with
validation and test documents). A finished run's ``final.json`` keeps its whole-split
validation loss (per corpus part and pooled: the ``validation`` record, what the
learning-rate sweep's choice reads) and, for a run that enters the verdicts, its **test**
scores: per-window NLL sums and token counts (float64) over windows of the run's
``seq_len`` on the test documents, per part and pooled
(:meth:`structlm.stats.WindowScores.as_dict`), scored once, at the end. A sweep run is
scored on test only if it is also a verdict run (``lr_sweep.reuse``: the chosen rate's run
at the sweep's seed), after the choice: no sweep run at a rate not chosen is ever scored on
the test text. A folder of an older
protocol is refused, not resumed (:class:`~structlm.experiments.study.config.
OldProtocolError`); its report stays as it was written.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from structlm.atomic import atomic_write_json
from structlm.experiments.study.config import (
    PROTOCOL,
    ArmSpec,
    OldProtocolError,
    Run,
    StudyConfig,
    chosen_rates,
    run_summary,
)
from structlm.train.checkpoint import run_folder_lock

__all__ = ["chosen_rates", "run_study", "run_summary", "score_test_split",
           "validation_losses"]


def _sweep_without_rates(sweep: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if sweep is None else {k: v for k, v in sweep.items() if k != "rates"}


def _defaults(cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return json.loads(json.dumps(out))


def _with_defaults(old: dict[str, Any]) -> dict[str, Any]:
    """A ``study_config.json`` written before a field existed: the field at its default
    (so a folder started by an older version resumes)."""
    arm_defaults = _defaults(ArmSpec)
    return {**_defaults(StudyConfig), **old,
            "arms": [{**arm_defaults, **a} for a in old.get("arms", [])]}


def _check_same_study(out: Path, cfg: StudyConfig) -> None:
    """A folder holds one study: the shared settings must match (arms may be added, and
    rates added to the sweep's grid: the runs at the old rates stay valid)."""
    path = out / "study_config.json"
    mine = {**dataclasses.asdict(cfg), "protocol": PROTOCOL}
    free = ("arms", "out_dir", "notes", "protocol")  # compared on their own, or free
    shared = {k: v for k, v in mine.items() if k not in free}
    shared["train"] = {k: v for k, v in cfg.train.items() if k != "threads"}  # runtime only
    if path.exists():
        raw = json.loads(path.read_text())
        if raw.get("protocol", 1) != PROTOCOL:
            raise OldProtocolError(
                f"{out} holds a study run under protocol {raw.get('protocol', 1)} (a train / "
                "validation split: the learning-rate sweep and the verdicts read the same "
                "validation text; verdicts by seed ranges). It cannot be resumed under "
                f"protocol {PROTOCOL} (train / validation / test split: decisions on "
                "validation, verdicts on the test text with intervals from structlm.stats): "
                "its runs were trained and chosen on other splits. Its report.md stays as "
                "written; run the study in another out_dir")
        old = _with_defaults(raw)
        old_sweep, new_sweep = old.get("lr_sweep"), shared.get("lr_sweep")
        if old_sweep and new_sweep and not set(old_sweep["rates"]) <= set(new_sweep["rates"]):
            raise ValueError(f"{out}: lr_sweep.rates {new_sweep['rates']} drop rates of the "
                             f"study started with {old_sweep['rates']}; rates may only be added")
        shared["lr_sweep"] = _sweep_without_rates(new_sweep)
        old = {**old, "lr_sweep": _sweep_without_rates(old_sweep)}
        old_shared = {k: v for k, v in old.items() if k not in free}
        old_shared["train"] = {k: v for k, v in old_shared.get("train", {}).items()
                               if k != "threads"}
        if old_shared != json.loads(json.dumps(shared)):
            changed = sorted(k for k in shared if old_shared.get(k) != json.loads(
                json.dumps(shared[k])))
            raise ValueError(f"{out} holds a study with other shared settings ({changed}); "
                             "use another out_dir")
        old_arms = {a["name"]: a for a in old["arms"]}
        for arm in mine["arms"]:
            prev = old_arms.get(arm["name"])
            if prev is not None and {k: v for k, v in prev.items() if k != "seeds"} != {
                    k: v for k, v in json.loads(json.dumps(arm)).items() if k != "seeds"}:
                raise ValueError(f"arm {arm['name']!r} changed since {out} was started; give "
                                 "the new variant another name")
    atomic_write_json(path, mine)


def _train_seconds(metrics: Path) -> float:
    """Training wall time of a run, summed over resumed segments (``seconds`` restarts
    from 0 when a run resumes)."""
    import csv

    total, last = 0.0, 0.0
    with metrics.open(newline="") as fh:
        for row in csv.DictReader(fh):
            sec = float(row["seconds"])
            if sec < last:
                total += last
            last = sec
    return total + last


def validation_losses(model: Any, data: Any, seq_len: int, batch_size: int, progress: bool
                      ) -> dict[str, Any]:
    """Whole-split validation loss: for a one-part corpus the split; for a ``+``-joined
    corpus each part's held-out documents on their own (no window spans two parts) and the
    pooled loss, the token-weighted mean of the parts (float64 sums)."""
    from structlm.train.evaluate import split_loss

    parts = data.val_parts()
    if len(parts) == 1:
        ev = split_loss(model, data.tokens("val"), seq_len, batch_size, progress)
        return {**ev, "parts": {}}
    per = {}
    for name, tokens in parts.items():
        if len(tokens) < 2:
            raise ValueError(f"corpus part {name!r} has no held-out document to validate "
                             "on: raise val_fraction or give it more documents")
        per[name] = split_loss(model, tokens, seq_len, batch_size, progress)
    scored = sum(v["tokens"] for v in per.values())
    loss = sum(v["loss"] * v["tokens"] for v in per.values()) / scored
    return {"loss": loss, "tokens": scored, "windows": sum(v["windows"] for v in per.values()),
            "parts": {k: {"loss": v["loss"], "tokens": v["tokens"]} for k, v in per.items()}}


def score_test_split(model: Any, data: Any, seq_len: int, batch_size: int,
                     progress: bool) -> dict[str, Any]:
    """The ``test`` record of ``final.json``: per-window scores over the test documents,
    windows of ``seq_len`` per corpus part (no window spans two parts) and pooled, each as
    :meth:`structlm.stats.WindowScores.as_dict`."""
    from structlm.train.evaluate import pooled_window_scores

    per, pooled = pooled_window_scores(model, data.test_parts(), seq_len, batch_size,
                                       progress)
    return {"role": "test", "seq_len": seq_len,
            "documents": list(data.meta["test_documents"]),
            "mean_nll": pooled.mean_nll, "tokens": sum(pooled.tokens),
            "pooled": pooled.as_dict(),
            "parts": {k: {**v.as_dict(), "mean_nll": v.mean_nll, "tokens": sum(v.tokens)}
                      for k, v in per.items()}}


def _load_model(cfg: StudyConfig, r: Run) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    rc = cfg.run_config_of(r)
    torch.set_num_threads(rc.threads)
    return rc, AutoModelForCausalLM.from_pretrained(Path(rc.out_dir) / "model").eval()


def _add_test_scores(cfg: StudyConfig, r: Run, data: Any, progress: bool) -> dict[str, Any]:
    """Score a finished run on the test text (once: a run that has its scores keeps them)
    and add them to its ``final.json``."""
    rc, model = _load_model(cfg, r)
    path = Path(rc.out_dir) / "final.json"
    summary = json.loads(path.read_text())
    if "test" in summary:
        return summary
    t0 = time.perf_counter()
    summary["test"] = score_test_split(model, data, rc.seq_len, cfg.eval_batch_size, progress)
    summary["test_seconds"] = round(time.perf_counter() - t0, 1)
    atomic_write_json(path, summary)
    return summary


def _finish_run(cfg: StudyConfig, r: Run, data: Any, progress: bool) -> dict[str, Any]:
    """Whole-split validation loss and the run's facts, written to ``final.json`` (the
    test scores are added by :func:`_add_test_scores`, for the runs that enter the
    verdicts)."""
    from structlm.models.cost import model_cost, parameter_count

    arm, seed = r.arm, r.seed
    rc, model = _load_model(cfg, r)
    run = Path(rc.out_dir)
    t0 = time.perf_counter()
    ev = validation_losses(model, data, rc.seq_len, cfg.eval_batch_size, progress)
    mcfg = model.config
    cost = model_cost(mcfg)
    dec = cost["decode_macs_per_token"]
    d, n = mcfg.hidden_size, mcfg.num_hidden_layers
    ffn = cost["training_macs_per_token"]["ffn"]["algebra"] // 3
    attn_proj = cost["training_macs_per_token"]["attention_projections"]["algebra"] // 3
    train_tokens = rc.max_steps * rc.batch_size * rc.seq_len * rc.grad_accum
    seconds = _train_seconds(run / "metrics.csv")
    summary = {
        "protocol": PROTOCOL,
        "arm": arm.name, "seed": seed, "algebra": arm.algebra, "steps": rc.max_steps,
        "lr": rc.lr, "init": arm.init, "val_parts": ev["parts"],
        "budget": {"steps": rc.max_steps, "tokens": train_tokens},
        "ffn_width": mcfg.intermediate_size, "type_schedule": rc.model_schedule(),
        "structured_scores": arm.structured_scores,
        "val_loss": ev["loss"], "val_tokens": ev["tokens"], "val_windows": ev["windows"],
        "validation": {"role": "validation", "loss": ev["loss"], "tokens": ev["tokens"],
                       "windows": ev["windows"], "parts": ev["parts"],
                       "documents": list(data.meta["val_documents"])},
        "eval_seconds": round(time.perf_counter() - t0, 1),
        "train_tokens": train_tokens, "train_seconds": round(seconds, 1),
        "train_tokens_per_s": round(train_tokens / seconds, 1) if seconds else None,
        "parameters": parameter_count(mcfg),
        "non_embedding_parameters": parameter_count(mcfg) - mcfg.vocab_size * d
        - mcfg.n_positions * d,
        "projection_macs_per_token": int(ffn + attn_proj),
        "ffn_macs_per_token": int(ffn),
        "decode_macs_per_token": int(dec["algebra"]),
        "training_macs_per_token": int(cost["training_macs_per_token"]["total"]["algebra"]),
        "type_tokens_per_window": rc.type_counts(),
        "layers": n,
    }
    atomic_write_json(run / "final.json", summary)
    return summary


def _generation(cfg: StudyConfig, out: Path, progress: bool) -> None:
    """Fixed-length generation throughput of the first dense-reference run against the
    first run of the first algebra arm at the largest budget (batch 1, the existing
    decode kernels)."""
    from structlm.bench.generate import GenerateBenchConfig, run_generate_bench

    if (out / "generate.csv").exists():
        return
    dense = next((a for a in cfg.arms if a.is_dense and a.ffn == "preset"), None)
    alg = next((a for a in cfg.arms if not a.is_dense), None)
    if dense is None or alg is None:
        return
    runs = cfg.main_runs(chosen_rates(cfg))
    last = max(cfg.all_budgets())
    first = {r.arm.name: r for r in reversed(runs) if r.steps == last}
    if dense.name not in first or alg.name not in first:
        return
    paths = {a.name: Path(cfg.run_config_of(first[a.name]).out_dir) / "model"
             for a in (dense, alg)}
    if not all(p.exists() for p in paths.values()):
        return
    bench = GenerateBenchConfig(preset=cfg.preset, algebra=alg.algebra,
                                dense_model=str(paths[dense.name]),
                                algebra_model=str(paths[alg.name]),
                                prompts=("ROMEO:\nWhat light", "KING HENRY:\nOnce more",
                                         "HAMLET:\nTo be", "First Citizen:\nWe are"),
                                modes=("fixed",), max_new_tokens=cfg.generation_tokens,
                                runs=cfg.generation_runs, tokenizer=str(paths[dense.name]))
    run_generate_bench(bench, str(out / "generate"), progress)


def _train_and_finish(cfg: StudyConfig, r: Run, data: Any, progress: bool, test: bool
                      ) -> None:
    """Train ``r``, write its ``final.json`` and, with ``test`` (a run of the verdicts),
    score it on the test text; then rewrite the report."""
    from structlm.experiments.study.report import write_report
    from structlm.train.loop import train

    train(cfg.run_config_of(r), progress=progress)
    s = _finish_run(cfg, r, data, progress)
    print(f"[study] {r.arm.name} ({r.steps} steps, lr {r.lr:g}) seed {r.seed}: validation "
          f"loss {s['val_loss']:.4f} on {s['val_tokens']:,} tokens "
          f"({s['train_tokens_per_s']} tokens/s)", flush=True)
    if test:
        _add_test_scores(cfg, r, data, progress)
    write_report(cfg, data)


def _check_data(cfg: StudyConfig, data: Any) -> None:
    """Validation and test each hold at least ``min_val_tokens`` tokens, and every corpus
    part has validation and test documents."""
    for split, name in (("val", "validation"), ("test", "test")):
        n = int(data.meta[f"{split}_tokens"])
        if n < cfg.min_val_tokens:
            raise ValueError(f"the {name} split has {n:,} tokens, fewer than "
                             f"min_val_tokens={cfg.min_val_tokens:,}: raise val_fraction (the "
                             "held-out share, dealt to validation and test) or "
                             "use a larger corpus")
    for split, parts in (("validation", data.val_parts()), ("test", data.test_parts())):
        empty = [k for k, v in parts.items() if len(v) < 2]
        if empty:
            raise ValueError(f"corpus parts {empty} have no {split} document: raise "
                             "val_fraction or give them more documents")


def run_study(cfg: StudyConfig, progress: bool = True) -> Path:
    """Train, evaluate and report every run of ``cfg`` (resuming); returns ``report.md``."""
    from structlm.data.tokens import build_token_dataset
    from structlm.experiments.study.report import write_report

    out = Path(cfg.out_dir)
    with run_folder_lock(out, "study"):
        _check_same_study(out, cfg)
        first = cfg.run_config(cfg.arms[0], cfg.arms[0].seeds[0], lr=1.0)
        data = build_token_dataset(cfg.corpus, first.data_dir, first.val_fraction,
                                   cfg.data_seed, "", cfg.tokenizer, test_split=True)
        _check_data(cfg, data)
        sweep = cfg.sweep_runs()
        for i, r in enumerate(sweep, 1):
            if run_summary(cfg, r) is None:
                print(f"[study] sweep run {i}/{len(sweep)}: {r.arm.name} lr {r.lr:g}, "
                      f"{r.steps} steps, seed {r.seed}", flush=True)
                _train_and_finish(cfg, r, data, progress, test=False)
        runs = cfg.main_runs(chosen_rates(cfg))
        for i, r in enumerate(runs, 1):
            s = run_summary(cfg, r)
            if s is not None:
                if "test" not in s:  # the chosen rate's sweep run (or one stopped between
                    # its validation and its test scores): scored on test now, once
                    print(f"[study] test scores of {r.arm.name}, {r.steps} steps, lr "
                          f"{r.lr:g}, seed {r.seed}", flush=True)
                    _add_test_scores(cfg, r, data, progress)
                continue
            print(f"[study] run {i}/{len(runs)}: {r.arm.name}, {r.steps} steps, lr {r.lr:g}, "
                  f"seed {r.seed}", flush=True)
            _train_and_finish(cfg, r, data, progress, test=True)
        _generation(cfg, out, progress)
        return write_report(cfg, data)
