"""``structlm bench train``: tokens/s of a training step, dense vs algebra model.

Both models are built from the same preset the way ``structlm train`` builds them (the
algebra's type schedule resolved for ``seq_len``, the same seed), and one step is what
the training loop does: zero the gradients, forward, cross-entropy, backward, clip, an
AdamW step. The two steps alternate (order flipped every round), medians over
``trials`` rounds after ``warmup`` untimed ones; random token ids (the step's cost does
not depend on them). Beside the measured ratio (dense time / algebra time) the **MAC
ideal** of a training step: forward, ``dX`` and ``dW`` each cost the forward's MACs, so
``3 ×`` per token of the attention projections ``4 D^2``, the attention scores and
weighted values ``2 D (T+1)/2`` (causal mean; structured scores scale the ``QK^T`` half
by ``rho_score``), the FFN ``3 D F rho`` with ``rho`` of the step's actual type mix, and
the LM head ``D V``; layer norms, activations and the optimiser (a few operations per
parameter) are not MACs and are left out, so the ideal is an upper bound. CSV with the
environment, Markdown from the CSV.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from fractions import Fraction
from typing import Annotated, Any

import torch
from tqdm import tqdm

from structlm.bench.bandwidth import gemm_peak_gflops
from structlm.bench.timing import (
    environment,
    environment_line,
    interleaved_medians,
    read_csv_rows,
    write_csv_atomic,
)
from structlm.config import ConfigError, NonEmpty, OneOf, Range, validated
from structlm.models.presets import PRESETS as MODEL_PRESETS

__all__ = ["PRESETS", "TrainBenchConfig", "markdown_from_csv", "run_train_bench",
           "training_step", "training_step_macs"]


@dataclass(frozen=True)
@validated
class TrainBenchConfig:
    """One comparison: a model preset at one context and batch, dense vs ``algebra``."""

    preset: Annotated[str, OneOf(*MODEL_PRESETS)] = "paper-110m"
    """Model preset of both arms."""
    algebra: Annotated[str, NonEmpty()] = "Q2^2"
    """FFN algebra of the algebra arm."""
    seq_len: Annotated[int, Range(ge=1)] = 1536
    """Tokens per sequence (the context of the step)."""
    batch_size: Annotated[int, Range(ge=1)] = 1
    """Sequences per step."""
    type_schedule: Annotated[str, NonEmpty()] = "auto"
    """Type schedule of the algebra arm (auto: blocks scaled to seq_len, as training)."""
    structured_scores: bool = False
    """Structured attention scores in the algebra arm."""
    trials: Annotated[int, Range(ge=1)] = 5
    """Interleaved timed rounds (medians reported)."""
    warmup: Annotated[int, Range(ge=0)] = 1
    """Untimed rounds first."""
    threads: Annotated[int, Range(ge=1)] = 2
    """Torch threads."""
    seed: Annotated[int, Range(ge=0)] = 0
    """Seed of initialisation and token ids."""
    profile: bool = False
    """After the timed rounds, two more steps of each arm under ``torch.profiler``; the
    operators by self CPU time go to ``<out>_profile.md`` (where the time goes)."""

    def __post_init__(self) -> None:
        """Cross-field checks (each field's own range is checked by ``@validated``)."""
        context = MODEL_PRESETS[self.preset]["n_positions"]
        if self.seq_len > context:
            raise ConfigError(f"seq_len: {self.seq_len} is beyond the context of preset "
                              f"{self.preset!r} ({context} positions)")


#: The issue's shapes: paper-110m at its context (batch 1 and 2) and the CPU study's run.
PRESETS: dict[str, list[TrainBenchConfig]] = {
    "paper-110m": [TrainBenchConfig(batch_size=1), TrainBenchConfig(batch_size=2)],
    "study-cpu": [TrainBenchConfig(preset="study-cpu", seq_len=256, batch_size=16,
                                   trials=7)],
    "tiny": [TrainBenchConfig(preset="study-tiny", seq_len=64, batch_size=2, trials=2)],
}


def _train_config(cfg: TrainBenchConfig, algebra: str) -> Any:
    from structlm.train import TrainConfig

    overrides = {"structured_scores": True} if cfg.structured_scores and algebra != "dense" \
        else {}
    return TrainConfig(preset=cfg.preset, algebra=algebra, seq_len=cfg.seq_len,
                       batch_size=cfg.batch_size, type_schedule=cfg.type_schedule,
                       model_overrides=overrides, seed=cfg.seed, threads=cfg.threads)


def training_step_macs(model: Any, seq_len: int) -> Fraction:
    """Multiply–accumulates per token of one training step of a ``StructLMForCausalLM``
    on windows of ``seq_len`` positions (see the module docstring)."""
    from structlm.models.cost import score_cost
    from structlm.nn import AlgebraLinear, get_schedule

    cfg = model.config
    d, f, v, n = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size,
                  cfg.num_hidden_layers)
    gate = model.transformer.h[0].mlp.gate
    rho = Fraction(1)
    if isinstance(gate, AlgebraLinear):
        types = get_schedule(cfg.type_schedule, gate.q)(torch.arange(seq_len))
        rho = gate.mac_ratio(types)
    rho_s = Fraction(1)
    if getattr(cfg, "structured_scores", False):
        rho_s = Fraction(score_cost(cfg, seq_len)["rho_score"])
    mean_len = Fraction(seq_len + 1, 2)
    fwd = n * (4 * d * d + d * mean_len * (1 + rho_s) + 3 * d * f * rho) + d * v
    return 3 * fwd


