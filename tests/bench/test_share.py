"""``structlm bench share`` on a tiny random Llama: the rows, the unique-tensor memory
accounting, the decode loop is a real cached greedy decode, CSV/Markdown/PNG outputs."""

from __future__ import annotations

import copy
import csv
import dataclasses
import math
import os
from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaForCausalLM

from structlm.bench.peak_memory import measure_peak_memory
from structlm.bench.share import (
    ShareBenchConfig,
    greedy_decode,
    measure,
    peak_memory_rows,
    unique_parameters,
    weights_read_per_token,
    write_outputs,
)
from structlm.cli import build_parser
from structlm.hf.adapters import get_adapter
from structlm.hf.calibration import calibrate
from structlm.hf.loading import LoadedModel
from structlm.share.compress import CompressionConfig, compress_model, save_compressed
from tiny_models import tiny_llama


def _ids(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 89, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def models() -> Iterator[tuple[LlamaForCausalLM, LlamaForCausalLM, dict]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest, and measure() sets it
    original = tiny_llama()
    compressed = copy.deepcopy(original)
    ad = get_adapter(compressed)
    cal = calibrate(ad, _ids(4 * 32), seq_len=32, batch_size=2, progress=False)
    report = compress_model(ad, cal, CompressionConfig(method="shared", types="all",
                                                       target_reduction=0.4))
    yield original, compressed, report
    torch.set_num_threads(threads)


def test_unique_parameters_counts_tied_and_shared_tensors_once(models) -> None:
    original, compressed, report = models
    po, bo = unique_parameters(original)
    assert po == sum(p.numel() for p in original.parameters())  # tied lm_head once
    assert bo == 4 * po
    pc, _ = unique_parameters(compressed)
    assert pc == report["model_parameters_after"]  # the shared basis once, not per layer
    assert sum(p.numel() for _, p in compressed.named_parameters(remove_duplicate=False)) > pc


def test_greedy_decode_equals_generate(models) -> None:
    _, compressed, _ = models
    prompt = _ids(3 * 7, seed=5).view(3, 7)
    compressed.generation_config.eos_token_id = None  # no early stop, no EOS masking
    with torch.no_grad():
        ref = compressed.generate(prompt, attention_mask=torch.ones_like(prompt),
                                  do_sample=False, max_new_tokens=4, pad_token_id=0)
    torch.testing.assert_close(greedy_decode(compressed, prompt, 3), ref[:, 7:])


def test_fused_step_decodes_the_compressed_model_as_its_forward(models) -> None:
    """The fused decode step on a compressed model (a shared basis on every matrix type,
    the stacked gate/up MLP-in) produces the model's own greedy tokens."""
    from structlm.hf.fused_decode import FusedDecoder

    _, compressed, _ = models
    prompt = _ids(3 * 7, seed=5).view(3, 7)
    dec = FusedDecoder(compressed)
    with torch.no_grad():
        token = dec.prefill(prompt, 6).argmax(-1)
        fused = torch.cat([token[:, None], dec.greedy_steps(token, 7, 5)], 1)
        assert torch.equal(fused, greedy_decode(compressed, prompt, 5))


def test_measure_rows_and_outputs(models, tmp_path) -> None:
    original, compressed, report = models
    cfg = ShareBenchConfig(batches=(1, 3), prompt_len=7, decode_tokens=3, trials=2,
                           threads=1)
    rows = measure(original, compressed, _ids(64), cfg, report, model_id="tiny-llama")
    lat = [r for r in rows if r["phase"] in ("prefill", "decode")]
    assert [(r["phase"], r["batch"]) for r in lat] == [
        ("prefill", 1), ("decode", 1), ("prefill", 3), ("decode", 3)]
    for r in lat:
        for key in ("original", "compressed", "speedup", "original_tok_s", "compressed_tok_s"):
            assert math.isfinite(float(r[key])) and float(r[key]) > 0, (key, r)
        assert r["unit"] == ("s_per_call" if r["phase"] == "prefill" else "s_per_token")
    # the memory floor of decode rows: bytes per step (weights once, KV per sequence)
    from structlm.hf.macs import decode_bytes_per_token, kv_cache_bytes_per_token

    context = cfg.prompt_len + cfg.decode_tokens / 2
    for r in lat:
        assert r["stream_read_gbps"] > 0
        if r["phase"] == "prefill":
            assert r["original_gbps"] == "" and r["compressed_pct_of_stream"] == ""
            continue
        for arm, model in (("original", original), ("compressed", compressed)):
            step = int(decode_bytes_per_token(model, context)
                       + (r["batch"] - 1) * kv_cache_bytes_per_token(model, context, 4))
            assert r[f"{arm}_bytes_per_step"] == step
            assert r[f"{arm}_gbps"] == round(step / r[arm] / 1e9, 3)
            assert r[f"{arm}_pct_of_stream"] >= 0
        # the same weights as the memory rows' count (KV, norms, embedding row equal)
        from structlm.bench.share import weights_read_per_token

        assert (r["original_bytes_per_step"] - r["compressed_bytes_per_step"]
                == 4 * (weights_read_per_token(original) - weights_read_per_token(compressed)))
    mem = {r["item"]: r for r in rows if r["phase"] == "memory"}
    assert mem["parameter_bytes"]["compressed"] < mem["parameter_bytes"]["original"]
    mat = mem["compressed_matrices_bytes"]
    assert mat["original"] == 4 * report["original_parameters"]
    assert mat["compressed"] == 4 * report["stored_parameters"]
    assert mat["compressed"] <= 0.6 * mat["original"] + 4
    assert all(r["env_torch"] and r["model"] == "tiny-llama" and r["method"] == "shared"
               and r["decode_path"] == "fused" for r in rows)

    prefix = str(tmp_path / "out" / "share")
    write_outputs(rows, prefix)
    with open(prefix + ".csv", newline="") as fh:
        assert len(list(csv.DictReader(fh))) == len(rows)
    md = open(prefix + ".md").read()
    assert "| decode | 3 |" in md and "KV cache" in md and "Environment:" in md
    assert "% of the stream read bandwidth" in md and "the fused step for both" in md
    hf_rows = measure(original, compressed, _ids(64), dataclasses.replace(cfg, decode="hf"),
                      report)
    assert {r["decode_path"] for r in hf_rows} == {"hf"}
    assert ("compressed model is slower" in md) == any(r["speedup"] < 1 for r in lat)
    assert os.path.getsize(prefix + ".png") > 1000


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="batches"):
        ShareBenchConfig(batches=(1, 0))
    with pytest.raises(ValueError, match="prompt_len"):
        ShareBenchConfig(prompt_len=0)


def test_peers_are_checked_at_the_boundary() -> None:
    from structlm.config import ConfigError

    with pytest.raises(ConfigError, match="built-in models"):
        ShareBenchConfig(model="some/folder", peers=("llamacpp-f32",))
    with pytest.raises(ConfigError, match="must include 1"):
        ShareBenchConfig(peers=("llamacpp-f32",), batches=(4,))
    with pytest.raises(ConfigError, match="llamacpp-q4"):
        ShareBenchConfig(peers=("llamacpp-q4",))
    with pytest.raises(ConfigError):
        ShareBenchConfig(peers=("llamacpp-f32", "llamacpp-f32"))
    # a compressed folder's source model is read from its manifest, at run time
    assert ShareBenchConfig(compressed="d", model="x", peers=("llamacpp-f32",)).peers
    assert ShareBenchConfig(peers=("llamacpp-f32", "llamacpp-q8_0")).peers
    args = build_parser().parse_args(["bench", "share", "--peers", "llamacpp-f32,llamacpp-q8_0"])
    assert args.flags.values(args)["peers"] == ("llamacpp-f32", "llamacpp-q8_0")


def test_absent_llama_cpp_skips_the_peers_with_a_note(monkeypatch, models) -> None:
    from structlm.bench import llamacpp, share

    monkeypatch.setattr(llamacpp, "llama_cpp_available", lambda: False)
    arms, notes = share._load_peers(ShareBenchConfig(peers=("llamacpp-f32",)), "smollm2")
    assert arms == {} and "not installed" in notes[0] and '.[peers]' in notes[0]


def test_measure_refuses_peers_without_batch_one(models) -> None:
    original, compressed, report = models
    cfg = ShareBenchConfig(batches=(3,), prompt_len=7, decode_tokens=3, trials=1)
    with pytest.raises(ValueError, match="must include 1"):  # before any timing
        measure(original, compressed, _ids(64), cfg, report, peers={"llamacpp-f32": None})


def test_peer_table_from_the_csv(models, tmp_path) -> None:
    """The Markdown's llama.cpp table reads a ``peer`` row's columns (a row built here with
    the columns ``measure`` gives it; the real arm's rows: tests/bench/test_llamacpp.py)."""
    original, compressed, report = models
    cfg = ShareBenchConfig(batches=(1,), prompt_len=7, decode_tokens=3, trials=1)
    rows = measure(original, compressed, _ids(64), cfg, report, model_id="tiny")
    decode = next(r for r in rows if r["phase"] == "decode")
    t = 2 * decode["original"]  # a peer at half the original's speed
    rows.append({**decode, "phase": "peer", "item": "llamacpp-f32", "peer": "llamacpp-f32",
                 "peer_s_per_token": t, "peer_tok_s": round(1 / t, 2),
                 "original_over_peer": round(t / decode["original"], 4),
                 "compressed_over_peer": round(t / decode["compressed"], 4),
                 "peer_bytes_per_step": 1000, "peer_gbps": 1.5, "peer_pct_of_stream": 7.0,
                 "peer_greedy_agreement": "3/3"})
    prefix = str(tmp_path / "share")
    write_outputs(rows, prefix)
    md = open(prefix + ".md").read()
    line = next(x for x in md.splitlines() if x.startswith("| llama.cpp f32 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == "0.500×"  # its speed over the original's
    # the compressed model's over it (the CSV keeps 4 decimals, the table prints 3)
    assert cells[3] == f"{round(t / decode['compressed'], 4):.3f}×"
    assert cells[4] == "1.5 (7%)" and cells[5] == "3/3"
    assert f"| original (structlm) | {decode['original_tok_s']:.1f} | 1 | " in md
    assert "| peer |" not in md  # not a latency row


def test_measure_rejects_short_streams(models) -> None:
    original, compressed, report = models
    cfg = ShareBenchConfig(batches=(4,), prompt_len=7, trials=1)
    with pytest.raises(ValueError, match="fewer than"):
        measure(original, compressed, _ids(20), cfg, report)


def test_cli_parses_bench_share() -> None:
    args = build_parser().parse_args(
        ["bench", "share", "--compressed", "d", "--batches", "1,4", "--prompt-len", "16",
         "--decode-tokens", "5", "--trials", "3", "--method", "svd-llm-w", "--types", "all"])
    given = args.flags.values(args)  # flags derived from ShareBenchConfig's fields
    assert args.model == "smollm2" and given["compressed"] == "d" and given["batches"] == (1, 4)
    assert (given["prompt_len"], given["decode_tokens"], given["trials"]) == (16, 5, 3)
    assert args.out == "bench-out/share" and args.func.__name__ == "_cmd_bench_share"
    with pytest.raises(SystemExit):  # a bad value is argparse's error naming the flag
        build_parser().parse_args(["bench", "share", "--batches", "1,x"])


def test_weights_read_count_every_use_of_a_shared_basis(models) -> None:
    original, compressed, _report = models
    emb = original.get_input_embeddings().weight
    unique_o, _ = unique_parameters(original)
    # tied head: the embedding matrix is read once (by the head), the lookup reads a row
    assert weights_read_per_token(original) == unique_o + emb.shape[1]
    # shared bases are stored once but read by every layer
    unique_c, _ = unique_parameters(compressed)
    basis = compressed.model.layers[0].self_attn.q_proj.basis
    per_use = sum(p.numel() for p in basis.parameters())
    uses = sum(1 for layer in compressed.model.layers if layer.self_attn.q_proj.basis is basis)
    assert uses == len(compressed.model.layers) > 1
    assert weights_read_per_token(compressed) >= unique_c + emb.shape[1] + (uses - 1) * per_use


def test_peak_memory_in_fresh_processes(models, tmp_path) -> None:
    original, compressed, report = models
    src = tmp_path / "tiny"
    original.save_pretrained(src)
    save_compressed(LoadedModel(compressed, None, "tiny", source=str(src)), report,
                    tmp_path / "comp")
    cfg = ShareBenchConfig(batches=(2,), prompt_len=7, decode_tokens=3, threads=1)
    rows = peak_memory_rows({"model": "tiny"}, str(src), str(tmp_path / "comp"), cfg)
    got = {r["item"]: r for r in rows}
    assert set(got) == {"resident_after_load", "peak_load_and_run", "anonymous_after_run",
                        "file_backed_after_run"}
    for side in ("original", "compressed"):
        load, peak, anon, file = (got[k][side] for k in (
            "resident_after_load", "peak_load_and_run", "anonymous_after_run",
            "file_backed_after_run"))
        assert load > 50 * 2**20  # a Python process with torch and transformers loaded
        assert peak >= load and peak >= anon + file - 2**20 and anon > 0 and file > 0
    with pytest.raises(RuntimeError, match="peak-memory child failed"):
        measure_peak_memory(str(src), str(tmp_path / "missing"), 1, 4, 1, 1)


def test_markdown_has_the_peak_memory_table(models, tmp_path) -> None:
    original, compressed, report = models
    cfg = ShareBenchConfig(batches=(1,), prompt_len=7, decode_tokens=2, trials=1, threads=1)
    rows = measure(original, compressed, _ids(64), cfg, report, model_id="tiny-llama")
    base = rows[0]
    rows += [{**base, "phase": "peak_memory", "item": item, "batch": 1, "original": 3 * 2**20,
              "compressed": 2 * 2**20, "unit": "bytes", "memory_ratio": 1.5}
             for item in ("resident_after_load", "peak_load_and_run", "anonymous_after_run",
                          "file_backed_after_run")]
    prefix = str(tmp_path / "share")
    write_outputs(rows, prefix)
    md = open(prefix + ".md").read()
    assert "| peak load and run | 1 | 3.00 MiB | 2.00 MiB | 1.500× |" in md
    assert "file-backed pages" in md
