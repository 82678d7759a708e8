"""Agent turns through the SDK against a scripted OpenAI-style server (``httpx.MockTransport``).

The fake plays vLLM's OpenAI server for a weather agent: each turn it checks the exact
messages (and fields) it receives, then answers with the reply the script holds. A turn
that calls tools keeps its assistant message in the history exactly as sent, and the
next turn must send it back followed by one ``tool`` message per call.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest

from orchestrator.sdk import (
    AsyncClient,
    Client,
    InvalidArgumentError,
    KVTideSDKError,
    SessionStateError,
    StructuredOutputError,
)

MODEL = "tiny-chat"
SYSTEM = {"role": "system", "content": "You are a weather agent."}
QUESTION = {"role": "user", "content": "Weather in Paris and Oslo?"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
# The assistant message of turn 1 as vLLM sends it: no content, two calls, and the null
# fields its serving layer fills in. The history must keep all of it.
CALLS = [
    {
        "id": "chatcmpl-tool-1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    },
    {
        "id": "chatcmpl-tool-2",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    },
]
CALLING = {"role": "assistant", "content": None, "tool_calls": CALLS, "reasoning_content": None}
RESULTS = [
    {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": '{"temp_c": 18}'},
    {"role": "tool", "tool_call_id": "chatcmpl-tool-2", "content": "9 C, rain"},
]
SUMMARY = {"role": "assistant", "content": "Paris 18 C; Oslo 9 C with rain."}
AS_JSON = {"role": "user", "content": "The same as JSON."}
REPORT = '{"cities": ["Paris", "Oslo"], "coldest": "Oslo"}'
LOGPROBS = {
    "content": [
        {
            "token": "Paris",
            "logprob": -0.01,
            "bytes": [80, 97, 114, 105, 115],
            "top_logprobs": [{"token": "Paris", "logprob": -0.01, "bytes": None}],
        }
    ]
}


class Report(pydantic.BaseModel):
    cities: list[str]
    coldest: str


Check = Callable[[dict[str, Any]], None]


class ScriptedServer:
    """Answers each chat request with the next scripted reply after ``check`` accepted the
    body; streamed requests get the reply as chunks (tool calls in pieces)."""

    def __init__(self) -> None:
        self.script: list[tuple[Check, dict[str, Any], str]] = []
        self.requests: list[httpx.Request] = []

    def expect(self, check: Check, message: dict[str, Any], finish: str = "stop") -> None:
        self.script.append((check, message, finish))

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.path.startswith("/kvtide/sessions/"):
            return httpx.Response(200, json={"deleted": True})  # the session's DELETE
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": MODEL}]})
        body = json.loads(request.content)
        check, message, finish = self.script.pop(0)
        check(body)
        n = len([r for r in self.requests if r.url.path == "/v1/chat/completions"])
        usage = {"prompt_tokens": 40 * n, "completion_tokens": 7, "total_tokens": 40 * n + 7}
        kvtide = {"kv_source": "sent_back" if n > 1 else "recomputed", "ttft_s": 0.1}
        if body.get("stream"):
            return httpx.Response(
                200,
                headers={"content-type": "text/event-stream"},
                content="".join(chunks(message, finish, usage, kvtide, body)).encode(),
            )
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
        if body.get("logprobs"):
            choice["logprobs"] = LOGPROBS
        answer = {"id": f"chatcmpl-{n}", "choices": [choice], "usage": usage, "kvtide": kvtide}
        return httpx.Response(200, json=answer)

    def chats(self) -> list[dict[str, Any]]:
        chat = [r for r in self.requests if r.url.path == "/v1/chat/completions"]
        return [json.loads(r.content) for r in chat]


def chunks(
    message: dict[str, Any],
    finish: str,
    usage: dict[str, Any],
    kvtide: dict[str, Any],
    body: dict[str, Any],
) -> list[str]:
    """The reply as vLLM streams it: content in two pieces (the first with its logprobs
    when asked); each tool call's id and name first, then its arguments in two pieces."""

    def sse(choice: dict[str, Any], **extra: Any) -> str:
        return "data: " + json.dumps({"id": "chatcmpl-s", "choices": [choice], **extra}) + "\n\n"

    out = []
    text = message.get("content") or ""
    for piece in filter(None, (text[: len(text) // 2], text[len(text) // 2 :])):
        choice = {"index": 0, "delta": {"content": piece}, "finish_reason": None}
        if body.get("logprobs") and not out:
            choice["logprobs"] = LOGPROBS
        out.append(sse(choice))
    for i, call in enumerate(message.get("tool_calls") or ()):
        fn, args = call["function"], call["function"]["arguments"]
        head = {"index": i, "id": call["id"], "type": "function", "function": {"name": fn["name"]}}
        out.append(sse({"index": 0, "delta": {"tool_calls": [head]}, "finish_reason": None}))
        for piece in (args[: len(args) // 2], args[len(args) // 2 :]):
            delta = {"tool_calls": [{"index": i, "function": {"arguments": piece}}]}
            out.append(sse({"index": 0, "delta": delta, "finish_reason": None}))
    out.append(sse({"index": 0, "delta": {}, "finish_reason": finish}, kvtide=kvtide))
    out.append("data: " + json.dumps({"id": "chatcmpl-s", "choices": [], "usage": usage}) + "\n\n")
    return [*out, "data: [DONE]\n\n"]


def client_for(server: ScriptedServer, max_retries: int = 3) -> Client:
    return Client(
        "http://kvtide.test",
        transport=httpx.MockTransport(server),
        max_retries=max_retries,
        sleep=lambda seconds: None,
    )


def messages_are(*expected: dict[str, Any]) -> Check:
    def check(body: dict[str, Any]) -> None:
        assert body["messages"] == list(expected)

    return check


# ---- a three-turn tool conversation --------------------------------------------------


def test_a_tool_conversation_sends_calls_and_results_back_as_the_protocol_says() -> None:
    server = ScriptedServer()

    def turn_1(body: dict[str, Any]) -> None:
        # The question, with the tools and the OpenAI fields as given.
        assert body["messages"] == [SYSTEM, QUESTION]
        assert body["tools"] == TOOLS and body["tool_choice"] == "auto"
        assert (body["logprobs"], body["top_logprobs"]) == (True, 1)
        assert body["parallel_tool_calls"] is True  # through extra_body

    def turn_3(body: dict[str, Any]) -> None:
        # The whole conversation so far, then the new question, and the model's schema.
        assert body["messages"] == [SYSTEM, QUESTION, CALLING, *RESULTS, SUMMARY, AS_JSON]
        fmt = body["response_format"]
        assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "Report"
        assert fmt["json_schema"]["schema"] == Report.model_json_schema()

    server.expect(turn_1, CALLING, finish="tool_calls")
    # Turn 2 sends no user message: the reply with its calls, then both results.
    server.expect(messages_are(SYSTEM, QUESTION, CALLING, *RESULTS), SUMMARY)
    server.expect(turn_3, {"role": "assistant", "content": REPORT})

    with client_for(server).session(model=MODEL, system=SYSTEM["content"]) as session:
        first = session.send(
            QUESTION["content"],
            tools=TOOLS,
            tool_choice="auto",
            logprobs=True,
            top_logprobs=1,
            extra_body={"parallel_tool_calls": True},
        )
        # Turn 1 asked for two calls; its message is in the history exactly as sent.
        assert [(c.id, c.name, c.args()) for c in first.tool_calls] == [
            ("chatcmpl-tool-1", "get_weather", {"city": "Paris"}),
            ("chatcmpl-tool-2", "get_weather", {"city": "Oslo"}),
        ]
        assert first.finish_reason == "tool_calls" and first.text == ""
        assert first.logprobs is not None and first.logprobs[0].token == "Paris"
        assert first.logprobs[0].top == (("Paris", -0.01),)
        assert session.messages[-1] == CALLING
        # Nothing else may be sent before every call has its result.
        with pytest.raises(SessionStateError, match="chatcmpl-tool-1"):
            session.send("And Rome?")
        with pytest.raises(InvalidArgumentError, match="no tool call 'call-9'"):
            session.add_tool_result("call-9", "?")
        session.add_tool_result("chatcmpl-tool-1", {"temp_c": 18})  # sent as JSON text
        session.add_tool_result("chatcmpl-tool-2", "9 C, rain")
        assert session.tool_results == RESULTS

        second = session.send(tools=TOOLS)
        assert second.text == SUMMARY["content"] and second.tool_calls == ()
        assert second.logprobs is None  # not asked for

        third = session.send(AS_JSON["content"], response_format=Report)
        assert third.parsed == Report(cities=["Paris", "Oslo"], coldest="Oslo")
        assert third.json() == {"cities": ["Paris", "Oslo"], "coldest": "Oslo"}

    assert server.script == []
    history = [SYSTEM, QUESTION, CALLING, *RESULTS, SUMMARY, AS_JSON, third.message]
    assert session.messages == history
    assert [t.kv_source for t in session.turns] == ["recomputed", "sent_back", "sent_back"]


def test_streamed_tool_calls_are_joined_and_kept_for_the_next_turn() -> None:
    server = ScriptedServer()
    server.expect(messages_are(QUESTION), CALLING, finish="tool_calls")
    server.expect(messages_are(QUESTION, CALLS_STREAMED, *RESULTS), SUMMARY)
    session = client_for(server).session(model=MODEL, renew_every_s=None)

    stream = session.stream(QUESTION["content"], tools=TOOLS)
    assert list(stream) == []  # no text: the reply is two calls
    result = stream.result
    assert [c.arguments for c in result.tool_calls] == ['{"city": "Paris"}', '{"city": "Oslo"}']
    assert session.messages[-1] == CALLS_STREAMED
    for call, output in zip(result.tool_calls, ('{"temp_c": 18}', "9 C, rain"), strict=True):
        session.add_tool_result(call.id, output)
    assert "".join(session.stream(logprobs=True)) == SUMMARY["content"]
    assert session.messages[-1] == SUMMARY and len(session.turns) == 2
    assert [lp.token for lp in session.turns[-1].logprobs or ()] == ["Paris"]


# What the deltas build: the calls as vLLM sent them, without the non-streamed extras.
CALLS_STREAMED = {"role": "assistant", "content": None, "tool_calls": CALLS}


def test_async_session_runs_the_same_tool_turns() -> None:
    server = ScriptedServer()
    server.expect(messages_are(QUESTION), CALLING, finish="tool_calls")
    server.expect(messages_are(QUESTION, CALLING, *RESULTS), SUMMARY)

    async def main() -> str:
        transport = httpx.MockTransport(server)
        async with AsyncClient("http://kvtide.test", transport=transport) as client:
            async with client.session(model=MODEL, renew_every_s=None) as session:
                first = await session.send(QUESTION["content"], tools=TOOLS)
                session.add_tool_result(first.tool_calls[0].id, {"temp_c": 18})
                session.add_tool_result(first.tool_calls[1].id, "9 C, rain")
                return (await session.send()).text

    assert asyncio.run(main()) == SUMMARY["content"]


# ---- failures and mistakes -----------------------------------------------------------


def test_a_failed_tool_turn_keeps_its_results_for_the_retry() -> None:
    server = ScriptedServer()
    server.expect(messages_are(QUESTION), CALLING, finish="tool_calls")
    session = client_for(server, max_retries=0).session(model=MODEL, renew_every_s=None)
    first = session.send(QUESTION["content"], tools=TOOLS)
    for call, output in zip(first.tool_calls, ('{"temp_c": 18}', "9 C, rain"), strict=True):
        session.add_tool_result(call.id, output)

    def refuse(body: dict[str, Any]) -> None:
        raise httpx.ConnectError("connection refused")

    server.expect(refuse, SUMMARY)  # the connection fails: no answer, nothing recorded
    with pytest.raises(KVTideSDKError, match="connection refused"):
        session.send()
    # The results wait for the next try, which sends exactly what the failed one did.
    server.expect(messages_are(QUESTION, CALLING, *RESULTS), SUMMARY)
    assert session.tool_results == RESULTS
    assert session.send().text == SUMMARY["content"] and session.tool_results == []


def test_a_reply_that_is_not_the_json_asked_for_is_in_the_history_and_raises() -> None:
    server = ScriptedServer()
    server.expect(messages_are(QUESTION), {"role": "assistant", "content": '{"cities": ["Pa'})
    session = client_for(server).session(model=MODEL, renew_every_s=None)
    with pytest.raises(StructuredOutputError, match="does not validate as Report") as info:
        session.send(QUESTION["content"], response_format=Report)
    # The server ran the turn: it is in the history, and the error carries its result.
    assert info.value.result is session.turns[-1] and len(session.messages) == 2
    assert isinstance(info.value, ValueError)


def test_fields_set_twice_or_reserved_are_refused_before_sending() -> None:
    server = ScriptedServer()
    session = client_for(server).session(model=MODEL, renew_every_s=None)
    with pytest.raises(InvalidArgumentError, match=r"\['tools'\] given twice"):
        session.send("hi", tools=TOOLS, extra_body={"tools": []})
    with pytest.raises(InvalidArgumentError, match="set by the session"):
        session.send("hi", extra_body={"messages": []})
    with pytest.raises(InvalidArgumentError, match="nothing to send"):
        session.send()
    with pytest.raises(InvalidArgumentError, match="model_json_schema"):
        session.send("hi", response_format=dict)
    assert server.requests == [] and session.turns == []


def test_a_resumed_history_may_hold_tool_calls_and_results() -> None:
    server = ScriptedServer()
    server.expect(messages_are(QUESTION, CALLING, *RESULTS, AS_JSON), SUMMARY)
    client = client_for(server)
    session = client.session(model=MODEL, messages=[QUESTION, CALLING, *RESULTS])
    assert session.send(AS_JSON["content"]).text == SUMMARY["content"]
    with pytest.raises(InvalidArgumentError, match="without its tool_call_id"):
        client.session(messages=[{"role": "tool", "content": "x"}])


# ---- the example ---------------------------------------------------------------------


def test_tools_example_answers_every_call_and_parses_its_verdict(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / "agent_tools.py"
    spec = importlib.util.spec_from_file_location("agent_tools", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "agent_tools", example)  # pydantic looks the module up
    spec.loader.exec_module(example)

    def call(i: int, name: str, arguments: str) -> dict[str, Any]:
        return {
            "id": f"c{i}",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }

    listing = {"role": "assistant", "content": None, "tool_calls": [call(1, "list_files", "{}")]}
    reading = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            call(2, "read_file", '{"path": "logs/test.log"}'),
            call(3, "read_file", '{"path": "nope"}'),
        ],
    }
    answer = {"role": "assistant", "content": "httpx 0.28 dropped proxies=."}
    verdict = {"culprit_package": "httpx", "failing_file": "src/client.py", "fix": "proxy="}

    def roles(*expected: str) -> Check:
        def check(body: dict[str, Any]) -> None:
            assert [m["role"] for m in body["messages"]] == list(expected)
            assert ("tools" in body) == ("response_format" not in body)

        return check

    def answered(body: dict[str, Any]) -> None:
        roles("system", "user", "assistant", "tool", "assistant", "tool", "tool")(body)
        results = {m["tool_call_id"]: m["content"] for m in body["messages"][-2:]}
        assert "1 failed, 212 passed" in results["c2"] and "no file 'nope'" in results["c3"]

    server = ScriptedServer()
    server.expect(roles("system", "user"), listing, finish="tool_calls")
    server.expect(roles("system", "user", "assistant", "tool"), reading, finish="tool_calls")
    server.expect(answered, answer)
    server.expect(
        roles(
            "system", "user", "assistant", "tool", "assistant", "tool", "tool", "assistant", "user"
        ),
        {"role": "assistant", "content": json.dumps(verdict)},
    )
    parsed = example.run(client_for(server))
    assert parsed == example.Verdict(**verdict) and server.script == []
    assert "turn  prompt tok" in capsys.readouterr().out
