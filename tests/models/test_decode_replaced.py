"""Cached decoding of a StructLM model whose matrices were replaced through the share
adapters (``structlm.hf.adapters``): a ``ConcatProjection`` qkv, a factorised output
projection, a ``GatedMLP``.

The fused decode step (``models.decode_step``) re-implements the original modules only,
so it must step aside for the whole model (its gate, ``_block_ready``) and every cached
step run the modules' forward; an unreplaced model keeps the fused step. Reference: the
same model without a cache (``generate(use_cache=False)``, the full-sequence forward).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from route_helpers import on_stack
from structlm.hf.adapters import (
    ConcatProjection,
    GatedMLP,
    MatrixType,
    get_adapter,
)
from structlm.models import StructLMConfig, StructLMForCausalLM, decode_step
from structlm.models.kv_cache import GrowingKVCache
from structlm.nn.factorized import (
    LowRankLinear,
    OneSidedLinear,
    SharedBasis,
    SharedBasisLinear,
)
from structlm.ops import cpu_kernels
from structlm.ops.route import Route

D, F, N_HEAD, VOCAB = 32, 64, 4, 97
ATTN = [MatrixType.Q, MatrixType.K, MatrixType.V, MatrixType.O]
ALL = [*ATTN, MatrixType.MLP_IN, MatrixType.MLP_OUT]


def _model(algebra: str, seed: int = 0) -> StructLMForCausalLM:
    """2 blocks, D = 32 (4 heads), FFN 64; layer norms and biases away from 1 / 0."""
    torch.manual_seed(seed)
    cfg = StructLMConfig(vocab_size=VOCAB, n_positions=64, hidden_size=D, num_hidden_layers=2,
                         num_attention_heads=N_HEAD, intermediate_size=F, algebra=algebra,
                         type_schedule="cyclic", initializer_range=0.1, bos_token_id=0,
                         eos_token_id=None)
    model = StructLMForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if ".ln_" in name
                                                     and name.endswith("weight") else 0.0))
    return model


def _randn(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Random factor with ``std = scale / sqrt(shape[-1])`` (outputs keep their size)."""
    return torch.randn(*shape, generator=gen) * (scale / shape[-1] ** 0.5)


# one maker per replacement module: (out, in, bias or None, shared basis cache, gen) -> module
def _low_rank(out: int, inp: int, bias: torch.Tensor | None, shared: dict,
              gen: torch.Generator) -> nn.Module:
    r = min(out, inp) // 2
    return LowRankLinear(_randn(out, r, gen=gen), _randn(r, inp, gen=gen), bias)


def _basis(out: int, inp: int, k_in: int, k_out: int | None, shared: dict,
           gen: torch.Generator) -> SharedBasis:
    """One basis per shape, shared by every layer (as the compression stores it): input
    map ``P (k_in, in)`` and output basis ``U (out, k_out)`` (none for ``k_out=None``)."""
    key = (out, inp, k_in, k_out)
    if key not in shared:
        shared[key] = SharedBasis(_randn(k_in, inp, gen=gen),
                                  None if k_out is None else _randn(out, k_out, gen=gen))
    return shared[key]


def _shared(out: int, inp: int, bias: torch.Tensor | None, shared: dict,
            gen: torch.Generator) -> nn.Module:
    k_in, k_out = min(out, inp) - 4, min(out, inp) - 8  # a rectangular core
    return SharedBasisLinear(_basis(out, inp, k_in, k_out, shared, gen),
                             _randn(k_out, k_in, gen=gen), bias)


def _shared_residual(out: int, inp: int, bias: torch.Tensor | None, shared: dict,
                     gen: torch.Generator) -> nn.Module:
    k, r = min(out, inp) // 2, 4
    return SharedBasisLinear(_basis(out, inp, k, k, shared, gen), _randn(k, k, gen=gen), bias,
                             residual=(_randn(out, r, gen=gen, scale=0.5),
                                       _randn(r, inp, gen=gen)))


def _one_sided(out: int, inp: int, bias: torch.Tensor | None, shared: dict,
               gen: torch.Generator) -> nn.Module:
    k = min(out, inp) - 4
    return OneSidedLinear(_basis(out, inp, k, None, shared, gen), _randn(out, k, gen=gen), bias)


