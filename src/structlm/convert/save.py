"""``structlm convert``: convert a pretrained model, optionally heal it, and save a folder
that loads back converted (``from_pretrained`` after ``import structlm``, or
:func:`~structlm.convert.load_converted`).

The folder is written atomically (a temporary folder beside it, then one rename) and
holds what ``save_pretrained`` writes (the conversion recorded in ``config.json``), the
tokenizer, and ``structlm_convert.json``: the conversion, projection MACs and parameters
before and after, and — when evaluated or healed — perplexity before, after the change
and after healing on exactly the text described there. Before the rename the saved
folder is loaded back and its logits compared with the converted model's. A killed
healing run resumes from ``.<out>.heal-state.pt`` beside the folder when the same
command runs again.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch

from structlm.config import ConfigError, NonEmpty, OneOf, Range, dataclass_from_dict, validated
from structlm.convert.convert import AlgebraConfig, conversion_info, convert_
from structlm.convert.distill import ModuleDistillation, dense_teacher
from structlm.convert.typed_linear import TypedAlgebraLinear
from structlm.folders import check_apart
from structlm.hf.finetune import FinetuneConfig, finetune
from structlm.hf.macs import projection_macs, projection_parameters

__all__ = ["REPORT", "ConvertConfig", "convert_and_save"]

REPORT = "structlm_convert.json"


def _no_healing() -> FinetuneConfig:
    return FinetuneConfig(steps=0)


@dataclass
@validated
class ConvertConfig:
    """What ``structlm convert`` does (checked when built)."""

    model: Annotated[str, NonEmpty()]
    """smollm2 or qwen2.5-coder (built in), a local folder, or a hub id."""
    algebra: Annotated[str, NonEmpty()] = "Q2^2"
    """Product rule (``structlm algebra table``)."""
    schedule: Annotated[str, NonEmpty()] = "cyclic"
    """Position types (cyclic, block:<size>[:<period>], table:..., cross-layer:...)."""
    targets: Annotated[str, NonEmpty()] = "mlp"
    """Matrix types converted: mlp, attn, all, or a list of q,k,v,o,mlp_in,mlp_out."""
    init: Annotated[str, OneOf("copy", "calibrated")] = "copy"
    """copy: every weight kept; calibrated: each converted projection refitted, layer by
    layer, to the dense one on ``calib_tokens`` calibration tokens
    (:mod:`structlm.convert.calibrate`)."""
    permute: bool = False
    """Reorder the FFN hidden units (mlp targets) and attention heads (attn targets, with
    ``groups: heads``) first, function-preserving, so that each type keeps as much
    calibration output as possible."""
    groups: Annotated[str, OneOf("equal", "heads")] = "equal"
    """equal: q equal groups per projection; heads: the attention projections' head side
    in groups of whole heads (:mod:`structlm.convert.heads`)."""
    calib_tokens: Annotated[int, Range(ge=512, note="one 512-token window")] = 16384
    """Calibration tokens (windows of the corpus's calibration documents) for ``init:
    calibrated`` and ``permute``."""
    distill: FinetuneConfig = field(default_factory=_no_healing)
    """Layer-wise distillation before healing (``steps`` 0: none): the converted layers
    trained to reproduce the dense layers' outputs (relative squared error per module,
    :mod:`structlm.convert.distill`) on the corpus's calibration documents."""
    heal: FinetuneConfig = field(default_factory=_no_healing)
    """Healing after the change (``steps`` 0: none): the converted layers' weights
    trained on the corpus's calibration documents."""
    corpus: Annotated[str, NonEmpty()] = "austen"
    """Healing text and in-domain evaluation text (held-out documents)."""
    second_corpus: str = "shakespeare"
    """Other-domain evaluation text ("" for none)."""
    eval_tokens: Annotated[int, Range(ge=0, note="0: no evaluation")] = 0
    """Scored tokens per text before and after (16384 for a report)."""
    seed: Annotated[int, Range(ge=0)] = 0
    """Seed of the document split, the windows and the healing batch order."""

    def __post_init__(self) -> None:
        """Cross-field checks (each field's own range is checked by ``@validated``)."""
        for key in ("heal", "distill"):
            if not isinstance(getattr(self, key), FinetuneConfig):
                raise ConfigError(f"{key}: {getattr(self, key)!r} is not a mapping of "
                                  "FinetuneConfig keys")
        self.algebra_config()  # checks the algebra, schedule, targets and permute

    def algebra_config(self) -> AlgebraConfig:
        """The :class:`AlgebraConfig` this conversion uses."""
        return AlgebraConfig(self.algebra, self.schedule, self.targets, init=self.init,
                             permute=self.permute, groups=self.groups)

    @property
    def uses_calibration(self) -> bool:
        """Whether the conversion reads calibration windows."""
        return self.init == "calibrated" or self.permute

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ConvertConfig:
        """From a YAML mapping (unknown keys named; ``heal`` a partial mapping)."""
        return dataclass_from_dict(cls, raw, {"heal": FinetuneConfig,
                                              "distill": FinetuneConfig})


