"""Calibrated conversion (``AlgebraConfig(init="calibrated")``): the closed-form fit
recovers a map the algebra can represent exactly, never has a larger calibration error
than the copy, agrees with the reference product, and, end to end on a small random
model, brings every converted layer and the logits closer to the dense model; the record
survives save and load, and bad calibration input is refused."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from structlm import AlgebraConfig, conversion_info, convert_  # noqa: E402
from structlm.algebra import get_algebra, support_of  # noqa: E402
from structlm.convert.calibrate import block_error, fit_blocks  # noqa: E402
from structlm.ops.reference import reference_linear  # noqa: E402
from tiny_models import tiny_gpt2, tiny_llama  # noqa: E402

CASES = [("Q2^2", [3, 5, 2, 6], [4, 7, 1, 5]), ("Q4", [4, 4, 4, 4], [2, 9, 3, 3]),
         ("Q2", [7, 9], [5, 11])]


def _data(algebra: str, in_w: list[int], n: int = 400, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = support_of(get_algebra(algebra)).mask
    q, k = mask.shape[0], sum(in_w)
    x = torch.randn(n, k, generator=g, dtype=torch.float64)
    types = torch.arange(n) % q
    return mask, x, types


def _moments(x: torch.Tensor, types: torch.Tensor, q: int, y: torch.Tensor | None = None):
    c = torch.stack([x[types == a].T @ x[types == a] for a in range(q)])
    p = None if y is None else torch.stack([y[types == a].T @ x[types == a] for a in range(q)])
    return c, p


@pytest.mark.parametrize(("algebra", "in_w", "out_w"), CASES)
def test_a_map_the_algebra_represents_exactly_is_recovered(algebra, in_w, out_w) -> None:
    mask, x, types = _data(algebra, in_w)
    g = torch.Generator().manual_seed(1)
    truth = torch.randn(sum(out_w), sum(in_w), generator=g, dtype=torch.float64)
    y = reference_linear(x, truth, types, mask, in_w, out_w)  # every type's own product
    c, p = _moments(x, types, mask.shape[0], y)
    anchor = torch.randn_like(truth)
    fitted = fit_blocks(anchor, c, mask, in_w, out_w, ridge=1e-12, cross=p)
    torch.testing.assert_close(fitted, truth, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize(("algebra", "in_w", "out_w"), CASES)
@pytest.mark.parametrize("ridge", [1e-8, 1e-4, 1.0, 100.0])
def test_the_fit_never_has_a_larger_error_than_the_copy(algebra, in_w, out_w, ridge) -> None:
    mask, x, types = _data(algebra, in_w, n=97, seed=2)  # fewer rows than K*q: rank-poor
    dense = torch.randn(sum(out_w), sum(in_w), generator=torch.Generator().manual_seed(3),
                        dtype=torch.float64)
    c, _ = _moments(x, types, mask.shape[0])
    copy = sum(block_error(dense, dense, c, mask, in_w, out_w))
    fitted = fit_blocks(dense, c, mask, in_w, out_w, ridge=ridge)
    fit = sum(block_error(fitted, dense, c, mask, in_w, out_w))
    assert fit <= copy * (1 + 1e-12) and copy > 0
    if ridge <= 1e-4:
        assert fit < 0.99 * copy  # strictly better: the copy is not the optimum


@pytest.mark.parametrize(("algebra", "in_w", "out_w"), CASES)
def test_block_error_is_the_reference_products_squared_error(algebra, in_w, out_w) -> None:
    mask, x, types = _data(algebra, in_w, n=61, seed=4)
    g = torch.Generator().manual_seed(5)
    dense = torch.randn(sum(out_w), sum(in_w), generator=g, dtype=torch.float64)
    w = torch.randn_like(dense)
    c, _ = _moments(x, types, mask.shape[0])
    err = (reference_linear(x, w, types, mask, in_w, out_w) - x @ dense.T) ** 2
    want = [float(err[types == a].sum()) for a in range(mask.shape[0])]
    got = block_error(w, dense, c, mask, in_w, out_w)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-9, atol=1e-9)


def _logit_error(model, dense, ids) -> float:
    with torch.no_grad():
        return float(((model(ids).logits - dense(ids).logits) ** 2).mean())


@pytest.mark.parametrize(("make", "targets"), [(tiny_llama, "mlp"), (tiny_llama, "all"),
                                               (tiny_gpt2, "all")])
def test_calibrated_conversion_beats_the_copy_layer_by_layer_and_in_the_logits(
        make, targets, tmp_path) -> None:
    import copy

    from transformers import AutoModelForCausalLM

    dense = make(vocab_size=97, max_position_embeddings=64) if make is tiny_llama else make()
    ids = torch.randint(1, 97, (32, 32), generator=torch.Generator().manual_seed(0))
    held_out = torch.randint(1, 97, (16, 32), generator=torch.Generator().manual_seed(1))
    copied = convert_(copy.deepcopy(dense), AlgebraConfig("Q2^2", "cyclic", targets))
    cfg = AlgebraConfig("Q2^2", "cyclic", targets, init="calibrated")
    calibrated = convert_(copy.deepcopy(dense), cfg, calibration=ids, progress=False)
    info = conversion_info(calibrated)
    assert info["init"] == "calibrated" and info["calibration"]["tokens"] == 32 * 32
    mods = info["calibration"]["modules"]
    assert list(mods) == info["modules"]  # every converted module, in forward order
    for name, m in mods.items():
        assert m["calibrated"] <= m["copy"] * (1 + 1e-9), name
        assert all(n == 32 * 32 // 4 for n in m["tokens_per_type"])
    assert sum(m["calibrated"] for m in mods.values()) < 0.97 * sum(
        m["copy"] for m in mods.values())  # random weights and ids: a modest gain
    assert sum(p.numel() for p in calibrated.parameters()) == sum(
        p.numel() for p in dense.parameters())
    for text in (ids, held_out):  # 256 tokens per type: enough here
        assert _logit_error(calibrated, dense, text) < _logit_error(copied, dense, text)
    calibrated.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    rec = conversion_info(loaded)
    assert rec["init"] == "calibrated" and "calibration" not in rec  # summary: this process
    assert loaded.config.structlm_conversion["calibration"]["tokens"] == 32 * 32
    with torch.no_grad():
        torch.testing.assert_close(loaded(held_out).logits, calibrated(held_out).logits)


def _block_diagonal_mlp_then_shuffled(model, q: int, seed: int):
    """Zero every FFN weight block off the diagonal (the blocks every position type of
    ``Q2^2`` / ``Q4`` keeps), then shuffle the hidden units (gate/up rows, down columns:
    the dense function is unchanged). The result is exactly representable by the algebra
    after the right permutation, and only after it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            mlp = layer.mlp
            d, f = mlp.gate_proj.in_features, mlp.gate_proj.out_features
            keep_in = torch.arange(f)[:, None] // (f // q) == torch.arange(d)[None] // (d // q)
            for lin in (mlp.gate_proj, mlp.up_proj):  # x8: the FFN weighs in the logits
                lin.weight.mul_(8 * keep_in)
            mlp.down_proj.weight.mul_(8 * keep_in.T)
            perm = torch.randperm(f, generator=g)
            for lin in (mlp.gate_proj, mlp.up_proj):
                lin.weight.copy_(lin.weight[perm])
            mlp.down_proj.weight.copy_(mlp.down_proj.weight[:, perm])
    return model


