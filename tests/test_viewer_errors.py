"""``probehook.view``'s refusals, before any data is read (no engine)."""

from __future__ import annotations

import pytest

from probehook import view


def test_an_empty_list_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one output: got an empty list"):
        view([])


def test_a_tokenizer_without_decode_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match=r"tokenizer=object has no decode\(\); pass llm.get_"):
        view([object()], tokenizer=object())
