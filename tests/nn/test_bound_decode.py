"""The layers' bound decode calls (``TypedRowsBinding``): one crossing into C++ per
few-row call, against the reference, and refusing exactly where the gate refuses.

The binding is made on a layer's first kernel decode call and used from the second on,
so every test calls twice and checks that the second call went through the binding.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from structlm import AlgebraLinear, get_algebra, support_of
from structlm.nn import DecodeLinear
from structlm.ops import cpu_kernels, force_backend
from structlm.ops.partition import TypePartition
from structlm.ops.reference import reference_linear
from structlm.ops.route import (
    DECODE_MAX_ROWS,
    DENSE_IN_PLACE_MAX_ROWS,
    DENSE_KERNEL_MAX_ROWS,
    force_layout,
)

pytestmark = pytest.mark.skipif(not cpu_kernels.fused_rows_available(),
                                reason="no C++ compiler: the rows kernel cannot be built")

ALGEBRAS = ["Q2", "Q4", "Q2^2", "Q8", "graph:4:0-1,1-2"]


def _layer(algebra: str, k: int, n: int, equal: bool, bias: bool,
           dtype: torch.dtype) -> AlgebraLinear:
    q = support_of(get_algebra(algebra)).q
    gen = torch.Generator().manual_seed(k * 31 + n + q)
    if equal:
        layer = AlgebraLinear(k * q, n * q, algebra, bias=bias, dtype=dtype)
    else:  # unequal groups
        in_w = [k + (i % 3) for i in range(q)]
        out_w = [n + (2 * i) % 5 for i in range(q)]
        layer = AlgebraLinear(sum(in_w), sum(out_w), algebra, bias=bias, dtype=dtype,
                              group_sizes=(in_w, out_w))
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen, dtype=torch.float64))
        if bias:
            layer.bias.copy_(torch.randn(layer.out_features, generator=gen,
                                         dtype=torch.float64))
    return layer.eval()


def _reference(layer: AlgebraLinear, x: torch.Tensor, part: TypePartition) -> torch.Tensor:
    """float64 reference ``(*, K) -> (*, N)``."""
    x2 = x.reshape(-1, layer.in_features).double()
    y = reference_linear(x2, layer.weight.detach().double(), part.types, layer.support.mask,
                         list(layer.in_widths), list(layer.out_widths))
    if layer.bias is not None:
        y = y + layer.bias.detach().double()
    return y.reshape(*x.shape[:-1], layer.out_features)


def _count_binding_calls(layer: torch.nn.Module) -> dict[str, int]:
    """Wrap the layer's binding so its successful calls are counted."""
    real = layer.__dict__["_rows_binding"]
    counts = {"bound": 0, "refused": 0}

    class Counting:
        def __call__(self, *args):
            y = real(*args)
            counts["bound" if y is not None else "refused"] += 1
            return y

        def matches(self, w):
            return real.matches(w)

    counting = Counting()
    layer.__dict__["_rows_binding"] = counting
    bound = layer.__dict__.get("_bound_call")  # what forward calls: (binding, w, b, epoch)
    if bound is not None:
        layer.__dict__["_bound_call"] = (counting, *bound[1:])
    return counts


def _unbind(layer: torch.nn.Module) -> None:
    """Drop the layer's bound call: its next call takes the general path and binds."""
    layer.__dict__.pop("_rows_binding")
    layer.__dict__.pop("_bound_call")