def training_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                  y: torch.Tensor, grad_clip: float) -> float:
    """One step of the training loop on token ids ``x`` and targets ``y`` (B, T): zero
    the gradients, forward, cross-entropy, backward, clip the gradient norm to
    ``grad_clip`` (``0``: no clipping, as ``TrainConfig.grad_clip``), an optimiser step.
    Returns the loss."""
    from structlm.train import clip_gradients

    opt.zero_grad(set_to_none=True)
    logits = model(x).logits  # (B, T, V)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    if not torch.isfinite(loss):
        raise FloatingPointError("non-finite loss in the training-step benchmark")
    loss.backward()
    clip_gradients(model.parameters(), grad_clip)
    opt.step()
    return float(loss.detach())


def _one(cfg: TrainBenchConfig) -> dict[str, Any]:
    from structlm.train import build_model, build_optimizer

    torch.set_num_threads(cfg.threads)
    arms = {}
    for name, algebra in (("dense", "dense"), ("algebra", cfg.algebra)):
        tc = _train_config(cfg, algebra)
        model = build_model(tc).train()
        opt, _ = build_optimizer(model, tc)
        arms[name] = (model, opt, tc.grad_clip)
    gen = torch.Generator().manual_seed(cfg.seed)
    vocab = arms["dense"][0].config.vocab_size
    ids = torch.randint(0, vocab, (cfg.batch_size, cfg.seq_len + 1), generator=gen)
    x, y = ids[:, :-1], ids[:, 1:]  # (B, T) each

    def step(model: Any, opt: Any, grad_clip: float) -> None:
        training_step(model, opt, x, y, grad_clip)

    t_dense, t_alg = interleaved_medians([lambda a=a: step(*arms[a]) for a in arms],
                                         cfg.trials, cfg.warmup)
    profiles = {a: _profile(lambda a=a: step(*arms[a])) for a in arms} if cfg.profile else {}
    macs = {a: training_step_macs(arms[a][0], cfg.seq_len) for a in arms}
    tokens = cfg.batch_size * cfg.seq_len
    speedup = t_dense / t_alg
    ideal = float(macs["dense"] / macs["algebra"])
    return {"preset": cfg.preset, "algebra": cfg.algebra,
            "type_schedule": arms["algebra"][0].config.type_schedule,
            "structured_scores": cfg.structured_scores, "seq_len": cfg.seq_len,
            "batch_size": cfg.batch_size, "tokens_per_step": tokens,
            "dense_ms": round(t_dense * 1e3, 2), "algebra_ms": round(t_alg * 1e3, 2),
            "dense_tok_s": round(tokens / t_dense, 1), "algebra_tok_s": round(tokens / t_alg, 1),
            "speedup": round(speedup, 4), "ideal": round(ideal, 4),
            "frac_of_ideal": round(speedup / ideal, 4),
            "dense_train_macs_per_token": int(macs["dense"]),
            "algebra_train_macs_per_token": int(macs["algebra"]),
            "trials": cfg.trials, "threads": cfg.threads,
            **{f"{a}_gflops": round(2 * float(macs[a]) * tokens / t / 1e9, 2)
               for a, t in (("dense", t_dense), ("algebra", t_alg))},
            **({"profiles": profiles} if profiles else {})}


