"""What ``Client`` and ``AsyncClient`` share: settings, headers and the retry decision."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import httpx

from orchestrator.sdk._wire import SESSIONS_PATH, check_session_id, normalize_base_url
from orchestrator.sdk.errors import KVTideAPIError
from orchestrator.sdk.retry import RetryPolicy

log = logging.getLogger("kvtide.sdk")

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
# A long turn streams for minutes; connecting should fail fast.
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
DEFAULT_RENEW_EVERY_S = 120.0
API_KEY_ENV = "KVTIDE_API_KEY"


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

    def _retry_delay(
        self, attempt: int, error: KVTideAPIError, retry_after_s: float | None, what: str
    ) -> float | None:
        delay = self.retry.delay_s(attempt, error, retry_after_s, self._rand())
        if delay is not None:
            log.info("%s failed (%s); retry %d in %.2fs", what, error, attempt + 1, delay)
        return delay

    @staticmethod
    def _session_path(session_id: str, suffix: str = "") -> str:
        return f"{SESSIONS_PATH}/{check_session_id(session_id)}{suffix}"

    @staticmethod
    def _first_model(body: Any) -> str:
        data = body.get("data") if isinstance(body, dict) else None
        if not data:
            raise KVTideAPIError("GET /v1/models listed no model; pass model= to the session")
        return str(data[0]["id"])
