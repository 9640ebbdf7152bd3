"""Generation throughput: dense vs algebra model on the same prompts, same harness.

Two modes:

* ``fixed`` — every sequence gets exactly ``max_new_tokens`` new tokens (greedy, with
  ``eos_token_id=None``: no token ends a sequence, an EOS is just a token), so both
  models do the same number of decode steps: the layer's effect alone (the paper lacked
  this mode; its models generated different lengths). No logits processor is involved:
  ``transformers``' ``min_new_tokens`` builds a vocabulary-sized ``isin`` mask every step
  and any processor list inspects each processor's signature every step (~1 ms of a
  ~35 ms step on 2 cores together, the same for both models, which only dilutes the
  ratio);
* ``paper`` — seed 000 §3.3: sampling (temperature 0.8, top-p 0.95, top-k 50) until
  EOS or ``max_new_tokens``.

The two models are a StructLM preset (random weights) or two trained StructLM folders —
or, with ``model``, any pretrained Hugging Face decoder an adapter knows (``smollm2``, a
folder) against a copy converted by :func:`structlm.convert_`; both then have their plain
projections on the decode kernel (:func:`structlm.hf.decode.use_decode_kernels_`),
and the MAC ideal counts the whole decode step of each (projections, attention, LM head).

Each (model, mode) runs ``runs`` times over all prompts, the first run is dropped
(warm-up), and tokens/s is reported as mean ± 95% Student-t half-width; tokenisation
and sampling are inside the timed region. Within a run the two models alternate prompt
by prompt (the order flips every prompt), so the machine's slow drifts (±15–30% between
minutes on the 2-core VM) hit both alike; each prompt is sampled from the same
generator state for both.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Annotated, Any

import torch
from tqdm import tqdm

from structlm.algebra.cost import decode_macs
from structlm.bench.llamacpp import PEER_ARMS
from structlm.bench.timing import environment, write_csv_atomic
from structlm.config import ConfigError, Distinct, NonEmpty, OneOf, Range, validated
from structlm.models.presets import PRESETS

__all__ = ["DEFAULT_PROMPTS", "PEER_ARMS", "GenerateBenchConfig", "ideal_decode_speedup",
           "plot_generate_csv", "run_generate_bench"]

DEFAULT_PROMPTS = (
    "Write a short function that returns the sum of a list of numbers.",
    "A farmer has 17 sheep and buys 5 more. How many sheep does the farmer have?",
    "What is the capital of France, and why is it famous?",
    "Translate into English: Я люблю читать книги по вечерам.",
)


@dataclass(frozen=True)
@validated
class GenerateBenchConfig:
    """What to run (models are built from a preset with random weights unless paths
    to trained models are given)."""

    preset: Annotated[str, OneOf(*PRESETS)] = "paper-110m"
    """Model preset of both arms (random weights unless models are given)."""
    algebra: Annotated[str, NonEmpty()] = "Q2^2"
    """FFN algebra of the algebra arm."""
    dense_model: str = ""
    """A trained dense model folder (with --algebra-model: both arms trained)."""
    algebra_model: str = ""
    """A trained algebra model folder."""
    prompts: Annotated[tuple[Annotated[str, NonEmpty()], ...], NonEmpty()] = DEFAULT_PROMPTS
    """Prompts (one sequence each)."""
    modes: Annotated[tuple[Annotated[str, OneOf("fixed", "paper")], ...], NonEmpty(),
                     Distinct()] = ("fixed", "paper")
    """fixed (fixed-length generation) and/or paper (the paper's protocol)."""
    max_new_tokens: Annotated[int, Range(ge=1)] = 256
    """Tokens generated per prompt."""
    runs: Annotated[int, Range(ge=2, note="the first run is a warm-up")] = 4
    """Timed runs per arm (the first is dropped)."""
    threads: Annotated[int, Range(ge=1)] = 2
    """Torch threads."""
    seed: Annotated[int, Range(ge=0)] = 0
    """Seed of the random weights and of sampling."""
    tokenizer: Annotated[str, NonEmpty()] = "gpt2"
    """``gpt2`` or a tokenizer folder (e.g. a trained model's, with its BPE). With
    trained models and the default, the models' own tokenizer (GPT-2 for a structlm
    folder without tokenizer files)."""
    model: str = ""
    """A pretrained decoder (smollm2, a folder, a hub id) benchmarked against a copy
    converted to ``algebra`` (its tokenizer is used; preset and model paths are ignored)."""
    targets: Annotated[str, NonEmpty()] = "mlp"
    """With ``model``: the projections converted (mlp, attn, all, or q,k,v,o,...)."""
    schedule: Annotated[str, NonEmpty()] = "cyclic"
    """With ``model``: the converted layers' position-type schedule."""
    decode: Annotated[str, OneOf("fused", "hf")] = "fused"
    """With ``model``: how the dense and algebra arms decode: ``fused`` (one compiled call
    per token, :mod:`structlm.hf.fused_decode`; a family it does not run falls back to
    ``hf`` with a note) or ``hf`` (``transformers``' ``generate``, the projections on the
    decode kernel)."""
    peers: Annotated[tuple[Annotated[str, OneOf(*PEER_ARMS)], ...], Distinct()] = ()
    """With a built-in ``model``: llama.cpp arms on the same weights (llamacpp-f32: the
    same function, its greedy tokens checked against the dense arm's; llamacpp-q8_0 /
    llamacpp-f16: what CPU users run). Needs ``pip install -e ".[peers]"``; skipped with a
    message without it."""

    def __post_init__(self) -> None:
        """Cross-field checks (each field's own range is checked by ``@validated``)."""
        if bool(self.dense_model) != bool(self.algebra_model):
            raise ConfigError("dense_model and algebra_model come together (both arms trained "
                              f"models), got dense_model={self.dense_model!r}, "
                              f"algebra_model={self.algebra_model!r}")
        if self.model:
            from structlm.convert import AlgebraConfig

            AlgebraConfig(self.algebra, self.schedule, self.targets)  # names a bad one
        if self.peers:
            from structlm.hf.loading import BUILTIN_MODELS

            if self.model.lower() not in BUILTIN_MODELS:
                raise ConfigError(f"peers {list(self.peers)} run the model's GGUF file on "
                                  f"llama.cpp: they need model= one of the built-in models "
                                  f"{sorted(BUILTIN_MODELS)}, got model={self.model!r}")


def ideal_decode_speedup(cfg: Any, context: float) -> float:
    """MAC ratio dense/algebra of one decode step at an average ``context``, over the
    whole model (projections, attention, LM head)."""
    from structlm.models.cost import _rho

    d, f, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers

    def total(rho: Any) -> float:
        return float(n * decode_macs(d, d, d, f, 0, rho)) + n * 2 * context * d + d * v

    return total(1) / total(_rho(cfg))


def _bytes_per_token(models: dict[str, Any], name: str, context: float) -> Fraction:
    """Bytes one decode token of arm ``name`` reads: its weights and KV cache (a llama.cpp
    arm: its GGUF's stored bytes and a float16 KV cache, llama.cpp's default)."""
    from structlm.bench.llamacpp import LlamaCppLM
    from structlm.hf.macs import decode_bytes_per_token, kv_cache_bytes_per_token

    model = models[name]
    if isinstance(model, LlamaCppLM):
        from structlm.bench.bandwidth import gguf_bytes_per_token

        return (gguf_bytes_per_token(model.path)
                + kv_cache_bytes_per_token(models["dense"], context, 2))
    return decode_bytes_per_token(model, context)


def _student_t_half_width(xs: list[float]) -> float:
    if len(xs) < 2:
        return float("nan")
    from scipy.stats import t

    return float(t.ppf(0.975, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs)))


