"""The session-aware SDK against a hand-written fake kvtide (``httpx.MockTransport``).

The fake keeps each session's KV the way the server contract says: a session's second
turn reuses what the first left behind (``kv_source="sent_back"``), a completed turn's
answer is stored under its idempotency key and replayed to a retry, and failures are
scripted per request. Time is a fake clock that the fake server advances, so timings are
exact and nothing sleeps.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest

from orchestrator.sdk import (
    APIConnectionError,
    AsyncClient,
    AsyncSession,
    AuthenticationError,
    BadRequestError,
    Client,
    ConflictError,
    EngineUnavailableError,
    KVTideAPIError,
    NotFoundError,
    RateLimitError,
    Session,
    StructuredOutputError,
    TurnResult,
    format_turns,
)

MODEL = "tiny-chat"
Script = Callable[[httpx.Request], httpx.Response]


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


class TimedStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """An SSE body whose events arrive at set times (the fake clock moves before each);
    ``drop_after`` breaks the connection after that many events."""

    def __init__(
        self, events: list[tuple[float, str]], clock: FakeClock, drop_after: int | None = None
    ) -> None:
        self.events, self.clock, self.drop_after = events, clock, drop_after

    def _chunks(self) -> Iterator[bytes]:
        for i, (delay_s, event) in enumerate(self.events):
            if i == self.drop_after:
                raise httpx.ReadError("connection reset by peer")
            self.clock.advance(delay_s)
            yield event.encode()

    def __iter__(self) -> Iterator[bytes]:
        yield from self._chunks()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks():
            yield chunk


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> httpx.Response:
    body = {"error": {"message": message, "type": "error", "param": None, "code": code}}
    ids = {"x-request-id": "serve-9", "x-kvtide-request-id": "req-err"}  # as behind Serve
    return httpx.Response(status, json=body, headers={**ids, **(headers or {})})


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class FakeKVTide:
    """Answers as kvtide would; ``script`` holds what the next chat requests get instead."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.requests: list[httpx.Request] = []
        self.script: list[Script | Exception] = []
        self.stored: dict[str, dict[str, Any]] = {}  # idempotency key -> completed answer
        self.held: dict[str, int] = {}  # session id -> tokens of KV kept after its last turn
        self.num_runs = 0
        self.stream_error: dict[str, Any] | None = None
        self.drop_stream_after: int | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path, method = request.url.path, request.method
        if path == "/v1/chat/completions":
            if self.script:
                step = self.script.pop(0)
                if isinstance(step, Exception):
                    raise step
                return step(request)
            return self.chat(request)
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": MODEL}]})
        if path == "/kvtide/stats":
            return httpx.Response(200, json={"kv": {"num_sessions": len(self.held)}})
        sid = path.split("/")[3]
        if method == "DELETE":
            self.held.pop(sid, None)
            return httpx.Response(
                200, json={"id": sid, "object": "session.deleted", "deleted": True}
            )
        if path.endswith("/renew") and sid not in self.held:
            return error_response(404, "session_not_found", f"session {sid!r} is not known")
        record = None
        if sid in self.held:
            record = {"engine_id": "decode-0", "num_tokens": self.held[sid], "bytes_held": 4096}
            record["expires_in_s"] = 480.0
        body = {"id": sid, "object": "session", "record": record, "lease_expires_in_s": 480.0}
        return httpx.Response(200, json=body)

    # ---- the turn -----------------------------------------------------------------

    def run_turn(self, request: httpx.Request) -> dict[str, Any]:
        """Run a turn once, remembering its answer under the idempotency key."""
        body = json.loads(request.content)
        sid, key = request.headers["x-session-id"], request.headers["idempotency-key"]
        self.num_runs += 1
        messages = body["messages"]
        num_prompt = sum(len(m["content"].split()) + 4 for m in messages)
        num_cached = self.held.get(sid, 0)
        words = f"answer {sum(m['role'] == 'user' for m in messages)} from kvtide".split()
        self.held[sid] = num_prompt + len(words)
        answer = {
            "id": f"chatcmpl-{self.num_runs}",
            "words": words,
            "usage": {
                "prompt_tokens": num_prompt,
                "completion_tokens": len(words),
                "total_tokens": num_prompt + len(words),
                "prompt_tokens_details": {"cached_tokens": num_cached},
            },
            "kvtide": {
                "request_id": f"chatcmpl-{self.num_runs}",
                "session_id": sid,
                "kv_source": "sent_back" if num_cached else "recomputed",
                "kv_plan": "pull" if num_cached else "recompute",
                "kv_plan_reason": "",
                "pull_fallback": False,
                "num_cached_tokens": num_cached,
                "prefill_s": 0.2,
                "ttft_s": 0.25,
                "router_s": 0.001,
            },
        }
        self.stored[key] = answer
        return answer

    def chat(self, request: httpx.Request) -> httpx.Response:
        key = request.headers["idempotency-key"]
        answer = self.stored.get(key) or self.run_turn(request)
        rid = answer["id"]
        if not json.loads(request.content).get("stream"):
            self.clock.advance(1.0)
            body = {
                "id": rid,
                "object": "chat.completion",
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": " ".join(answer["words"])},
                        "finish_reason": "stop",
                    }
                ],
                "usage": answer["usage"],
                "kvtide": answer["kvtide"],
            }
            return httpx.Response(200, json=body, headers=self.id_headers(rid))
        return httpx.Response(
            200,
            headers={**self.id_headers(rid), "content-type": "text/event-stream"},
            stream=TimedStream(self.events(answer), self.clock, self.drop_stream_after),
        )

    def id_headers(self, rid: str) -> dict[str, str]:
        """As behind Ray Serve: Serve's own x-request-id, kvtide's id in its header."""
        return {"x-request-id": f"serve-{len(self.requests)}", "x-kvtide-request-id": rid}

    def events(self, answer: dict[str, Any]) -> list[tuple[float, str]]:
        """The first token after 0.5 s, then one every 0.1 s; usage and [DONE] at once."""
        base = {"id": answer["id"], "object": "chat.completion.chunk", "model": MODEL}
        words: list[str] = answer["words"]
        out = []
        for i, word in enumerate(words):
            text = word if i == 0 else " " + word
            choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
            chunk: dict[str, Any] = {**base, "choices": [choice]}
            if i == len(words) - 1:
                choice["finish_reason"] = "stop"
                chunk["kvtide"] = answer["kvtide"]
            out.append((0.5 if i == 0 else 0.1, sse(chunk)))
        if self.stream_error is not None:
            out.insert(2, (0.1, sse({"error": self.stream_error})))
        out.append((0.0, sse({**base, "choices": [], "usage": answer["usage"]})))
        out.append((0.0, "data: [DONE]\n\n"))
        return out

    # ---- what the client sent -----------------------------------------------------

    def chats(self) -> list[httpx.Request]:
        return [r for r in self.requests if r.url.path == "/v1/chat/completions"]

    def keys(self) -> list[str]:
        return [r.headers["idempotency-key"] for r in self.chats()]

    def calls(self, method: str, suffix: str = "") -> list[httpx.Request]:
        return [
            r
            for r in self.requests
            if r.method == method and r.url.path.startswith("/kvtide/sessions/")
            if r.url.path.endswith(suffix)
        ]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def server(clock: FakeClock) -> FakeKVTide:
    return FakeKVTide(clock)


