"""The differential suite's corpus: requests an agent sends, built from parameters.

Each case is one HTTP request (endpoint, body, streamed or not) or a conversation (a list
of turns whose later turns carry the earlier answers back: assistant messages with their
tool calls, tool results). Greedy unless the case samples with a seed. The same corpus
goes to vLLM's own OpenAI server and to kvtide (``test_differential.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Case", "corpus"]

WORDS = "cache token prefill decode engine session rack domain tensor block layer".split()

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a service up in the incident log.",
            "parameters": {
                "type": "object",
                "properties": {"service": {"type": "string", "enum": ["cache", "engine", "rack"]}},
                "required": ["service"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "restart",
            "description": "Restart a service.",
            "parameters": {
                "type": "object",
                "properties": {"force": {"type": "boolean"}},
                "required": ["force"],
            },
        },
    },
]
SCHEMA = {
    "type": "object",
    "properties": {
        "service": {"type": "string", "enum": ["cache", "engine", "rack"]},
        "failed": {"type": "boolean"},
    },
    "required": ["service", "failed"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Case:
    """One request (``turns`` of one) or a conversation (several: each later turn's
    ``messages`` are appended to the history with the previous answer)."""

    name: str
    endpoint: str
    body: dict[str, Any]
    turns: tuple[dict[str, Any], ...] = ()
    session: bool = False
    tags: tuple[str, ...] = field(default=())


def _text(n: int, seed: int) -> str:
    return " ".join(WORDS[(i * seed + seed) % len(WORDS)] for i in range(n))


def _chats() -> list[Case]:
    cases = []
    prompts = [_text(n, s) for n, s in ((6, 1), (40, 3), (200, 5), (90, 2), (15, 4))]
    samplings: list[dict[str, Any]] = [
        {"temperature": 0},
        {"temperature": 0, "stop": ["rack", "engine"]},
        {"temperature": 0.8, "seed": 11},
        {"temperature": 1.0, "seed": 5, "top_p": 0.9, "top_k": 20},
        {"temperature": 0, "presence_penalty": 1.0, "frequency_penalty": 0.5},
        {"temperature": 0, "repetition_penalty": 1.3},
        {"temperature": 0, "logit_bias": {"5": -100, "17": 3}},
        {"temperature": 0, "logprobs": True, "top_logprobs": 3},
        {"temperature": 0.7, "seed": 3, "n": 3},
        {"temperature": 0, "response_format": {"type": "json_object"}},
        {
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "verdict", "schema": SCHEMA},
            },
        },
        {"temperature": 0, "tools": TOOLS, "tool_choice": "required"},
        {
            "temperature": 0,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "restart"}},
        },
        {"temperature": 0, "tools": TOOLS, "tool_choice": "none"},
        {"temperature": 0, "tools": TOOLS, "tool_choice": "auto"},
        {"temperature": 0, "max_tokens": 1},
        {"temperature": 0, "prompt_logprobs": 2},
        {"temperature": 0.5, "seed": 9, "n": 2, "logprobs": True, "top_logprobs": 1},
    ]
    for (i, prompt), (j, sampling), stream in itertools.product(
        enumerate(prompts), enumerate(samplings), (False, True)
    ):
        if stream and (sampling.get("n") or sampling.get("prompt_logprobs")):
            continue  # compared unstreamed (n choices interleave; prompt logprobs)
        max_tokens = 48 if "tools" in sampling or "response_format" in sampling else 12
        body = {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": prompt},
            ],
            "max_tokens": max_tokens,
            "stream": stream,
            **sampling,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        cases.append(Case(f"chat-p{i}-s{j}-{'stream' if stream else 'full'}", "chat", body))
    return cases


def _completions() -> list[Case]:
    cases = []
    for (i, n), (j, sampling), stream in itertools.product(
        enumerate((8, 120, 40)),
        enumerate(
            [
                {"temperature": 0},
                {"temperature": 0, "logprobs": 2},
                {"temperature": 0, "echo": True},
                {"temperature": 0, "echo": True, "logprobs": 1},
                {"temperature": 0.9, "seed": 7, "n": 2},
                {"temperature": 0, "stop": ["cache"]},
                {"temperature": 0, "response_format": {"type": "json_object"}},
            ]
        ),
        (False, True),
    ):
        if stream and (sampling.get("n") or sampling.get("echo")):
            continue
        body = {"prompt": _text(n, 7 + i), "max_tokens": 10, "stream": stream, **sampling}
        cases.append(Case(f"cmpl-p{i}-s{j}-{'stream' if stream else 'full'}", "completion", body))
    return cases


def _conversations() -> list[Case]:
    """Multi-turn with tool results: turn k's answer (with its tool calls) goes back, then
    the tool's result and a question. With and without a session header."""
    cases = []
    for session, stream in itertools.product((False, True), (False, True)):
        turns = (
            {"tool_choice": "required"},
            {"tool_choice": {"type": "function", "function": {"name": "lookup"}}},
            {"tool_choice": "none"},
            {"tool_choice": "required"},
        )
        body = {
            "messages": [{"role": "user", "content": _text(150, 9) + "\nWhich service failed?"}],
            "tools": TOOLS,
            "max_tokens": 48,
            "temperature": 0,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        name = f"conv-{'session' if session else 'history'}-{'stream' if stream else 'full'}"
        cases.append(Case(name, "chat", body, turns=turns, session=session))
    return cases


def _invalid() -> list[Case]:
    bad: list[dict[str, Any]] = [
        {"tool_choice": "required"},  # no tools
        {"tools": [{"type": "function"}]},
        {"response_format": {"type": "json_schema"}},
        {"logprobs": True, "top_logprobs": 50},
        {"n": 0},
        {"temperature": -1},
        {"logit_bias": {"x": 1}},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    ]
    return [
        Case(
            f"invalid-{k}",
            "chat",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **b},
            tags=("invalid",),
        )
        for k, b in enumerate(bad)
    ]


def corpus() -> list[Case]:
    return [*_chats(), *_completions(), *_conversations(), *_invalid()]
