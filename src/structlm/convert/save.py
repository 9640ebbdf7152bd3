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

One writer per output: the run holds ``.<out>.lock`` beside the folder (``flock``), and
under it removes the temporary folders ``.tmp-convert-<out>-*`` a killed run of the same
output left (saying so on stderr). Every sequence length the run feeds the model is
checked against the model's context before any work: healing and distillation windows
(``seq_len + 1`` tokens) must fit; calibration, validation and evaluation windows are
``min(512, context)`` tokens.
"""

from __future__ import annotations

import copy
import dataclasses
import fcntl
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch

from structlm.config import (
    ConfigError,
    NonEmpty,
    OneOf,
    Range,
    RunError,
    dataclass_from_dict,
    validated,
)
from structlm.convert.algebra_config import AlgebraConfig
from structlm.convert.calibrate import model_context
from structlm.convert.convert import conversion_info, convert_
from structlm.convert.distill import ModuleDistillation, dense_teacher
from structlm.convert.typed_linear import TypedAlgebraLinear
from structlm.folders import check_apart
from structlm.hf.finetune import FinetuneConfig, finetune
from structlm.hf.macs import projection_macs, projection_parameters

__all__ = ["REPORT", "WINDOW", "ConvertConfig", "check_context", "clean_leftovers",
           "convert_and_save", "output_lock"]

REPORT = "structlm_convert.json"
WINDOW = 512
"""Calibration, validation and evaluation windows: this many tokens, or the model's
context where it is shorter."""
_TMP = ".tmp-convert-"


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


def check_context(cfg: ConvertConfig) -> int:
    """The window length the run uses, after checking every sequence length ``cfg`` feeds
    the model against its context (read from the architecture alone, no weights).

    Raises:
        ConfigError: a healing or distillation ``seq_len`` whose windows (``seq_len + 1``
            tokens) do not fit, naming the field, its flag, the value and the context.
    """
    from structlm.hf.loading import load_model

    context = model_context(load_model(cfg.model, weights=False).model)
    if context is None:
        return WINDOW
    for key, fc in (("heal", cfg.heal), ("distill", cfg.distill)):
        if fc.steps > 0 and fc.seq_len + 1 > context:
            raise ConfigError(f"{key}.seq_len (--{key}-seq-len) {fc.seq_len}: "
                              f"{'healing' if key == 'heal' else 'distillation'} feeds windows "
                              f"of seq_len + 1 = {fc.seq_len + 1} tokens, beyond the context "
                              f"of model {cfg.model!r} ({context} positions): use at most "
                              f"{context - 1}")
    return min(WINDOW, context)


@contextmanager
def output_lock(out: Path) -> Iterator[Path]:
    """Hold ``.<out.name>.lock`` beside ``out`` (``flock``) for the block: one writer per
    output (the folder itself must stay new or empty, so the lock lies beside it); the
    lock file is removed when the block ends.

    Raises:
        RunError: another process holds it.
    """
    path = out.parent / f".{out.name}.lock"
    out.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        fh = open(path, "a")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            raise RunError(f"output {str(out)!r} is being written by another process (it "
                           f"holds {path}): wait for it or choose another --out") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino
        except FileNotFoundError:  # removed by the holder that just finished
            same = False
        if not same:
            fh.close()
            continue
        try:
            yield path
        finally:
            path.unlink(missing_ok=True)  # still held: no one else can hold this file
            fh.close()
        return
    raise RunError(f"could not lock {path}: it keeps being replaced by other processes")


def clean_leftovers(out: Path) -> list[Path]:
    """Remove the temporary folders ``.tmp-convert-<out.name>-*`` a killed run of the same
    output left beside it (call it under :func:`output_lock`), saying so on stderr;
    another output's leftovers are not touched. Returns what was removed."""
    pattern = re.compile(re.escape(f"{_TMP}{out.name}-") + r"[a-z0-9_]{8}")
    removed = []
    for path in sorted(out.parent.glob(f"{_TMP}*")):
        if pattern.fullmatch(path.name):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
            print(f"structlm convert: removed {path}, left by an interrupted run of the same "
                  "output", file=sys.stderr)
    return removed


def convert_and_save(cfg: ConvertConfig, out: str | Path, progress: bool = True
                     ) -> dict[str, Any]:
    """Load ``cfg.model``, convert it, heal it if asked, save it to ``out``; returns the
    report written to ``out/structlm_convert.json``. Every sequence length is checked
    against the model's context first (:func:`check_context`); the run holds the
    output's lock and removes what a killed run of the same output left.

    Raises:
        ValueError: an output that is not new or empty or overlaps the input, a sequence
            length beyond the model's context, anything :func:`convert_` refuses.
        RunError: another process writes the same output.
    """
    out = Path(out)
    done = _finished(out, cfg)
    if done is not None:  # the same command, rerun after it finished (or was killed late)
        print(f"{out} already holds this conversion ({REPORT}): nothing to do", flush=True)
        return done
    _check_out(out, cfg.model)
    window = check_context(cfg)
    with output_lock(out):
        clean_leftovers(out)
        _check_out(out, cfg.model)  # again, under the lock
        return _convert_and_save(cfg, out, window, progress)


def _record_config(cfg: ConvertConfig) -> dict[str, Any]:
    """The config as the report records it."""
    return {**dataclasses.asdict(cfg), "heal": dataclasses.asdict(cfg.heal)}


def _finished(out: Path, cfg: ConvertConfig) -> dict[str, Any] | None:
    """The report of a finished conversion with exactly ``cfg`` in ``out`` (``None`` if
    there is none, or it was made with another config: then ``out`` is refused)."""
    path = out / REPORT
    if not path.is_file():
        return None
    try:
        report = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    same = json.loads(json.dumps(_record_config(cfg), default=str))
    return report if isinstance(report, dict) and report.get("config") == same else None


def _convert_and_save(cfg: ConvertConfig, out: Path, window: int, progress: bool
                      ) -> dict[str, Any]:
    from structlm.hf.pipeline import evaluate_all, prepare, validation_windows

    t0 = time.time()
    heal = cfg.heal.steps > 0
    seq_lens = [c.seq_len for c in (cfg.heal, cfg.distill) if c.steps > 0]
    prep = prepare(cfg.model, cfg.corpus, cfg.second_corpus if cfg.eval_tokens else "",
                   eval_tokens=cfg.eval_tokens, seed=cfg.seed, calibrate=False,
                   calib_tokens=max(*seq_lens, window,
                                    cfg.calib_tokens if cfg.uses_calibration else 0),
                   seq_len=window, progress=progress,
                   val_tokens=max([c.eval_tokens for c in (cfg.heal, cfg.distill)
                                   if c.steps > 0], default=0),  # only a curve reads it
                   # no evaluation, healing, distillation or calibration: no text is
                   # read, and the model needs no tokenizer
                   text=bool(cfg.eval_tokens or seq_lens or cfg.uses_calibration))
    loaded = prep.loaded
    model = loaded.model

    def ppl() -> dict[str, float]:
        return {k: v["ppl"] for k, v in evaluate_all(model, prep.eval_ids, window=window,
                                                      progress=progress).items()}

    report: dict[str, Any] = {
        "model": loaded.model_id, "model_note": loaded.note,
        "config": _record_config(cfg),
        "window": window,
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
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f"{_TMP}{out.name}-"))
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
