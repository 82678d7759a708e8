"""Requests kvtide's own OpenAI layer does not serve, through vLLM's serving layer on
kvtide's turn: the ingress's real routes (``ingress_harness``), vLLM's real serving
classes, tokenizer and chat template (the tiny model's, with tools), and a scripted
decode engine that answers what a real one would under the request's constraints.

What a user relies on: tools and structured output reach the engine as vLLM's own
sampling parameters; tool calls, logprobs and ``n`` come back in OpenAI's shapes with
kvtide's object and headers; vLLM's refusals are 400s naming the field; fields neither
layer knows are still refused by kvtide.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest
from ingress_harness import MODEL, bare_ingress, handle
from test_router import decode_script

from engines.base import GenerateChunk, GenerateRequest, TokenLogprob
from engines.kv_params import KVTransferParams

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
# tool_choice "required" as the embedded default samples it: a JSON list of calls, by
# the tools' JSON schema (``model.tool_call_structural_tags`` off for the tiny model).
CALL = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'


def scripted(text: str, finish: str = "stop") -> Any:
    """A decode engine that writes ``text`` one character a token, with log
    probabilities when the request's sampling parameters ask for them; it keeps its
    blocks for the session's next turn when asked (``kvtide_keep``)."""

    def run(req: GenerateRequest) -> list[GenerateChunk]:
        n = len(req.prompt_token_ids)
        asked = req.kv_transfer_params
        kept = KVTransferParams(
            do_remote_decode=True,
            remote_engine_id="D",
            remote_request_id=req.request_id,
            remote_block_ids=((5, 6, 7),),
            remote_num_tokens=n + len(text),
        )
        if asked is None or asked.kvtide_keep is not True:
            kept = KVTransferParams()
        params = req.sampling_params
        want = None if params is None else params.logprobs
        chunks = []
        for i, char in enumerate(text):
            last = i == len(text) - 1
            logprobs = None
            if want is not None:
                top = [TokenLogprob(token_id=100 + i, logprob=-0.5, rank=1, decoded=char)]
                top += [
                    TokenLogprob(token_id=900 + k, logprob=-3.0 - k, rank=2 + k, decoded="x")
                    for k in range(want)
                ]
                logprobs = [top]
            chunks.append(
                GenerateChunk(
                    request_id=req.request_id,
                    text=char,
                    token_ids=[100 + i],
                    logprobs=logprobs,
                    finished=last,
                    finish_reason=finish if last else None,
                    num_prompt_tokens=n,
                    kv_transfer_params=kept if last else None,
                )
            )
        return chunks

    return run


@pytest.fixture
def ingress(tiny_tokenizer: Any) -> Any:
    return bare_ingress(tiny_tokenizer, max_model_len=1024)


def chat(**fields: Any) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}], **fields}
    return json.dumps(body).encode()


def decode_requests(ingress: Any) -> list[GenerateRequest]:
    return ingress.router.decode.requests  # type: ignore[no-any-return]


def test_a_required_tool_call_is_constrained_at_the_decode_and_parsed(ingress: Any) -> None:
    ingress.router.decode.script = scripted(CALL)
    status, body = asyncio.run(
        handle(
            ingress,
            "/v1/chat/completions",
            chat(tools=TOOLS, tool_choice="required", max_tokens=64),
            x_session_id="agent-1",
        )
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # The decode engine sampled under vLLM's own constraint: the tools' JSON schema.
    (req,) = decode_requests(ingress)
    assert req.sampling_params is not None
    constraint = req.sampling_params.structured_outputs
    assert constraint is not None and "get_weather" in json.dumps(constraint.json)
    assert req.session_id == "agent-1"
    assert body["kvtide"]["session_id"] == "agent-1"
    assert body["usage"]["prompt_tokens"] == len(req.prompt_token_ids)


def test_logprobs_come_back_in_openai_shape(ingress: Any) -> None:
    ingress.router.decode.script = scripted("hi")
    status, body = asyncio.run(
        handle(ingress, "/v1/chat/completions", chat(logprobs=True, top_logprobs=2))
    )
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-0.5, -0.5]
    assert [len(c["top_logprobs"]) for c in content] == [2, 2]
    assert decode_requests(ingress)[0].sampling_params.logprobs == 2


def test_a_replay_is_the_first_answer_streamed_only_if_it_was_streamed(ingress: Any) -> None:
    ingress.router.decode.script = scripted("hi")
    path, body = "/v1/chat/completions", chat(logprobs=True)
    first = asyncio.run(handle(ingress, path, body, idempotency_key="v1"))
    assert first[0] == 200, first
    ran = len(decode_requests(ingress))
    assert asyncio.run(handle(ingress, path, body, idempotency_key="v1")) == first
    # Asked as a stream, the unstreamed turn is not replayed: 422 naming the key.
    streamed = chat(logprobs=True, stream=True)
    status, refused = asyncio.run(handle(ingress, path, streamed, idempotency_key="v1"))
    assert status == 422 and refused["error"]["param"] == "Idempotency-Key", refused
    # A streamed turn replays as the same stream.
    events = asyncio.run(handle(ingress, path, streamed, idempotency_key="v2"))
    assert events[0] == 200 and "data: [DONE]" in events[1]
    assert asyncio.run(handle(ingress, path, streamed, idempotency_key="v2")) == events
    assert len(decode_requests(ingress)) == ran + 1  # each key's turn ran once


