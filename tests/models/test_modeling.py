"""The decoder LM: parameter counts, KV cache, chunked prefill, left padding, HF contract."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lm_checks import assert_left_padding_matches_alone  # noqa: E402
from structlm.models import StructLMForCausalLM, config_from_preset, decode_step  # noqa: E402


def _model(algebra: str = "Q2^2", schedule: str = "block:3", seed: int = 0
           ) -> StructLMForCausalLM:
    torch.manual_seed(seed)
    model = StructLMForCausalLM(config_from_preset("tiny", algebra, type_schedule=schedule))
    return model.eval()


@pytest.mark.parametrize("algebra", ["dense", "Q2^2"])
def test_paper_110m_parameter_count(algebra: str) -> None:
    model = StructLMForCausalLM(config_from_preset("paper-110m", algebra))
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 110_631_168
    assert model.lm_head.weight is model.transformer.wte.weight  # tied


@pytest.mark.parametrize(("algebra", "schedule"), [("Q2^2", "block:3"), ("Q4", "cyclic"),
                                                   ("dense", "block")])
def test_cached_generation_matches_full_forward(algebra: str, schedule: str) -> None:
    model = _model(algebra, schedule)
    prompt = torch.randint(0, 512, (2, 7))
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=9,
                         do_sample=False, return_dict_in_generate=True, output_logits=True,
                         pad_token_id=0)
    seq = out.sequences
    with torch.no_grad():
        full = model(seq).logits
    steps = torch.stack(out.logits, 1)  # (B, new, V)
    torch.testing.assert_close(steps, full[:, prompt.shape[1] - 1:-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("algebra", ["dense", "Q2^2"])
@pytest.mark.parametrize("fused", [True, False])
def test_cpu_decode_runs_on_the_rows_kernel(algebra: str, fused: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached decode step runs all blocks as one compiled call (dense and algebra
    alike) with our cache, or, with a plain ``DynamicCache``, every FFN as one compiled
    call and every other projection on the same kernel; both match the full forward."""
    from transformers import DynamicCache

    from structlm.models.kv_cache import GrowingKVCache
    from structlm.ops import cpu_kernels

    if not cpu_kernels.fused_rows_available():
        pytest.skip("no C++ compiler: the rows kernel cannot be built")
    calls = {"stack": 0, "swiglu": 0, "dense": 0}
    originals = {"stack": decode_step.decode_stack, "swiglu": cpu_kernels.swiglu_rows,
                 "dense": cpu_kernels.dense_rows_linear}

    def count(name: str):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return wrapped

    monkeypatch.setattr(decode_step, "decode_stack", count("stack"))
    monkeypatch.setattr(cpu_kernels, "swiglu_rows", count("swiglu"))
    monkeypatch.setattr(cpu_kernels, "dense_rows_linear", count("dense"))
    model = _model(algebra, "cyclic")
    from structlm.ops.route import DENSE_KERNEL_MAX_ROWS

    n = DENSE_KERNEL_MAX_ROWS + 1  # a prefill longer than the few-row kernels take
    ids = torch.randint(0, 512, (1, n + 1))
    with torch.no_grad():
        cache = GrowingKVCache() if fused else DynamicCache()
        out = model(ids[:, :n], cache=cache, use_cache=True)
        assert calls == {"stack": 0, "swiglu": 0, "dense": 0}  # prefill: the PyTorch path
        step = model(ids[:, n:], cache=out.cache, use_cache=True).logits[:, -1]
        full = model(ids).logits[:, -1]
    layers = model.config.num_hidden_layers
    if fused:
        assert calls == {"stack": 1, "swiglu": 0, "dense": 1}  # the blocks; the LM head
    else:
        assert calls == {"stack": 0, "swiglu": layers, "dense": 2 * layers + 1}
    torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_equals_one_shot() -> None:
    model = _model()
    ids = torch.randint(0, 512, (3, 23))
    with torch.no_grad():
        one = model(ids).logits
        cache, parts = None, []
        for a in range(0, 23, 5):
            out = model(ids[:, a:a + 5], cache=cache, use_cache=True)
            cache = out.cache
            parts.append(out.logits)
    torch.testing.assert_close(torch.cat(parts, 1), one, rtol=1e-5, atol=1e-5)


def test_left_padding_keeps_absolute_positions() -> None:
    assert_left_padding_matches_alone(_model())


def test_save_and_load_round_trip(tmp_path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    model = _model("Q4", "cyclic")
    model.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "structlm"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is StructLMForCausalLM and loaded.config.algebra == "Q4"
    ids = torch.randint(0, 512, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_loss_and_backward() -> None:
    model = _model().train()
    ids = torch.randint(0, 512, (2, 16))
    out = model(ids, labels=ids)
    assert out.loss is not None and torch.isfinite(out.loss)
    out.loss.backward()
    ffn = model.transformer.h[0].mlp.gate
    assert ffn.weight.grad is not None and ffn.weight.grad.abs().sum() > 0


def test_context_overflow_error() -> None:
    model = _model()
    with pytest.raises(ValueError, match="beyond the context n_positions=128"):
        model(torch.zeros(1, 129, dtype=torch.long))
