"""The benchmark writers of ``structlm.bench.timing``: CSV with the environment, and a
Markdown table drawn from the CSV as read back."""

from __future__ import annotations

import os

import pytest

from structlm.bench.timing import environment, environment_line, write_csv_and_markdown


def test_csv_and_markdown_from_the_csv(tmp_path: os.PathLike[str]) -> None:
    rows = [{"case": "Q4", "ms": 1.25}, {"case": "Q8", "ms": 0.5}]
    seen: list[list[dict[str, str]]] = []

    def markdown(read: list[dict[str, str]]) -> str:
        seen.append(read)
        return environment_line(read) + "\n" + "\n".join(
            f"| {r['case']} | {r['ms']} |" for r in read)

    prefix = os.path.join(tmp_path, "sub", "bench.v2")  # a dot in the name: not a suffix
    write_csv_and_markdown(prefix, rows, markdown)
    assert os.path.exists(prefix + ".csv") and os.path.exists(prefix + ".md")
    read = seen[0]
    assert [r["case"] for r in read] == ["Q4", "Q8"] and read[0]["ms"] == "1.25"  # strings
    env = environment()
    assert all(read[0][f"env_{k}"] == v for k, v in env.items() if k != "date")
    assert read[0]["env_date"]
    text = open(prefix + ".md").read()
    assert text.startswith("Environment: ") and "| Q8 | 0.5 |" in text
    assert [p for p in os.listdir(os.path.dirname(prefix)) if p.startswith(".tmp")] == []


def test_empty_rows_are_refused(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(ValueError, match="no rows"):
        write_csv_and_markdown(os.path.join(tmp_path, "x"), [], lambda r: "")


def test_passive_wait_policy_is_warned_and_recorded(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """OMP_WAIT_POLICY=PASSIVE (any case) gets a warning on stderr naming it; the policy
    is part of every run's environment, "unset" when it is."""
    from structlm.bench.timing import warn_if_passive_wait

    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert "OMP_WAIT_POLICY=PASSIVE" in (warn_if_passive_wait() or "")
    assert "OMP_WAIT_POLICY=PASSIVE" in capsys.readouterr().err
    assert environment()["omp_wait_policy"] == "passive"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert warn_if_passive_wait() is None and capsys.readouterr().err == ""
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert warn_if_passive_wait() is None and environment()["omp_wait_policy"] == "unset"
