"""Request bodies of the OpenAI-compatible API as strict pydantic models.

``parse_chat`` / ``parse_completion`` validate a decoded JSON body and return the frozen
``ApiRequest`` the ingress serves, or raise ``InvalidRequest`` (400) whose ``param``
names the offending field and whose message says what would fix it. Every field falls
in one of three groups (docs/api.md lists them):

* honoured: the model, the prompt, token limits, sampling (``temperature``, ``top_p``,
  ``seed``, ``stop``, penalties, vLLM's ``top_k``, ``min_p``, ``min_tokens``, ...),
  streaming;
* accepted only with the neutral value OpenAI clients send by default, because any other
  value asks for something kvtide does not do (``n: 1``, ``tools: []``,
  ``logprobs: false``, ``response_format: {"type": "text"}``, ...), plus a few fields
  that change nothing about the answer (``user``, ``metadata``, ``parallel_tool_calls``);
* everything else, known or unknown, refused with a message that names it.

Types are strict: ``"false"`` is not a boolean, ``2.0`` is not an integer. Strings must
be valid Unicode (a lone surrogate escape like ``"\\ud800"`` is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from engines.base import Sampling
from orchestrator.errors import InvalidRequest, ModelNotFound
from orchestrator.serve.refusals import invalid_request, shown

__all__ = [
    "ApiRequest",
    "ChatBody",
    "CompletionBody",
    "ReuseOnBody",
    "parse_chat",
    "parse_completion",
    "parse_reuse_on",
]

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiRequest:
    """A validated chat or completion request, before tokenization."""

    kind: Literal["chat", "completion"]
    model: str
    messages: tuple[tuple[str, str], ...] = ()
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    max_tokens: int | None
    # How the engines sample the answer (vLLM's SamplingParams defaults: no effect).
    sampling: Sampling
    stream: bool
    include_usage: bool
    # vLLM's extension: every streamed chunk carries the usage so far.
    continuous_usage: bool = False
    # vLLM's extension: return prompt and completion token ids in the response.
    return_token_ids: bool = False
    # vLLM's extension: the model goes on writing the final (assistant) message.
    continue_final_message: bool = False


# ---- field types ------------------------------------------------------------------------


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError(
            "kvtide_unicode",
            "contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is "
            "not a character; send valid Unicode",
        ) from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


def _refuse(message: str) -> PydanticCustomError:
    return PydanticCustomError("kvtide_refused", message)


def _is(value: object, neutral: object) -> bool:
    # Types must match too: True == 1 and 0 == False in Python.
    return type(value) is type(neutral) and value == neutral


def _neutral(table: dict[str, tuple[tuple[object, ...], str]]) -> Any:
    """A validator for fields accepted only with a neutral value: null or one of the
    table's values, which ask for nothing kvtide does not do; any other value is refused
    with the table's reason."""

    def check(value: object, info: ValidationInfo) -> object:
        accepted, why = table[str(info.field_name)]
        if value is None or any(_is(value, n) for n in accepted):
            return value
        # A feature kvtide's own layer does not implement (vLLM's layer may serve it).
        raise PydanticCustomError("kvtide_unsupported", why)

    return field_validator(*table, mode="before")(check)


MAX_STOP_BYTES = 4096
"""Most bytes (UTF-8) of all of a request's stop strings together: every engine step
checks each of them against the text it made."""


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or len(stops) > 4
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise _refuse("must be a non-empty string or a list of up to 4 non-empty strings")
    checked = tuple(_unicode(s) for s in stops)
    size = sum(len(s.encode("utf-8", "surrogatepass")) for s in checked)
    if size > MAX_STOP_BYTES:
        raise _refuse(
            f"holds {size} bytes of stop strings, over the {MAX_STOP_BYTES} kvtide takes; "
            "send shorter stop strings"
        )
    return checked


def _content(value: object) -> str:
    """A message's content: a string, null, or a list of text parts (joined)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return _unicode(value)
    if not isinstance(value, list):
        raise _refuse("must be a string or a list of text parts")
    parts = []
    for i, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else part
            raise _refuse(
                f"part {i} is not a text part (type {shown(kind)}): kvtide serves text "
                'models; send parts like {"type": "text", "text": "..."}'
            )
        if set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise _refuse(f'part {i} must be exactly {{"type": "text", "text": "<a string>"}}')
        parts.append(_unicode(part["text"]))
    return "".join(parts)


def _prompt(value: object) -> str | tuple[int, ...]:
    """A completion prompt: one string, or one list of token ids (also wrapped in a
    one-item list, as the OpenAI API allows)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str) and value:
        return _unicode(value)
    if isinstance(value, list) and value:
        if all(type(t) is int and 0 <= t <= INT32_MAX for t in value):
            return tuple(value)
        if all(isinstance(t, str | list) for t in value):
            raise _refuse(
                "holds several prompts; batched prompts are not supported: send one prompt "
                "per request"
            )
    raise _refuse("must be a non-empty string or a non-empty list of token ids (integers >= 0)")