def _check_out(out: Path, model: str) -> None:
    """The output folder must be new (or empty) and never hold or be the input."""
    check_apart(out, [model])
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output {str(out)!r} exists and is not an empty folder: choose a "
                         "new folder (nothing is overwritten)")


def convert_and_save(cfg: ConvertConfig, out: str | Path, progress: bool = True
                     ) -> dict[str, Any]:
    """Load ``cfg.model``, convert it, heal it if asked, save it to ``out``; returns the
    report written to ``out/structlm_convert.json``."""
    from structlm.hf.pipeline import evaluate_all, prepare, validation_windows

    out = Path(out)
    _check_out(out, cfg.model)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    heal = cfg.heal.steps > 0
    prep = prepare(cfg.model, cfg.corpus, cfg.second_corpus if cfg.eval_tokens else "",
                   eval_tokens=cfg.eval_tokens, seed=cfg.seed, calibrate=False,
                   calib_tokens=max(cfg.heal.seq_len, cfg.distill.seq_len, 512,
                                    cfg.calib_tokens if cfg.uses_calibration else 0),
                   progress=progress)
    loaded = prep.loaded
    model = loaded.model

    def ppl() -> dict[str, float]:
        return {k: v["ppl"] for k, v in evaluate_all(model, prep.eval_ids,
                                                      progress=progress).items()}

    report: dict[str, Any] = {
        "model": loaded.model_id, "model_note": loaded.note,
        "config": {**dataclasses.asdict(cfg), "heal": dataclasses.asdict(cfg.heal)},
        "original": {"projection_macs": float(projection_macs(model)),
                     "projection_parameters": projection_parameters(model)}}
    if cfg.eval_tokens:
        report["text"] = prep.text
        report["original"]["ppl"] = ppl()
    dense = copy.deepcopy(model) if cfg.distill.steps > 0 else None  # the teacher's source
    convert_(model, cfg.algebra_config(),
             calibration=prep.calib_ids if cfg.uses_calibration else None, progress=progress)
    report["conversion"] = conversion_info(model)
    report["converted"] = {"projection_macs": float(projection_macs(model)),
                           "projection_parameters": projection_parameters(model)}
    if cfg.eval_tokens:
        report["converted"]["ppl"] = ppl()
    params = [p for m in model.modules() if isinstance(m, TypedAlgebraLinear)
              for p in m.parameters()]
    if dense is not None:
        teacher = dense_teacher(dense, model)  # the student's layout (same function)
        del dense
        dcfg = dataclasses.replace(cfg.distill, seed=cfg.seed)
        torch.manual_seed(cfg.seed)
        report["distill_curve"] = finetune(
            model, prep.train_ids, validation_windows(prep, dcfg.eval_tokens), dcfg,
            progress, state_path=_state_path(out, "distill"), params=params,
            prefix=prep.window_prefix,
            objective=ModuleDistillation(teacher, report["conversion"]["modules"]))
        del teacher
        model.eval()
        if cfg.eval_tokens:
            report["converted"]["ppl_distilled"] = ppl()
    if heal:
        hcfg = dataclasses.replace(cfg.heal, seed=cfg.seed)
        torch.manual_seed(cfg.seed)
        report["heal_curve"] = finetune(model, prep.train_ids,
                                        validation_windows(prep, hcfg.eval_tokens), hcfg,
                                        progress, state_path=_state_path(out), params=params,
                                        prefix=prep.window_prefix)
        model.eval()
        if cfg.eval_tokens:
            report["converted"]["ppl_healed"] = ppl()
    report["seconds"] = round(time.time() - t0, 1)
    _save(model, loaded.tokenizer, report, out)
    for stage in ("distill", "heal"):
        _state_path(out, stage).unlink(missing_ok=True)  # recorded in the folder now
    return report


def _state_path(out: Path, stage: str = "heal") -> Path:
    """Where a killed healing (or distillation) run's state waits for the same command to
    resume it."""
    return out.parent / f".{out.name}.{stage}-state.pt"


def _save(model: torch.nn.Module, tokenizer: Any, report: dict[str, Any], out: Path) -> None:
    """Write the folder through a temporary one; check it loads back to the same logits."""
    from transformers import AutoModelForCausalLM

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-convert-"))
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / REPORT).write_text(json.dumps(report, indent=1))
        back = AutoModelForCausalLM.from_pretrained(tmp, dtype=next(model.parameters()).dtype)
        def record(m: torch.nn.Module) -> dict[str, Any] | None:
            info = conversion_info(m)  # this process's summaries are not saved
            return None if info is None else {k: v for k, v in info.items()
                                              if k not in ("calibration", "permutation")}

        if record(back) != record(model):
            raise RuntimeError(f"the saved folder loads back as {record(back)}, not "
                               f"{record(model)}")
        ids = torch.arange(1, 17)[None] % int(model.get_input_embeddings().weight.shape[0])
        with torch.no_grad():
            torch.testing.assert_close(back.eval()(ids).logits, model.eval()(ids).logits)
        if out.exists():
            out.rmdir()  # checked empty by _check_out
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