def _random_model(preset: str, algebra: str, seed: int) -> Any:
    """A preset model with random weights (the same for both arms: seeded)."""
    from structlm.models import StructLMForCausalLM, config_from_preset

    torch.manual_seed(seed)
    return StructLMForCausalLM(config_from_preset(preset, algebra)).eval()


def _folder_algebra(model: Any) -> str:
    """The FFN algebra a loaded model computes with (``dense`` for a plain model)."""
    return str(getattr(model.config, "algebra", "dense") or "dense")


def _trained_pair(cfg: GenerateBenchConfig) -> tuple[Any, dict[str, Any]]:
    """The tokenizer and the two trained models; refuses folders in the wrong slots (a
    swapped pair would report the inverse speed-up) or with different tokenizers."""
    from structlm.algebra import is_dense
    from structlm.data import load_tokenizer
    from structlm.hf.loading import check_tokenizer_fits, load_model

    # load_model refuses missing, mis-shaped and non-finite weights
    loaded = {"dense": load_model(cfg.dense_model), "algebra": load_model(cfg.algebra_model)}
    kinds = {k: _folder_algebra(v.model) for k, v in loaded.items()}
    if not is_dense(kinds["dense"]) or is_dense(kinds["algebra"]):
        raise ValueError(f"--dense-model {cfg.dense_model!r} computes with {kinds['dense']!r} "
                         f"and --algebra-model {cfg.algebra_model!r} with {kinds['algebra']!r}:"
                         " the dense arm needs a dense model and the algebra arm an algebra "
                         "one (are the two folders swapped?)")
    if cfg.tokenizer != "gpt2":
        tok = load_tokenizer(cfg.tokenizer)
    else:  # the models' own tokenizer (structlm folders without one: GPT-2)
        toks = [v.tokenizer for v in loaded.values()]
        if any(t is None for t in toks):
            raise ValueError("a model folder has no tokenizer files: pass --tokenizer")
        if toks[0].get_vocab() != toks[1].get_vocab():
            raise ValueError(f"--dense-model and --algebra-model have different tokenizers "
                             f"({len(toks[0]):,} vs {len(toks[1]):,} tokens): compare models "
                             "trained on the same tokens")
        tok = toks[0]
    models = {k: v.model.eval() for k, v in loaded.items()}
    for name, m in models.items():
        check_tokenizer_fits(tok, m, f"the {name} model")
    return tok, models