@pytest.fixture
def sleeps() -> list[float]:
    return []


def make_client(server: FakeKVTide, sleeps: list[float], **kwargs: Any) -> Client:
    return Client(
        "http://kvtide.test/v1",
        transport=httpx.MockTransport(server),
        sleep=sleeps.append,
        clock=server.clock,
        rand=lambda: 0.0,
        **kwargs,
    )


def make_async_client(server: FakeKVTide, sleeps: list[float], **kwargs: Any) -> AsyncClient:
    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    return AsyncClient(
        "http://kvtide.test",
        transport=httpx.MockTransport(server),
        sleep=sleep,
        clock=server.clock,
        rand=lambda: 0.0,
        **kwargs,
    )


def body_of(request: httpx.Request) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(request.content)
    return body


# ---- a session's turns ---------------------------------------------------------------


def test_three_turn_session_grows_history_and_reuses_kv(
    server: FakeKVTide, sleeps: list[float]
) -> None:
    client = make_client(server, sleeps, api_key="sk-test")
    with client.session(system="Be brief.", renew_every_s=None) as session:
        results = [session.send(q, max_tokens=16, temperature=0.0) for q in ("a b", "c", "d e")]

    chats = server.chats()
    # Every turn carries the session id, the key and the API key; each turn a new key.
    assert {r.headers["x-session-id"] for r in chats} == {session.id}
    assert {r.headers["authorization"] for r in chats} == {"Bearer sk-test"}
    assert len(set(server.keys())) == 3
    # The history grows by the user message and the reply of each completed turn.
    assert [len(body_of(r)["messages"]) for r in chats] == [2, 4, 6]
    last = body_of(chats[-1])
    assert last["model"] == MODEL  # asked GET /v1/models once, then remembered
    assert [r.url.path for r in server.requests].count("/v1/models") == 1
    assert (last["max_tokens"], last["temperature"], last["stream"]) == (16, 0.0, False)
    assert last["messages"][:3] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a b"},
        {"role": "assistant", "content": "answer 1 from kvtide"},
    ]
    assert session.messages[-1] == {"role": "assistant", "content": "answer 3 from kvtide"}
    # Turn 1 computed its prompt; later turns reused the KV the previous turn left behind.
    assert [r.kv_source for r in results] == ["recomputed", "sent_back", "sent_back"]
    assert results[1].cached_tokens == results[0].prompt_tokens + results[0].completion_tokens
    assert [r.turn for r in session.turns] == [1, 2, 3]
    # Non-streamed: TTFT is the server's; the fake answered after 1 s of client time.
    first = results[0]
    assert (first.ttft_s, first.server_ttft_s, first.total_s) == (0.25, 0.25, 1.0)
    assert first.tokens_per_s == pytest.approx(3 / 0.75)
    assert first.request_id == "chatcmpl-1" and first.num_attempts == 1
    assert first.kvtide["kv_plan"] == "recompute"


