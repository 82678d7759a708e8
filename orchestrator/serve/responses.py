"""Response shapes of the OpenAI-compatible ingress: final bodies, replayed streams,
session bodies, idempotency keys and server-error bodies (no Serve or FastAPI state).

The ingress deployment class is pickled by value; the helpers it uses live here, in an
importable module, rather than beside it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

import msgspec

from engines.base import GenerateChunk
from orchestrator.errors import (
    IdempotencyKeyReused,
    InvalidRequest,
    LimitExceeded,
    TurnInProgress,
)
from orchestrator.kv.messages import Claim, SessionInfo
from orchestrator.kv.ownership import session_not_found
from orchestrator.kv.service import KVServiceAPI, count_decode_paths, merge_counters
from orchestrator.router import TurnReport
from orchestrator.serve import openai_api as api

__all__ = [
    "Output",
    "begin_replay",
    "ending",
    "final_body",
    "pool_stats",
    "raise_unclaimed",
    "replay_key_of",
    "replay_sse",
    "request_fingerprints",
    "server_error_body",
    "session_body",
    "stream_error",
    "stream_status",
    "usage_of",
]


def session_body(info: SessionInfo) -> dict[str, Any]:
    record = None
    if info.engine_id is not None:
        record = {
            "engine_id": info.engine_id,
            "num_tokens": info.num_tokens,
            "bytes_held": info.bytes_held,
            "expires_in_s": info.expires_in_s,
        }
    return {
        "id": info.session_id,
        "object": "session",
        "record": record,
        "lease_expires_in_s": info.lease_expires_in_s,
    }


def replay_key_of(header: str | None, owner: str, session_id: str | None) -> str | None:
    """The replay book's key of an ``Idempotency-Key`` header, scoped by its owner (the
    API key's name) and session; None without the header."""
    if header is None:
        return None
    key = header.strip()
    if not key or len(key) > 255 or not key.isprintable():
        raise InvalidRequest(
            "Idempotency-Key must be 1-255 printable characters (a UUID per turn, "
            "the same on every retry of that turn)",
            param="Idempotency-Key",
        )
    return "\x1f".join((owner, session_id or "", key))


# What a retry or the SDK's continuation of a cut stream may change and still be the
# same request: how the answer is delivered, and the token budget left (lowered by the
# tokens already made). The continuation's extra final assistant message is the
# second fingerprint (``request_fingerprints``).
_NOT_FINGERPRINTED = frozenset(
    {"stream", "include_usage", "continuous_usage", "max_tokens", "min_tokens"}
    | {"continue_final_message"}
)


def _fingerprint(kind: str, fields: dict[str, Any]) -> str:
    text = json.dumps(fields, sort_keys=True, ensure_ascii=True, default=list)
    return f"{kind}:" + hashlib.sha256(text.encode()).hexdigest()[:32]


def body_fingerprints(kind: str, body: dict[str, Any]) -> tuple[str, ...]:
    """``request_fingerprints`` of a request served by vLLM's layer, from its body (the
    same fields left out, under the OpenAI names)."""
    left_out = _NOT_FINGERPRINTED | {"stream_options", "max_completion_tokens"}
    return (_fingerprint(kind, {k: v for k, v in body.items() if k not in left_out}),)


def request_fingerprints(req: api.ApiRequest) -> tuple[str, ...]:
    """The fingerprints an ``Idempotency-Key`` is bound to (``orchestrator.kv.replay``):
    the endpoint and a digest of what the request asks. The first is the request's own;
    a request that continues its final assistant message has a second, that of the
    request it continues (the same messages without the last one)."""
    asked = {f.name: getattr(req, f.name) for f in dataclasses.fields(req)}
    asked |= msgspec.structs.asdict(asked.pop("sampling"))  # its fields, by their names
    fields = {name: v for name, v in asked.items() if name not in _NOT_FINGERPRINTED}
    own = _fingerprint(req.kind, fields)
    if not (req.continue_final_message and req.messages):
        return (own,)
    return own, _fingerprint(req.kind, {**fields, "messages": req.messages[:-1]})


async def begin_replay(
    kv: KVServiceAPI, key: str, attempt: str, kind: str, fingerprints: tuple[str, ...]
) -> dict[str, Any] | None:
    """Look ``key`` up in the replay book for the HTTP attempt ``attempt``: the stored
    response to replay, or None when the turn is to run now. Raises ``TurnInProgress``
    (409) while the key's turn runs and ``IdempotencyKeyReused`` (422) when the key came
    with another request first (another endpoint or body: ``fingerprints``, from
    ``request_fingerprints`` or ``body_fingerprints``): a key names one turn, and a
    replay has its endpoint's shape."""
    replay = await kv.replay_begin(key, fingerprints, attempt)
    if replay.action == "in_progress":
        raise TurnInProgress(
            "a turn with this Idempotency-Key is still running; retry after it "
            "finishes to get its result",
            param="Idempotency-Key",
        )
    body = replay.body
    if replay.action == "mismatch" or (
        replay.action == "replay"
        and (body is None or body.get("object") != api.RESPONSE_OBJECT[kind])
    ):
        raise IdempotencyKeyReused(
            "this Idempotency-Key was first sent with a different request (another "
            "endpoint or body); send a new Idempotency-Key with each new request, and "
            "reuse a key only to retry the very request it came with",
            param="Idempotency-Key",
        )
    return body if replay.action == "replay" else None