def _pretrained_pair(cfg: GenerateBenchConfig) -> tuple[Any, dict[str, Any]]:
    """The tokenizer, the pretrained model and its converted copy, both with their plain
    projections on the decode kernel."""
    import copy

    from structlm.convert import AlgebraConfig, convert_
    from structlm.hf.decode import use_decode_kernels_
    from structlm.hf.loading import load_model

    loaded = load_model(cfg.model)
    if loaded.tokenizer is None:
        raise ValueError(f"model {cfg.model!r} has no tokenizer")
    dense = loaded.model.eval()
    converted = convert_(copy.deepcopy(dense), AlgebraConfig(cfg.algebra, cfg.schedule,
                                                             cfg.targets))
    for m in (dense, converted):
        use_decode_kernels_(m)
    return loaded.tokenizer, {"dense": dense, "algebra": converted}


def _runners(cfg: GenerateBenchConfig, models: dict[str, Any]
             ) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """What generates for each arm (the fused decode step of a pretrained model where it
    runs the model, else the model itself), each arm's decode path, and notes."""
    runners: dict[str, Any] = dict(models)
    paths = {name: "structlm" for name in models}
    notes: list[str] = []
    if not cfg.model:
        return runners, paths, notes
    paths = {name: "hf generate" for name in models}
    if cfg.decode == "fused":
        from structlm.hf.fused_decode import fused_decoders

        decoders, why = fused_decoders(models)
        if decoders is None:  # both arms on one path, or the ratio would credit the path
            notes.append("both arms decode with hf generate: the fused step does not run "
                         + "; ".join(f"the {n} arm ({w})" for n, w in why.items()))
            return runners, paths, notes
        for name, decoder in decoders.items():
            runners[name], paths[name] = decoder, "fused"
            notes.append(f"the {name} arm decodes with the fused step (one compiled call per "
                         f"token; weights {decoder.weight_bytes / 1e6:.0f} MB "
                         + ("in memory advised for transparent huge pages"
                            if decoder.huge_pages else
                            "on 4 KiB pages: the kernel offers no transparent huge pages")
                         + "); its prompt goes through the model's forward")
    return runners, paths, notes


def _fused_agreement(models: dict[str, Any], runners: dict[str, Any], paths: dict[str, str],
                     tok: Any, cfg: GenerateBenchConfig) -> dict[str, str]:
    """For each fused arm, its greedy tokens on the first prompt against its own model's
    ``generate`` (``"128/128"``: equal up to the first difference)."""
    from structlm.bench.llamacpp import greedy_agreement

    out = {}
    for name, path in paths.items():
        if path == "fused":
            equal, total = greedy_agreement(models[name], runners[name], tok, cfg.prompts[0],
                                            cfg.max_new_tokens)
            out[name] = f"{equal}/{total}"
    return out


def _one_generate(model: Any, tok: Any, prompt: str, mode: str, max_new: int,
                  seed: int) -> tuple[int, float]:
    """New tokens and seconds for one prompt: tokenising, ``generate``, decoding."""
    torch.manual_seed(seed)  # both models sample with the same generator state
    t0 = time.perf_counter()
    ids = tok(prompt, return_tensors="pt")
    kw: dict[str, Any] = dict(max_new_tokens=max_new, pad_token_id=tok.eos_token_id)
    if mode == "fixed":
        kw.update(do_sample=False, eos_token_id=None)
    else:
        kw.update(do_sample=True, temperature=0.8, top_p=0.95, top_k=50)
    with torch.no_grad():
        out = model.generate(**ids, **kw)
    tok.decode(out[0, ids["input_ids"].shape[1]:])
    return int(out.shape[1] - ids["input_ids"].shape[1]), time.perf_counter() - t0