def _linear(out: int, inp: int, bias: torch.Tensor | None, shared: dict,
            gen: torch.Generator) -> nn.Module:
    lin = nn.Linear(inp, out, bias=bias is not None)
    with torch.no_grad():
        lin.weight.copy_(_randn(out, inp, gen=gen))
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


KINDS: dict[str, Callable[..., nn.Module]] = {
    "low_rank": _low_rank, "shared_basis": _shared, "shared_basis_residual": _shared_residual,
    "one_sided": _one_sided, "linear": _linear}


def _replace(model: StructLMForCausalLM, kind: str, t: MatrixType,
             layers: list[int] | None = None, seed: int = 1) -> None:
    """Replace matrix ``t`` of ``layers`` (all by default) by random ``kind`` modules; the
    original bias is kept (Q, K, V, O have one), plus noise so it is not zero."""
    gen = torch.Generator().manual_seed(seed)
    ad = get_adapter(model)
    shared: dict = {}
    for i in range(ad.num_layers) if layers is None else layers:
        layer = ad.layers[i]
        w, b = layer.weight(t), layer.bias(t)
        if b is not None:
            b = b + 0.1 * torch.randn(b.shape, generator=gen)
        layer.replace(t, KINDS[kind](w.shape[0], w.shape[1], b, shared, gen))


class _CountKernel:
    """Counts calls of the fused decode step's kernel."""

    def __init__(self) -> None:
        self.n = 0
        self._orig = decode_step.decode_stack

    def __enter__(self) -> _CountKernel:
        def counted(*args: object, **kwargs: object) -> object:
            self.n += 1
            return self._orig(*args, **kwargs)

        decode_step.decode_stack = counted
        return self

    def __exit__(self, *exc: object) -> None:
        decode_step.decode_stack = self._orig


def _fused_applies(model: StructLMForCausalLM) -> bool:
    """Whether the route takes the decode stack for a one-token step after a 5-token
    prefill."""
    cache = GrowingKVCache()
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0)),
              cache=cache, use_cache=True)
        return on_stack(model.transformer, torch.randn(2, 1, D),
                                                None, cache)


