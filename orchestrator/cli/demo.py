"""A multi-turn conversation against a running kvtide endpoint, one table row per turn.

Turn 1 carries a long document, so its prompt KV is worth keeping; later turns add the
answer and a short question. Every turn offers a tool (``lookup``, as an agent offers
its tools on every turn); turn 2 asks the model to call it (``tool_choice`` naming it),
and turn 3 sends the call and the tool's result back. With a session id, the decode
engine keeps each turn's KV and the next turn's prefill pulls it back instead of
recomputing it, across the tool call too. A last row sends a fresh prompt of the same
length without a session: the recompute baseline.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from orchestrator.cli.table import format_table
from orchestrator.sdk._stream import StreamCollector
from orchestrator.sdk.errors import KVTideAPIError

__all__ = ["TurnRow", "format_turns", "long_document", "run_demo", "stream_chat"]

_WORDS = (
    "cache token prefill decode engine session rack domain tensor block layer turn agent "
    "tool plan search result memory transfer context model queue batch latency throughput"
).split()


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnRow:
    turn: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_completion_tokens: int
    ttft_s: float
    tokens_per_s: float
    kv_source: str
    answer: str
    # The assistant message as a client sends it back (with its tool calls).
    message: dict[str, Any] = field(default_factory=dict)

    @property
    def tool_call(self) -> str | None:
        """The turn's first tool call as ``name(arguments)``, if it made one."""
        calls = self.message.get("tool_calls") or ()
        if not calls:
            return None
        function = calls[0]["function"]
        return f"{function['name']}({function['arguments']})"


LOOKUP_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a service up in the incident log.",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"service": {"type": "string", "enum": ["cache", "engine", "rack"]}},
            "required": ["service"],
        },
    },
}


def long_document(num_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def stream_chat(
    client: httpx.Client,
    model: str,
    messages: list[dict[str, Any]],
    *,
    max_tokens: int,
    session_id: str | None,
    turn: str,
    extra: dict[str, Any] | None = None,
) -> TurnRow:
    """One streamed chat turn (``extra``: more request fields, e.g. tools); measures
    TTFT and decode speed at the client."""
    headers = {"x-session-id": session_id} if session_id else {}
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    t0 = time.monotonic()
    t_first: float | None = None
    stream = StreamCollector(request_id=None)
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"turn {turn}: HTTP {resp.status_code}: {resp.text}")
        try:
            for line in resp.iter_lines():
                if stream.feed(line) or stream.tool_calls:
                    t_first = t_first or time.monotonic()
            stream.end()
        except KVTideAPIError as exc:
            raise RuntimeError(f"turn {turn}: {exc}") from None
    t_end = time.monotonic()
    use = stream.usage if isinstance(stream.usage, dict) else {}
    ext = stream.kvtide
    num_out = int(use.get("completion_tokens", 0))
    ttft = (t_first or t_end) - t0
    return TurnRow(
        turn=turn,
        num_prompt_tokens=int(use.get("prompt_tokens", 0)),
        num_cached_tokens=int(use.get("prompt_tokens_details", {}).get("cached_tokens", 0)),
        num_completion_tokens=num_out,
        ttft_s=ttft,
        tokens_per_s=(num_out - 1) / (t_end - (t_first or t_end)) if num_out > 1 else 0.0,
        kv_source=str(ext.get("kv_source", "?")),
        answer="".join(stream.parts),
        message=stream.message(),
    )


