"""An earlier run's fine-tuned numbers beside this one's (``ExperimentConfig.beside``).

A longer fine-tuning is only informative next to the shorter one it replaces: the report
of a run with ``beside: DIR`` adds, for every whole-model method and reduction, the
fine-tuned perplexity of the same arm in ``DIR`` (an earlier ``structlm experiment
share`` folder) and that run's verdict. The two runs must score the same text (model,
evaluation windows and documents are compared; anything else is refused), so the columns
differ only by how the arms were fine-tuned — which the report states for both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["check_beside_folder", "load_beside"]


def check_beside_folder(folder: str) -> None:
    """Refuse a ``beside`` folder without the files a finished experiment writes."""
    path = Path(folder)
    missing = [n for n in ("experiment.json", "config.json") if not (path / n).is_file()]
    if missing:
        raise ValueError(f"beside: {folder!r} is not a `structlm experiment share` folder "
                         f"(missing {', '.join(missing)})")


def load_beside(folder: str, res: dict[str, Any]) -> dict[str, Any]:
    """The fine-tuned numbers of ``folder`` keyed ``"method@reduction"``, after checking
    that it scored the same text as ``res`` (this run's results so far)."""
    path = Path(folder)
    other = json.loads((path / "experiment.json").read_text())
    cfg = json.loads((path / "config.json").read_text())
    if other.get("model") != res["model"]:
        raise ValueError(f"beside: {folder!r} is a run of {other.get('model')!r}, this run "
                         f"is of {res['model']!r}")
    for text in res["eval_texts"]:
        if not same_text(other.get("text", {}).get(text), res["text"][text]):
            raise ValueError(f"beside: {folder!r} scored other {text} text than this run "
                             "(windows, seed or documents differ): its numbers are not "
                             "comparable")
    entries = {f"{e['method']}@{e['reduction']}": e["finetuned"]
               for e in other.get("whole_model", [])}
    return {"folder": folder, "finetune": cfg.get("finetune", {}), "entries": entries}


_DEFINING = ("windows", "window", "tokens", "seed", "windows_per_document", "document_tokens")
"""The fields of a text's description that decide which tokens were scored."""


def same_text(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether two runs' descriptions of an evaluation text name the same windows: every
    defining field equal, and the tokenizer's prefix equal where both record it (a run
    older than that field counts as prefix-free only if this run's prefix is empty)."""
    if not old or any(old.get(k) != new.get(k) for k in _DEFINING):
        return False
    return old.get("prefix", []) == new.get("prefix", [])


def beside_label(beside: dict[str, Any]) -> str:
    """The column header: the folder's name and its fine-tuning length."""
    steps = beside["finetune"].get("steps", "?")
    return f"fine-tuned in {Path(beside['folder']).name} ({steps} steps)"


def beside_stats(beside: dict[str, Any] | None, method: str, reduction: float,
                 text: str) -> dict[str, float]:
    """The earlier run's fine-tuned ``{mean, std, min, max, n}`` of one arm ({} if none)."""
    if not beside:
        return {}
    return beside["entries"].get(f"{method}@{reduction}", {}).get(text, {})


def beside_finetune_text(beside: dict[str, Any]) -> str:
    """How the earlier run fine-tuned, for the report's header."""
    f = beside["finetune"]
    return (f"{f.get('steps')} steps × {f.get('batch_size')} × {f.get('seq_len')} tokens, "
            f"lr {f.get('lr')} ({f.get('lr_scaling')}), warm-up {f.get('warmup')}, cosine "
            f"to {f.get('min_lr_ratio')}×")