Nonneg = Annotated[int, Field(ge=0, le=INT32_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
MetadataKey = Annotated[Text, StringConstraints(max_length=64)]
MetadataValue = Annotated[Text, StringConstraints(max_length=512)]

_NO_TOOLS = "is not supported: kvtide does not call tools"
_NO_LOGPROBS = "is not supported: kvtide returns no log probabilities"
_TEXT_ONLY = "is not supported: kvtide serves text models"


class _Body(BaseModel):
    """Unknown fields are errors; no type coercion; no infinities or NaNs."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class StreamOptions(_Body):
    include_usage: bool | None = None
    # vLLM's extension: usage (tokens so far) in every chunk, as a resuming client needs.
    continuous_usage_stats: bool | None = None
    # OpenAI's stream obfuscation padding: kvtide's chunks never carry it either way.
    include_obfuscation: bool | None = None


class Message(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[str, BeforeValidator(_content)] = ""
    # The empty fields the openai SDK writes back from its own assistant messages.
    refusal: object = None
    audio: object = None
    function_call: object = None
    tool_calls: object = None
    annotations: object = None
    name: object = None
    tool_call_id: object = None

    _neutral_fields = _neutral(
        {
            "refusal": ((), "is not supported: kvtide never writes refusals; leave it out"),
            "audio": ((), _TEXT_ONLY),
            "function_call": ((), _NO_TOOLS),
            "tool_calls": (([],), _NO_TOOLS),
            "annotations": (([],), "is not supported: kvtide writes no annotations"),
            "name": (
                (),
                "is not supported: the chat template sees each message's role and content "
                "only; put the name in the content",
            ),
            "tool_call_id": ((), _NO_TOOLS),
        }
    )


class _Common(_Body):
    """Fields of both endpoints, declared once: a base of fields and validators only,
    pydantic's way to share them (no method reaches ``self``; test_packages holds it)."""

    model: Annotated[Text, StringConstraints(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: Annotated[tuple[str, ...], BeforeValidator(_stop)] = ()
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # vLLM's extensions.
    repetition_penalty: Annotated[float, Field(gt=0.0, le=1e6)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Nonneg | None = None
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None
    # No effect on the answer: an end-user id for the operator's logs.
    user: Text | None = None
    n: object = None
    logit_bias: object = None

    _neutral_common = _neutral(
        {
            "n": (
                (1,),
                "is not supported beyond 1: kvtide returns one choice per request; send n "
                "separate requests",
            ),
            "logit_bias": (({},), "is not supported: leave it out or send {}"),
        }
    )


class ChatBody(_Common):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    # vLLM's extensions: continue the final assistant message instead of starting a
    # new one (what the SDK sends to resume a stream cut by an engine failure).
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    # No effect on the answer.
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None
    # Neutral values only.
    logprobs: object = None
    top_logprobs: object = None
    response_format: object = None
    tools: object = None
    tool_choice: object = None
    functions: object = None
    function_call: object = None
    store: object = None
    modalities: object = None
    audio: object = None
    prediction: object = None
    reasoning_effort: object = None
    verbosity: object = None
    web_search_options: object = None
    service_tier: object = None

    _neutral_chat = _neutral(
        {
            "logprobs": ((False,), _NO_LOGPROBS + "; leave it out or send false"),
            "top_logprobs": ((0,), _NO_LOGPROBS),
            "response_format": (
                ({"type": "text"},),
                "is not supported beyond plain text: kvtide does no structured (JSON) "
                'output; leave it out or send {"type": "text"}',
            ),
            "tools": (([],), _NO_TOOLS + "; leave it out or send []"),
            # "auto" chooses among no tools (tools must be empty): it asks for nothing.
            "tool_choice": (("none", "auto"), _NO_TOOLS + '; leave it out or send "none"'),
            "functions": (([],), _NO_TOOLS),
            "function_call": (("none", "auto"), _NO_TOOLS),
            "store": (
                (False,),
                "is not supported: kvtide does not store completions; leave it out or send false",
            ),
            "modalities": ((["text"],), _TEXT_ONLY + '; leave it out or send ["text"]'),
            "audio": ((), _TEXT_ONLY),
            "prediction": ((), "is not supported: kvtide takes no predicted outputs"),
            "reasoning_effort": (
                (),
                "is not supported: kvtide passes no reasoning options to the model",
            ),
            "verbosity": ((), "is not supported: leave it out"),
            "web_search_options": ((), "is not supported: kvtide does not search the web"),
            "service_tier": (
                ("auto", "default"),
                'is not supported beyond "auto" and "default": kvtide has one service tier',
            ),
        }
    )


class CompletionBody(_Common):
    """``POST /v1/completions``."""

    prompt: Annotated[str | tuple[int, ...], BeforeValidator(_prompt)]
    echo: object = None
    best_of: object = None
    suffix: object = None
    logprobs: object = None

    _neutral_completion = _neutral(
        {
            "echo": (
                (False,),
                "is not supported: kvtide does not echo the prompt; leave it out or send false",
            ),
            "best_of": (
                (1,),
                "is not supported beyond 1: kvtide generates one completion per request",
            ),
            "suffix": (("",), "is not supported: kvtide does not insert text; leave it out"),
            "logprobs": ((), _NO_LOGPROBS + "; leave it out"),
        }
    )


EngineId = Annotated[str, Field(min_length=1, max_length=256)]


class ReuseOnBody(_Body):
    """``POST /kvtide/integrity/reuse``: the engine pair whose reuse an integrity check
    turned off, to turn back on (``orchestrator.kv.integrity``)."""

    prefill_engine_id: EngineId
    source_engine_id: EngineId


def parse_reuse_on(body: dict[str, Any]) -> ReuseOnBody:
    return _validate(ReuseOnBody, body)


# ---- errors --------------------------------------------------------------------------

# ---- to ApiRequest --------------------------------------------------------------------

_B = TypeVar("_B", bound=BaseModel)


def _validate(model: type[_B], body: dict[str, Any]) -> _B:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid_request(exc) from None


def _common(b: _Common, served_model: str, max_tokens: int | None) -> dict[str, Any]:
    if b.model != served_model:
        raise ModelNotFound(
            f"The model {shown(b.model)} does not exist on this server; it serves "
            f"{served_model!r} (see GET /v1/models)",
            param="model",
        )
    if b.min_tokens is not None and max_tokens is not None and b.min_tokens > max_tokens:
        raise InvalidRequest(
            f"min_tokens ({b.min_tokens}) must not exceed max_tokens ({max_tokens}); lower "
            "min_tokens or raise max_tokens",
            param="min_tokens",
        )
    return {
        "model": b.model,
        "max_tokens": max_tokens,
        "sampling": Sampling(
            temperature=1.0 if b.temperature is None else b.temperature,
            top_p=1.0 if b.top_p is None else b.top_p,
            seed=b.seed,
            stop=b.stop,
            ignore_eos=bool(b.ignore_eos),
            presence_penalty=b.presence_penalty or 0.0,
            frequency_penalty=b.frequency_penalty or 0.0,
            repetition_penalty=1.0 if b.repetition_penalty is None else b.repetition_penalty,
            top_k=b.top_k or 0,
            min_p=b.min_p or 0.0,
            min_tokens=b.min_tokens or 0,
        ),
        "stream": bool(b.stream),
        "include_usage": bool(b.stream_options and b.stream_options.include_usage),
        "continuous_usage": bool(b.stream_options and b.stream_options.continuous_usage_stats),
        "return_token_ids": bool(b.return_token_ids),
    }


def parse_chat(body: dict[str, Any], served_model: str) -> ApiRequest:
    b = _validate(ChatBody, body)
    max_tokens = b.max_completion_tokens
    if max_tokens is None:
        max_tokens = b.max_tokens
    elif b.max_tokens is not None and b.max_tokens != max_tokens:
        raise InvalidRequest(
            f"max_completion_tokens ({max_tokens}) and max_tokens ({b.max_tokens}) disagree; "
            "send only max_completion_tokens",
            param="max_completion_tokens",
        )
    messages = tuple((m.role, m.content) for m in b.messages)
    cont = bool(b.continue_final_message)
    if cont and b.add_generation_prompt is not False:
        raise InvalidRequest(
            "continue_final_message: true needs add_generation_prompt: false (the model "
            "goes on writing the final message instead of starting a new one); send "
            "add_generation_prompt: false with it",
            param="add_generation_prompt",
        )
    if b.add_generation_prompt is False and not cont:
        raise InvalidRequest(
            "add_generation_prompt: false is supported only with continue_final_message: "
            "true; leave it out",
            param="add_generation_prompt",
        )
    if cont and (messages[-1][0] != "assistant" or not messages[-1][1]):
        raise InvalidRequest(
            "continue_final_message needs a final assistant message with the text to "
            "continue; add it, or leave continue_final_message out",
            param=f"messages[{len(messages) - 1}]",
        )
    return ApiRequest(
        kind="chat",
        messages=messages,
        continue_final_message=cont,
        **_common(b, served_model, max_tokens),
    )


def parse_completion(body: dict[str, Any], served_model: str) -> ApiRequest:
    b = _validate(CompletionBody, body)
    common = _common(b, served_model, b.max_tokens)
    if isinstance(b.prompt, str):
        return ApiRequest(kind="completion", prompt_text=b.prompt, **common)
    return ApiRequest(kind="completion", prompt_token_ids=b.prompt, **common)
