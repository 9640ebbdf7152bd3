"""Layer-wise distillation of a converted model toward its dense teacher: zero for the
teacher itself, falling under training, only the converted modules trained, the
forward stopping after the last compared module."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from structlm import AlgebraConfig, conversion_info, convert_  # noqa: E402
from structlm.convert import TypedAlgebraLinear  # noqa: E402
from structlm.convert.distill import ModuleDistillation  # noqa: E402
from structlm.hf.finetune import FinetuneConfig, finetune  # noqa: E402
from tiny_models import tiny_llama, validation_of  # noqa: E402


def _setup():
    dense = tiny_llama(vocab_size=97, max_position_embeddings=64)
    teacher = copy.deepcopy(dense)
    student = convert_(dense, AlgebraConfig("Q2^2", "cyclic", "mlp"))
    names = conversion_info(student)["modules"]
    return teacher, student, names


def test_the_teacher_scores_zero_and_a_converted_student_does_not() -> None:
    teacher, student, names = _setup()
    batch = torch.randint(1, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    objective = ModuleDistillation(teacher, names)
    assert float(objective(copy.deepcopy(teacher), batch).detach()) == 0.0
    assert float(objective(student, batch).detach()) > 0.01
    with pytest.raises(ValueError, match="no modules"):
        ModuleDistillation(teacher, ["model.layers.9.mlp.up_proj"])


def test_distillation_trains_the_converted_modules_toward_the_teacher() -> None:
    teacher, student, names = _setup()
    train = torch.randint(1, 97, (4096,), generator=torch.Generator().manual_seed(1))
    held = torch.randint(1, 97, (4, 32), generator=torch.Generator().manual_seed(2))
    objective = ModuleDistillation(teacher, names)
    before_loss = float(objective(student, held).detach())
    frozen = {n: p.detach().clone() for n, p in student.named_parameters()
              if "mlp" not in n}
    params = [p for m in student.modules() if isinstance(m, TypedAlgebraLinear)
              for p in m.parameters()]
    cfg = FinetuneConfig(steps=30, lr=0.05, warmup=2, batch_size=4, seq_len=32,
                         eval_every=30, eval_tokens=64, eval_window=32)
    curve = finetune(student, train, validation_of(held), cfg, progress=False, params=params,
                     objective=objective)
    assert float(objective(student, held).detach()) < 0.95 * before_loss  # random model:
    # each type's restricted product cannot follow an isotropic input much better
    assert curve[-1]["val_ppl"] is not None and curve[-1]["loss"] < curve[1]["loss"]
    for n, p in student.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n


def test_the_forward_stops_after_the_last_compared_module() -> None:
    teacher, student, names = _setup()
    calls = []
    student.lm_head.register_forward_hook(lambda *_: calls.append(1))
    ModuleDistillation(teacher, names[:3])(student, torch.randint(1, 97, (1, 8)))
    assert calls == []  # neither later layers nor the LM head ran
