"""``probehook --help`` reads as plain text (no reStructuredText markup from docstrings)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("argv", [["--help"], ["capture", "--help"], ["store", "--help"]])
def test_help_is_plain_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from probehook.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: probehook")
    assert "``" not in text and ":func:" not in text and ":class:" not in text, text
    if argv == ["--help"]:
        assert "probehook serve MODEL" in text and "probehook store info" in text