@pytest.mark.parametrize("algebra", ["Q2^2", "Q4"])
def test_convert_recovers_a_model_the_algebra_represents_after_a_permutation(algebra) -> None:
    """Known answer through the real path (``convert_``: sequential capture, the FFN
    permutation, the ridge chosen on held-out windows, the closed-form fit): an FFN that
    is block-diagonal up to a shuffle of its hidden units is converted exactly — the
    converted model's logits are the dense model's — where the copy is not."""
    import copy

    from structlm.algebra import get_algebra, support_of

    mask = support_of(get_algebra(algebra)).mask
    q = mask.shape[0]
    assert all(mask[a, b, b] for a in range(q) for b in range(q))  # the diagonal is kept
    dense = _block_diagonal_mlp_then_shuffled(tiny_llama(seed=3), q, seed=4)
    ids = torch.randint(1, 89, (16, 32), generator=torch.Generator().manual_seed(5))
    held_out = torch.randint(1, 89, (4, 32), generator=torch.Generator().manual_seed(6))
    cfg = AlgebraConfig(algebra, "cyclic", "mlp", init="calibrated", permute=True)
    fitted = convert_(copy.deepcopy(dense), cfg, calibration=ids, progress=False)
    copied = convert_(copy.deepcopy(dense), AlgebraConfig(algebra, "cyclic", "mlp"))
    with torch.no_grad():
        want = dense(held_out).logits
        torch.testing.assert_close(fitted(held_out).logits, want, rtol=1e-4, atol=1e-4)
        fit_err = float((fitted(held_out).logits - want).abs().max())
        copy_err = float((copied(held_out).logits - want).abs().max())
    assert copy_err > 0.05 and fit_err < 1e-3 * copy_err, (fit_err, copy_err)
    assert conversion_info(fitted)["parameters"]["values"].startswith("refitted")
    assert conversion_info(copied)["parameters"] == {
        "count": "unchanged (the same tensor shapes under the same names)",
        "values": "copied bit for bit"}