def final_body(
    req: api.ApiRequest,
    rid: str,
    ids: list[int],
    out: Output,
    report: TurnReport,
    fingerprint: str | None,
) -> dict[str, Any]:
    """A finished turn's response body, as vLLM's server writes it: its
    ``system_fingerprint`` (``fingerprint``, the same as kvtide's vLLM layer gives) and,
    with ``return_token_ids``, the prompt's ids where vLLM puts them (a chat's at the top,
    a completion's in its choice) and the answer's in the choice."""
    make = api.chat_response if req.kind == "chat" else api.completion_response
    body = make(
        rid, req.model, "".join(out.text), report.finish_reason, usage_of(report), report.as_dict()
    )
    body["system_fingerprint"] = fingerprint
    if req.return_token_ids:
        (body if req.kind == "chat" else body["choices"][0])["prompt_token_ids"] = ids
        body["choices"][0]["token_ids"] = out.token_ids
    return body


async def replay_sse(req: api.ApiRequest, body: dict[str, Any]) -> AsyncIterator[str]:
    """A stored response as a stream: the whole text in one chunk, then the end."""
    choice = body["choices"][0]
    text = choice["message"]["content"] if req.kind == "chat" else choice["text"]
    rid, ext = str(body["id"]), body.get("kvtide")
    yield api.stream_chunk(
        req.kind,
        rid,
        req.model,
        text=text,
        first=True,
        token_ids=choice.get("token_ids") if req.return_token_ids else None,
        prompt_token_ids=(body if req.kind == "chat" else choice).get("prompt_token_ids")
        if req.return_token_ids
        else None,
    )
    yield api.stream_chunk(
        req.kind, rid, req.model, text="", finish=choice["finish_reason"], ext=ext
    )
    if req.include_usage:
        yield api.stream_chunk(req.kind, rid, req.model, use=body["usage"], ext=ext)
    yield "data: [DONE]\n\n"


_ERROR_EVENT = 'data: {"error"'


def stream_status(event: str) -> int:
    """The HTTP status a stream's final error event stands for (``stream_error``): 5xx
    for a server error (an engine, the service, a deadline, the stream itself), else
    400 (the client's)."""
    try:
        error = json.loads(event[len("data: ") :])["error"]
    except (ValueError, KeyError, TypeError):
        return 500
    return 500 if error.get("type") == "server_error" else 400


async def ending(body: AsyncIterable[Any], end: Callable[[int | None], None]) -> AsyncIterator[Any]:
    """``body``, then ``end(status)`` once it is exhausted or closed early: 200 for a
    stream that ended well, the status its error event stands for (``stream_status``)
    for one that ended with an error (its HTTP status was sent as 200 before it
    failed), None for one closed before its end (the client went away)."""
    status: int | None = None
    failed: int | None = None
    try:
        async for item in body:
            if isinstance(item, str) and item.startswith(_ERROR_EVENT):
                failed = stream_status(item)
            yield item
        status = failed or 200
    finally:
        end(status if status is not None else failed)


def usage_of(report: TurnReport) -> dict[str, Any]:
    return api.usage(
        report.num_prompt_tokens, report.num_completion_tokens, report.num_cached_tokens
    )


class Output:
    """A turn's generated text and token ids, gathered from its chunks."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []

    def add(self, chunk: GenerateChunk) -> None:
        self.text.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)


def stream_error(body: dict[str, Any], out: Output) -> str:
    """The final SSE event of a stream that failed: the error, and how many completion
    tokens the turn had generated (a client resuming the turn with
    ``continue_final_message`` lowers its ``max_tokens`` by them)."""
    return f"data: {json.dumps({**body, 'kvtide': {'completion_tokens': len(out.token_ids)}})}\n\n"


def server_error_body(message: str, code: str) -> dict[str, Any]:
    """An OpenAI-style body for a failure that is not the client's."""
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


def raise_unclaimed(claim: Claim, session_id: str) -> None:
    """Raise the error a refused ``claim_session`` answers with (nothing when claimed)."""
    if claim.outcome == "claimed":
        return
    if claim.outcome == "not_found":
        raise session_not_found(session_id)
    if claim.outcome == "turn_in_progress":
        raise TurnInProgress(claim.message, param="x-session-id")
    raise LimitExceeded(
        claim.message,
        code=claim.code or "session_limit_exceeded",
        param="x-session-id",
        retry_after_s=claim.retry_after_s,
    )


def pool_stats(pool: str, books: list[dict[str, Any]]) -> dict[str, Any]:
    """One pool's engine counters: each replica's summed, the KV cache usage averaged
    (a fraction of each engine's cache), ``decode_paths`` the number of replicas on each
    decode path (their reasons are in the replicas' own entries), ``engine_id`` the
    pool's name."""
    merged = merge_counters(books)
    if books:
        usage = [float(b.get("kv_cache_usage", 0.0)) for b in books]
        merged["kv_cache_usage"] = sum(usage) / len(usage)
    merged.pop("decode_path_reason", None)
    merged.pop("decode_path", None)
    merged["decode_paths"] = count_decode_paths(books)
    merged["engine_id"] = pool
    merged["num_replicas"] = len(books)
    return merged
