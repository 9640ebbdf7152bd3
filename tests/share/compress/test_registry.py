"""The compression-method registry: every registered method through the protocol on a
tiny random model (ranks for a budget → factors → modules → accounting → placeholders →
save/load), the lookup errors, and a toy method registered here that ``compress_model``,
the accounting and the loader use without any other file knowing it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from structlm.hf.adapters import MatrixType, get_adapter, parse_types
from structlm.hf.calibration import Calibration, calibrate
from structlm.hf.loading import LoadedModel
from structlm.nn.factorized import LowRankLinear
from structlm.share.compress import (
    METHODS,
    CompressionConfig,
    CompressionMethod,
    TypeFactors,
    TypePlan,
    TypeRanks,
    compress_model,
    get_method,
    load_compressed,
    plan_types,
    register_method,
    save_compressed,
    stored_parameters,
    token_macs,
)
from structlm.share.compress.factorize import RootCache, kept_energy, meta_tensor
from tiny_models import tiny_llama

BUILT_IN = ["shared", "hybrid", "svd-llm-w", "svd-llm", "basis-sharing", "onesided-all-layers"]
L = 4


def _ids(n: int = 8 * 32, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 89, (n,), generator=torch.Generator().manual_seed(seed))


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids(2 * 16, seed=9).view(2, 16)).logits


def _calibrated(model: nn.Module) -> Calibration:
    return calibrate(get_adapter(model), _ids(), seq_len=32, batch_size=2, progress=False)


def _stored_in(mods: list[nn.Module]) -> int:
    """Parameters the modules hold (a shared basis once; biases are not compressed)."""
    held = {id(p): p for m in mods for n, p in m.named_parameters()
            if n.split(".")[-1] != "bias"}
    return sum(p.numel() for p in held.values())


def _shapes(tf: TypeFactors) -> tuple[list[dict[str, tuple[int, ...]]], ...]:
    return ([{k: tuple(v.shape) for k, v in b.items()} for b in tf.bases],
            [{k: tuple(v.shape) for k, v in e.items()} for e in tf.per_layer])


def _save_and_load(model: nn.Module, rep: dict, tmp_path) -> nn.Module:
    src = tmp_path / "source"
    tiny_llama(num_hidden_layers=L).save_pretrained(src)
    out = tmp_path / "compressed"
    save_compressed(LoadedModel(model, None, "tiny-llama", "", source=str(src)), rep, out)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "structlm_compressed.safetensors", "structlm_compression.json"
            } <= names and "model.safetensors" not in names  # self-contained
    return load_compressed(out).model


def test_built_in_methods_are_registered_in_order() -> None:
    from structlm.share.compress.ranks import METHODS as ranks_methods

    assert list(METHODS)[:len(BUILT_IN)] == BUILT_IN
    assert ranks_methods is METHODS  # the old import path sees the same registry
    for name in BUILT_IN:
        m = get_method(name)
        assert isinstance(m, CompressionMethod) and m.name == name
    assert [n for n in BUILT_IN if get_method(n).supports_update] == ["basis-sharing",
                                                                       "onesided-all-layers"]
    assert [n for n in BUILT_IN if get_method(n).always_updates] == ["svd-llm"]
    assert [n for n in BUILT_IN if get_method(n).two_sided] == ["shared", "hybrid"]
    assert [n for n in BUILT_IN if get_method(n).has_residual] == ["hybrid"]
    assert [n for n in BUILT_IN if not get_method(n).shares_across_layers] == ["svd-llm-w",
                                                                                "svd-llm"]


def test_unknown_method_error_names_the_value_and_the_choices() -> None:
    for call in (lambda: get_method("pca"), lambda: CompressionConfig(method="pca"),
                 lambda: stored_parameters("pca", 4, 4, TypeRanks(1, 1), [1])):
        with pytest.raises(ValueError, match="unknown method 'pca'") as err:
            call()
        assert all(repr(n) in str(err.value) for n in BUILT_IN)
    with pytest.raises(ValueError, match="'onesided' was renamed: use 'onesided-all-layers'"):
        get_method("onesided")
    with pytest.raises(ValueError, match="already registered"):
        register_method(get_method("svd-llm-w"))
    with pytest.warns(DeprecationWarning, match="'svd' is deprecated"):
        assert get_method("svd") is get_method("svd-llm-w")
    alias = PlainSvd()
    alias.name = "svd"  # a former name stays reserved for what it resolves to
    with pytest.raises(ValueError, match="already registered"):
        register_method(alias)


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_method_round_trips_through_the_protocol(name: str, tmp_path) -> None:
    """Per type: the layout's method, ranks for a budget, factors, modules; the modules
    hold exactly the method's stored parameters (within the budget); the placeholder has
    the factors' shapes; ``compress_model`` reports the same, and save/load gives the same
    logits."""
    configured = get_method(name)
    cfg = CompressionConfig(method=name, types="all", target_reduction=0.4,
                            hybrid={"residual_rank": 2})
    model = tiny_llama(num_hidden_layers=L)
    ad = get_adapter(model)
    cal = _calibrated(model)
    roots = RootCache(cfg.eig_floor)
    expected: dict[str, int] = {}
    for t in parse_types(cfg.types):
        out, inn = ad.layers[0].weight(t).shape
        method, groups = configured.layout(t, L, cfg)
        assert sorted(i for g in groups for i in g) == list(range(L))
        sizes = [len(g) for g in groups]
        parts = ad.row_blocks(t) if method.splits_row_blocks else 1
        budget = 0.6 * L * out * inn
        r = cfg.hybrid.residual_rank if method.has_residual else 0
        ranks = method.budget_ranks((out, inn), sizes, parts, budget, r)
        plan = TypePlan(t, method.name, (out, inn), ranks, budget, groups, parts, r)
        tf = method.factorize(plan, ad.weights(t), [cal.C(i, t) for i in range(L)],
                              cfg.eig_floor, roots)
        assert tf.method == method.name and len(tf.energy) == L
        assert ranks is None or tf.ranks == ranks
        assert all(0 < e <= 1 + 1e-9 for e in tf.energy)
        mods = method.build_modules(tf, [None] * L)
        stored = method.stored_parameters(out, inn, tf.ranks, sizes, parts)
        assert _stored_in(mods) == stored <= budget, t
        assert 0 < method.token_macs(out, inn, tf.ranks, sizes, parts)
        expected[t.value] = stored
        ph = method.placeholder((out, inn), tf.ranks, groups, parts)
        assert _shapes(ph) == _shapes(tf), t
        assert all(v.is_meta for e in ph.per_layer + ph.bases for v in e.values())
    rep = compress_model(ad, cal, cfg, calib_tokens=_ids())  # svd-llm's update reads them
    assert {t: d["stored_parameters"] for t, d in rep["types"].items()} == expected
    assert sum(p.numel() for p in model.parameters()) == rep["model_parameters_after"]
    for d in rep["types"].values():
        assert d["token_macs"] == token_macs(d["method"], *d["shape"], TypeRanks(
            d["k_out"], d["k_in"], d["r"]), d["group_sizes"], d["parts"])
    back = _save_and_load(model, rep, tmp_path)
    torch.testing.assert_close(_logits(back), _logits(model), rtol=0, atol=0)


class PlainSvd(CompressionMethod):
    """A toy method: per-layer truncated SVD without whitening."""

    name = "toy-plain-svd"
    shares_across_layers = False

    def default_ranks(self, k: int, shape: tuple[int, int], group_sizes: list[int],
                      parts: int, r: int) -> TypeRanks:
        return TypeRanks(min(k, *shape), min(k, *shape))

    def budget_ranks(self, shape: tuple[int, int], group_sizes: list[int], parts: int,
                     budget: float, r: int) -> TypeRanks | None:
        k = min(int(budget // (sum(group_sizes) * sum(shape))), *shape)
        return TypeRanks(k, k)

    def factorize(self, plan: TypePlan, weights: list[torch.Tensor], Cs: list[torch.Tensor],
                  floor: float, roots: RootCache) -> TypeFactors:
        assert plan.ranks is not None
        k = plan.ranks.k
        tf = TypeFactors(self.name, plan.ranks, plan.groups, plan.parts)
        for w, c in zip(weights, Cs, strict=True):
            U, S, Vh = torch.linalg.svd(w.double(), full_matrices=False)
            tf.per_layer.append({"B": U[:, :k] * S[:k], "C": Vh[:k]})
            tf.energy.append(kept_energy(w, U[:, :k] * S[:k] @ Vh[:k], c))
        return tf

    def build_modules(self, factors: TypeFactors, biases: list[torch.Tensor | None]
                      ) -> list[nn.Module]:
        return [LowRankLinear(e["B"], e["C"], b)
                for e, b in zip(factors.per_layer, biases, strict=True)]

    def stored_parameters(self, out: int, inn: int, ranks: TypeRanks,
                          group_sizes: list[int], parts: int = 1) -> int:
        return sum(group_sizes) * ranks.k * (out + inn)

    def token_macs(self, out: int, inn: int, ranks: TypeRanks, group_sizes: list[int],
                   parts: int = 1) -> int:
        return self.stored_parameters(out, inn, ranks, group_sizes, parts)

    def placeholder(self, shape: tuple[int, int], ranks: TypeRanks, groups: list[list[int]],
                    parts: int) -> TypeFactors:
        tf = TypeFactors(self.name, ranks, groups, parts)
        tf.per_layer = [{"B": meta_tensor(shape[0], ranks.k), "C": meta_tensor(ranks.k, shape[1])}
                        for g in groups for _ in g]
        return tf


@pytest.fixture
def toy() -> Iterator[CompressionMethod]:
    method = register_method(PlainSvd())
    try:
        yield method
    finally:
        METHODS.pop(method.name)


def test_a_method_registered_here_works_end_to_end(toy: CompressionMethod, tmp_path) -> None:
    model = tiny_llama(num_hidden_layers=L)
    ad = get_adapter(model)
    cal = _calibrated(model)
    before = _logits(model)
    cfg = CompressionConfig(method=toy.name, types="attn", target_reduction=0.5)
    assert [p.method for p in plan_types(ad, cfg)] == [toy.name] * 4
    rep = compress_model(ad, cal, cfg)
    after = _logits(model)
    assert torch.isfinite(after).all() and not torch.allclose(after, before)
    assert isinstance(ad.layers[0].module(MatrixType.Q), LowRankLinear)
    assert rep["stored_parameters"] <= 0.5 * rep["original_parameters"]
    assert sum(p.numel() for p in model.parameters()) == rep["model_parameters_after"]
    q = rep["types"]["q"]
    assert q["method"] == toy.name and q["stored_parameters"] == stored_parameters(
        toy.name, *q["shape"], TypeRanks(q["k"], q["k"]), q["group_sizes"])
    back = _save_and_load(model, rep, tmp_path)
    torch.testing.assert_close(_logits(back), after, rtol=0, atol=0)
    with pytest.raises(ValueError, match="update is Basis Sharing's step"):
        CompressionConfig(method=toy.name, basis_sharing={"update": True})

