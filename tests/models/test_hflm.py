"""lm-evaluation-harness's ``HFLM`` runs the model unchanged (no downloads)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from structlm.data import gpt2_tokenizer
from structlm.models import StructLMForCausalLM, config_from_preset


def test_hflm_loglikelihood_and_generation(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("STRUCTLM_CACHE", str(tmp_path))
    gpt2_tokenizer.cache_clear()
    torch.manual_seed(0)
    cfg = config_from_preset("tiny", "Q2^2", vocab_size=50257, type_schedule="block:3")
    model = StructLMForCausalLM(cfg).eval()
    tok = gpt2_tokenizer()
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=2, max_length=128, device="cpu")
    pairs = [("The cat sat on the", " mat"), ("Hello", " world, again")]
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i)
            for i, p in enumerate(pairs)]
    got = lm.loglikelihood(reqs)
    for (ctx, cont), (ll, _greedy) in zip(pairs, got, strict=True):
        c, x = tok(ctx)["input_ids"], tok(cont)["input_ids"]
        ids = torch.tensor([c + x])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)
        want = sum(logp[len(c) - 1 + i, t].item() for i, t in enumerate(x))
        assert ll == pytest.approx(want, abs=1e-3)
    gen = Instance(request_type="generate_until", doc={},
                   arguments=("Once upon a time", {"until": ["\n"], "max_gen_toks": 5,
                                                   "do_sample": False}), idx=0)
    out = lm.generate_until([gen])
    assert len(out) == 1 and isinstance(out[0], str)
    gpt2_tokenizer.cache_clear()
