"""vLLM's OpenAI serving layer in the ingress, over kvtide's turn.

kvtide's own OpenAI layer (``openai_api.py``, ``requests.py``) answers the requests it
implements: text turns with sampling, stop strings, streams, usage. A request that asks
for anything else vLLM's OpenAI server honours (``tools`` and ``tool_choice``,
``response_format`` json_object/json_schema and vLLM's ``structured_outputs``,
``logprobs``/``top_logprobs``, ``n`` > 1, ``logit_bias``, ``reasoning_effort``,
``echo``, assistant messages with ``tool_calls`` and ``tool`` messages, vLLM's other
extension fields) is served by vLLM's own serving classes (``OpenAIServingChat``,
``OpenAIServingCompletion``) over ``orchestrator.serve.turn_client``: vLLM validates it
(its 400s, worded as vLLM words them), renders the chat template with the tools, builds
the sampling parameters and parses the output (tool calls, reasoning, logprobs); the
tokens come from kvtide's turn (P/D, sessions, KV send-back), and each response carries
kvtide's ``kvtide`` object and ``x-session-id`` as the other path's do.

A field neither layer knows is refused by kvtide's (400 naming it); vLLM's own server
would ignore it. ``kv_transfer_params`` is kvtide's to set, never a client's;
``priority`` and ``cache_salt``, which kvtide's turn would drop, are refused unless they
hold vLLM's default (400 naming them).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.config.sections import ModelConfig
from orchestrator.errors import (
    InvalidRequest,
    RequestError,
    ServingLayerRefused,
    UnsupportedParameter,
)
from orchestrator.serve.refusals import invalid_request, shown
from orchestrator.serve.turn_client import Kind, TurnRunner, make_turn_client

__all__ = [
    "Kind",
    "StreamedToolCalls",
    "VLLMServing",
    "build_serving",
    "check_fields",
    "client_error",
    "error_of",
    "parse_request",
    "prepend",
    "sse_events",
    "with_kvtide",
]

log = logging.getLogger("kvtide.ingress")

# Fields only kvtide sets: a client's would steer the engines' KV transfer.
_KVTIDE_ONLY = frozenset({"kv_transfer_params"})

# vLLM's fields kvtide's P/D path does not honour, refused unless they hold vLLM's
# default (which asks for nothing): vLLM's layer would take them and kvtide's turn
# would drop them.
_NOT_HONOURED = {
    "priority": (
        0,
        "priority is not supported: kvtide's engines schedule requests first come, first "
        "served; leave priority out (or send 0)",
    ),
    "cache_salt": (
        None,
        "cache_salt is not supported: kvtide's KV reuse (a session's KV sent back, "
        "prefix-aware prefill routing) does not keep salted prefix caches apart; leave "
        "cache_salt out",
    ),
}


def _request_class(kind: Kind) -> Any:
    if kind == "responses":
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

        return ResponsesRequest
    if kind == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest


def check_fields(kind: Kind, body: Mapping[str, Any]) -> None:
    """A body kvtide's own layer does not serve goes to vLLM's when every field is one
    of vLLM's request fields (vLLM then validates their values); else 400 naming the
    first field neither layer takes."""
    fields = _request_class(kind).model_fields
    for name, (default, why) in _NOT_HONOURED.items():
        value = body.get(name)
        if value is not None and not (type(value) is type(default) and value == default):
            raise UnsupportedParameter(why, param=name)
    if kind == "responses" and body.get("background"):
        raise UnsupportedParameter(
            "background responses are not available: a kvtide turn runs within its "
            "request (its deadline, its key's concurrency); send background: false",
            param="background",
        )
    prompt = body.get("prompt") if kind == "completion" else None
    if (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, str | list) for p in prompt)
    ):
        # vLLM's layer would run each prompt as its own request, each a turn of its own
        # outside the key's concurrency count.
        raise UnsupportedParameter(
            "prompt holds several prompts; batched prompts are not supported (with n or "
            "any other field): send one prompt per request",
            param="prompt",
        )
    if body.get("use_beam_search"):
        raise UnsupportedParameter(
            "use_beam_search is not available on kvtide's P/D path; leave it out",
            param="use_beam_search",
        )
    for name, value in body.items():
        if not _is_unicode(value):
            param = name if _is_unicode(name) and len(name) <= 64 else shown(name)
            raise InvalidRequest(
                f"{param} holds a string that is not valid Unicode (a lone UTF-16 "
                "surrogate escape, \\ud800-\\udfff); send valid Unicode",
                param=param,
            )
        if name in _KVTIDE_ONLY:
            raise UnsupportedParameter(
                f"{name} is set by kvtide for its own KV transfers; remove it", param=name
            )
        if name not in fields:
            param = name if name.isprintable() and len(name) <= 64 else shown(name)
            raise UnsupportedParameter(
                f"{param} is not a field kvtide accepts: remove it (docs/api.md lists the "
                "fields kvtide honours)",
                param=param,
            )


def _is_unicode(value: Any, depth: int = 0) -> bool:
    """Whether every string in ``value`` (keys too) is valid Unicode: vLLM's renderer and
    tokenizer fail on a lone surrogate with a TypeError."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if depth > 64:  # deeper than any request shape; vLLM's model refuses it
        return True
    if isinstance(value, dict):
        return all(
            _is_unicode(k, depth + 1) and _is_unicode(v, depth + 1) for k, v in value.items()
        )
    if isinstance(value, list):
        return all(_is_unicode(v, depth + 1) for v in value)
    return True