def test_n_choices_share_one_prompt_and_only_the_first_keeps_the_session(ingress: Any) -> None:
    ingress.router.decode.script = scripted("ok")
    status, body = asyncio.run(
        handle(
            ingress,
            "/v1/chat/completions",
            chat(n=3, seed=7, logit_bias={"5": -100}),
            x_session_id="agent-2",
        )
    )
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    reqs = sorted(decode_requests(ingress), key=lambda r: "-c" in r.request_id)
    assert len(reqs) == 3
    assert len({tuple(r.prompt_token_ids) for r in reqs}) == 1
    # Choice 0 is the session's turn; the others keep nothing, each with vLLM's seed.
    assert [r.session_id for r in reqs] == ["agent-2", None, None]
    assert sorted(r.sampling_params.seed for r in reqs) == [7, 8, 9]
    assert all(r.sampling_params.n == 1 or r.sampling_params.n == 3 for r in reqs)


def test_a_streamed_tool_call_ends_with_kvtides_object(ingress: Any) -> None:
    ingress.router.decode.script = scripted(CALL)
    status, text = asyncio.run(
        handle(
            ingress,
            "/v1/chat/completions",
            chat(tools=TOOLS, tool_choice="required", stream=True, max_tokens=64),
        )
    )
    assert status == 200, text
    events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
    calls = [
        c
        for e in events
        for ch in e["choices"]
        for c in (ch.get("delta") or {}).get("tool_calls") or ()
    ]
    assert calls and calls[0]["function"]["name"] == "get_weather"
    finishing = [e for e in events if any(ch.get("finish_reason") for ch in e["choices"])]
    assert finishing and "kvtide" in finishing[-1]
    assert text.rstrip().endswith("data: [DONE]")


def test_vllms_refusals_are_400s_naming_the_field(ingress: Any) -> None:
    # Asked for a tool without giving any: vLLM's own validation.
    status, body = asyncio.run(
        handle(ingress, "/v1/chat/completions", chat(tool_choice="required"))
    )
    assert status == 400, body
    assert "tool" in body["error"]["message"]
    # In kvtide's words, as every refusal: no exception's name.
    assert (body["error"]["type"], body["error"]["code"]) == (
        "invalid_request_error",
        "invalid_request",
    )
    status, body = asyncio.run(
        handle(
            ingress,
            "/v1/completions",
            json.dumps({"model": MODEL, "prompt": "a", "logprobs": "x"}).encode(),
        )
    )
    assert status == 400 and body["error"]["param"] == "logprobs", body


def test_tool_choice_auto_is_parsed_with_the_tiny_models_hermes_parser(ingress: Any) -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    ingress.router.decode.script = scripted(call)
    status, body = asyncio.run(
        handle(ingress, "/v1/chat/completions", chat(tools=TOOLS, tool_choice="auto"))
    )
    assert status == 200, body
    (tool_call,) = body["choices"][0]["message"]["tool_calls"]
    assert tool_call["function"]["name"] == "get_weather"
    assert json.loads(tool_call["function"]["arguments"]) == {"city": "Paris"}
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_auto_without_a_parser_is_vllms_400(tiny_tokenizer: Any) -> None:
    ingress = bare_ingress(tiny_tokenizer, model={"enable_auto_tool_choice": False})
    status, body = asyncio.run(
        handle(ingress, "/v1/chat/completions", chat(tools=TOOLS, tool_choice="auto"))
    )
    assert status == 400 and "auto" in body["error"]["message"], body
    # vLLM's message, in kvtide's words around it (vLLM's type is an exception's name).
    assert (body["error"]["type"], body["error"]["code"]) == (
        "invalid_request_error",
        "invalid_request",
    )
    assert not decode_requests(ingress)


def test_a_failure_inside_vllms_layer_is_a_500_that_names_nothing_internal() -> None:
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    from orchestrator.serve.vllm_api import error_of

    # vLLM's server answers an exception it did not expect with its text.
    failed = error_of(create_error_response(RuntimeError("ActorDiedError pid=4242 /opt/x.py")))
    body = failed.body()
    assert failed.status_code == 500
    assert (body["error"]["type"], body["error"]["code"]) == ("server_error", "internal_error")
    assert not any(word in json.dumps(body) for word in ("Actor", "4242", "/opt", "Runtime"))


