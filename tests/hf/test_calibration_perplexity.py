"""Covariance accumulation and the perplexity protocol on a small random GPT-2."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from structlm.hf.adapters import MatrixType, get_adapter
from structlm.hf.calibration import (
    Calibration,
    CovarianceAccumulator,
    NonFiniteActivationError,
    SavedTensors,
    calibrate,
    load_or_calibrate,
)
from structlm.hf.perplexity import NonFiniteLogitsError, perplexity


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64,
                                      vocab_size=101)).eval()


def _tokens(n: int) -> torch.Tensor:
    return torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(2))


def test_accumulator_matches_direct_computation() -> None:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 7, 5, generator=g) * 4 + 1 for _ in range(4)]
    acc = CovarianceAccumulator(5)
    for x in xs:
        acc.update(x)
    X = torch.cat([x.reshape(-1, 5) for x in xs]).double()
    torch.testing.assert_close(acc.second_moment(), X.T @ X / X.shape[0])
    torch.testing.assert_close(acc.mean(), X.mean(0))
    assert acc.n == 84 and acc.second_moment().dtype == torch.float64
    with pytest.raises(NonFiniteActivationError):
        acc.update(torch.tensor([[float("nan")] * 5]))


def test_calibration_hooks_capture_each_site(tmp_path) -> None:
    model = _model()
    ad = get_adapter(model)
    ids = _tokens(3 * 16)
    cal = calibrate(ad, ids, seq_len=16, batch_size=2, progress=False, meta={"model": "t"})
    # direct: capture the MLP-out input (GELU output) of layer 1 and compare
    seen = []
    h = ad.layers[1].site_module("mlp_out").register_forward_pre_hook(
        lambda _m, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        model(ids.view(3, 16))
    h.remove()
    X = seen[0].double()
    torch.testing.assert_close(cal.C(1, MatrixType.MLP_OUT), X.T @ X / X.shape[0])
    assert cal.C(0, MatrixType.Q) is cal.C(0, MatrixType.V)  # one site for Q, K, V
    path = tmp_path / "cal.safetensors"
    cal.save(path)
    back = Calibration.load(path)
    assert back.meta["model"] == "t" and back.meta["tokens_used"] == 48
    torch.testing.assert_close(back.C(1, MatrixType.MLP_OUT), cal.C(1, MatrixType.MLP_OUT))
    again = load_or_calibrate(path, ad, ids, {"model": "t"}, seq_len=16, progress=False)
    assert again.meta == back.meta  # reused, not recomputed
    with pytest.raises(KeyError, match="no calibration for layer 5"):
        cal.C(5, MatrixType.O)
    with pytest.raises(KeyError, match="no calibration for layer 5"):
        back.C(5, MatrixType.O)
    # the loaded moments are read from the file on access, every key and value intact
    assert isinstance(back.second_moments, SavedTensors)
    assert sorted(back.second_moments) == sorted(cal.second_moments)
    assert len(back.means) == len(cal.means) and (1, "mlp_out") in back.means
    for key in cal.second_moments:
        assert torch.equal(back.second_moments[key], cal.second_moments[key])
        assert torch.equal(back.means[key], cal.means[key])
    fresh = load_or_calibrate(tmp_path / "new.safetensors", ad, ids, {"model": "t"},
                              seq_len=16, progress=False)  # computed, saved, read back
    assert isinstance(fresh.second_moments, SavedTensors)
    torch.testing.assert_close(fresh.C(1, MatrixType.MLP_OUT), cal.C(1, MatrixType.MLP_OUT))


def test_perplexity_matches_a_direct_computation() -> None:
    model = _model()
    ids = _tokens(50)
    res = perplexity(model, ids, window=20, batch_size=3, progress=False)
    assert res.tokens == 49  # every token after the first, exactly once
    total = 0.0
    a = 1
    while a < 50:  # windows ending at b, scoring [a, b), input ids[b-20:b]
        b = min(a + 19, 50)
        s = max(0, b - 20)
        with torch.no_grad():
            logp = F.log_softmax(model(ids[s:b][None]).logits[0].double(), -1)
        total -= sum(float(logp[p - s - 1, ids[p]]) for p in range(a, b))
        a = b
    assert res.ppl == pytest.approx(math.exp(total / 49), rel=1e-6)
    strided = perplexity(model, ids, window=20, stride=5, progress=False)
    assert strided.tokens == 49 and strided.windows == 10
    with_bos = perplexity(model, ids, window=20, bos_id=100, progress=False)
    assert with_bos.tokens == 50 and with_bos.bos


def test_non_finite_logits_raise() -> None:
    model = _model()
    with torch.no_grad():
        model.transformer.wte.weight[5] = float("nan")
    ids = _tokens(30)
    ids[10] = 5
    with pytest.raises(NonFiniteLogitsError, match="non-finite logits"):
        perplexity(model, ids, window=16, progress=False)


@pytest.mark.parametrize("shape", [(1, 2), (1, 7), (3, 97), (2, 64)])
@pytest.mark.parametrize("chunk", [1, 89 * 3, 89 * 1025, 1 << 25])
def test_the_chunked_head_gives_the_whole_models_log_probabilities(shape, chunk) -> None:
    """LLaMA-family head in chunks of rows (1 logit → one row; 3 rows; more rows than
    there are) equals ``log_softmax`` of the whole model's logits; GPT-2 (no plain-head
    route) is called whole and gives the same numbers as by hand too."""
    from structlm.hf.perplexity import next_token_logprobs, plain_head
    from tiny_models import tiny_gpt2, tiny_llama

    for model, vocab in ((tiny_llama(seed=4, max_position_embeddings=128), 89),
                         (tiny_gpt2(seed=4, n_positions=128), 97)):
        ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits.double()
        want = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        got = next_token_logprobs(model, ids, chunk_elements=chunk)
        assert got.shape == (shape[0], shape[1] - 1) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        assert (plain_head(model) is None) == (vocab == 97)


def test_the_chunked_head_raises_on_non_finite_logits() -> None:
    from structlm.hf.perplexity import next_token_logprobs
    from tiny_models import tiny_llama

    model = tiny_llama(seed=5)
    with torch.no_grad():
        model.model.embed_tokens.weight[5] = float("nan")
    ids = torch.tensor([[1, 2, 5, 3, 4]])
    with pytest.raises(NonFiniteLogitsError, match="non-finite logits in window 9"):
        next_token_logprobs(model, ids, "window 9", chunk_elements=89)
    with pytest.raises(NonFiniteLogitsError, match="non-finite logits"):
        perplexity(model, ids, progress=False)
