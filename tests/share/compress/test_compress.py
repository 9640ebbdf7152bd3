"""Compression methods on small random models with real calibration hooks: exactness at
full rank, ranks bounded only by each method's own algebra (GQA shapes), honest
accounting, Basis Sharing's grouping, rank rule and update step, save/load round trip
(also of a folder that names a former method). ``svd-llm``'s update: test_svd_llm.py."""

from __future__ import annotations

import pytest
import torch

from structlm.hf.adapters import MatrixType, get_adapter
from structlm.hf.calibration import calibrate
from structlm.hf.loading import LoadedModel
from structlm.share.compress import (
    METHODS,
    CompressionConfig,
    OneSidedLinear,
    SharedBasisLinear,
    TypeRanks,
    best_rectangular_ranks,
    compress_model,
    consecutive_groups,
    factorize_basis_sharing,
    factorize_shared,
    factorize_svd,
    load_compressed,
    plan_types,
    save_compressed,
    solve_basis_sharing_rank,
    solve_svd_rank,
    stored_parameters,
)
from tiny_models import FAMILY_OVERRIDES, tiny_family, tiny_llama


def _ids(n: int = 4 * 32, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 89, (n,), generator=torch.Generator().manual_seed(seed))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids(2 * 16, seed=9).view(2, 16)).logits