def test_logprobs_from_engines_that_return_none_are_a_400_naming_them(ingress: Any) -> None:
    # The simulated engine's decode, as the default fake pool's: tokens, no logprobs.
    status, body = asyncio.run(handle(ingress, "/v1/chat/completions", chat(logprobs=True)))
    assert status == 400 and body["error"]["param"] == "logprobs", body
    assert "leave logprobs out" in body["error"]["message"]


def test_a_field_neither_layer_knows_is_refused_by_name(ingress: Any) -> None:
    status, body = asyncio.run(
        handle(ingress, "/v1/chat/completions", chat(tools=TOOLS, colour="blue"))
    )
    assert status == 400 and body["error"]["param"] == "colour", body
    # kvtide's KV transfer parameters are never a client's.
    status, body = asyncio.run(
        handle(ingress, "/v1/chat/completions", chat(tools=TOOLS, kv_transfer_params={}))
    )
    assert status == 400, body
    assert not decode_requests(ingress)


def test_plain_requests_stay_on_kvtides_own_layer(ingress: Any) -> None:
    ingress.router.decode.script = decode_script
    status, body = asyncio.run(handle(ingress, "/v1/chat/completions", chat(max_tokens=3)))
    assert status == 200, body
    assert decode_requests(ingress)[0].sampling_params is None


def test_a_tool_calling_turn_sent_back_renders_as_generated_and_reuses_its_kv(
    ingress: Any,
) -> None:
    # The model spelled the call its own way (compact JSON); the parser returns it
    # re-serialized, and the template would write it with spaces.
    raw = '[{"name":"get_weather","parameters":{"city":"Paris"}}]'
    ingress.router.decode.script = scripted(raw, finish="length")
    first = chat(tools=TOOLS, tool_choice="required", max_tokens=len(raw))
    status, body = asyncio.run(
        handle(ingress, "/v1/chat/completions", first, x_session_id="agent-3")
    )
    assert status == 200, body
    message = body["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    # Turn 2: the assistant message as returned, the tool's result, a question.
    ingress.router.decode.script = scripted("sunny", finish="length")
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": message["tool_calls"]},
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "18C"},
    ]
    second = json.dumps({"model": MODEL, "messages": history, "tools": TOOLS, "max_tokens": 5})
    status, body = asyncio.run(
        handle(ingress, "/v1/chat/completions", second.encode(), x_session_id="agent-3")
    )
    assert status == 200, body
    assert body["kvtide"]["kv_plan"] == "pull", body["kvtide"]
    turn1, turn2 = decode_requests(ingress)
    # Turn 2's prompt starts with every token turn 1 ran and generated.
    assert turn2.prompt_token_ids[: len(turn1.prompt_token_ids)] == turn1.prompt_token_ids
    # A call the client changed renders as sent: no reuse past it, never wrong KV.
    history[1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Rome"}'
    third = json.dumps({"model": MODEL, "messages": history, "tools": TOOLS, "max_tokens": 5})
    status, body = asyncio.run(
        handle(ingress, "/v1/chat/completions", third.encode(), x_session_id="agent-3")
    )
    assert status == 200, body
    assert body["kvtide"]["kv_plan"] == "recompute"


def test_prompt_logprobs_come_from_the_prefill_and_the_turn_runs_outside_its_session(
    ingress: Any,
) -> None:
    prefill = ingress.router.prefill
    plain = prefill.script

    def with_prompt_logprobs(req: GenerateRequest) -> list[GenerateChunk]:
        chunks = plain(req)
        if req.prompt_logprobs is None:
            return chunks
        positions: list[list[TokenLogprob] | None] = [None]
        positions += [
            [TokenLogprob(token_id=t, logprob=-1.25, rank=3, decoded="x")]
            for t in req.prompt_token_ids[1:]
        ]
        chunks[-1] = msgspec.structs.replace(chunks[-1], prompt_logprobs=positions)
        return chunks

    prefill.script = with_prompt_logprobs
    ingress.router.decode.script = scripted("ok")
    status, body = asyncio.run(
        handle(
            ingress,
            "/v1/chat/completions",
            chat(prompt_logprobs=1, max_tokens=2),
            x_session_id="agent-5",
        )
    )
    assert status == 200, body
    (decode,) = decode_requests(ingress)
    pre = [r for r in prefill.requests if r.prompt_logprobs is not None]
    # Asked of the prefill, which computes the whole prompt; the decode pulls it.
    assert len(pre) == 1 and pre[0].prompt_logprobs == 1 and decode.prompt_logprobs is None
    got = body["prompt_logprobs"]
    assert got[0] is None and len(got) == len(decode.prompt_token_ids)
    assert all(next(iter(p.values()))["logprob"] == -1.25 for p in got[1:])
    # Outside its session: nothing claimed, pulled or kept for agent-5.
    assert body["kvtide"]["session_id"] is None and decode.session_id is None
