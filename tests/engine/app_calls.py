"""The engine tier's HTTP calls to the shared app (``tests/conftest.py``'s ``kvtide_app``):
greedy completions and chats that must succeed, and ``/kvtide/stats``."""

from __future__ import annotations

from typing import Any

import httpx

__all__ = ["PULLED", "chat", "complete", "kvtide_stats"]

PULLED = ("sent_back", "prefix_cache", "host_tier")
"""Where a turn whose plan pulled the previous turn's KV back says that KV came from:
``sent_back`` when its prefill engine read blocks from the decode engine, ``prefix_cache``
when that engine already held every block the pull offered and read 0 bytes (with the
tiny model's 128-token blocks: an answer that filled no block of its own), ``host_tier``
when it read them from the host tier (the shared app's idle budget evicted the session
from its decode engine in the meantime)."""


def _post(app: Any, path: str, body: dict[str, Any], session: str | None) -> dict[str, Any]:
    resp = httpx.post(
        app.base_url + path,
        json={"model": app.model, "temperature": 0, "return_token_ids": True, **body},
        headers={"x-session-id": session} if session else {},
        timeout=300,
    )
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


def complete(
    app: Any, prompt: list[int], session: str | None = None, *, max_tokens: int, **extra: Any
) -> dict[str, Any]:
    """A greedy ``/v1/completions`` of token ids (in the session, if given), with the
    prompt's and the answer's token ids."""
    return _post(
        app, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **extra}, session
    )


def chat(
    app: Any,
    messages: list[dict[str, str]],
    session: str | None = None,
    *,
    max_tokens: int,
    **extra: Any,
) -> dict[str, Any]:
    """A greedy ``/v1/chat/completions`` (in the session, if given), with token ids."""
    return _post(
        app,
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": max_tokens, **extra},
        session,
    )


def kvtide_stats(app: Any) -> dict[str, Any]:
    """``GET /kvtide/stats``: the KV service's books, the engines' counters, metrics."""
    resp = httpx.get(app.base_url + "/kvtide/stats", timeout=60)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body