def test_calibration_batches_from_a_data_loader_and_a_tokenizer_encoding() -> None:
    """Any iterable of batches: a DataLoader of dicts, a tokenizer's ``BatchEncoding``
    (a ``UserDict``, not a ``dict``) — the same fit as the tensor they hold."""
    import copy

    from torch.utils.data import DataLoader
    from transformers import BatchEncoding

    dense = tiny_llama(seed=1)
    ids = torch.randint(1, 89, (16, 32), generator=torch.Generator().manual_seed(2))
    cfg = AlgebraConfig("Q2^2", "cyclic", "mlp", init="calibrated", ridge=1e-3)
    want = convert_(copy.deepcopy(dense), cfg, calibration=ids, progress=False)
    loader = DataLoader([{"input_ids": row} for row in ids], batch_size=8)
    encodings = [BatchEncoding({"input_ids": ids[:8]}), BatchEncoding({"input_ids": ids[8:]})]
    for calibration in (loader, encodings):
        got = convert_(copy.deepcopy(dense), cfg, calibration=calibration, progress=False)
        for (name, p), (_, r) in zip(got.named_parameters(), want.named_parameters(),
                                     strict=True):
            torch.testing.assert_close(p, r, msg=name)


def test_bad_calibration_input_is_refused() -> None:
    from structlm.config import ConfigError

    model = tiny_llama()
    ids = torch.randint(1, 89, (2, 16))
    cal = AlgebraConfig("Q2^2", "cyclic", "mlp", init="calibrated")
    with pytest.raises(ValueError, match="needs calibration token ids"):
        convert_(tiny_llama(), cal)
    with pytest.raises(ValueError, match="only used with init='calibrated'"):
        convert_(tiny_llama(), AlgebraConfig("Q2^2"), calibration=ids)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 89\)"):
        convert_(tiny_llama(), cal, calibration=ids + 100, progress=False)
    with pytest.raises(ValueError, match="expected integer token ids"):
        convert_(tiny_llama(), cal, calibration=ids.float(), progress=False)
    with pytest.raises(ValueError, match=r"position types \[2, 3\] never occur"):
        convert_(model, AlgebraConfig("Q2^2", "block:12", "mlp", init="calibrated"),
                 calibration=ids, progress=False)  # 16 tokens: blocks of 12 give types 0, 1
    for bad in ({"init": "zeros"}, {"ridge": 0.0}, {"ridge": float("nan")}):
        with pytest.raises(ConfigError):
            AlgebraConfig("Q2^2", **bad)


@pytest.mark.parametrize("family", ["llama", "gpt2", "structlm", "gemma3_text"])
def test_blocks_run_one_by_one_reproduce_the_models_forward(family: str) -> None:
    """The calibration runs each block on its own with the arguments the model gave it
    (masks, rotary tables: per layer, so sliding-window layers get theirs); chained, they
    must give the model's own last hidden state."""
    from structlm.convert.calibrate import _capture, _run_block
    from structlm.hf.adapters import get_adapter
    from tiny_models import tiny_family, tiny_structlm

    make = {"llama": tiny_llama, "gpt2": tiny_gpt2, "structlm": tiny_structlm,
            "gemma3_text": lambda: tiny_family("gemma3_text")}[family]
    model = convert_(make(), AlgebraConfig("Q2^2", "cyclic", "mlp"))
    blocks = [layer.block for layer in get_adapter(model).layers]
    source = model._structlm_conversion.source
    ids = torch.randint(1, 89, (3, 24), generator=torch.Generator().manual_seed(0))
    seen = []
    handle = blocks[-1].register_forward_pre_hook(  # the last block's input, as the model
        lambda _m, args, kwargs: seen.append(args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True)
    with torch.no_grad():
        model(ids)
        handle.remove()
        want = seen[0]
        (batch,) = _capture(model, blocks, [ids], source, 0)
        for i in range(len(blocks) - 1):
            out = _run_block(blocks[i], batch, i, source)
            batch.hidden = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(batch.hidden, want)