def test_stream_yields_deltas_then_the_result(
    server: FakeKVTide, sleeps: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVTIDE_API_KEY", raising=False)
    client = make_client(server, sleeps)
    session = client.session(model=MODEL, renew_every_s=None)
    session.send("warm up")
    stream = session.stream("go on", traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01")
    deltas = list(stream)

    assert deltas == ["answer", " 2", " from", " kvtide"]
    request = server.chats()[-1]
    assert body_of(request)["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": True,
    }
    assert request.headers["traceparent"].startswith("00-aaaa")
    assert "authorization" not in request.headers  # no key, no header
    result = stream.result
    assert result.text == "answer 2 from kvtide" and result.streamed
    assert (result.kv_source, result.finish_reason) == ("sent_back", "stop")
    assert result.cached_tokens == session.turns[0].prompt_tokens + 4
    # Client-measured: first token 0.5 s after the call, then 3 more at 0.1 s each.
    assert result.ttft_s == pytest.approx(0.5) and result.server_ttft_s == 0.25
    assert result.tokens_per_s == pytest.approx(3 / 0.3)
    assert session.turns[-1] == result
    assert session.messages[-1] == {"role": "assistant", "content": "answer 2 from kvtide"}


def test_error_inside_a_stream_raises_its_type_and_keeps_history(
    server: FakeKVTide, sleeps: list[float]
) -> None:
    session = make_client(server, sleeps).session(model=MODEL, renew_every_s=None)
    server.stream_error = {"message": "decode engine died", "type": "server_error", "code": None}
    server.stream_error["code"] = "engine_unavailable"
    stream = session.stream("hello")
    seen = []
    with pytest.raises(EngineUnavailableError, match="decode engine died") as info:
        for delta in stream:
            seen.append(delta)

    assert seen == ["answer", " 1"]  # what came before the error
    assert info.value.status_code is None and info.value.code == "engine_unavailable"
    assert info.value.idempotency_key == server.keys()[0]
    assert session.turns == [] and session.messages == []
    # The session is usable again: the next turn runs normally.
    server.stream_error = None
    assert session.send("hello").text == "answer 1 from kvtide"


def stream_of(
    words: list[str],
    clock: FakeClock,
    *,
    error_after: int | None = None,
    error_code: str = "engine_unavailable",
    drop_after: int | None = None,
    replayed: bool = False,
) -> Script:
    """A chat stream of ``words``, one token each, every chunk with the usage so far
    (``continuous_usage_stats``); with ``error_after`` the server's engine fails after
    that many words and the stream ends with kvtide's error event (tokens so far); with
    ``drop_after`` the connection breaks after that many events; ``replayed``: the
    server's replay of a completed turn (its header)."""

    def answer(request: httpx.Request) -> httpx.Response:
        base = {"id": "chatcmpl-r", "object": "chat.completion.chunk", "model": MODEL}
        events = []
        for i, word in enumerate(words[:error_after]):
            last = error_after is None and i == len(words) - 1
            choice = {"index": 0, "delta": {"content": word}, "finish_reason": None}
            if last:
                choice["finish_reason"] = "length"
            so_far = {"prompt_tokens": 30, "completion_tokens": i + 1, "total_tokens": 31 + i}
            events.append((0.1, sse({**base, "choices": [choice], "usage": so_far})))
        if error_after is not None:
            error = {"message": "no decode engine left", "type": "server_error"}
            error |= {"param": None, "code": error_code}
            events.append((0.1, sse({"error": error, "kvtide": {"completion_tokens": 3}})))
        else:
            usage = {"prompt_tokens": 30, "completion_tokens": len(words), "total_tokens": 0}
            events.append((0.0, sse({**base, "choices": [], "usage": usage})))
        events.append((0.0, "data: [DONE]\n\n"))
        headers = {"content-type": "text/event-stream", "x-kvtide-request-id": "chatcmpl-r"}
        if replayed:
            headers["x-kvtide-replayed"] = "true"
        return httpx.Response(200, headers=headers, stream=TimedStream(events, clock, drop_after))

    return answer


def stream_async(
    server: FakeKVTide, sleeps: list[float], text: str
) -> tuple[list[str], TurnResult]:
    """One streamed turn of a new async session: its deltas and result."""

    async def main() -> tuple[list[str], TurnResult]:
        async with make_async_client(server, sleeps) as client:
            session = client.session(model=MODEL, renew_every_s=None)
            stream = await session.stream(text)
            return [d async for d in stream], stream.result

    return asyncio.run(main())


def test_a_stream_broken_by_an_engine_failure_goes_on_where_it_stopped(
    server: FakeKVTide, sleeps: list[float]
) -> None:
    session = make_client(server, sleeps).session(model=MODEL, renew_every_s=None)
    # Three tokens reached the client as two deltas; then no decode engine was left.
    server.script = [
        stream_of(["Once", " upon", " a"], server.clock, error_after=2),
        stream_of([" time", " there"], server.clock),
    ]
    stream = session.stream("tell me", max_tokens=8, min_tokens=4)
    deltas = list(stream)
    assert deltas == ["Once", " upon", " time", " there"]  # each token once
    first, resumed = server.chats()
    body = body_of(resumed)
    # The continuation: the same conversation, the text so far to be continued, and
    # what is left of the token budget; a key of its own, derived from the turn's.
    assert body["messages"] == [
        *body_of(first)["messages"],
        {"role": "assistant", "content": "Once upon"},
    ]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert (body["max_tokens"], body["min_tokens"]) == (5, 1)
    key = first.headers["idempotency-key"]
    assert resumed.headers["idempotency-key"] == f"{key}.resume1"
    result = stream.result
    assert result.text == "Once upon time there" and result.num_resumes == 1
    assert result.completion_tokens == 3 + 2 and result.idempotency_key == key
    assert session.messages[-1] == {"role": "assistant", "content": "Once upon time there"}


def cut_short(answer: Script) -> Script:
    """``answer``'s stream closed right after its last event that says something: no
    ``[DONE]``, no usage event, and no blank line after that last event."""

    def cut(request: httpx.Request) -> httpx.Response:
        response = answer(request)
        assert isinstance(response.stream, TimedStream)
        events = [e for e in response.stream.events if '"choices": []' not in e[1]][:-1]
        delay_s, last = events[-1]
        response.stream.events = [*events[:-1], (delay_s, last.rstrip("\n"))]
        return response

    return cut


@pytest.mark.parametrize("shell", ["sync", "async"])
def test_a_last_event_without_its_blank_line_still_counts(
    server: FakeKVTide, sleeps: list[float], shell: str
) -> None:
    # The server closed the body right after the event with the last word and the
    # finish_reason: that word is shown and the turn is complete.
    server.script = [cut_short(stream_of(["Once", " upon", " a"], server.clock))]
    if shell == "sync":
        stream = make_client(server, sleeps).session(model=MODEL, renew_every_s=None).stream("x")
        deltas, result = list(stream), stream.result
    else:
        deltas, result = stream_async(server, sleeps, "x")
    assert deltas == ["Once", " upon", " a"]
    assert result.text == "Once upon a" and result.finish_reason == "length"


@pytest.mark.parametrize("shell", ["sync", "async"])
def test_a_stream_that_ended_on_an_engine_failure_goes_on_in_the_next_body(
    server: FakeKVTide, sleeps: list[float], shell: str
) -> None:
    # The engine-failure event is the body's last, without its blank line; the
    # continuation's body is read in full after it.
    server.script = [
        cut_short(stream_of(["Once", " upon", " a"], server.clock, error_after=2)),
        stream_of([" time", " there"], server.clock),
    ]
    if shell == "sync":
        stream = make_client(server, sleeps).session(model=MODEL, renew_every_s=None).stream("x")
        deltas, result = list(stream), stream.result
    else:
        deltas, result = stream_async(server, sleeps, "x")
    assert deltas == ["Once", " upon", " time", " there"]
    assert result.text == "Once upon time there" and result.num_resumes == 1
    assert len(server.chats()) == 2


def test_a_broken_stream_is_not_continued_past_its_budget_or_without_a_count(
    server: FakeKVTide, sleeps: list[float]
) -> None:
    session = make_client(server, sleeps).session(model=MODEL, renew_every_s=None)
    # The engine failed after the turn's last allowed token: nothing to continue.
    server.script = [stream_of(["a", " b", " c"], server.clock, error_after=2)]
    with pytest.raises(EngineUnavailableError):
        list(session.stream("x", max_tokens=3))
    assert len(server.chats()) == 1 and session.messages == []


@pytest.mark.parametrize("code", ["engine_unavailable", "service_unavailable", "stream_failed"])
def test_a_failed_stream_is_continued_up_to_max_retries_times(
    server: FakeKVTide, sleeps: list[float], code: str
) -> None:
    session = make_client(server, sleeps, max_retries=1).session(model=MODEL, renew_every_s=None)
    # Both the stream and its one continuation fail: a second continuation is not sent.
    server.script = [
        stream_of(["Once", " upon", " a"], server.clock, error_after=1, error_code=code),
        stream_of([" upon", " a"], server.clock, error_after=1, error_code=code),
    ]
    with pytest.raises(KVTideAPIError) as err:
        list(session.stream("tell me", max_tokens=32))
    assert err.value.code == code
    assert len(server.chats()) == 2 and session.messages == []


def test_async_stream_goes_on_after_an_engine_failure(
    server: FakeKVTide, sleeps: list[float]
) -> None:
    server.script = [
        stream_of(["Once", " upon", " a"], server.clock, error_after=2),
        stream_of([" time"], server.clock),
    ]

    deltas, result = stream_async(server, sleeps, "tell me")
    assert deltas == ["Once", " upon", " time"] and result.num_resumes == 1
    body = body_of(server.chats()[1])
    assert body["messages"][-1] == {"role": "assistant", "content": "Once upon"}
    assert "max_tokens" not in body  # none was set: the server's default applies


def test_a_stream_cut_by_a_broken_connection_goes_on_under_the_same_key(
    server: FakeKVTide, sleeps: list[float]
) -> None:
    session = make_client(server, sleeps).session(model=MODEL, renew_every_s=None)
    # Two tokens arrived, then the connection broke; the server had dropped the turn
    # (the key is free again), so the continuation runs.
    server.script = [
        stream_of(["Once", " upon", " a"], server.clock, drop_after=2),
        stream_of([" a", " time"], server.clock),
    ]
    stream = session.stream("tell me", max_tokens=8)
    assert list(stream) == ["Once", " upon", " a", " time"]
    first, again = server.chats()
    body = body_of(again)
    assert body["messages"][-1] == {"role": "assistant", "content": "Once upon"}
    assert body["continue_final_message"] is True and body["max_tokens"] == 6
    # The same key as the broken request: had the turn finished, this is its replay.
    assert again.headers["idempotency-key"] == first.headers["idempotency-key"]
    result = stream.result
    assert result.text == "Once upon a time" and result.num_resumes == 1
    assert session.messages[-1] == {"role": "assistant", "content": "Once upon a time"}


def test_a_turn_that_finished_behind_a_broken_connection_is_replayed_not_run_again(
    server: FakeKVTide, sleeps: list[float]
) -> None:
    session = make_client(server, sleeps).session(model=MODEL, renew_every_s=None)
    # The server finished the turn; the retry with its key gets the stored response,
    # whose first two tokens the caller has seen: only the rest is new.
    server.script = [
        stream_of(["Once", " upon", " a", " time"], server.clock, drop_after=2),
        stream_of(["Once", " upon", " a", " time"], server.clock, replayed=True),
    ]
    stream = session.stream("tell me", max_tokens=8)
    assert list(stream) == ["Once", " upon", " a", " time"]
    assert stream.result.text == "Once upon a time"
    first, again = server.chats()
    assert again.headers["idempotency-key"] == first.headers["idempotency-key"]


def test_a_replay_that_differs_from_what_was_streamed_is_an_error(
    server: FakeKVTide, sleeps: list[float]
) -> None:
    session = make_client(server, sleeps).session(model=MODEL, renew_every_s=None)
    server.script = [
        stream_of(["Once", " upon", " a"], server.clock, drop_after=2),
        stream_of(["Long", " ago"], server.clock, replayed=True),
    ]
    with pytest.raises(KVTideAPIError, match="differs"):
        list(session.stream("tell me"))
    assert session.messages == []


def test_async_stream_goes_on_after_a_broken_connection(
    server: FakeKVTide, sleeps: list[float]
) -> None:
    server.script = [
        stream_of(["Once", " upon", " a"], server.clock, drop_after=1),
        stream_of([" upon", " a"], server.clock),
    ]

    deltas, result = stream_async(server, sleeps, "tell me")
    assert deltas == ["Once", " upon", " a"] and result.num_resumes == 1
    first, again = server.chats()
    assert again.headers["idempotency-key"] == first.headers["idempotency-key"]


def test_broken_stream_raises_connection_error(server: FakeKVTide, sleeps: list[float]) -> None:
    session = make_client(server, sleeps).session(model=MODEL, renew_every_s=None)
    # A server whose chunks carry no usage so far: the tokens made are unknown.
    server.drop_stream_after = 2
    with pytest.raises(APIConnectionError, match=r"stream .* broke off .*ReadError"):
        list(session.stream("hello"))
    assert session.turns == [] and sleeps == []  # deltas were shown: no silent retry


def test_stream_closed_early_is_not_added_to_the_history(
    server: FakeKVTide, sleeps: list[float]
) -> None:
    session = make_client(server, sleeps).session(model=MODEL, renew_every_s=None)
    with session.stream("hello") as stream:
        assert next(stream) == "answer"
    with pytest.raises(RuntimeError, match="not finished"):
        _ = stream.result
    assert session.turns == []
    assert session.send("again").turn == 1


# ---- retries and idempotency ---------------------------------------------------------


def test_503_is_retried_with_the_same_key_and_the_turn_kept_once(
    server: FakeKVTide, sleeps: list[float]
) -> None:
    session = make_client(server, sleeps).session(model=MODEL, renew_every_s=None)
    server.script = [lambda r: error_response(503, "engine_unavailable", "no decode engine")]
    result = session.send("hello")

    assert len(server.keys()) == 2 and len(set(server.keys())) == 1
    assert sleeps == [0.5]  # initial backoff; jitter drew 0
    assert result.num_attempts == 2 and server.num_runs == 1
    assert len(session.turns) == 1 and len(session.messages) == 2


def test_turn_in_progress_then_replay_runs_the_turn_once(
    server: FakeKVTide, sleeps: list[float]
) -> None:
    session = make_client(server, sleeps).session(model=MODEL, renew_every_s=None)

    def run_then_drop(request: httpx.Request) -> httpx.Response:
        server.run_turn(request)  # the turn completes, but its answer is lost on the way
        raise httpx.RemoteProtocolError("server disconnected", request=request)

    in_progress = error_response(
        409, "turn_in_progress", "turn still running", headers={"retry-after": "2"}
    )
    server.script = [run_then_drop, lambda r: in_progress]
    result = session.send("hello")

    assert server.num_runs == 1 and len(set(server.keys())) == 1
    assert sleeps == [0.5, 2.0]  # backoff, then the server's retry-after
    assert result.text == "answer 1 from kvtide" and result.num_attempts == 3
    assert len(session.turns) == 1


def test_a_turn_still_running_past_the_retry_budget_raises_the_409(
    server: FakeKVTide, sleeps: list[float]
) -> None:
    # The turn's ingress died with it: the server answers 409 until its book forgets it.
    session = make_client(server, sleeps, max_retries=2).session(model=MODEL, renew_every_s=None)
    in_progress = error_response(409, "turn_in_progress", "turn still running")
    server.script = [lambda r: in_progress] * 3
    with pytest.raises(KVTideAPIError) as info:
        session.send("hello")
    assert (info.value.status_code, info.value.code) == (409, "turn_in_progress")
    assert len(server.chats()) == 3 and len(set(server.keys())) == 1  # one key throughout
    assert session.turns == []


@pytest.mark.parametrize(
    ("status", "code", "error_type"),
    [
        (400, "context_length_exceeded", BadRequestError),
        (401, "invalid_api_key", AuthenticationError),
        (404, "model_not_found", NotFoundError),
        (409, "idempotency_key_reused", ConflictError),
        (429, "rate_limit_exceeded", RateLimitError),
    ],
)
def test_non_retryable_errors_raise_at_once_with_the_server_message(
    server: FakeKVTide,
    sleeps: list[float],
    status: int,
    code: str,
    error_type: type[KVTideAPIError],
) -> None:
    session = make_client(server, sleeps).session(model=MODEL, renew_every_s=None)
    server.script = [lambda r: error_response(status, code, f"the server says {code}")]
    with pytest.raises(error_type) as info:
        session.send("hello")

    err = info.value
    assert (err.status_code, err.code, err.message) == (status, code, f"the server says {code}")
    assert f"the server says {code}" in str(err) and err.request_id == "req-err"
    assert not err.retryable and sleeps == [] and len(server.chats()) == 1
    assert session.turns == [] and session.messages == []


def test_concurrency_limit_429_is_retried(server: FakeKVTide, sleeps: list[float]) -> None:
    session = make_client(server, sleeps).session(model=MODEL, renew_every_s=None)
    busy = error_response(429, "concurrency_limit_exceeded", "too many turns in flight")
    server.script = [lambda r: busy, lambda r: busy]
    assert session.send("hello").num_attempts == 3
    assert sleeps == [0.5, 1.0]


def test_connection_errors_retry_then_raise_and_the_key_resends_the_turn(
    server: FakeKVTide, sleeps: list[float]
) -> None:
    session = make_client(server, sleeps, max_retries=2).session(model=MODEL, renew_every_s=None)
    refused = httpx.ConnectError("connection refused")
    server.script = [refused, refused, refused]
    with pytest.raises(APIConnectionError, match="connection refused") as info:
        session.send("hello")

    assert len(server.chats()) == 3 and sleeps == [0.5, 1.0]  # max_retries=2: 3 attempts
    assert info.value.retryable and info.value.idempotency_key == server.keys()[0]
    assert session.turns == []
    # Resending with the error's key is the same turn to the server.
    session.send("hello", idempotency_key=info.value.idempotency_key)
    assert server.keys()[-1] == server.keys()[0] and server.num_runs == 1


# ---- closing and renewing ------------------------------------------------------------


def test_close_deletes_once_also_on_context_exit(server: FakeKVTide, sleeps: list[float]) -> None:
    client = make_client(server, sleeps)
    session = client.session(model=MODEL, renew_every_s=None)
    session.send("hello")
    session.close()
    session.close()
    assert [r.url.path for r in server.calls("DELETE")] == [f"/kvtide/sessions/{session.id}"]
    assert session.id not in server.held
    with pytest.raises(RuntimeError, match="closed"):
        session.send("more")

    with pytest.raises(ValueError, match="boom"), client.session(renew_every_s=None) as other:
        raise ValueError("boom")  # the block's own error still reaches the caller
    with client.session("agent-7", renew_every_s=None) as third:
        third.close()
    deleted = [r.url.path.rsplit("/", 1)[1] for r in server.calls("DELETE")]
    assert deleted == [session.id, other.id, "agent-7"]


def test_renewal_is_due_an_interval_after_the_last_activity(
    server: FakeKVTide, sleeps: list[float], clock: FakeClock
) -> None:
    session = make_client(server, sleeps).session(model=MODEL, renew_every_s=60.0)
    assert not session._renew_due(clock() + 600)  # no turn yet: nothing to keep

    session.send("hello")
    done = clock()
    assert not session._renew_due(done + 59.9)
    assert session._renew_due(done + 60.0)
    assert session._renew_if_due(done + 60.0)
    assert len(server.calls("POST", "/renew")) == 1
    assert not session._renew_due(clock() + 59.9)  # the renewal restarts the interval

    server.held.clear()  # the server dropped the KV: renewal stops until the next turn
    assert session._renew_if_due(clock() + 60)
    assert isinstance(session.renew_error, NotFoundError)
    assert not session._renew_due(clock() + 6000)
    session.send("again")
    assert session._renew_due(clock() + 60) and session.renew_error is not None
    session.close()
    assert not session._renew_due(clock() + 6000)


def test_renew_loop_waits_until_due_and_stops_when_told(
    server: FakeKVTide, sleeps: list[float], clock: FakeClock
) -> None:
    session = make_client(server, sleeps).session(model=MODEL, renew_every_s=60.0)
    session._stop_renewer()  # drive the loop by hand instead of the thread
    session.send("hello")
    clock.advance(15.0)
    waits: list[float] = []

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        clock.advance(seconds)
        return len(waits) > 3  # stop on the fourth wait

    session._renew_loop(wait)
    assert waits == [45.0, 60.0, 60.0, 60.0]
    assert len(server.calls("POST", "/renew")) == 3


def test_background_thread_stops_on_close(server: FakeKVTide, sleeps: list[float]) -> None:
    session = make_client(server, sleeps).session(model=MODEL, renew_every_s=3600.0)
    session.send("hello")
    renewer = session._renewer
    assert renewer is not None and renewer.daemon and renewer.is_alive()
    session.close()
    assert not renewer.is_alive()


def test_deleting_a_session_the_server_no_longer_knows_is_not_an_error(
    sleeps: list[float],
) -> None:
    # One session expired on the server (session_not_found); any other 404 is an error.
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/expired"):
            return error_response(404, "session_not_found", "session 'expired' is not known")
        return error_response(404, "not_found", "this route is off (server.sessions_api)")

    transport = httpx.MockTransport(answer)
    client = Client("http://kvtide.test", transport=transport, sleep=sleeps.append)
    client.delete_session("expired")
    with pytest.raises(NotFoundError, match="route is off"):
        client.delete_session("other")

    async def main() -> None:
        async with AsyncClient("http://kvtide.test", transport=transport) as aclient:
            await aclient.delete_session("expired")
            with pytest.raises(NotFoundError, match="route is off"):
                await aclient.delete_session("other")

    asyncio.run(main())
    assert sleeps == []  # a 404 is not retried


def test_a_streamed_reply_that_does_not_validate_is_kept_and_its_kv_renewed(
    server: FakeKVTide, sleeps: list[float]
) -> None:
    class Verdict(pydantic.BaseModel):
        verdict: str

    session = make_client(server, sleeps).session(model=MODEL, renew_every_s=60.0)
    stream = session.stream("hello", response_format=Verdict)
    with pytest.raises(StructuredOutputError):
        list(stream)
    # The server ran the turn and keeps its KV: the turn is in the history, and the
    # session renews its lease while idle, as after any turn.
    assert len(session.turns) == 1 and len(session.messages) == 2
    assert session._renewer is not None and session._renewer.is_alive()
    session.close()
    assert not session._renewer.is_alive()


def test_info_renew_stats_and_validation(server: FakeKVTide, sleeps: list[float]) -> None:
    client = make_client(server, sleeps)
    session = client.session(model=MODEL, renew_every_s=None)
    assert session.info().record is None
    with pytest.raises(NotFoundError, match="is not known") as info:
        session.renew()
    assert info.value.code == "session_not_found"
    session.send("hello")
    renewed = session.renew()
    record = renewed.record
    assert record is not None and record.engine_id == "decode-0" and record.expires_in_s == 480.0
    assert renewed.lease_expires_in_s == 480.0 and renewed.raw["object"] == "session"
    assert client.stats() == {"kv": {"num_sessions": 1}}
    with pytest.raises(ValueError, match="1-128 characters"):
        client.session("has spaces")
    with pytest.raises(TypeError, match="set by the session"):
        session.send("x", messages=[])


def test_format_turns_prints_one_row_per_turn() -> None:
    turn = TurnResult(
        turn=2,
        session_id="s",
        text="",
        finish_reason="stop",
        prompt_tokens=2604,
        completion_tokens=24,
        cached_tokens=2580,
        kv_source="sent_back",
        ttft_s=0.2312,
        server_ttft_s=0.2,
        tokens_per_s=41.25,
        total_s=0.8,
        request_id=None,
        idempotency_key="k",
        num_attempts=1,
        streamed=True,
    )
    lines = format_turns([turn]).splitlines()
    assert lines[0].split("  ")[0] == "turn"
    assert "prompt tok" in lines[0] and "KV source" in lines[0] and "tok/s" in lines[0]
    assert lines[1].split() == ["2", "2604", "2580", "sent_back", "0.231", "41.2"]


# ---- asyncio -------------------------------------------------------------------------


def test_async_session_turns_stream_and_close(server: FakeKVTide, sleeps: list[float]) -> None:
    async def main() -> tuple[list[TurnResult], list[str], str]:
        async with make_async_client(server, sleeps) as client:
            async with client.session(renew_every_s=None) as session:
                await session.send("one")
                await session.send("two")
                stream = await session.stream("three")
                deltas = [d async for d in stream]
                assert stream.result.ttft_s == pytest.approx(0.5)
                return session.turns, deltas, session.id

    turns, deltas, sid = asyncio.run(main())
    assert [t.kv_source for t in turns] == ["recomputed", "sent_back", "sent_back"]
    assert deltas == ["answer", " 3", " from", " kvtide"] and turns[-1].streamed
    assert [len(body_of(r)["messages"]) for r in server.chats()] == [1, 3, 5]
    assert len(set(server.keys())) == 3
    assert [r.url.path for r in server.calls("DELETE")] == [f"/kvtide/sessions/{sid}"]


def test_async_retry_keeps_the_key_and_errors_are_typed(
    server: FakeKVTide, sleeps: list[float]
) -> None:
    async def main() -> None:
        client = make_async_client(server, sleeps)
        session = client.session(model=MODEL, renew_every_s=None)
        server.script = [lambda r: error_response(503, "engine_unavailable", "no engine")]
        assert (await session.send("hello")).num_attempts == 2
        server.script = [lambda r: error_response(401, "invalid_api_key", "bad key")]
        with pytest.raises(AuthenticationError, match="bad key"):
            await session.send("again")
        server.stream_error = {"message": "pull failed", "code": "engine_unavailable"}
        with pytest.raises(EngineUnavailableError, match="pull failed"):
            async for _ in await session.stream("streamed"):
                pass
        await session.close()
        await session.close()
        await client.aclose()

    asyncio.run(main())
    assert sleeps == [0.5] and server.num_runs == 2
    assert server.keys()[0] == server.keys()[1] != server.keys()[2]
    assert len(server.calls("DELETE")) == 1


def test_async_renewal(server: FakeKVTide, sleeps: list[float], clock: FakeClock) -> None:
    async def main() -> list[float]:
        client = make_async_client(server, sleeps)
        session = client.session(model=MODEL, renew_every_s=60.0)
        await session.send("hello")
        assert session._renewer is not None  # a task waits for the lease to come due
        await session._stop_renewer()
        assert not await session._renew_if_due(clock() + 59.0)
        waits: list[float] = []

        async def wait(seconds: float) -> bool:
            waits.append(seconds)
            clock.advance(seconds)
            return len(waits) > 2

        await session._renew_loop(wait)
        await session.close()
        await client.aclose()
        return waits

    assert asyncio.run(main()) == [60.0, 60.0, 60.0]
    assert len(server.calls("POST", "/renew")) == 2


# ---- the example ---------------------------------------------------------------------


def test_agent_example_runs_five_turns_and_closes(
    server: FakeKVTide, sleeps: list[float], capsys: pytest.CaptureFixture[str]
) -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / "agent_session.py"
    spec = importlib.util.spec_from_file_location("agent_session", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    example.run(make_client(server, sleeps), 5, 16)
    table = capsys.readouterr().out.split("turn  prompt tok")[1].splitlines()
    assert [row.split()[0] for row in table[1:6]] == ["1", "2", "3", "4", "5"]
    assert "recomputed" in table[1] and all("sent_back" in row for row in table[2:6])
    # The context grows every turn: the previous prompt, the reply and the tool output.
    sizes = [len(body_of(r)["messages"]) for r in server.chats()]
    assert sizes == [2, 4, 6, 8, 10]
    assert len(server.calls("DELETE")) == 1


TURN_PARAMETERS = [
    "self",
    "user_text",
    "max_tokens",
    "temperature",
    "tools",
    "tool_choice",
    "response_format",
    "logprobs",
    "top_logprobs",
    "extra_body",
    "traceparent",
    "idempotency_key",
    "sampling",
]


def test_both_shells_show_callers_the_same_named_arguments() -> None:
    # What help(), an IDE and inspect show: the arguments by name, not a wrapper's.
    for method in (Session.send, Session.stream, AsyncSession.send, AsyncSession.stream):
        params = inspect.signature(method).parameters
        assert list(params) == TURN_PARAMETERS, method.__qualname__
        assert params["user_text"].default is None
        assert params["max_tokens"].kind is inspect.Parameter.KEYWORD_ONLY
        assert params["sampling"].kind is inspect.Parameter.VAR_KEYWORD
    for method in (Client.session, AsyncClient.session):
        params = inspect.signature(method).parameters
        assert list(params) == [
            "self",
            "session_id",
            "model",
            "system",
            "messages",
            "renew_every_s",
        ]
        assert params["renew_every_s"].default == 120.0
    assert Session.send.__doc__ and "idempotency_key" in Session.send.__doc__
    # The async shell's turns stay coroutine functions, as asyncio code checks for.
    assert inspect.iscoroutinefunction(AsyncSession.send)
    assert inspect.iscoroutinefunction(AsyncSession.stream)
    assert not inspect.iscoroutinefunction(Session.send)


def test_public_names_are_pinned() -> None:
    import orchestrator.sdk

    assert sorted(orchestrator.sdk.__all__) == sorted(
        [
            "Client",
            "AsyncClient",
            "Session",
            "AsyncSession",
            "TurnStream",
            "AsyncTurnStream",
            "TurnResult",
            "SessionInfo",
            "SessionRecord",
            "RetryPolicy",
            "format_turns",
            "KVTideAPIError",
            "APIConnectionError",
            "APITimeoutError",
            "BadRequestError",
            "AuthenticationError",
            "NotFoundError",
            "ConflictError",
            "RateLimitError",
            "InternalServerError",
            "EngineUnavailableError",
            # The error root and the local errors under it.
            "KVTideSDKError",
            "InvalidArgumentError",
            "SessionStateError",
            "StructuredOutputError",
            # Agent turns: tool calls and logprobs; SessionInfo's unique name.
            "ToolCall",
            "Logprob",
            "SessionStatus",
        ]
    )
