"""The ingress's request handling without Ray: its real route methods on an object
built without ``__init__`` (which needs Serve handles), with the tiny model's
tokenizer, the real router and KV service, and hand-written fake pools
(``test_router``). Requests are Starlette ``Request``s fed from bytes, as Serve's proxy
feeds them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from test_router import FakePool, decode_script, make_router, prefill_script

from engines.tiny_model import generate_tiny_model, is_tiny_model_dir
from orchestrator.config import KVTideConfig, parse_config
from orchestrator.errors import RequestError
from orchestrator.serve.admission import AdmissionGate
from orchestrator.serve.auth import Authenticator, ConcurrencyGate
from orchestrator.serve.ingress import Ingress
from orchestrator.serve.prompts import PromptEncoder
from orchestrator.serve.responses_api import response_book
from orchestrator.serve.tool_turns import ToolTurns
from orchestrator.serve.vllm_api import build_serving

MODEL = "kvtide-tiny"


class _BareIngress(Ingress.func_or_class):  # type: ignore[misc,name-defined]
    def __del__(self) -> None:
        """Serve's wrapper closes its ASGI app here; this one never started it."""


def bare_ingress(
    tokenizer: Any, *, vllm: bool = True, max_model_len: int = 256, **server: Any
) -> Any:
    """An ``Ingress`` with the state its ``__init__`` would give it (config: the embedded
    default with a ``max_model_len``-token context and ``server`` fields). ``vllm``: with vLLM's
    OpenAI serving layer on the tiny model (generated where the embedded default keeps
    it; ~10 s to import vLLM the first time in a process)."""
    config: KVTideConfig = parse_config(
        {"model": {"max_model_len": max_model_len}, "server": server}
    )
    ingress = _BareIngress.__new__(_BareIngress)
    router = make_router(FakePool(prefill_script()), FakePool(decode_script))
    ingress.config = config
    ingress.tokenizer = tokenizer
    ingress.prompts = PromptEncoder(tokenizer, max_model_len=config.model.max_model_len)
    ingress.router = router
    ingress.session_tokens = router.session_tokens
    ingress.kv = router.kv
    ingress.metrics = router.metrics
    ingress.auth = Authenticator(config.server.api_keys)
    ingress.gate = ConcurrencyGate(retry_after_s=1.0)
    ingress.admission = AdmissionGate(
        config.admission.settings(), pools=("prefill", "decode"), metrics=router.metrics
    )
    if vllm:
        if not is_tiny_model_dir(config.model.resolved_path()):
            generate_tiny_model(config.model.resolved_path())
        ingress.vllm = build_serving(config.model, ingress._vllm_turn)
        ingress.tool_turns = ToolTurns()
        ingress.response_book = response_book(config, ingress.router.clock)
        ingress.response_book.install(ingress.vllm.responses)
    return ingress


class Feed:
    """An ASGI ``receive`` that hands out the body in chunks and counts them."""

    def __init__(self, body: bytes, chunk: int) -> None:
        self.parts = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
        self.num_read = 0

    async def __call__(self) -> dict[str, Any]:
        n = self.num_read
        if n >= len(self.parts):
            return {"type": "http.disconnect"}
        self.num_read += 1
        return {"type": "http.request", "body": self.parts[n], "more_body": n + 1 < len(self.parts)}


def http_request(
    path: str,
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
    *,
    method: str = "POST",
    chunk: int = 65536,
) -> tuple[Request, Feed]:
    all_headers = {"content-type": "application/json", **(headers or {})}
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "scheme": "http",
        "query_string": b"",
        "http_version": "1.1",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
        "headers": [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in all_headers.items()
        ],
    }
    feed = Feed(body, chunk)
    return Request(scope, feed), feed


async def handle(ingress: Any, path: str, body: bytes, **headers: str) -> tuple[int, Any]:
    """What the app answers: status and JSON body (or the SSE text of a stream). A
    ``RequestError`` becomes its OpenAI-style body as the app's handler renders it; any
    other exception propagates (the app would answer 500)."""
    request, _ = http_request(path, body, {k.replace("_", "-"): v for k, v in headers.items()})
    if path.endswith("chat/completions"):
        handler, operation = ingress._chat, "chat"
    elif path.endswith("/responses"):
        handler, operation = ingress._responses_create, "responses"
    else:
        handler, operation = ingress._completion, "text_completion"
    try:
        response = await ingress._traced(request, operation, handler)
    except RequestError as exc:
        rendered = JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers())
        await ingress.router.settled()
        return rendered.status_code, json.loads(rendered.body)
    if isinstance(response, StreamingResponse):
        text = "".join([part async for part in response.body_iterator])  # type: ignore[misc]
        await ingress.router.settled()  # the finished turn handed to the service
        return response.status_code, text
    await ingress.router.settled()
    return response.status_code, json.loads(response.body)
