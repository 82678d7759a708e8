"""The ingress's request handling without Ray: its real route methods on an object
built without ``__init__`` (which needs Serve handles), with the tiny model's
tokenizer, the real router and KV service, and hand-written fake pools
(``test_router``). Requests are Starlette ``Request``s fed from bytes, as Serve's proxy
feeds them."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from test_router import FakePool, decode_script, make_router, prefill_script

from engines.tiny_model import generate_tiny_model, is_tiny_model_dir
from orchestrator.config import KVTideConfig, parse_config
from orchestrator.errors import RequestError
from orchestrator.kv.service import KVServiceAPI
from orchestrator.serve.admission import AdmissionGate
from orchestrator.serve.auth import Authenticator, ConcurrencyGate
from orchestrator.serve.ingress import Ingress, route_groups
from orchestrator.serve.operator_views import OperatorViews
from orchestrator.serve.prompts import PromptEncoder
from orchestrator.serve.request_edge import RequestEdge

MODEL = "kvtide-tiny"


class _BareIngress(Ingress.func_or_class):  # type: ignore[misc,name-defined]
    def __del__(self) -> None:
        """Serve's wrapper closes its ASGI app here; this one never started it."""


def bare_ingress(
    tokenizer: Any,
    *,
    vllm: bool = True,
    max_model_len: int = 256,
    routing: Mapping[str, Any] | None = None,
    model: Mapping[str, Any] | None = None,
    kv: Callable[[KVServiceAPI], KVServiceAPI] | None = None,
    prompts: type[PromptEncoder] = PromptEncoder,
    **server: Any,
) -> Any:
    """An ``Ingress`` with the state its ``__init__`` would give it, its parts composed
    as it composes them (config: the embedded default with a ``max_model_len``-token
    context, ``model``, ``routing`` and ``server`` fields; no pools to ask for /health or
    /kvtide/stats). ``kv(service)``: the service the router and the parts call (a
    wrapper of the real one); ``prompts``: the prompt encoder's class. ``vllm``: with
    the OpenAI route groups, which need vLLM's OpenAI serving layer on the tiny model
    (generated where the embedded default keeps it; ~10 s to import vLLM the first
    time in a process); without, the operator views only (``routes.operator``)."""
    config: KVTideConfig = parse_config(
        {
            "model": {"max_model_len": max_model_len, **(model or {})},
            "server": server,
            "routing": routing or {},
        }
    )
    ingress = _BareIngress.__new__(_BareIngress)
    router = make_router(FakePool(prefill_script()), FakePool(decode_script))
    if kv is not None:
        router.kv = kv(router.kv)
    ingress.config = config
    ingress.tokenizer = tokenizer
    ingress.prompts = prompts(tokenizer, max_model_len=config.model.max_model_len)
    ingress.router = router
    ingress.session_tokens = router.session_tokens
    ingress.kv = router.kv
    ingress.metrics = router.metrics
    ingress.pools = {}
    ingress.pool_handles = {}
    ingress.gate = ConcurrencyGate(retry_after_s=1.0)
    ingress.admission = AdmissionGate(
        config.admission.settings(), pools=("prefill", "decode"), metrics=router.metrics
    )
    if not vllm:
        edge = RequestEdge(
            config=config, auth=Authenticator(config.server.api_keys), metrics=router.metrics
        )
        ingress.routes = SimpleNamespace(
            edge=edge,
            operator=OperatorViews(
                config=config,
                kv=ingress.kv,
                router=router,
                admission=ingress.admission,
                pools={},
                pool_handles={},
                edge=edge,
            ),
        )
        return ingress
    if not is_tiny_model_dir(config.model.resolved_path()):
        generate_tiny_model(config.model.resolved_path())
    ingress.routes = route_groups(
        config=config,
        router=router,
        kv=ingress.kv,
        prompts=ingress.prompts,
        session_tokens=router.session_tokens,
        metrics=router.metrics,
        gate=ingress.gate,
        admission=ingress.admission,
        pools={},
        pool_handles={},
    )
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
    routes = ingress.routes
    if path.endswith("chat/completions"):
        handler, operation = routes.own.chat, "chat"
    elif path.endswith("/responses"):
        handler, operation = routes.responses.create, "responses"
    else:
        handler, operation = routes.own.completion, "text_completion"
    try:
        response = await routes.edge.traced(request, operation, handler)
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
