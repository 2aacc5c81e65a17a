"""Every test the docs, the package's docstrings and the tests' own docstrings cite exists: a
claim in the docs names the test that proves it, so a renamed or deleted test must take its
citations along (the 11-29 review found three citing tests long gone)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILE = re.compile(r"\b(?:tests/)?(test_[a-z0-9_]+\.py)(?:::([A-Za-z0-9_]+))?")
NAME = re.compile(r"`(?:[a-z0-9_/]*\.py::)?(test_[a-z0-9_]+)(?:\[[^\]]*\])?`")
NOT_TESTS = {"test_size", "test_async_llm"}  # a training argument; a module named bare


def _cited() -> list[tuple[str, str, str | None]]:
    """``(where, file, test name or None)`` of every citation of a test file (and test)."""
    sources = [
        *ROOT.glob("*.md"),
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "probehook").rglob("*.py"),
        *(ROOT / "tests").glob("*.py"),
        *(ROOT / "benchmarks").glob("*.py"),
        *(ROOT / "scripts").glob("*.py"),
    ]
    found = []
    for path in sources:
        if path == Path(__file__).resolve():
            continue
        text = path.read_text(encoding="utf-8")
        for match in FILE.finditer(text):
            found.append((f"{path.relative_to(ROOT)}", match.group(1), match.group(2)))
        if path.suffix == ".md":  # a bare test name in backticks: some test file defines it
            for match in NAME.finditer(text):
                if match.group(1) in NOT_TESTS:
                    continue
                found.append((f"{path.relative_to(ROOT)}", "", match.group(1)))
    return found


def _defined() -> dict[str, set[str]]:
    return {
        path.name: set(re.findall(r"^(?:async )?def (test_[A-Za-z0-9_]+)", path.read_text(), re.M))
        for path in (ROOT / "tests").glob("test_*.py")
    }


def test_every_cited_test_exists() -> None:
    defined = _defined()
    everywhere = set().union(*defined.values())
    missing = []
    for where, file, name in _cited():
        if file and file not in defined:
            missing.append(f"{where}: {file}")
        elif name and name not in (defined[file] if file else everywhere):
            missing.append(f"{where}: {file}::{name}" if file else f"{where}: {name}")
    assert not missing, "cited tests that do not exist:\n" + "\n".join(sorted(set(missing)))


def test_the_check_sees_a_missing_test(tmp_path) -> None:
    """The patterns find the forms the docs use (a file, a file::test, a bare name)."""
    text = "`tests/test_a.py::test_one` and `test_b.py` and `test_two[x]`"
    assert [m.groups() for m in FILE.finditer(text)] == [
        ("test_a.py", "test_one"),
        ("test_b.py", None),
    ]
    assert [m.group(1) for m in NAME.finditer(text)] == ["test_one", "test_two"]