def parse_request(kind: Kind, body: Mapping[str, Any]) -> Any:
    """vLLM's request model for ``body``; its validation errors as kvtide's 400 naming
    the field and what it must be (vLLM's own server answers them with 400 too)."""
    from pydantic import ValidationError
    from vllm.exceptions import VLLMClientError

    try:
        return _request_class(kind).model_validate(dict(body))
    except ValidationError as exc:
        raise invalid_request(exc) from None
    except VLLMClientError as exc:
        raise client_error(exc) from None
    except (TypeError, AttributeError, KeyError, ValueError):
        # One of vLLM's own validators failing on a value of the wrong shape (a string
        # where it expects an object): the request's fault, never a 500.
        raise InvalidRequest(
            "the body does not match the OpenAI request shape: a field has a value of the "
            "wrong type (see the OpenAI API reference for this endpoint)"
        ) from None


def client_error(exc: Exception) -> InvalidRequest:
    """vLLM's own refusal of a request (``VLLMClientError``: a 4xx in vLLM's server) as
    a 400 naming the parameter."""
    message = str(exc.args[0]) if exc.args else "invalid request"
    return InvalidRequest(message, getattr(exc, "parameter", None))


@dataclass(frozen=True, slots=True)
class VLLMServing:
    """vLLM's serving classes for one model, over kvtide's turns."""

    chat: Any
    completion: Any
    responses: Any
    client: Any

    async def create(self, kind: Kind, request: Any, raw_request: Any) -> Any:
        """vLLM's response (a model, an SSE generator or an ``ErrorResponse``); vLLM's
        own refusals raised on the way are 400s."""
        from vllm.exceptions import VLLMClientError

        try:
            if kind == "chat":
                return await self.chat.create_chat_completion(request, raw_request)
            if kind == "responses":
                return await self.responses.create_responses(request, raw_request)
            return await self.completion.create_completion(request, raw_request)
        except VLLMClientError as exc:
            raise client_error(exc) from None


