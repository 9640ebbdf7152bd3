"""What a saved model's weights were trained for, kept beside ``config.json``.

``config.json`` names the FFN algebra, but two algebras can share every weight shape
(``Q4`` and ``Q2^2`` both split the FFN into 4×4 blocks): a folder whose ``config.json``
was edited to name the other one loads without an error and computes a different
function (generation then prints fluent-looking garbage). ``save_pretrained`` therefore
also writes :data:`PRODUCT_FILE` — the algebra, the schedule and a hash of the algebra's
structure tensor — and ``from_pretrained`` refuses a folder whose ``config.json``
disagrees with it. Folders saved without the file load as before.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from structlm.algebra import get_algebra, is_dense
from structlm.atomic import atomic_write_text

__all__ = ["PRODUCT_FILE", "check_saved_product", "product_of", "write_saved_product"]

PRODUCT_FILE = "structlm_product.json"


def product_of(config: Any) -> dict[str, Any]:
    """The fields of ``config`` that decide the product the weights compute."""
    algebra = str(config.algebra)
    table = ""
    if not is_dense(algebra):
        alg = get_algebra(algebra)
        h = hashlib.sha1()
        cells = alg.cells if alg.cells is not None else np.zeros(0)
        for arr in (np.asarray(alg.entries, dtype=np.int64), np.asarray(alg.values, np.float64),
                    np.asarray(cells, dtype=np.int64)):
            h.update(arr.tobytes())
        table = h.hexdigest()[:16]
    return {"algebra": algebra, "structure_sha1": table,
            "type_schedule": str(config.type_schedule),
            "structured_scores": bool(getattr(config, "structured_scores", False))}


def write_saved_product(folder: str | Path, config: Any) -> None:
    """Write :data:`PRODUCT_FILE` for ``config`` into ``folder`` (atomically)."""
    atomic_write_text(Path(folder) / PRODUCT_FILE,
                      json.dumps(product_of(config), indent=1, sort_keys=True))


def check_saved_product(folder: str | Path, config: Any) -> None:
    """Refuse ``config`` when ``folder``'s :data:`PRODUCT_FILE` records another product.

    Raises:
        ValueError: naming each field that differs, both values and the file.
    """
    path = Path(folder) / PRODUCT_FILE
    if not path.is_file():
        return
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is damaged ({e}): restore it from the saved run") from None
    now = product_of(config)
    diff = [f"{k}: config.json says {now[k]!r}, the weights were saved for {saved[k]!r}"
            for k in now if k in saved and saved[k] != now[k]]
    if diff:
        raise ValueError(f"{folder}: config.json does not describe the saved weights ("
                         + "; ".join(diff) + f"; recorded in {PRODUCT_FILE}): loading would "
                         "compute another function. Restore config.json")
