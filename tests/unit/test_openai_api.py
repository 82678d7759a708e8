"""Request validation: every bad input gets a typed error with an OpenAI-style body."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from engines.base import Sampling
from orchestrator.errors import (
    DeadlineExceeded,
    EngineUnavailable,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    RequestError,
    ServiceUnavailable,
    TurnInProgress,
    UnsupportedMediaType,
)
from orchestrator.sdk._wire import check_session_id
from orchestrator.serve import openai_api as api

MODEL = "kvtide-tiny"


def _chat(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def test_body_must_be_a_json_object_sent_as_json() -> None:
    with pytest.raises(UnsupportedMediaType) as err:
        api.parse_body(b"{}", "text/plain")
    assert err.value.status_code == 415 and "application/json" in err.value.message
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        api.parse_body(b'{"model": ', "application/json")
    with pytest.raises(InvalidRequest, match="JSON object, got list"):
        api.parse_body(b"[1]", "application/json; charset=utf-8")
    assert api.parse_body(b'{"a": 1}', "application/json; charset=utf-8") == {"a": 1}


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 2}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
    ],
)
def test_invalid_chat_fields_name_the_parameter(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        api.parse_chat(_chat(**fields), MODEL)
    body = err.value.body()["error"]
    assert isinstance(body, dict)
    assert body["param"] == param and body["type"] == "invalid_request_error"
    assert err.value.status_code == 400


def test_unknown_model_is_404_and_names_the_served_model() -> None:
    with pytest.raises(ModelNotFound) as err:
        api.parse_chat(_chat(model="gpt-4"), MODEL)
    assert err.value.status_code == 404 and MODEL in err.value.message


def test_valid_requests_parse_to_one_frozen_request() -> None:
    req = api.parse_chat(
        _chat(
            max_tokens=5,
            temperature=0,
            stream=True,
            stop="END",
            stream_options={"include_usage": True},
            seed=3,
            user="ignored",
        ),
        MODEL,
    )
    assert req.messages == (("user", "hi"),)
    assert (req.max_tokens, req.sampling.temperature, req.stream, req.include_usage) == (
        5,
        0.0,
        True,
        True,
    )
    assert req.sampling.stop == ("END",) and req.sampling.seed == 3
    text_parts = api.parse_chat(
        _chat(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ]
        ),
        MODEL,
    )
    assert text_parts.messages == (("user", "ab"),)
    ids = api.parse_completion({"model": MODEL, "prompt": [1, 2, 3]}, MODEL)
    assert ids.prompt_token_ids == (1, 2, 3) and ids.max_tokens is None
    one = api.parse_completion({"model": MODEL, "prompt": ["just one"]}, MODEL)
    assert one.prompt_text == "just one"


def test_every_documented_role_and_content_form_is_accepted() -> None:
    messages = [
        {"role": "system", "content": "s"},
        {"role": "developer", "content": "d"},
        {"role": "user", "content": [{"type": "text", "text": "u"}]},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "t"},
        {"role": "user", "content": "u2"},
    ]
    req = api.parse_chat(_chat(messages=messages), MODEL)
    assert [role for role, _ in req.messages] == [m["role"] for m in messages]
    # A one-item list of token ids is the prompt; top_k -1 and 0 both turn it off.
    one = api.parse_completion({"model": MODEL, "prompt": [[1, 2, 3]]}, MODEL)
    assert one.prompt_token_ids == (1, 2, 3)
    for top_k in (-1, 0):
        api.parse_chat(_chat(top_k=top_k), MODEL)


def test_completion_prompt_errors() -> None:
    with pytest.raises(InvalidRequest, match="batched prompts"):
        api.parse_completion({"model": MODEL, "prompt": ["a", "b"]}, MODEL)
    for bad in ("", [], [1, -2], None, 7):
        with pytest.raises(InvalidRequest):
            api.parse_completion({"model": MODEL, "prompt": bad}, MODEL)


def test_session_ids_are_checked() -> None:
    assert api.parse_session_id(None) is None and api.parse_session_id("") is None
    assert api.parse_session_id("agent-7:run.3") == "agent-7:run.3"
    with pytest.raises(InvalidRequest, match="x-session-id"):
        api.parse_session_id("has space")
    assert api.parse_session_id("x" * 128) == "x" * 128
    with pytest.raises(InvalidRequest):
        api.parse_session_id("x" * 129)


@pytest.mark.parametrize("value", ["abc\n", "abc\r\n", "\nabc", "abc\x00"])
def test_session_ids_are_matched_exactly(value: str) -> None:
    # "$" matches before a final newline: "abc\n" once passed as "abc".
    with pytest.raises(InvalidRequest) as err:
        api.parse_session_id(value)
    assert err.value.param == "x-session-id"
    with pytest.raises(ValueError, match="session id"):
        check_session_id(value)


def test_stream_chunks_are_openai_shaped() -> None:
    line = api.stream_chunk("chat", "id1", MODEL, text="hi", first=True)
    event = json.loads(line.removeprefix("data: "))
    assert event["object"] == "chat.completion.chunk"
    assert event["choices"][0]["delta"] == {"role": "assistant", "content": "hi"}
    usage = json.loads(api.stream_chunk("chat", "id1", MODEL, use=api.usage(5, 2, 3))[6:])
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 7
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}


def test_every_request_error_has_a_4xx_or_503_status() -> None:
    for cls in RequestError.__subclasses__():
        assert 400 <= cls.status_code < 500 or cls.status_code == 503, cls


def test_a_busy_session_and_every_503_say_when_to_retry() -> None:
    assert TurnInProgress("busy").headers() == {"Retry-After": "1"}
    for cls in (EngineUnavailable, ServiceUnavailable, DeadlineExceeded, Overloaded):
        assert cls("x").status_code == 503 and cls("x").headers()["Retry-After"] == "1", cls


# ---- strict request models (issue 12: bad input never a 500, nothing ignored) ------------


def _refusal(fields: dict[str, object], parse: str = "chat") -> InvalidRequest:
    body = _chat(**fields) if parse == "chat" else {"model": MODEL, "prompt": "p", **fields}
    with pytest.raises(InvalidRequest) as err:
        (api.parse_chat if parse == "chat" else api.parse_completion)(body, MODEL)
    assert err.value.status_code == 400
    return err.value


@pytest.mark.parametrize(
    "fields,param",
    [
        # Wrong types: once a TypeError (500) or silently coerced.
        ({"stop": 5}, "stop"),
        ({"stop": [5]}, "stop"),
        ({"stop": {"a": 1}}, "stop"),
        ({"stream": "false"}, "stream"),  # a non-empty string once counted as true
        ({"ignore_eos": "false"}, "ignore_eos"),
        ({"return_token_ids": 1}, "return_token_ids"),
        ({"stream_options": {"include_usage": "false"}}, "stream_options.include_usage"),
        ({"max_tokens": 5.0}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"seed": 2**64}, "seed"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages[0].content",
        ),
        ({"messages": [{"role": "user"}, 5]}, "messages[1]"),
        ({"messages": "hi"}, "messages"),
        ({"model": 5}, "model"),
        # Lone surrogates (JSON "\ud800") cannot be encoded: once a 500 in the tokenizer.
        ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
        ({"stop": ["\udfff"]}, "stop"),
        ({"user": "\ud800"}, "user"),
        # Out of range for vLLM's SamplingParams.
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"max_tokens": 8, "max_completion_tokens": 9}, "max_completion_tokens"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),  # up to 16 pairs
        ({"metadata": {"k": 1}}, "metadata.k"),
    ],
)
def test_wrong_types_and_ranges_are_400s_naming_the_field(
    fields: dict[str, object], param: str
) -> None:
    err = _refusal(fields)
    assert err.param == param and err.message.startswith(param)


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": {"name": "f"}}, "function_call"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"n": 2}, "n"),
        ({"n": True}, "n"),  # True == 1 in Python; not in JSON
        ({"store": True}, "store"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
        (
            {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]},
            "messages[0].tool_calls",
        ),
        # Unknown fields, at the top and inside objects.
        ({"temprature": 0.5}, "temprature"),
        ({"guided_json": {}}, "guided_json"),
        (
            {"stream_options": {"chunk_size": 4}},
            "stream_options.chunk_size",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "cache_control": {}}]},
            "messages[0].cache_control",
        ),
    ],
)
def test_what_kvtide_cannot_honour_is_refused_naming_the_field(
    fields: dict[str, object], param: str
) -> None:
    err = _refusal(fields)
    assert err.param == param and param in err.message


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "tail"}, "suffix"),
        ({"logprobs": 0}, "logprobs"),  # 0 still asks for the sampled token's logprob
        ({"logprobs": 5}, "logprobs"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages"),  # a chat field
    ],
)
def test_completion_fields_kvtide_cannot_honour_are_refused(
    fields: dict[str, object], param: str
) -> None:
    assert _refusal(fields, parse="completion").param == param


def test_neutral_values_openai_clients_send_are_accepted() -> None:
    req = api.parse_chat(
        _chat(
            n=1,
            tools=[],
            tool_choice="none",
            functions=[],
            logprobs=False,
            top_logprobs=0,
            response_format={"type": "text"},
            logit_bias={},
            store=False,
            modalities=["text"],
            parallel_tool_calls=True,
            service_tier="auto",
            user="end-user-7",
            metadata={"team": "search"},
            prompt_cache_key="k",
            safety_identifier="end-user-7",
            stream_options={"include_usage": False, "include_obfuscation": True},
            messages=[
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                # An assistant message as the openai SDK dumps its own response objects.
                {
                    "role": "assistant",
                    "content": "hello",
                    "refusal": None,
                    "annotations": [],
                    "audio": None,
                    "function_call": None,
                    "tool_calls": None,
                },
                {"role": "user", "content": None},
            ],
        ),
        MODEL,
    )
    assert [r for r, _ in req.messages] == ["system", "user", "assistant", "user"]
    assert api.parse_chat(_chat(tool_choice="auto", tools=None), MODEL).kind == "chat"
    for neutral in (
        {"service_tier": "default"},
        {"function_call": "none"},
        {"function_call": "auto"},
        {"audio": None, "prediction": None, "reasoning_effort": None},
        {"verbosity": None, "web_search_options": None},
    ):
        assert api.parse_chat(_chat(**neutral), MODEL).kind == "chat", neutral
    done = api.parse_completion(
        {"model": MODEL, "prompt": "p", "echo": False, "best_of": 1, "suffix": "", "n": 1},
        MODEL,
    )
    assert done.prompt_text == "p"


def test_max_completion_tokens_null_does_not_hide_max_tokens() -> None:
    req = api.parse_chat(_chat(max_completion_tokens=None, max_tokens=7), MODEL)
    assert req.max_tokens == 7
    assert api.parse_chat(_chat(max_completion_tokens=5, max_tokens=None), MODEL).max_tokens == 5
    assert api.parse_chat(_chat(max_completion_tokens=5, max_tokens=5), MODEL).max_tokens == 5


def test_sampling_vllm_can_honour_is_carried() -> None:
    asked = {
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "top_k": 40,
        "min_p": 0.05,
        "min_tokens": 3,
    }
    # An integer temperature is a number.
    req = api.parse_chat(_chat(**asked, max_tokens=10, seed=-7, temperature=1), MODEL)
    assert req.sampling == Sampling(**asked, seed=-7, temperature=1.0)
    # Unset, each is vLLM's default (OpenAI's temperature 1): no effect.
    assert api.parse_chat(_chat(), MODEL).sampling == Sampling(temperature=1.0)


@pytest.mark.parametrize(
    "raw,needle",
    [
        (b'{"model": "m", "seed": ' + b"9" * 5000 + b"}", "5000 digits"),  # once a 500
        (b'{"model": "m", "metadata": {"a": ' + b"9" * 4301 + b"}}", "4301 digits"),
        (b"[" * 50_000 + b"]" * 50_000, "nests"),  # once a RecursionError (500)
        (b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nests"),
        (b'{"temperature": NaN}', "NaN"),
        (b'{"temperature": -Infinity}', "-Infinity"),
        (b'{"model": "\xff"}', "UTF-8"),
        (b"", "not valid JSON"),
    ],
)
def test_malformed_bodies_are_400s(raw: bytes, needle: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        api.parse_body(raw, "application/json")
    assert needle in err.value.message


def test_metadata_of_16_string_pairs_is_accepted() -> None:
    api.parse_chat(_chat(metadata={f"k{i}": "v" for i in range(16)}), MODEL)


def test_an_integer_of_4300_digits_is_json() -> None:
    assert api.parse_body(b'{"a": ' + b"9" * 4300 + b"}", "application/json") == {"a": 10**4300 - 1}


def test_error_bodies_always_encode_and_name_no_internals() -> None:
    # A lone surrogate in a key; an unknown key is echoed back as the field's name.
    for key in ("x\\ud800", "x\\u0000y"):
        with pytest.raises(InvalidRequest) as err:
            api.parse_chat({**_chat(), **json.loads(f'{{"{key}": 1}}')}, MODEL)
        json.dumps(err.value.body(), ensure_ascii=False).encode("utf-8")  # as JSONResponse
    assert err.value.param == '"x\\u0000y"'
    for fields in ({"stop": 5}, {"messages": [{"role": "user", "content": "\ud800"}]}):
        message = _refusal(fields).message
        assert "Error" not in message and "Traceback" not in message
        assert "pydantic" not in message and "Input should" not in message


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def test_bodies_over_the_cap_are_413_before_they_are_read() -> None:
    read = asyncio.run(api.read_body(_chunks(b"{}", b" "), None, max_bytes=3))
    assert read == b"{} "
    with pytest.raises(PayloadTooLarge) as err:  # refused from the header: nothing read
        asyncio.run(api.read_body(_chunks(), "4194305", max_bytes=4 * 2**20))
    assert err.value.status_code == 413 and "server.max_request_bytes" in err.value.message
    with pytest.raises(PayloadTooLarge):  # a lying or missing Content-Length: while reading
        asyncio.run(api.read_body(_chunks(b"x" * 3, b"x" * 3), "1", max_bytes=5))


def test_every_request_field_is_documented() -> None:
    from pathlib import Path

    from orchestrator.serve.requests import ChatBody, CompletionBody, Message

    doc = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    fields = {*ChatBody.model_fields, *CompletionBody.model_fields, *Message.model_fields}
    missing = sorted(f for f in fields - {"role", "content"} if f"`{f}`" not in doc)
    assert not missing, f"docs/api.md does not say what kvtide does with {missing}"