@pytest.mark.parametrize("algebra", ALGEBRAS)
@pytest.mark.parametrize("shape", [(1, 7), (7, 1), (97, 33)])
@pytest.mark.parametrize("lead", [(1,), (1, 1), (DECODE_MAX_ROWS,), (2, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bound_call_matches_the_reference(algebra: str, shape: tuple[int, int],
                                          lead: tuple[int, ...], dtype: torch.dtype) -> None:
    k, n = shape
    layer = _layer(algebra, k, n, equal=k != 97, bias=k == 7, dtype=dtype)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(*lead, layer.in_features, generator=gen, dtype=torch.float64).to(dtype)
    for t in range(layer.q):
        part = TypePartition(torch.full(lead, t), layer.q)
        with torch.no_grad():
            first = layer(x, part)  # unbound kernel call; binds
            assert "_rows_binding" in layer.__dict__
            counts = _count_binding_calls(layer)
            second = layer(x, part)
        assert counts == {"bound": 1, "refused": 0}
        assert second.shape == (*lead, layer.out_features) and second.dtype == dtype
        assert torch.equal(first, second)  # the same loop, bound or not
        tol = 1e-4 if dtype == torch.float32 else 1e-10
        torch.testing.assert_close(second.double(), _reference(layer, x, part), rtol=tol,
                                   atol=tol * (layer.in_features ** 0.5))
        _unbind(layer)  # the next type's first call is unbound


def test_bound_call_keeps_nan_semantics() -> None:
    """A NaN in an input group reaches exactly the outputs the support says (as the
    reference), through the bound call."""
    layer = _layer("Q4", 5, 3, equal=True, bias=False, dtype=torch.float64)
    x = torch.randn(1, layer.in_features, dtype=torch.float64)
    x[0, 0] = float("nan")  # input group 0
    for t in range(layer.q):
        part = TypePartition(torch.tensor([t]), layer.q)
        with torch.no_grad():
            layer(x, part)
            counts = _count_binding_calls(layer)
            y = layer(x, part)
        assert counts["bound"] == 1
        ref = _reference(layer, x, part)
        assert torch.equal(y.isnan(), ref.isnan()) and bool(ref.isnan().any())
        torch.testing.assert_close(y[~y.isnan()], ref[~ref.isnan()])
        _unbind(layer)


def test_a_changed_weight_is_rebound() -> None:
    """In-place updates, ``.data`` swaps and a replaced parameter: the binding refuses
    the stale weight, the layer recomputes and rebinds, the result is the new weight's."""
    layer = _layer("Q2^2", 6, 5, equal=True, bias=True, dtype=torch.float32)
    x = torch.randn(1, layer.in_features)
    part = TypePartition(torch.tensor([2]), layer.q)
    changes = [lambda: layer.weight.mul_(-0.5),
               lambda: setattr(layer.weight, "data", torch.randn_like(layer.weight)),
               lambda: setattr(layer, "weight", torch.nn.Parameter(torch.randn_like(
                   layer.weight))),
               lambda: layer.bias.add_(3.0),
               # written past nn.Module.__setattr__, as some loaders do
               lambda: layer._parameters.__setitem__("weight", torch.nn.Parameter(
                   torch.randn_like(layer.weight))),
               lambda: layer._parameters.__setitem__("bias", torch.nn.Parameter(
                   torch.randn_like(layer.bias)))]
    with torch.no_grad():
        layer(x, part)
        for change in changes:
            change()
            y = layer(x, part)
            torch.testing.assert_close(y.double(), _reference(layer, x, part), rtol=1e-4,
                                       atol=1e-4)
            assert layer.__dict__["_rows_binding"].matches(layer.weight)


def test_binding_refuses_where_the_gate_refuses() -> None:
    """Mixed types, too many rows, autograd recording (input, weight or bias), another
    dtype: the binding returns None, the layer's general path gives the right result
    (and gradients where asked)."""
    layer = _layer("Q4", 4, 3, equal=True, bias=True, dtype=torch.float32)
    x1 = torch.randn(1, layer.in_features)
    with torch.no_grad():
        layer(x1, TypePartition(torch.tensor([1]), layer.q))  # bind
    binding = layer.__dict__["_rows_binding"]
    cases = {
        "mixed types": (torch.randn(2, layer.in_features), torch.tensor([0, 1]), False),
        "too many rows": (torch.randn(DECODE_MAX_ROWS + 1, layer.in_features),
                          torch.zeros(DECODE_MAX_ROWS + 1, dtype=torch.long), False),
        "int32 types": (x1, torch.tensor([1], dtype=torch.int32), False),
    }
    for name, (x, types, _) in cases.items():
        part = TypePartition(types, layer.q)
        with torch.no_grad():
            assert binding(x, part.types, layer.weight, layer.bias) is None, name
            y = layer(x, part)
        torch.testing.assert_close(y.double(), _reference(layer, x, part), rtol=1e-4,
                                   atol=1e-4)
    part = TypePartition(torch.tensor([1]), layer.q)
    xg = x1.clone().requires_grad_(True)
    assert binding(xg, part.types, layer.weight, layer.bias) is None  # input grad
    assert binding(x1, part.types, layer.weight, layer.bias) is None  # weight trainable
    y = layer(xg, part)
    assert y.requires_grad and y.grad_fn is not None
    y.sum().backward()
    assert xg.grad is not None and layer.weight.grad is not None
    layer.weight.requires_grad_(False)
    assert binding(x1, part.types, layer.weight, layer.bias) is None  # bias trainable
    y = layer(x1, part)
    assert y.requires_grad  # the bias gets its gradient
    layer.bias.requires_grad_(False)
    assert binding(x1, part.types, layer.weight, layer.bias) is not None  # frozen: bound
    assert binding(x1.double(), part.types, layer.weight, layer.bias) is None  # dtype
    assert binding(x1, part.types, layer.weight, layer.bias.double()) is None  # bias dtype


def test_forced_backend_or_layout_bypasses_the_binding(monkeypatch) -> None:
    layer = _layer("Q4", 4, 3, equal=True, bias=False, dtype=torch.float64)
    x = torch.randn(1, layer.in_features, dtype=torch.float64)
    part = TypePartition(torch.tensor([3]), layer.q)
    with torch.no_grad():
        layer(x, part)
        counts = _count_binding_calls(layer)
        with force_backend("reference"):
            ref = layer(x, part)
        with force_layout("diag-first"):
            blocked = layer(x, part)
        monkeypatch.setenv("STRUCTLM_BACKEND", "reference")
        env = layer(x, part)
        monkeypatch.delenv("STRUCTLM_BACKEND")
        with cpu_kernels.decode_copy("blocks"):
            blocks = layer(x, part)
        assert counts == {"bound": 0, "refused": 0}
        bound = layer(x, part)
    assert counts == {"bound": 1, "refused": 0}
    for y in (ref, blocked, env, blocks):
        torch.testing.assert_close(y, bound)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_bind_their_own_weight(how: str) -> None:
    layer = _layer("Q2", 5, 4, equal=True, bias=True, dtype=torch.float32)
    x = torch.randn(1, layer.in_features)
    part = TypePartition(torch.tensor([1]), layer.q)
    with torch.no_grad():
        before = layer(x, part)
        twin = copy.deepcopy(layer) if how == "deepcopy" else pickle.loads(pickle.dumps(layer))
        assert "_rows_binding" not in twin.__dict__ and "_bound_call" not in twin.__dict__
        twin.weight.mul_(2.0)
        twin.bias.mul_(2.0)
        torch.testing.assert_close(twin(x, part), 2 * before)
        torch.testing.assert_close(twin(x, part), 2 * before)  # bound to the twin's weight
        torch.testing.assert_close(layer(x, part), before)


@pytest.mark.parametrize("k,n", [(1, 7), (97, 1025), (1025, 97)])
@pytest.mark.parametrize("lead", [(1,), (3, 1), (DENSE_IN_PLACE_MAX_ROWS,),
                                  (DENSE_KERNEL_MAX_ROWS,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decode_linear_bound_call_matches_f_linear(k: int, n: int, lead: tuple[int, ...],
                                                   dtype: torch.dtype) -> None:
    """Up to DENSE_IN_PLACE_MAX_ROWS rows the bound call; more rows (the panel-packed
    copy) refused by it and run unbound."""
    gen = torch.Generator().manual_seed(k + n)
    layer = DecodeLinear(k, n, bias=True, dtype=dtype)
    x = torch.randn(*lead, k, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        layer(x.to(dtype))
        layer(torch.randn(1, k, generator=gen, dtype=torch.float64).to(dtype))  # binds
        counts = _count_binding_calls(layer)
        y = layer(x.to(dtype))
    rows = x.numel() // k
    bound = rows <= DENSE_IN_PLACE_MAX_ROWS
    assert counts == {"bound": int(bound), "refused": int(not bound)}
    assert y.shape == (*lead, n)
    exact = F.linear(x, layer.weight.double(), layer.bias.double())
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(y.double(), exact, rtol=tol, atol=tol * k ** 0.5)


def test_decode_linear_binding_refuses_training_and_stale_weights() -> None:
    layer = DecodeLinear(9, 5, bias=True)
    x = torch.randn(1, 9)
    with torch.no_grad():
        layer(x)
    binding = layer.__dict__["_rows_binding"]
    empty = torch.empty(0, dtype=torch.long)
    assert binding(x, empty, layer.weight, layer.bias) is None  # trainable weight
    y = layer(x)
    y.sum().backward()
    assert layer.weight.grad is not None and layer.bias.grad is not None
    with torch.no_grad():
        assert binding(x, empty, layer.weight, layer.bias) is not None
        layer.weight.add_(1.0)
        assert binding(x, empty, layer.weight, layer.bias) is None  # stale: rebind
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert layer.__dict__["_rows_binding"].matches(layer.weight)
        twin = copy.deepcopy(layer)
        assert "_rows_binding" not in twin.__dict__
        torch.testing.assert_close(twin(x), layer(x))


@pytest.mark.parametrize("kind", ["algebra", "dense"])
@pytest.mark.parametrize("tool", ["prune", "parametrize"])
def test_a_computed_weight_takes_the_general_path(kind: str, tool: str) -> None:
    """Pruning or a parametrization makes ``weight`` a tensor computed per call, not the
    registered parameter: no cached bound call is kept, and every call is right."""
    from torch.nn.utils import parametrize, prune

    class Half(torch.nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return 0.5 * w

    layer = (_layer("Q2^2", 8, 6, equal=True, bias=True, dtype=torch.float32)
             if kind == "algebra" else DecodeLinear(8, 6, bias=True))
    if tool == "prune":
        prune.l1_unstructured(layer, "weight", amount=0.5)
    else:
        parametrize.register_parametrization(layer, "weight", Half())
    x = torch.randn(1, layer.in_features)
    part = TypePartition(torch.tensor([1]), layer.q) if kind == "algebra" else None
    with torch.no_grad():
        for _ in range(3):
            y = layer(x, part) if part is not None else layer(x)
            if part is not None:
                exact = _reference(layer, x, part)
            else:
                exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
            torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)
    assert "_bound_call" not in layer.__dict__


def test_a_replaced_environment_is_read(monkeypatch) -> None:
    """``os.environ`` replaced wholesale (as ``mock.patch("os.environ", ...)`` does) is read
    by the bound calls' check, not the mapping seen at import."""
    import os

    from structlm.ops.route import bound_calls_open

    assert bound_calls_open()
    monkeypatch.setattr(os, "environ", {**os.environ, "STRUCTLM_BACKEND": "reference"})
    assert not bound_calls_open()
