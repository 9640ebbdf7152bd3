"""The README's Python snippets run as written (each in a fresh interpreter), and the
README stays a newcomer's page (at most 300 lines, every relative link resolves)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)


def test_readme_is_short_and_has_three_snippets() -> None:
    assert len(README.splitlines()) <= 300
    assert len(SNIPPETS) >= 3


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_snippet_runs(index: int, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", SNIPPETS[index]], capture_output=True,
                         text=True, cwd=tmp_path, timeout=300,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, f"snippet {index + 1}:\n{SNIPPETS[index]}\n{out.stderr[-3000:]}"


def test_relative_links_resolve() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for page in docs:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert missing == []
