"""The kvtide Python SDK: sessions whose KV cache the server keeps between turns.

    from orchestrator.sdk import Client, format_turns

    with Client("http://127.0.0.1:8000") as client, client.session() as session:
        print(session.send("Hello").text)
        stream = session.stream("And then?")
        for delta in stream:
            print(delta, end="")
        print(stream.result.kv_source)
        print(format_turns(session.turns))

A session sends its id in ``x-session-id`` (so kvtide reuses the previous turn's KV), a
per-turn ``idempotency-key`` (so retries never run a turn twice), keeps the history, and
renews its KV lease while idle. It depends on httpx only. See ``docs/sdk.md``.
"""

from __future__ import annotations

from orchestrator.sdk.async_client import AsyncClient
from orchestrator.sdk.async_session import AsyncSession, AsyncTurnStream
from orchestrator.sdk.client import Client
from orchestrator.sdk.errors import (
    APIConnectionError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    EngineUnavailableError,
    InternalServerError,
    InvalidArgumentError,
    KVTideAPIError,
    KVTideSDKError,
    NotFoundError,
    RateLimitError,
    SessionStateError,
    StructuredOutputError,
)
from orchestrator.sdk.results import (
    Logprob,
    SessionInfo,
    SessionRecord,
    SessionStatus,
    ToolCall,
    TurnResult,
    format_turns,
)
from orchestrator.sdk.retry import RetryPolicy
from orchestrator.sdk.session import Session, TurnStream

__all__ = [
    "APIConnectionError",
    "APITimeoutError",
    "AsyncClient",
    "AsyncSession",
    "AsyncTurnStream",
    "AuthenticationError",
    "BadRequestError",
    "Client",
    "ConflictError",
    "EngineUnavailableError",
    "InternalServerError",
    "InvalidArgumentError",
    "KVTideAPIError",
    "KVTideSDKError",
    "Logprob",
    "NotFoundError",
    "RateLimitError",
    "RetryPolicy",
    "Session",
    "SessionInfo",
    "SessionRecord",
    "SessionStateError",
    "SessionStatus",
    "StructuredOutputError",
    "ToolCall",
    "TurnResult",
    "TurnStream",
    "format_turns",
]
