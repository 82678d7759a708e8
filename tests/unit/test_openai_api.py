"""Request validation: every bad input gets a typed error with an OpenAI-style body."""

from __future__ import annotations

import json

import pytest

from orchestrator.errors import InvalidRequest, ModelNotFound, RequestError, UnsupportedMediaType
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
    assert (req.max_tokens, req.temperature, req.stream, req.include_usage) == (5, 0.0, True, True)
    assert req.stop == ("END",) and req.seed == 3
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
