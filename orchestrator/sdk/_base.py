"""What the sync and async shells share besides the protocol core (``_turn``): the
client's settings and headers, the calls its endpoints make, and a session's view of its
state. Nothing here sends anything."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import httpx

from orchestrator.sdk._state import ConversationState
from orchestrator.sdk._turn import WireRequest
from orchestrator.sdk._wire import SESSIONS_PATH, check_session_id, normalize_base_url
from orchestrator.sdk.errors import KVTideAPIError
from orchestrator.sdk.results import TurnResult
from orchestrator.sdk.retry import RetryPolicy

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
# A long turn streams for minutes; connecting should fail fast.
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
DEFAULT_RENEW_EVERY_S = 120.0
API_KEY_ENV = "KVTIDE_API_KEY"
MODELS_PATH = "/v1/models"
STATS_PATH = "/kvtide/stats"


class BaseClient:
    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        *,
        max_retries: int,
        retry: RetryPolicy | None,
        clock: Callable[[], float],
        rand: Callable[[], float],
    ) -> None:
        self.base_url = normalize_base_url(base_url)
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.retry = retry if retry is not None else RetryPolicy(max_retries=max_retries)
        self._clock = clock
        self._rand = rand
        self._model: str | None = None

    def _headers(self) -> dict[str, str]:
        headers = {"user-agent": "kvtide-sdk"}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        return headers

    @staticmethod
    def _get(path: str) -> WireRequest:
        return WireRequest(method="GET", path=path)

    @staticmethod
    def _session_call(method: str, session_id: str, suffix: str = "") -> WireRequest:
        path = f"{SESSIONS_PATH}/{check_session_id(session_id)}{suffix}"
        return WireRequest(method=method, path=path)

    @staticmethod
    def _model_ids(body: Any) -> list[str]:
        data = body.get("data") if isinstance(body, dict) else None
        return [str(m["id"]) for m in data or ()]

    @staticmethod
    def _first_model(body: Any) -> str:
        ids = BaseClient._model_ids(body)
        if not ids:
            raise KVTideAPIError("GET /v1/models listed no model; pass model= to the session")
        return ids[0]


class SessionView:
    """A session's read-only side and its bookkeeping calls, the same in both shells."""

    _state: ConversationState

    @property
    def id(self) -> str:
        return self._state.id

    @property
    def model(self) -> str | None:
        return self._state.model

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The history the next turn sends first (a copy): completed turns only, each
        reply as the server sent it (``tool_calls`` included)."""
        return copy.deepcopy(self._state.messages)

    @property
    def tool_results(self) -> list[dict[str, Any]]:
        """The ``tool`` messages added for the next turn (a copy)."""
        return copy.deepcopy(self._state.pending)

    @property
    def turns(self) -> list[TurnResult]:
        return list(self._state.turns)

    @property
    def closed(self) -> bool:
        return self._state.closed

    @property
    def renew_error(self) -> Exception | None:
        """The last background renewal's error (cleared by the next success)."""
        return self._state.renew_error

    def add_tool_result(self, tool_call_id: str, content: Any) -> None:
        """Answer one of the last reply's ``tool_calls``; the next turn sends the reply's
        calls, then every result, then its user message (if any). ``content``: the
        tool's output, a string or anything JSON-serialisable (sent as its JSON text)."""
        self._state.add_tool_result(tool_call_id, content)

    def _renew_due(self, now_s: float) -> bool:
        return self._state.renew_due(now_s)
