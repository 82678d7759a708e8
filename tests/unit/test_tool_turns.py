"""The ingress's book of tool-calling answers (``orchestrator.serve.tool_turns``) is
bounded, in answers and in characters: the least recently used go first, and a
conversation whose call was dropped renders its message as sent (docs/api.md)."""

from __future__ import annotations

from typing import Any

from orchestrator.serve.tool_turns import ToolTurns, tool_calls_of


def called(name: str) -> dict[str, Any]:
    call = {"id": f"call-{name}", "type": "function"}
    call["function"] = {"name": name, "arguments": "{}"}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def remembered(book: ToolTurns, name: str) -> bool:
    return book.as_generated([called(name)]) is not None


def test_the_book_keeps_its_most_recent_answers_up_to_its_bounds() -> None:
    book = ToolTurns(max_entries=2, max_chars=100)
    for name in ("a", "b"):
        calls = tool_calls_of(called(name))
        assert calls is not None
        book.remember(calls, f"<tool_call>{name}</tool_call>")
    assert book.as_generated([called("a")]) == [
        {"role": "assistant", "content": "<tool_call>a</tool_call>"}
    ]
    # "a" was used last: a third answer drops "b".
    calls = tool_calls_of(called("c"))
    assert calls is not None
    book.remember(calls, "<tool_call>c</tool_call>")
    assert len(book) == 2
    assert [remembered(book, n) for n in "abc"] == [True, False, True]


def test_the_book_is_bounded_in_characters() -> None:
    book = ToolTurns(max_entries=10, max_chars=10)
    for name in ("a", "b"):
        calls = tool_calls_of(called(name))
        assert calls is not None
        book.remember(calls, name * 6)
    assert [remembered(book, n) for n in "ab"] == [False, True]
