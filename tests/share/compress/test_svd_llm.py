"""``svd-llm`` (SVD-LLM with its layer-wise closed-form update) against ``svd-llm-w`` (the
whitened truncation alone) on small random models: the refit is SVD-LLM's ``lstsq`` on the
raw activations, lowers every module's error on its calibration inputs, reads the inputs
of the model whose earlier layers are already compressed and updated, changes no shape
and no input factor; the former name ``svd`` still reads as ``svd-llm-w``."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from structlm.bench.share import ShareBenchConfig
from structlm.config import read_yaml
from structlm.hf.adapters import SITE_OF, ConcatProjection, MatrixType, get_adapter
from structlm.hf.adapters.modules import linear_from
from structlm.hf.calibration import calibrate, calibration_windows
from structlm.nn.factorized import LowRankLinear
from structlm.share.compress import (
    CompressionConfig,
    TypeRanks,
    compress_model,
    get_method,
    plan_types,
    stored_parameters,
)
from structlm.share.compress.methods import SVD_LLM_METHOD, SVD_LLM_W_METHOD
from structlm.share.compress.methods.refit import update_coefficients
from structlm.share.compress.methods.svd_llm import block_inputs, layerwise_update
from tiny_models import tiny_family, tiny_gpt2, tiny_llama, tiny_structlm

L = 4
SEQ = 32


def _ids(n: int = 8 * SEQ, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 89, (n,), generator=torch.Generator().manual_seed(seed))


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids(2 * 16, seed=9).view(2, 16)).logits


def _pieces(m: nn.Module) -> list[LowRankLinear]:
    return list(m.parts) if isinstance(m, ConcatProjection) else [m]


def _dense(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.dense_weight().detach().double() for p in _pieces(m)])


def _err(W: torch.Tensor, What: torch.Tensor, C: torch.Tensor) -> float:
    E = W.double() - What
    return float(((E @ C) * E).sum())


@pytest.mark.parametrize(("out", "inn", "k", "parts"), [(14, 97, 5, 2), (97, 7, 3, 1),
                                                         (7, 97, 4, 1), (194, 7, 6, 2)])
def test_refit_is_svd_llms_lstsq_on_the_raw_activations(out: int, inn: int, k: int,
                                                        parts: int) -> None:
    """SVD-LLM's ``local_update``: with the truncated ``Σ_k`` and ``V_kᵀ S⁻¹`` fixed,
    ``x = X (V_kᵀ S⁻¹)ᵀ Σ_k`` and ``Uᵀ = lstsq(x, Y)``, ``Y = X Wᵀ`` the original module's
    output on the new inputs; the refit from ``E[XᵀX]`` gives the same output factor
    (``U Σ_k`` here), each of gate and up on its own."""
    g = torch.Generator().manual_seed(out * inn + k)
    W = torch.randn(out, inn, generator=g, dtype=torch.float64)
    scale = torch.linspace(0.3, 2.5, inn, dtype=torch.float64)
    X0 = torch.randn(500, inn, generator=g, dtype=torch.float64) * scale  # whitening data
    mix = torch.eye(inn, dtype=torch.float64) + 0.3 * torch.randn(inn, inn, generator=g,
                                                                  dtype=torch.float64)
    X = (torch.randn(700, inn, generator=g, dtype=torch.float64) * scale) @ mix  # new inputs
    S = torch.linalg.cholesky(X0.T @ X0)  # SVD-LLM's root of XᵀX
    op = out // parts
    mods, truncs = [], []
    for p in range(parts):
        U, s, Vh = torch.linalg.svd(W[p * op:(p + 1) * op] @ S, full_matrices=False)
        v = Vh[:k] @ torch.linalg.inv(S)  # SVD-LLM's truc_v (k, in)
        truncs.append((s[:k], v))
        mods.append(LowRankLinear(U[:, :k] * s[:k], v, None))
    module = mods[0] if parts == 1 else ConcatProjection(mods)
    res = update_coefficients([module], [W.float()], [X.T @ X / len(X)], [[0]], parts,
                              floor=1e-14)
    assert len(res["error_after"]) == parts
    for p, (piece, (s, v)) in enumerate(zip(_pieces(module), truncs, strict=True)):
        v32 = v.float().double()  # the input factor the module holds (float32)
        x = X @ v32.T @ torch.diag(s)
        uT = torch.linalg.lstsq(x, X @ W[p * op:(p + 1) * op].float().double().T).solution
        torch.testing.assert_close(piece.B.detach().double(), uT.T @ torch.diag(s),
                                   rtol=2e-5, atol=2e-5 * float(uT.abs().max()))
        torch.testing.assert_close(piece.C.detach().double(), v32, rtol=0, atol=0)


@pytest.fixture(scope="module")
def pair() -> dict[str, Any]:
    """The same tiny LLaMA compressed at -40% by ``svd-llm-w`` (``w``), by ``svd-llm``
    through ``compress_model`` (``u``), and by ``svd-llm-w`` then the update called
    directly with the captured moments kept (``direct``)."""
    ids = _ids()
    out: dict[str, Any] = {"ids": ids, "original": tiny_llama(num_hidden_layers=L)}
    out["cal"] = calibrate(get_adapter(out["original"]), ids, seq_len=SEQ, batch_size=2,
                           progress=False)
    for key, method in (("w", "svd-llm-w"), ("u", "svd-llm"), ("direct", "svd-llm-w")):
        model = tiny_llama(num_hidden_layers=L)
        ad = get_adapter(model)
        cfg = CompressionConfig(method=method, types="all", target_reduction=0.4)
        plans = plan_types(ad, cfg)
        originals = {p.type: ad.weights(p.type) for p in plans}
        rep = compress_model(ad, out["cal"], cfg, calib_tokens=ids)
        out[key] = (model, rep)
    model, _ = out["direct"]
    moments: dict[tuple[int, str], torch.Tensor] = {}
    out["direct_update"] = layerwise_update(get_adapter(model), plans, originals, ids,
                                            seq_len=SEQ, floor=1e-6, moments=moments)
    out["moments"], out["originals"] = moments, originals
    return out


def test_compress_model_runs_the_update_as_the_direct_call(pair: dict[str, Any]) -> None:
    (u, rep), (direct, _) = pair["u"], pair["direct"]
    torch.testing.assert_close(_logits(u), _logits(direct), rtol=0, atol=0)
    assert set(rep["update"]) == {t.value for t in MatrixType}
    assert rep["update"]["q"]["error_after"] == pytest.approx(
        pair["direct_update"]["q"]["error_after"], rel=1e-12)
    assert rep["update_seconds"] > 0 and "update" not in pair["w"][1]
    assert {d["method"] for d in rep["types"].values()} == {"svd-llm"}
    assert rep["config"]["method"] == "svd-llm"
    assert rep["config"]["basis_sharing"]["update"] is False


def test_update_lowers_every_modules_error_on_its_calibration_inputs(pair: dict[str, Any]
                                                                     ) -> None:
    """Per layer and type, ``tr((W − Ŵ) C_X (W − Ŵ)ᵀ)`` under the captured inputs: the
    refit (least squares) is never worse than the truncation, and better somewhere."""
    w_ad, u_ad = get_adapter(pair["w"][0]), get_adapter(pair["u"][0])
    gains = []
    for t in MatrixType:
        for i in range(L):
            C = pair["moments"][(i, SITE_OF[t])]
            W = pair["originals"][t][i]
            before = _err(W, _dense(w_ad.layers[i].module(t)), C)
            after = _err(W, _dense(u_ad.layers[i].module(t)), C)
            assert after <= before * (1 + 1e-6) + 1e-9, (t, i, before, after)
            gains.append(1 - after / before)
    assert max(gains) > 0.01
    for t, d in pair["u"][1]["update"].items():
        assert d["error_after"] <= d["error_before"] * (1 + 1e-9), t
        assert d["relative_error_after"] <= d["relative_error_before"] * (1 + 1e-9) < 1
        assert len(d["error_before_per_layer"]) == L
    # layer 0's Q/K/V read the original inputs: the truncation is already their optimum
    q = pair["u"][1]["update"]["q"]
    assert q["error_after_per_layer"][0] == pytest.approx(q["error_before_per_layer"][0],
                                                          rel=1e-6)


def test_update_reads_the_inputs_of_the_already_compressed_layers(pair: dict[str, Any]
                                                                  ) -> None:
    """Layer ``i``'s refit reads the inputs of the *original* layer ``i`` in the model whose
    layers ``< i`` are compressed and updated: rebuilt here by putting layer ``i``'s dense
    modules back into the final model and calibrating it."""
    cal, moments = pair["cal"], pair["moments"]
    torch.testing.assert_close(moments[(0, "attn_in")], cal.C(0, MatrixType.Q))
    for i in (1, 2):
        ref = copy.deepcopy(pair["u"][0])
        ad = get_adapter(ref)
        for t in MatrixType:
            mod = ad.layers[i].module(t)
            bias = None if _pieces(mod)[0].bias is None else torch.cat(
                [p.bias.detach() for p in _pieces(mod)])
            ad.layers[i].replace(t, linear_from(pair["originals"][t][i], bias))
        again = calibrate(ad, pair["ids"], seq_len=SEQ, batch_size=4, layers=[i],
                          progress=False)
        for site in ("attn_in", "attn_out", "mlp_in", "mlp_out"):
            mine, orig = moments[(i, site)], cal.second_moments[(i, site)]
            torch.testing.assert_close(mine, again.second_moments[(i, site)],
                                       rtol=1e-5, atol=1e-7)
            assert (mine - orig).norm() > 1e-3 * orig.norm(), (i, site)


def test_update_changes_values_not_shapes(pair: dict[str, Any]) -> None:
    """Same stored parameters and MACs as ``svd-llm-w`` at the budget, the same tensors'
    shapes, the input factors ``C`` bit for bit; the output factors moved."""
    (w, rw), (u, ru) = pair["w"], pair["u"]
    assert ru["stored_parameters"] == rw["stored_parameters"]
    assert ru["model_parameters_after"] == rw["model_parameters_after"]
    for t, d in ru["types"].items():
        e = rw["types"][t]
        assert (d["k"], d["stored_parameters"], d["token_macs"]) == (
            e["k"], e["stored_parameters"], e["token_macs"]), t
    pw, pu = dict(w.named_parameters()), dict(u.named_parameters())
    assert {n: p.shape for n, p in pw.items()} == {n: p.shape for n, p in pu.items()}
    cs = [n for n in pu if n.endswith(".C")]
    assert len(cs) == L * 7  # q, k, v, o, gate, up, down per layer
    assert all(torch.equal(pu[n], pw[n]) for n in cs)
    assert any(not torch.equal(pu[n], pw[n]) for n in pu if n.endswith(".B"))
    for name in ("svd-llm", "svd-llm-w"):
        assert stored_parameters(name, 64, 32, TypeRanks(5, 5), [1] * L, 2) == 2 * L * 5 * 64
    assert SVD_LLM_METHOD.always_updates and not SVD_LLM_METHOD.supports_update
    assert not SVD_LLM_W_METHOD.always_updates


def test_svd_llm_needs_the_calibration_tokens_before_any_work(pair: dict[str, Any]) -> None:
    model = tiny_llama(num_hidden_layers=L)
    before = _logits(model)
    with pytest.raises(ValueError, match=r"'svd-llm' refits every layer.*needs the "
                                         "calibration tokens"):
        compress_model(get_adapter(model), pair["cal"],
                       CompressionConfig(method="svd-llm", types="all", target_reduction=0.4))
    torch.testing.assert_close(_logits(model), before, rtol=0, atol=0)  # untouched
    with pytest.raises(ValueError, match="always runs its own update"):
        CompressionConfig(method="svd-llm", basis_sharing={"update": True})


@pytest.mark.parametrize("family", ["llama", "gpt2", "structlm", "gemma2", "gemma3_text",
                                    "phi3", "qwen2"])
def test_blocks_run_one_at_a_time_give_the_models_hidden_states(family: str) -> None:
    """The captured block inputs and arguments (masks, rotary tables, sliding-window
    layers) carried block by block reproduce every block's output in the full forward."""
    model = {"llama": lambda: tiny_llama(num_hidden_layers=3), "gpt2": tiny_gpt2,
             "structlm": tiny_structlm}.get(family, lambda: tiny_family(family))()
    ad = get_adapter(model)
    blocks = [layer.block for layer in ad.layers]
    windows = calibration_windows(_ids(5 * 16, seed=1), 16)  # batches of 2, 2 and 1
    seen: list[torch.Tensor] = []
    hooks = [b.register_forward_hook(lambda m, a, y: seen.append(
        (y[0] if isinstance(y, tuple) else y).detach())) for b in blocks]
    with torch.no_grad():
        for ids in windows.split(2):
            model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    batches = block_inputs(model, blocks, list(windows.split(2)))
    got: list[list[torch.Tensor]] = [[] for _ in batches]
    with torch.no_grad():
        for i, block in enumerate(blocks):
            for j, b in enumerate(batches):
                y = b.run(block, i)
                b.hidden = y[0] if isinstance(y, tuple) else y
                got[j].append(b.hidden)
    want = [seen[j * len(blocks):(j + 1) * len(blocks)] for j in range(len(batches))]
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "gemma3_text", "qwen2"])
def test_svd_llm_on_other_families_improves_and_round_trips(family: str, tmp_path) -> None:
    from structlm.hf.loading import LoadedModel
    from structlm.share.compress import load_compressed, save_compressed

    make = tiny_gpt2 if family == "gpt2" else (lambda: tiny_family(family))
    model = make()
    ad = get_adapter(model)
    ids = _ids()
    cal = calibrate(ad, ids, seq_len=SEQ, batch_size=2, progress=False)
    rep = compress_model(ad, cal, CompressionConfig(method="svd-llm", types="all",
                                                    target_reduction=0.4), calib_tokens=ids)
    assert sum(d["error_after"] for d in rep["update"].values()) < sum(
        d["error_before"] for d in rep["update"].values())
    after = _logits(model)
    src, out = tmp_path / "source", tmp_path / "compressed"
    make().save_pretrained(src)
    save_compressed(LoadedModel(model, None, family, "", source=str(src)), rep, out)
    back = load_compressed(out)
    torch.testing.assert_close(_logits(back.model), after, rtol=0, atol=0)
    assert "compressed (svd-llm)" in back.note


def test_former_name_svd_reads_as_svd_llm_w(tmp_path) -> None:
    """``svd`` in a config, a YAML file, a lookup or the accounting: ``svd-llm-w`` with a
    ``DeprecationWarning`` that names both new methods."""
    with pytest.warns(DeprecationWarning, match="'svd-llm-w'.*'svd-llm'"):
        cfg = CompressionConfig(method="svd", types="q")
    assert cfg.method == "svd-llm-w"
    path = tmp_path / "c.yaml"
    path.write_text("method: svd\ntypes: attn\ntarget_reduction: 0.2\n")
    with pytest.warns(DeprecationWarning, match="deprecated"):
        cfg = CompressionConfig.from_dict(read_yaml(str(path)))
    assert cfg.method == "svd-llm-w"
    with pytest.warns(DeprecationWarning):
        assert get_method("svd") is SVD_LLM_W_METHOD
    with pytest.warns(DeprecationWarning):
        assert ShareBenchConfig(method="svd").method == "svd-llm-w"
    with pytest.warns(DeprecationWarning):
        assert stored_parameters("svd", 8, 6, SVD_LLM_W_METHOD.default_ranks(
            2, (8, 6), [1], 1, 0), [1, 1]) == 2 * 2 * 14