def _one_run(models: dict[str, Any], tok: Any, prompts: Sequence[str], mode: str,
             max_new: int, run: int, seed: int, bar: Any = None) -> dict[str, tuple[int, float]]:
    """One run of every model over all prompts, interleaved prompt by prompt (the order
    of the models alternates), so slow drifts of the machine hit both models alike.
    Returns per model (new tokens, seconds) summed over the prompts."""
    totals = {name: (0, 0.0) for name in models}
    for i, prompt in enumerate(prompts):
        names = list(models) if (run + i) % 2 == 0 else list(models)[::-1]
        for name in names:
            n, sec = _one_generate(models[name], tok, prompt, mode, max_new,
                                   seed + 1000 * run + i)
            totals[name] = (totals[name][0] + n, totals[name][1] + sec)
            if bar is not None:
                bar.update(1)
    return totals


def run_generate_bench(cfg: GenerateBenchConfig, out_prefix: str,
                       progress: bool = True) -> list[dict[str, Any]]:
    """Time both models; write ``<out_prefix>.csv``, ``.md`` and ``.png``; return the rows."""
    from structlm.data import load_tokenizer

    torch.set_num_threads(cfg.threads)
    if cfg.model:
        tok, models = _pretrained_pair(cfg)
    elif cfg.dense_model:
        tok, models = _trained_pair(cfg)
    else:
        tok = load_tokenizer(cfg.tokenizer)
        models = {"dense": _random_model(cfg.preset, "dense", cfg.seed),
                  "algebra": _random_model(cfg.preset, cfg.algebra, cfg.seed)}
    env = environment()
    rows: list[dict[str, Any]] = []
    runners, paths, notes = _runners(cfg, models)
    prompt_lens = [len(tok(p)["input_ids"]) for p in cfg.prompts]
    prompt_len = statistics.mean(prompt_lens)
    agreement = _fused_agreement(models, runners, paths, tok, cfg)
    if agreement:
        notes.append("greedy tokens of the fused step equal its model's own generate on the "
                     "first prompt (up to the first difference): "
                     + ", ".join(f"{k} {v}" for k, v in agreement.items()))
    if cfg.peers:  # llama.cpp on the same weights, interleaved with the other arms
        from structlm.bench.llamacpp import peer_arms

        peers, peer_agreement, peer_notes = peer_arms(
            cfg.model, tuple(p.removeprefix("llamacpp-") for p in cfg.peers), cfg.threads,
            max(prompt_lens) + cfg.max_new_tokens + 16, models["dense"], tok, cfg.prompts[0],
            cfg.max_new_tokens)
        notes += peer_notes
        agreement.update(peer_agreement)
        models.update(peers)
        runners.update(peers)
        paths.update({name: "llama.cpp" for name in peers})
    from structlm.bench.bandwidth import add_stream_columns, stream_read_gbps

    stream = [stream_read_gbps()]  # the memory floor, before and after the timed runs
    for mode in cfg.modes:
        rates: dict[str, list[float]] = {k: [] for k in models}
        lengths: dict[str, list[int]] = {k: [] for k in models}
        bar = tqdm(total=cfg.runs * len(cfg.prompts) * len(models), unit="gen",
                   desc=f"bench generate ({mode})", disable=not progress)
        for run in range(cfg.runs):
            totals = _one_run(runners, tok, cfg.prompts, mode, cfg.max_new_tokens, run,
                              cfg.seed, bar)
            if run > 0:  # the first run is a warm-up
                for name, (n, sec) in totals.items():
                    rates[name].append(n / sec)
                    lengths[name].append(n)
        bar.close()
        mean_new = statistics.mean(lengths["algebra"]) / len(cfg.prompts)
        context = prompt_len + mean_new / 2
        if cfg.model:
            from structlm.hf.macs import decode_macs_per_token

            ideal = float(decode_macs_per_token(models["dense"], context)
                          / decode_macs_per_token(models["algebra"], context))
        else:
            ideal = ideal_decode_speedup(models["algebra"].config, context)
        step_bytes = {name: _bytes_per_token(models, name, context) for name in models}
        for name in models:
            rate = statistics.mean(rates[name])
            rows.append({
                "mode": mode, "model": name,
                "algebra": getattr(models[name].config, "algebra", None) or (
                    cfg.algebra if name == "algebra" else "dense"),
                "tokens_per_s": round(rate, 3),
                "ci95": round(_student_t_half_width(rates[name]), 3),
                "mean_new_tokens": round(statistics.mean(lengths[name]) / len(cfg.prompts), 1),
                "runs_kept": len(rates[name]),
                "per_run_tokens_per_s": ";".join(f"{r:.3f}" for r in rates[name]),
                "speedup_vs_dense": round(statistics.mean(rates[name])
                                          / statistics.mean(rates["dense"]), 4),
                "ideal_mac_speedup": round(ideal, 4) if name == "algebra" else 1.0,
                "bytes_per_token": int(step_bytes[name]),
                "ideal_bytes_speedup": round(float(step_bytes["dense"] / step_bytes[name]), 4),
                "achieved_gbps": round(int(step_bytes[name]) * round(rate, 3) / 1e9, 2),
                "runtime": "llama.cpp" if paths[name] == "llama.cpp" else "structlm",
                "decode_path": paths[name],
                "greedy_tokens_equal_reference": agreement.get(name, ""),
                **{f"env_{k}": v for k, v in env.items()},
            })
    stream.append(stream_read_gbps())
    add_stream_columns(rows, stream, (("achieved_gbps", "pct_of_stream"),))
    os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
    write_csv_atomic(out_prefix + ".csv", rows)
    lines = ["| mode | model | decode | tokens/s (mean ± 95% CI) | new tokens / prompt | "
             "speed-up | MAC ideal | bytes ideal | MB / token | GB/s | % of stream |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['model']} ({r['algebra']}) | {r['decode_path']} | "
                     f"{r['tokens_per_s']:.2f} "
                     + (f"± {r['ci95']:.2f}" if math.isfinite(r["ci95"]) else "(1 run: no CI)")
                     + f" | {r['mean_new_tokens']} | "
                     f"{r['speedup_vs_dense']:.3f}× | "
                     + ("— | — |" if r["runtime"] == "llama.cpp" else
                        f"{r['ideal_mac_speedup']:.3f}× | {r['ideal_bytes_speedup']:.3f}× |")
                     + f" {r['bytes_per_token'] / 1e6:.1f} | {r['achieved_gbps']:.1f} | "
                     f"{r['pct_of_stream']:.0f}% |")
    notes = [f"stream read bandwidth (torch sum over 256 MiB, median of 7, before;after the "
             f"timed runs): {rows[0]['stream_read_gbps_before_after']} GB/s; GB/s = bytes per "
             "token × tokens/s, a lower bound on the decode step's (tokens/s includes the "
             "prefill and tokenisation)", *notes]
    text = "\n".join(lines) + "\n"
    tmp = out_prefix + ".md.tmp"
    with open(tmp, "w") as fh:
        fh.write(f"Environment: {env}\n\n" + text
                 + "".join(f"\n- {n}" for n in notes) + ("\n" if notes else ""))
    os.replace(tmp, out_prefix + ".md")
    plot_generate_csv(out_prefix + ".csv", out_prefix + ".png")
    return rows