def _profile(step: Any, steps: int = 2, rows: int = 12) -> str:
    """The operators of ``steps`` calls of ``step`` by self CPU time (a text table)."""
    with torch.profiler.profile() as prof:
        for _ in range(steps):
            step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows,
                                     max_name_column_width=40)


def run_train_bench(cfgs: list[TrainBenchConfig], out_prefix: str, progress: bool = True
                    ) -> list[dict[str, Any]]:
    """Time every configuration; writes ``<out_prefix>.csv`` and ``.md``; the rows."""
    env = {f"env_{k}": v for k, v in environment().items()}
    os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
    rows: list[dict[str, Any]] = []
    peaks: list[float] = []
    profiles: list[str] = []
    for cfg in tqdm(cfgs, desc="bench train", disable=not progress, unit="cfg"):
        torch.set_num_threads(cfg.threads)
        peaks.append(gemm_peak_gflops())  # the compute ceiling, measured beside each row
        row = {**_one(cfg), **env}
        for arm, table in row.pop("profiles", {}).items():
            profiles.append(f"## {cfg.preset}, T = {cfg.seq_len}, B = {cfg.batch_size}: "
                            f"{arm} ({row['algebra'] if arm == 'algebra' else 'dense'})\n\n"
                            f"```\n{table}\n```\n")
        peaks.append(gemm_peak_gflops())
        row["gemm_peak_gflops"] = round(statistics.mean(peaks[-2:]), 1)
        for arm in ("dense", "algebra"):
            row[f"{arm}_pct_of_peak"] = round(100 * row[f"{arm}_gflops"]
                                              / row["gemm_peak_gflops"], 1)
        rows.append(row)
        write_csv_atomic(out_prefix + ".csv", rows)  # partial results survive a stop
    tmp = out_prefix + ".md.tmp"
    with open(tmp, "w") as fh:
        fh.write(markdown_from_csv(out_prefix + ".csv"))
    os.replace(tmp, out_prefix + ".md")
    if profiles:
        with open(tmp, "w") as fh:
            fh.write("# Where a training step's time goes (two steps per arm, "
                     "`torch.profiler`, operators by self CPU time)\n\n" + "\n".join(profiles))
        os.replace(tmp, out_prefix + "_profile.md")
    return rows


def markdown_from_csv(csv_path: str) -> str:
    """The table (and the environment) from a ``bench train`` CSV."""
    rows = read_csv_rows(csv_path)
    if not rows:
        return "(no rows)\n"
    lines = [environment_line(rows), "",
             "One training step (forward, backward, clip, AdamW), dense and algebra model of "
             "the same preset, interleaved rounds, medians. Ideal = training MACs per token, "
             "dense / algebra (an upper bound: norms, activations and the optimiser are "
             "not counted). A training step at these sizes is compute-bound: its ceiling is "
             "the float32 GEMM rate measured beside each row (1024³ `torch.mm`, median of 5, "
             "before and after), and GFLOP/s = 2 × counted MACs × tokens / time.", "",
             "| preset | algebra | schedule | T | B | dense tok/s | algebra tok/s | "
             "speed-up | MAC ideal | % of ideal | GFLOP/s dense → algebra (% of GEMM) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        scores = " + scores" if r["structured_scores"] == "True" else ""
        lines.append(f"| {r['preset']} | {r['algebra']}{scores} | {r['type_schedule']} | "
                     f"{r['seq_len']} | {r['batch_size']} | {float(r['dense_tok_s']):,.0f} | "
                     f"{float(r['algebra_tok_s']):,.0f} | {float(r['speedup']):.3f}× | "
                     f"{float(r['ideal']):.3f}× | {100 * float(r['frac_of_ideal']):.0f}% | "
                     + (f"{float(r['dense_gflops']):.0f} → {float(r['algebra_gflops']):.0f} "
                        f"({float(r['dense_pct_of_peak']):.0f}% → "
                        f"{float(r['algebra_pct_of_peak']):.0f}% of "
                        f"{float(r['gemm_peak_gflops']):.0f}) |" if r.get("gemm_peak_gflops")
                        else "— |"))
    return "\n".join(lines) + "\n"
