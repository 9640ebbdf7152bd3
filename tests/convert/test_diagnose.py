"""Where a converted model's error sits (``convert.diagnose.module_errors``): zero when
every block any type drops is zero in both models (known answer), positive otherwise,
the first module's drift equal to its local error (nothing before it changed), per type
as well as in total."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from structlm import AlgebraConfig, convert_, unconvert_  # noqa: E402
from structlm.convert.diagnose import module_errors  # noqa: E402
from structlm.convert.distill import dense_teacher  # noqa: E402
from structlm.convert.typed_linear import TypedAlgebraLinear  # noqa: E402
from tiny_models import tiny_gpt2, tiny_llama  # noqa: E402


def _ids(seed: int, vocab: int = 89) -> torch.Tensor:
    return torch.randint(1, vocab, (6, 24), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("algebra", ["Q2^2", "Q4"])
def test_errors_vanish_when_the_dropped_blocks_are_zero(algebra) -> None:
    student = convert_(tiny_llama(), AlgebraConfig(algebra, "cyclic", "all"))
    with torch.no_grad():
        for m in student.modules():
            if isinstance(m, TypedAlgebraLinear):
                io = [0, *torch.tensor(m.in_widths).cumsum(0).tolist()]
                oo = [0, *torch.tensor(m.out_widths).cumsum(0).tolist()]
                dropped = ~torch.as_tensor(m.support.mask).all(0)  # (beta, delta)
                for b, d in dropped.nonzero().tolist():
                    m.weight[oo[d]:oo[d + 1], io[b]:io[b + 1]] = 0
    teacher = unconvert_(copy.deepcopy(student))  # the same weights, dense product
    errs = module_errors(student, teacher, _ids(0))
    assert len(errs) == 3 * 7
    for e in errs.values():
        assert e["local"] < 1e-10 and e["drift"] < 1e-10
        assert len(e["local_per_type"]) == 4 and max(e["drift_per_type"]) < 1e-10


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_a_copied_conversion_has_errors_and_the_first_module_drift_is_local(make) -> None:
    dense = make()
    student = convert_(copy.deepcopy(dense), AlgebraConfig("Q4", "cyclic", "all"))
    vocab = dense.get_input_embeddings().weight.shape[0]
    errs = module_errors(student, dense_teacher(dense, student), _ids(1, vocab), batch_size=4)
    first = next(iter(errs.values()))
    assert first["drift"] == pytest.approx(first["local"], rel=1e-9)
    assert all(e["local"] > 1e-3 and e["drift"] > 1e-3 for e in errs.values())
    assert all(min(e["local_per_type"]) > 0 for e in errs.values())
    last = list(errs.values())[-1]
    assert last["drift"] > last["local"] * 0.5  # errors upstream reach the last module
    with pytest.raises(ValueError, match="not converted"):
        module_errors(dense, dense, _ids(1, vocab))