def plot_generate_csv(csv_path: str, png_path: str) -> None:
    """Bar chart from the benchmark's CSV: tokens/s per mode and model with the 95%
    intervals, each algebra bar labelled with its speed-up and MAC ideal."""
    import csv

    from structlm.plotting import pyplot

    plt = pyplot()

    with open(csv_path) as fh:
        rows = list(csv.DictReader(fh))
    fig, ax = plt.subplots(figsize=(6, 3.2))
    labels = [f"{r['mode']}\n{r['model']} ({r['algebra']})" for r in rows]
    rates = [float(r["tokens_per_s"]) for r in rows]
    bars = ax.bar(labels, rates, yerr=[float(r["ci95"]) for r in rows], capsize=4,
                  color=["grey" if r["model"] == "dense" else "C2"
                         if r.get("runtime") == "llama.cpp" else "C0" for r in rows])
    for bar, r in zip(bars, rows, strict=True):
        if r.get("runtime") == "llama.cpp":
            ax.annotate(f"{float(r['speedup_vs_dense']):.3f}×", (bar.get_x() + bar.get_width() / 2,
                        bar.get_height() + float(r["ci95"] or 0)), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 3), textcoords="offset points")
        elif r["model"] != "dense":
            ax.annotate(f"{float(r['speedup_vs_dense']):.3f}× (ideal "
                        f"{float(r['ideal_mac_speedup']):.2f}×)",
                        (bar.get_x() + bar.get_width() / 2,
                         bar.get_height() + float(r["ci95"] or 0)),
                        ha="center", va="bottom", fontsize=8, xytext=(0, 3),
                        textcoords="offset points")
    ax.margins(y=0.15)
    ax.set_ylabel("tokens / s (mean ± 95% CI)")
    ax.set_title(f"generation, batch 1 ({rows[0].get('env_cpu', '')})", fontsize=9)
    fig.tight_layout()
    tmp = png_path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, png_path)