def build_serving(model: ModelConfig, run: TurnRunner) -> VLLMServing:
    """vLLM's OpenAI serving classes on ``model`` (its config, tokenizer and chat
    template; no engine), whose engine is kvtide's turn (``run``)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
    from vllm.renderers.chat_utils import load_chat_template
    from vllm.renderers.online_renderer import OnlineRenderer

    path = model.resolved_path()
    args = AsyncEngineArgs(
        model=path,
        served_model_name=[model.name],
        dtype=model.dtype,
        max_model_len=model.max_model_len,
        reasoning_parser=model.reasoning_parser or "",
    )
    client = make_turn_client(args.create_engine_config(), run)
    models = OpenAIServingModels(
        engine_client=client, base_model_paths=[BaseModelPath(name=model.name, model_path=path)]
    )
    template = load_chat_template(model.chat_template)
    common: dict[str, Any] = {
        "chat_template": template,
        "chat_template_content_format": "auto",
        "enable_auto_tools": model.auto_tool_choice,
        "tool_parser": model.tool_parser,
        "reasoning_parser": model.reasoning_parser or "",
    }
    renderer = OnlineRenderer(
        model_config=client.model_config,
        renderer=client.renderer,
        request_logger=None,
        trust_request_chat_template=False,
        trust_request_mm_kwargs=False,
        exclude_tools_when_tool_choice_none=False,
        tool_strict_level="auto",
        default_chat_template_kwargs=None,
        log_error_stack=False,
        **common,
    )
    chat = OpenAIServingChat(
        client,
        models,
        "assistant",
        online_renderer=renderer,
        request_logger=None,
        enable_prompt_tokens_details=True,
        **common,
    )
    completion = OpenAIServingCompletion(
        client,
        models,
        online_renderer=renderer,
        request_logger=None,
        enable_prompt_tokens_details=True,
    )
    responses = OpenAIServingResponses(
        client,
        models,
        renderer,
        request_logger=None,
        chat_template=template,
        chat_template_content_format="auto",
        reasoning_parser=model.reasoning_parser or "",
        enable_auto_tools=model.auto_tool_choice,
        tool_parser=model.tool_parser,
        enable_prompt_tokens_details=True,
    )
    # Stored responses are kvtide's to bound, own and expire (``responses_api``).
    responses.enable_store = True
    return VLLMServing(chat=chat, completion=completion, responses=responses, client=client)


def error_of(response: Any) -> RequestError:
    """vLLM's ``ErrorResponse`` as kvtide's error. A refusal keeps vLLM's status, message
    and ``param``, as an ``invalid_request`` (vLLM's type names an exception class); a
    failure of vLLM's own is a 500 ``internal_error``: its message is the exception's
    text, which goes to the log only."""
    error = response.error
    status = int(error.code)
    if status >= 500:
        log.warning("vLLM's serving layer failed: %s: %s", error.type, error.message)
        failed = ServingLayerRefused(
            "internal error; retry the request", status_code=500, error_type="server_error"
        )
        failed.code = "internal_error"
        return failed
    refused = ServingLayerRefused(
        str(error.message), error.param, status_code=status, error_type="invalid_request_error"
    )
    refused.code = "invalid_request"
    return refused


_FINAL_EVENTS = (
    "event: response.completed",
    "event: response.incomplete",
    "event: response.failed",
)


def _is_final(event: str) -> bool:
    """A choice's finishing chunk, the usage-only chunk, or the Responses API's last
    event (every chunk carries usage with ``continuous_usage_stats``: not a test)."""
    return (
        '"finish_reason":"' in event or '"choices":[]' in event or event.startswith(_FINAL_EVENTS)
    )


def with_kvtide(event: str, ext: Callable[[], dict[str, Any]]) -> str:
    """One SSE event of vLLM's stream, with kvtide's object added where the turn's
    facts are final: a choice's finishing chunk, the usage chunk, the Responses API's
    completed response."""
    at = event.find("data: {")
    if at < 0 or not _is_final(event):
        return event
    body = json.loads(event[at + len("data: ") :])
    body["kvtide"] = ext()
    return f"{event[:at]}data: {json.dumps(body, ensure_ascii=False)}\n\n"


class StreamedToolCalls:
    """Choice 0's tool calls as a client assembles them from a stream's deltas."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, Any]] = {}

    def add(self, event: str) -> None:
        if '"tool_calls":[{' not in event or not event.startswith("data: {"):
            return
        for choice in json.loads(event[len("data: ") :]).get("choices") or ():
            if choice.get("index") != 0:
                continue
            for delta in (choice.get("delta") or {}).get("tool_calls") or ():
                call = self._calls.setdefault(
                    int(delta.get("index", 0)), {"id": None, "name": "", "arguments": ""}
                )
                call["id"] = delta.get("id") or call["id"]
                function = delta.get("function") or {}
                call["name"] += function.get("name") or ""
                call["arguments"] += function.get("arguments") or ""

    def message(self) -> dict[str, Any]:
        """The assistant message's ``tool_calls`` as the client sends them back."""
        calls = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for _, c in sorted(self._calls.items())
        ]
        return {"role": "assistant", "tool_calls": calls}


async def prepend(first: list[str], rest: AsyncIterator[str]) -> AsyncIterator[str]:
    for item in first:
        yield item
    async for item in rest:
        yield item


async def sse_events(events: AsyncIterator[Any]) -> AsyncIterator[str]:
    """The Responses API's stream events as SSE, named by type (as vLLM's server sends
    them: the openai client reads the ``event:`` line)."""
    async for event in events:
        kind = getattr(event, "type", "unknown")
        yield f"event: {kind}\ndata: {event.model_dump_json(indent=None, by_alias=True)}\n\n"