def _data(L: int, out: int, inn: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    W = [torch.randn(out, inn, generator=g, dtype=torch.float64) for _ in range(L)]
    X = [torch.randn(300, inn, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3, inn)
         for _ in range(L)]
    return W, [x.T @ x / 300 for x in X]


def test_full_rank_reconstructs_exactly() -> None:
    W, Cs = _data(4, 12, 18)
    for tf in (factorize_shared("shared", W, Cs, TypeRanks(12, 18), floor=1e-12),
               factorize_shared("hybrid", W, Cs, TypeRanks(12, 18, 2), floor=1e-12),
               factorize_svd(W, Cs, 12, floor=1e-12),
               factorize_svd(W, Cs, 6, parts=2, floor=1e-12),
               factorize_basis_sharing(W, Cs, 18, [[0, 1], [2, 3]], floor=1e-12),
               factorize_basis_sharing(W, Cs, 18, [[0, 1, 2, 3]], parts=2, floor=1e-12)):
        assert min(tf.energy) > 1 - 1e-9, (tf.method, tf.energy)


def test_low_rank_energy_is_ordered_and_hybrid_improves_shared() -> None:
    W, _ = _data(5, 16, 24, seed=1)
    Cs = [torch.eye(24, dtype=torch.float64) for _ in range(5)]
    shared = factorize_shared("shared", W, Cs, TypeRanks(6, 6))
    hybrid = factorize_shared("hybrid", W, Cs, TypeRanks(6, 6, 3))
    svd = factorize_svd(W, Cs, 6)
    assert all(h > s for h, s in zip(hybrid.energy, shared.energy, strict=True))
    assert all(v >= s - 1e-12 for v, s in zip(svd.energy, shared.energy, strict=True))
    assert 0 < min(hybrid.info["residual_share_of_basis_error"]) < 1


def _bs_reference_rank(nx: int, nf: int, group: int, ratio_percent: int) -> int:
    """The Basis Sharing code's rank rule (its ``utils.compute_num_basis``), written from
    the paper's formula: k = floor((1 - ratio) * in * out * n / (in + out * n))."""
    return int((nx * nf * group * (1 - ratio_percent / 100)) // (nx + nf * group))


@pytest.mark.parametrize("group", [1, 2, 3, 5, 30])
@pytest.mark.parametrize("shape", [(576, 576), (192, 576), (1536, 576), (576, 1536)])
@pytest.mark.parametrize("ratio", [20, 30, 40, 50])
def test_basis_sharing_rank_is_the_papers(group: int, shape: tuple[int, int],
                                          ratio: int) -> None:
    out, inn = shape
    L = 30
    sizes = [len(g) for g in consecutive_groups(L, group)]
    k = solve_basis_sharing_rank(out, inn, sizes, 1, (1 - ratio / 100) * L * out * inn)
    ref = _bs_reference_rank(inn, out, group, ratio)
    # equal up to float rounding of the budget (the reference divides first)
    assert abs(k - min(ref, inn, group * out)) <= 1, (k, ref)


def test_gqa_ranks_are_not_capped_at_min_out_in() -> None:
    """SmolLM2's K/V (192 × 576, 30 layers): a one-sided basis over all layers may hold
    up to 576 directions; at -20% the budget allows 418 (the paper's formula)."""
    L, out, inn = 30, 192, 576
    budget = 0.8 * L * out * inn
    k = solve_basis_sharing_rank(out, inn, [L], 1, budget)
    assert k == 418 > min(out, inn)
    assert stored_parameters("basis-sharing", out, inn, TypeRanks(k, k), [L]) <= budget
    assert stored_parameters("basis-sharing", out, inn, TypeRanks(k + 1, k + 1), [L]) > budget
    assert solve_basis_sharing_rank(out, inn, [L], 1, 0.6 * L * out * inn) == 314
    # per-layer SVD stays bounded by its own math: min(out, in) = 192 at most
    assert solve_svd_rank(L, out, inn, 0.8 * L * out * inn) == 115  # ⌊0.8·192·576/768⌋
    assert solve_svd_rank(L, out, inn, 10.0 * L * out * inn) == 192
    with pytest.raises(ValueError, match="cannot hold rank 1"):
        solve_svd_rank(L, out, inn, 100.0)


def test_shared_rectangular_ranks_recover_a_known_structure() -> None:
    """Layers that truly share a 6-dim output and a 20-dim input subspace, with a K-like
    shape (out 12 < in 36): the energy-optimal search finds k_out ≥ 6 and k_in ≥ 20 > out,
    keeping all the energy, and stays within the budget."""
    g = torch.Generator().manual_seed(4)
    L, out, inn, a, b = 8, 12, 36, 6, 20
    U = torch.linalg.qr(torch.randn(out, a, generator=g, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(inn, b, generator=g, dtype=torch.float64))[0]
    W = [U @ torch.randn(a, b, generator=g, dtype=torch.float64) @ V.T for _ in range(L)]
    budget = a * out + b * inn + L * a * b + 50.0
    ranks, _, _, share = best_rectangular_ranks(W, budget)
    assert ranks.k_out >= a and ranks.k_in >= b > out
    assert share == pytest.approx(1.0, abs=1e-10)
    assert stored_parameters("shared", out, inn, ranks, [L]) <= budget
    # a budget too small for the full structure: the best pair still fits and is optimal
    small = 0.5 * budget
    ranks, U_all, V_all, share = best_rectangular_ranks(W, small)
    assert stored_parameters("shared", out, inn, ranks, [L]) <= small < budget
    best = max(sum(float((U_all[:, :ko].T @ w @ V_all[:, :ki]).pow(2).sum()) for w in W)
               for ko in range(1, out + 1) for ki in range(1, inn + 1)
               if ko * out + ki * inn + L * ko * ki <= small)
    total = sum(float(w.pow(2).sum()) for w in W)
    assert share == pytest.approx(best / total, rel=1e-12)


def test_basis_sharing_group_size_one_equals_per_layer_svd_llm() -> None:
    """Group size 1 is SVD-LLM per layer and per linear module (gate and up on their own)."""
    models = {}
    for name, cfg in {"svd": CompressionConfig(method="svd-llm-w", types="all",
                                               target_reduction=0.4),
                      "bs1": CompressionConfig(method="basis-sharing", types="all",
                                               target_reduction=0.4, basis_sharing={"group_size": 1,
                                               "shared_types": "all"})}.items():
        model = tiny_llama(num_hidden_layers=4)
        ad = get_adapter(model)
        cal = calibrate(ad, _ids(), seq_len=32, batch_size=2, progress=False)
        rep = compress_model(ad, cal, cfg)
        models[name] = (model, rep)
    (m1, r1), (m2, r2) = models["svd"], models["bs1"]
    assert r1["stored_parameters"] == r2["stored_parameters"]
    for t in r1["types"]:
        assert r1["types"][t]["k"] == r2["types"][t]["k"]
        assert r1["types"][t]["energy_kept"] == pytest.approx(r2["types"][t]["energy_kept"],
                                                              abs=1e-9)
    torch.testing.assert_close(_logits(m1), _logits(m2), rtol=1e-4, atol=1e-5)


def test_basis_sharing_shares_within_groups_only_and_splits_gate_up() -> None:
    model = tiny_llama(num_hidden_layers=5)
    ad = get_adapter(model)
    cal = calibrate(ad, _ids(), seq_len=32, batch_size=2, progress=False)
    rep = compress_model(ad, cal, CompressionConfig(method="basis-sharing", types="all",
                                                    target_reduction=0.3))
    q = [ad.layers[i].module(MatrixType.Q) for i in range(5)]
    assert all(isinstance(m, OneSidedLinear) for m in q)
    assert q[0].basis is q[1].basis and q[2].basis is q[3].basis
    assert q[1].basis is not q[2].basis and q[4].basis is not q[3].basis
    assert rep["types"]["q"]["group_sizes"] == [2, 2, 1]
    assert rep["types"]["o"]["method"] == rep["types"]["mlp_out"]["method"] == "svd-llm-w"
    mlp_in = ad.layers[0].module(MatrixType.MLP_IN)
    gate, up = mlp_in.parts
    assert gate.basis is not up.basis and rep["types"]["mlp_in"]["parts"] == 2
    assert rep["stored_parameters"] <= 0.7 * rep["original_parameters"]


def test_update_step_refits_coefficients_on_the_compressed_inputs(tmp_path) -> None:
    model = tiny_llama(num_hidden_layers=4)
    ad = get_adapter(model)
    ids = _ids(8 * 32)
    cal = calibrate(ad, ids, seq_len=32, batch_size=2, progress=False)
    cfg = CompressionConfig(method="basis-sharing", types="all", target_reduction=0.4,
                            basis_sharing={"update": True})
    rep = compress_model(ad, cal, cfg, calib_tokens=ids)
    for t, u in rep["update"].items():
        assert u["error_after"] <= u["error_before"] * (1 + 1e-9), t
    assert any(u["error_after"] < 0.999 * u["error_before"] for u in rep["update"].values())
    with pytest.raises(ValueError, match="needs the calibration tokens"):
        compress_model(get_adapter(tiny_llama()), cal, cfg)


def test_plans_for_gqa_shapes() -> None:
    ad = get_adapter(tiny_llama(num_hidden_layers=6, hidden_size=64, num_attention_heads=8,
                                num_key_value_heads=2, intermediate_size=96))
    plans = {p.type: p for p in plan_types(ad, CompressionConfig(
        method="onesided-all-layers", types="all", target_reduction=0.2))}
    k = plans[MatrixType.K]
    assert k.shape == (16, 64) and k.groups == [list(range(6))]
    assert k.ranks is not None and k.ranks.k > 16  # beyond min(out, in)
    assert plans[MatrixType.O].method == "svd-llm-w"
    seed = {p.type: p for p in plan_types(ad, CompressionConfig(method="shared", types="k"))}
    assert seed[MatrixType.K].ranks == TypeRanks(16, 16)  # k = d/4 = 16 on both sides


def test_config_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match="unknown method 'pca'"):
        CompressionConfig(method="pca")
    with pytest.raises(ValueError, match="'onesided' was renamed"):
        CompressionConfig(method="onesided")
    with pytest.raises(ValueError, match=r"target_reduction: 1.5 is out of range: expected > 0 "
                                         "and < 1"):
        CompressionConfig(target_reduction=1.5)
    with pytest.raises(ValueError, match="budget: 'pooled' is not valid: expected one of "
                                         "'per_type'"):
        CompressionConfig(budget="pooled")
    with pytest.raises(ValueError, match="update is Basis Sharing's step"):
        CompressionConfig(method="svd-llm-w", basis_sharing={"update": True})
    with pytest.raises(ValueError, match="'svd-llm' always runs its own update"):
        CompressionConfig(method="svd-llm", basis_sharing={"update": True})
    with pytest.raises(ValueError, match="group_size: 0 is out of range: expected >= 1"):
        CompressionConfig(method="basis-sharing", basis_sharing={"group_size": 0})
    with pytest.raises(ValueError, match=r"ranks\['x'\]|unknown matrix type 'x'"):
        CompressionConfig(ranks={"x": 3})
    with pytest.raises(ValueError, match=r"ranks\['q'\] must be a positive int"):
        CompressionConfig(ranks={"q": [1, 2, 3]})


@pytest.mark.parametrize("method", METHODS)
def test_compress_model_save_load_round_trip(method: str, tmp_path) -> None:
    model = tiny_llama(num_hidden_layers=5)
    ad = get_adapter(model)
    ids = _ids(8 * 32)
    cal = calibrate(ad, ids, seq_len=32, batch_size=2, progress=False)
    before = _logits(model)
    cfg = CompressionConfig(method=method, types="all", target_reduction=0.4,
                            hybrid={"residual_rank": 2},
                            basis_sharing={"update": method == "basis-sharing"})
    rep = compress_model(ad, cal, cfg, calib_tokens=ids)
    after = _logits(model)
    assert torch.isfinite(after).all() and not torch.allclose(after, before)
    assert rep["stored_parameters"] <= 0.6 * rep["original_parameters"] + 1
    # the accounting equals the tensors the model now holds
    held = sum(p.numel() for p in model.parameters())
    assert held == rep["model_parameters_after"]
    if method in ("shared", "hybrid"):
        assert isinstance(ad.layers[0].module(MatrixType.Q), SharedBasisLinear)
        assert ad.layers[0].module(MatrixType.Q).basis is ad.layers[2].module(MatrixType.Q).basis
    out = tmp_path / "compressed"
    save_compressed(LoadedModel(model, None, "tiny-llama", "", source="unused"), rep, out)
    # load_compressed rebuilds the source from its id: save a source folder to point at
    src = tmp_path / "source"
    tiny_llama(num_hidden_layers=5).save_pretrained(src)
    manifest = (out / "structlm_compression.json")
    manifest.write_text(manifest.read_text().replace('"unused"', f'"{src}"'))
    for f in src.glob("*.safetensors"):  # the source's weights are never read
        f.unlink()
    back = load_compressed(out)
    torch.testing.assert_close(_logits(back.model), after, rtol=0, atol=0)
    assert sum(p.numel() for p in back.model.parameters()) == held
    bm = back.model
    if bm.config.tie_word_embeddings:
        assert bm.lm_head.weight is bm.model.embed_tokens.weight
    if method in ("shared", "hybrid"):
        bad = get_adapter(bm)
        assert bad.layers[0].module(MatrixType.Q).basis is bad.layers[2].module(MatrixType.Q).basis
    if method == "svd-llm-w":  # a folder saved when the method was called "svd" still loads
        text = manifest.read_text()
        assert text.count('"svd-llm-w"') == 7  # the config and the six types
        manifest.write_text(text.replace('"svd-llm-w"', '"svd"'))
        with pytest.warns(DeprecationWarning, match="'svd' is deprecated"):
            old = load_compressed(out)
        torch.testing.assert_close(_logits(old.model), after, rtol=0, atol=0)
        assert "compressed (svd-llm-w)" in old.note


@pytest.mark.parametrize("method", METHODS)
def test_token_macs_count_what_a_one_token_call_multiplies(method: str) -> None:
    """``token_macs`` (in the compression report) equals the matmul MACs that
    ``FlopCounterMode`` counts when every compressed module maps one token (GQA K/V
    narrower than Q; the gated MLP-in as two parts for the per-part methods)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = tiny_llama(num_hidden_layers=5)
    ad = get_adapter(model)
    ids = _ids(8 * 32)
    cal = calibrate(ad, ids, seq_len=32, batch_size=2, progress=False)
    cfg = CompressionConfig(method=method, types="all", target_reduction=0.3,
                            hybrid={"residual_rank": 2})
    rep = compress_model(ad, cal, cfg, calib_tokens=ids)
    assert rep["types"]["k"]["shape"][0] < rep["types"]["q"]["shape"][0]  # GQA
    for t, d in rep["types"].items():
        mt = MatrixType(t)
        x = torch.randn(1, d["shape"][1], generator=torch.Generator().manual_seed(1))
        x.requires_grad_(True)  # a graph-recording call: PyTorch ops, which the mode sees
        with FlopCounterMode(display=False) as fc:
            for layer in ad.layers:
                layer.module(mt)(x)
        assert fc.get_total_flops() == 2 * d["token_macs"], (t, d["method"])
    if method in ("shared", "hybrid"):  # the two-sided shared basis: U in every layer
        d = rep["types"]["mlp_in"]
        assert d["token_macs"] > d["stored_parameters"]


def test_load_compressed_refuses_a_file_that_lacks_a_factor(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    model = tiny_llama(num_hidden_layers=3)
    ad = get_adapter(model)
    ids = _ids(4 * 32)
    cal = calibrate(ad, ids, seq_len=32, batch_size=2, progress=False)
    rep = compress_model(ad, cal, CompressionConfig(method="svd-llm-w", types="q",
                                                    target_reduction=0.5))
    src = tmp_path / "source"
    tiny_llama(num_hidden_layers=3).save_pretrained(src)
    out = tmp_path / "compressed"
    save_compressed(LoadedModel(model, None, "tiny-llama", "", source=str(src)), rep, out)
    tensors = load_file(str(out / "structlm_compressed.safetensors"))
    dropped = next(k for k in tensors if k.endswith("q_proj.B"))
    del tensors[dropped]
    save_file(tensors, str(out / "structlm_compressed.safetensors"))
    with pytest.raises(ValueError, match="lacks tensors for"):
        load_compressed(out)


@pytest.mark.parametrize("model_type", sorted(FAMILY_OVERRIDES))
def test_shared_basis_round_trip_on_every_family(model_type: str, tmp_path) -> None:
    """Gemma 2/3, Qwen3, Phi-3, OLMo 2: the seed's shared method on every matrix type,
    saved and loaded with identical logits (the fused Phi-3 qkv / gate_up and the Gemma 3
    text decoder inside its multimodal model included)."""
    model = tiny_family(model_type)
    ad = get_adapter(model)
    ids = _ids(8 * 32)
    cal = calibrate(ad, ids, seq_len=32, batch_size=2, progress=False)
    rep = compress_model(ad, cal, CompressionConfig(method="shared", types="all",
                                                    target_reduction=0.4,
                                                    hybrid={"residual_rank": 2}),
                         calib_tokens=ids)
    after = _logits(model)
    assert torch.isfinite(after).all()
    assert rep["stored_parameters"] <= 0.6 * rep["original_parameters"] + 1
    out, src = tmp_path / "compressed", tmp_path / "source"
    tiny_family(model_type).save_pretrained(src)
    save_compressed(LoadedModel(model, None, model_type, "", source=str(src)), rep, out)
    back = load_compressed(out)
    torch.testing.assert_close(_logits(back.model), after, rtol=0, atol=0)


def test_compress_output_never_holds_an_input(tmp_path) -> None:
    """``share compress runs/x/model --out runs/x`` once deleted its own source: an output
    that is, holds or lies inside an input folder (or a compressed input's source) is
    refused before anything is loaded; a manifest naming itself is refused on load."""
    import json

    from structlm.share.compress.io import MANIFEST, load_compressed
    from structlm.share.compress.run import run_compress

    src = tmp_path / "runs" / "x" / "model"
    tiny_llama().save_pretrained(src)
    for out in (src, src.parent, src / "inside"):
        with pytest.raises(ValueError, match="overlaps the input"):
            run_compress(str(src), CompressionConfig(), out, progress=False)
    assert (src / "config.json").exists()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / MANIFEST).write_text(json.dumps({"source_model": str(bad)}))
    with pytest.raises(ValueError, match="names itself as a source"):
        load_compressed(bad)