def run_demo(
    base_url: str = "http://127.0.0.1:8000",
    *,
    model: str | None = None,
    num_turns: int = 3,
    document_words: int = 1500,
    max_tokens: int = 32,
    timeout_s: float = 300.0,
) -> list[TurnRow]:
    questions = [
        "Summarise the document above in one line.",
        "Which service failed? Look it up in the incident log.",
        "And what happens after the time to live?",
        "List three tools the agent used.",
        "Say it again, shorter.",
    ]
    session = f"demo-{uuid.uuid4().hex[:8]}"
    rows: list[TurnRow] = []
    with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
        model = model or client.get("/v1/models").json()["data"][0]["id"]
        doc = long_document(document_words, seed=7)
        messages = [{"role": "user", "content": f"{doc}\n\n{questions[0]}"}]
        for i in range(num_turns):
            # Turn 2 calls a tool; the next turn sends the call and its result back.
            tool_turn = i == 1
            row = stream_chat(
                client,
                model,
                messages,
                max_tokens=max_tokens if not tool_turn else max(max_tokens, 48),
                session_id=session,
                turn=str(i + 1),
                # An agent offers its tools on every turn (they open the prompt); it
                # asks for a call on turn 2 only.
                extra={
                    "tools": [LOOKUP_TOOL],
                    "tool_choice": (
                        {"type": "function", "function": {"name": "lookup"}}
                        if tool_turn
                        else "none"
                    ),
                },
            )
            rows.append(row)
            calls = row.message.get("tool_calls") or ()
            messages.append(row.message if calls else {"role": "assistant", "content": row.answer})
            for call in calls:
                result = {"service": "cache", "failed_at": "03:12", "error": "evicted"}
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)}
                )
            messages.append({"role": "user", "content": questions[(i + 1) % len(questions)]})
        # Baseline: a fresh conversation as long as the last turn, no session to reuse.
        # The same tool offered under another description: as long a prompt, none of it
        # in any engine's cache.
        fresh = long_document(document_words + 60 * num_turns, seed=11)
        function = {**LOOKUP_TOOL["function"], "description": f"Look up ({session})."}
        rows.append(
            stream_chat(
                client,
                model,
                [{"role": "user", "content": fresh}],
                max_tokens=max_tokens,
                session_id=None,
                turn="fresh",
                extra={"tools": [{**LOOKUP_TOOL, "function": function}], "tool_choice": "none"},
            )
        )
    return rows


def format_turns(rows: list[TurnRow]) -> str:
    """The demo's table: one row per turn, and turn 3's TTFT against a fresh prompt's."""
    head = ("turn", "prompt tok", "cached tok", "TTFT s", "tok/s", "prompt KV came from")
    labels = {
        "sent_back": "sent back from decode (previous turn's KV)",
        "extended": "kept on decode, only the new tokens prefilled there",
        "prefix_cache": "prefix cache on prefill",
        "recomputed": "recomputed on prefill",
    }
    cells = [
        [
            str(r.turn),
            r.num_prompt_tokens,
            r.num_cached_tokens,
            f"{r.ttft_s:.3f}",
            f"{r.tokens_per_s:.1f}",
            labels.get(r.kv_source, r.kv_source),
        ]
        for r in rows
    ]
    lines = [format_table(head, cells, align=(">", ">", ">", ">", ">", "<"))]
    for i, r in enumerate(rows):
        if r.tool_call is not None and i + 1 < len(rows) and rows[i + 1].turn != "fresh":
            after = rows[i + 1]
            lines.append(
                f"turn {r.turn} called {r.tool_call}; turn {after.turn} sent the call and its "
                f"result back: prompt KV {labels.get(after.kv_source, after.kv_source)}"
            )
    # A turn that reused the previous turn's KV: extended where decode kept it, or
    # pulled (sent back, or already in the prefill engine's prefix cache: read nothing).
    reused = [
        r
        for r in rows
        if r.kv_source in ("extended", "sent_back", "prefix_cache") and r.turn not in ("1", "fresh")
    ]
    fresh = [r for r in rows if r.turn == "fresh"]
    if reused and fresh:
        ratio = fresh[0].ttft_s / max(1e-9, reused[-1].ttft_s)
        lines.append(
            f"turn {reused[-1].turn} reused {reused[-1].num_cached_tokens:,} prompt tokens: "
            f"TTFT {ratio:.1f}x lower than recomputing a prompt of the same length"
        )
    return "\n".join(lines)
