"""Tool turns keep their KV: an assistant message with ``tool_calls`` that this ingress
returned renders again as the very text the decode engine wrote.

A client sends a tool-calling turn back as structured ``tool_calls`` (name and
arguments, re-serialized by the tool parser); the chat template then writes them in
its own spelling, which need not be the model's token for token (whitespace in the
arguments' JSON, key order, anything the model wrote around the call). The prompt would
then stop extending the session's kept KV at that message, and the turn recompute
everything after the last user message before it, every turn of an agent loop.

So the ingress remembers, per tool-calling turn it answered, the calls it returned (id,
name, arguments) and the raw text the decode engine generated. A later request whose
assistant message carries exactly those calls (and no other content) is rendered with
that message's content set to the raw text and no ``tool_calls``: the template writes
the assistant turn as the model wrote it, the prompt extends the kept tokens, and the
turn is sent back. A message that differs in any call is rendered as sent.

Bounded (least recently used out) and per ingress replica: a conversation that moves to
another replica renders as sent (and recomputes from that message on).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["ToolTurns", "tool_calls_of"]

Call = tuple[str, str, str]  # id, function name, arguments (as returned)


def tool_calls_of(message: Mapping[str, Any]) -> tuple[Call, ...] | None:
    """An assistant message's tool calls as (id, name, arguments), or None when it has
    none or they are not in OpenAI's shape."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return None
    out: list[Call] = []
    for call in calls:
        if not isinstance(call, Mapping):
            return None
        function = call.get("function")
        if not isinstance(function, Mapping):
            return None
        args = function.get("arguments")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        out.append((str(call.get("id")), str(function.get("name")), args))
    return tuple(out)


class ToolTurns:
    """The raw text behind each tool-calling answer this replica gave (see the module)."""

    def __init__(self, max_entries: int = 10_000, max_chars: int = 64 * 2**20) -> None:
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._by_calls: OrderedDict[tuple[Call, ...], str] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._by_calls)

    def remember(self, calls: Iterable[Call], raw_text: str) -> None:
        key = tuple(calls)
        if not key or len(raw_text) > self.max_chars:
            return
        old = self._by_calls.pop(key, None)
        if old is not None:
            self._chars -= len(old)
        self._by_calls[key] = raw_text
        self._chars += len(raw_text)
        while len(self._by_calls) > self.max_entries or self._chars > self.max_chars:
            _, dropped = self._by_calls.popitem(last=False)
            self._chars -= len(dropped)

    def as_generated(self, messages: Sequence[Any]) -> list[Any] | None:
        """``messages`` with each remembered tool-calling assistant message replaced by
        its raw text; None when none is remembered (render as sent)."""
        out: list[Any] | None = None
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or message.get("role") != "assistant":
                continue
            if message.get("content") not in (None, ""):
                continue
            calls = tool_calls_of(message)
            raw = None if calls is None else self._by_calls.get(calls)
            if raw is None:
                continue
            assert calls is not None
            self._by_calls.move_to_end(calls)
            if out is None:
                out = list(messages)
            out[i] = {"role": "assistant", "content": raw}
        return out