def _check_decoding(model: StructLMForCausalLM, expect_fused: bool) -> None:
    """(a) greedy ``generate`` runs; (b) its cached tokens equal the uncached ones, and a
    cached step-by-step decode (``GrowingKVCache``, as ``generate`` uses) gives the
    full-sequence forward's logits at every position."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (2, 6), generator=gen)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with _CountKernel() as calls:
        cached = model.generate(ids, use_cache=True, **kw)
    uncached = model.generate(ids, use_cache=False, **kw)
    assert cached.shape == (2, 6 + 8)
    assert torch.equal(cached[:, :6], ids)
    assert torch.equal(cached, uncached)
    assert (calls.n > 0) == expect_fused, calls.n

    seq = torch.randint(0, VOCAB, (2, 14), generator=gen)
    prefill = 5
    with torch.no_grad(), _CountKernel() as calls:
        full = model(seq).logits  # (B, T, V), no cache
        out = model(seq[:, :prefill], cache=GrowingKVCache(), use_cache=True)
        steps = [out.logits]
        for t in range(prefill, seq.shape[1]):
            out = model(seq[:, t:t + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    assert calls.n == (seq.shape[1] - prefill if expect_fused else 0)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def _kernels() -> bool:
    return cpu_kernels.fused_rows_available()


@pytest.mark.parametrize("t", ALL, ids=[t.value for t in ALL])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_dense_model_with_a_replaced_matrix_decodes(kind: str, t: MatrixType) -> None:
    """Dense FFN, matrix ``t`` of every block replaced: Q/K/V make ``attn.qkv`` a
    ``ConcatProjection``, MLP-in/out swap the MLP for a ``GatedMLP``; only a plain
    ``nn.Linear`` output projection (with bias) is still what the fused step computes."""
    model = _model("dense")
    _replace(model, kind, t)
    block = model.transformer.h[0]
    if t in (MatrixType.Q, MatrixType.K, MatrixType.V):
        assert isinstance(block.attn.qkv, ConcatProjection)
    if t in (MatrixType.MLP_IN, MatrixType.MLP_OUT):
        assert isinstance(block.mlp, GatedMLP)
    fused = _kernels() and kind == "linear" and t is MatrixType.O
    assert _fused_applies(model) == fused
    _check_decoding(model, expect_fused=fused)


@pytest.mark.parametrize("t", ATTN, ids=[t.value for t in ATTN])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_algebra_model_with_a_replaced_attention_matrix_decodes(kind: str,
                                                                t: MatrixType) -> None:
    """Algebra FFN (``Q2^2``; it refuses replacement), attention matrix ``t`` replaced."""
    model = _model("Q2^2")
    _replace(model, kind, t)
    fused = _kernels() and kind == "linear" and t is MatrixType.O
    assert _fused_applies(model) == fused
    _check_decoding(model, expect_fused=fused)


@pytest.mark.parametrize("algebra", ["dense", "Q2^2"])
def test_unreplaced_model_keeps_the_fused_step(algebra: str) -> None:
    """The gate does not disable the fast path: an unreplaced model decodes fused (and
    right); so does a plain ``nn.Linear`` output projection (the parametrised tests)."""
    if not _kernels():
        pytest.skip("no C++ compiler: the CPU kernels cannot be built")
    model = _model(algebra)
    assert _fused_applies(model)
    _check_decoding(model, expect_fused=True)


@pytest.mark.parametrize("t", [MatrixType.K, MatrixType.O, MatrixType.MLP_IN],
                         ids=["k", "o", "mlp_in"])
def test_replacing_after_a_fused_decode_rebuilds_the_plan(t: MatrixType) -> None:
    """A cached decode plan (built fused) goes stale when one block's matrix is replaced:
    the next decode falls back for the whole model instead of reading the old modules'
    weights or failing on the new ones."""
    model = _model("dense")
    fused = _kernels()
    _check_decoding(model, expect_fused=fused)
    _replace(model, "low_rank", t, layers=[1])  # one block only
    assert not _fused_applies(model)
    _check_decoding(model, expect_fused=False)


def test_replaced_model_with_padding_decodes() -> None:
    """A left-padded batch (the modules' cached path with a mask) with a factorised qkv and
    gated MLP: cached and uncached greedy tokens agree."""
    model = _model("dense")
    _replace(model, "shared_basis_residual", MatrixType.V)
    _replace(model, "low_rank", MatrixType.MLP_OUT, seed=2)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, use_cache=True, **kw),
                       model.generate(ids, use_cache=False, **kw))


def test_mlp_kernel_kind_follows_the_projections() -> None:
    """``StructLMMLP.kernel_kind`` (the structure fact of the FFN and decode-stack routes):
    the original projections only; a replaced or biased projection means the modules."""
    dense, algebra = _model("dense").transformer.h[0].mlp, _model("Q2^2").transformer.h[0].mlp
    assert dense.kernel_kind() == "dense" and algebra.kernel_kind() == "algebra"
    x = torch.randn(1, 1, D)
    with torch.no_grad():  # a decode-sized call on the kernel (its kind remembered)
        assert (dense._route(x, None) is Route.SWIGLU_KERNEL) == _kernels()
    algebra.down = nn.Linear(F, D, bias=False)  # mixed kinds
    assert algebra.kernel_kind() is None
    dense.up = nn.Linear(D, F, bias=True)  # the kernel has no FFN bias
    assert dense.kernel_kind() is None
    dense.up = nn.Linear(D, F, bias=False)
    assert dense.kernel_kind() == "dense"
    dense.up = _low_rank(F, D, None, {}, torch.Generator().manual_seed(0))
    assert dense.kernel_kind() is None
    with torch.no_grad():  # after the replacement: the modules' forward, not the kernel
        assert dense._route(x, None) is not Route.SWIGLU_KERNEL
        want = dense.down(torch.nn.functional.silu(dense.gate(x)) * dense.up(x))
        torch.testing.assert_close(dense(x, None), want)


def test_no_torch_wide_hooks() -> None:
    """structlm installs no torch-wide module hooks, not even after a model has decoded
    on the fused step (invalidation is explicit: ``structlm.nn.structure``)."""
    import subprocess
    import sys

    code = ("import torch, torch.nn.modules.module as m, structlm, structlm.models as sm; "
            "c = sm.StructLMConfig(vocab_size=50, n_positions=32, hidden_size=16, "
            "num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, "
            "algebra='Q2^2'); model = sm.StructLMForCausalLM(c).eval(); "
            "model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False); "
            "print(len(m._global_module_registration_hooks), "
            "len(m._global_parameter_registration_hooks))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert out.stdout.split()[-2:] == ["0", "0"], out.stdout + out.stderr
