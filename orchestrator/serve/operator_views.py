"""The ingress's routes for operators and the SDK's session calls: ``/health``,
``/metrics``, ``/kvtide/stats``, ``/kvtide/sessions/{id}`` (read, renew, close) and
``/kvtide/integrity/reuse`` (reuse turned back on for an engine pair: operators only,
``auth.require_operator``), as an ``APIRouter`` that ``Ingress`` includes.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from ray.serve.handle import DeploymentHandle

from orchestrator.cluster.handle_pool import HandlePool
from orchestrator.config import KVTideConfig
from orchestrator.errors import EngineUnavailable, NotFound
from orchestrator.kv.ownership import Principal, session_not_found
from orchestrator.kv.service import KVServiceAPI, engine_pool
from orchestrator.observability.metrics import render_prometheus
from orchestrator.router import Router
from orchestrator.serve import openai_api as api
from orchestrator.serve.admission import AdmissionGate
from orchestrator.serve.auth import require_operator
from orchestrator.serve.request_edge import RequestEdge
from orchestrator.serve.requests import parse_reuse_on
from orchestrator.serve.responses import pool_stats, session_body

__all__ = ["PROMETHEUS_CONTENT_TYPE", "OperatorViews"]

log = logging.getLogger("kvtide.ingress")

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(slots=True, kw_only=True, eq=False)
class OperatorViews:
    """The ingress's operator and session routes (see the module). ``pools``: each pool's
    handles; ``pool_handles``: where ``/health`` looks (a pool, or each of a pool's
    domain deployments)."""

    config: KVTideConfig
    kv: KVServiceAPI
    router: Router
    admission: AdmissionGate
    pools: Mapping[str, HandlePool]
    pool_handles: Mapping[str, DeploymentHandle]
    edge: RequestEdge
    routes: APIRouter = field(init=False)

    def __post_init__(self) -> None:
        self.routes = APIRouter()
        add = self.routes.add_api_route
        add("/health", self.health, methods=["GET"])
        add("/metrics", self.prometheus_metrics, methods=["GET"])
        add("/kvtide/stats", self.stats, methods=["GET"])
        add("/kvtide/integrity/reuse", self.reuse_on, methods=["POST"])
        add("/kvtide/sessions/{session_id}", self.get_session, methods=["GET"])
        add("/kvtide/sessions/{session_id}/renew", self.renew_session, methods=["POST"])
        add("/kvtide/sessions/{session_id}", self.close_session, methods=["DELETE"])

    async def health(self) -> JSONResponse:
        """200 ``ok`` when every pool and the KV service answer within their deadlines;
        503 naming what did not (each check bounded: /health never hangs). ``degraded``
        when an engine makes no progress or a pool refuses turns (admission control):
        503 with Retry-After while turns are refused, 200 while they are still admitted
        (docs/reliability.md#overload)."""
        timeout_s = self.config.kv.service_timeout_s
        names = list(self.pool_handles)
        checks = [asyncio.wait_for(self.pool_handles[n].info.remote(), timeout_s) for n in names]
        results = await asyncio.gather(*checks, self.kv.stats(), return_exceptions=True)
        failed = [
            n
            for n, r in zip([*names, "kv_service"], results, strict=True)
            if isinstance(r, BaseException)
        ]
        if failed:
            for name, result in zip([*names, "kv_service"], results, strict=True):
                if isinstance(result, BaseException):
                    log.warning("health: %s: %s: %s", name, type(result).__name__, result)
            raise EngineUnavailable(
                f"not ready: {', '.join(failed)} did not answer within {timeout_s:g} s"
            )
        state = self.admission.health()
        if state.status == "ok":
            return JSONResponse({"status": "ok"})
        body = {
            "status": state.status,
            "admits": state.admits,
            "refusing_pools": list(state.refusing_pools),
            "engines": state.engines,
        }
        if state.admits:
            return JSONResponse(body)
        retry = {"Retry-After": str(max(1, math.ceil(self.config.admission.retry_after_s)))}
        return JSONResponse(body, status_code=503, headers=retry)

    async def _session_of(self, session_id: str, http: Request) -> tuple[str, Principal]:
        """The session a ``/kvtide/sessions/{id}`` route names, if the caller may see it.
        With API keys, an unknown session and another key's look the same: 404."""
        principal = self.edge.principal(http)
        sid = api.parse_session_id(session_id)
        assert sid is not None
        if not await self.kv.session_owned(sid, principal):
            raise session_not_found(sid)
        return sid, principal

    async def prometheus_metrics(self, request: Request) -> PlainTextResponse:
        """kvtide's metrics in Prometheus's text format: every ingress replica's book and
        the KV service's, summed (each replica reports its book every second). Behind
        the API keys like every route; 404 with ``observability.metrics`` off."""
        self.edge.principal(request)
        if not self.config.observability.metrics:
            raise NotFound("metrics are off (observability.metrics: false)")
        await self.router.settled()
        kv = await self.kv.stats()
        return PlainTextResponse(
            render_prometheus(kv.get("metrics", {})), media_type=PROMETHEUS_CONTENT_TYPE
        )

    async def stats(self, request: Request) -> dict[str, Any]:
        """The service's books with every engine's counters (each engine host reports its
        own with its heartbeat; summed per pool) and every ingress replica's metrics
        (summed, with the service's). A pool none of whose engines has reported yet (just
        deployed) is asked directly, one replica, within the service deadline. A key that
        is not an operator's sees no other key's session or request ids."""
        principal = self.edge.principal(request)
        await self.router.settled()  # the turns finished here are in the books
        kv = await self.kv.stats()
        if not principal.may_operate:
            kv["reuse_off"] = [_own_only(pair, principal) for pair in kv.get("reuse_off", ())]
        engines: dict[str, dict[str, Any]] = kv.pop("engines", {})
        kv.pop("ingress_metrics", None)
        metrics = kv.pop("metrics", {})
        by_pool: dict[str, list[dict[str, Any]]] = {name: [] for name in self.pools}
        for engine_id, counters in engines.items():
            by_pool.setdefault(engine_pool(engine_id), []).append(counters)
        for name, books in by_pool.items():
            if not books and name in self.pools:
                timeout_s = self.config.kv.service_timeout_s
                try:
                    stats = await asyncio.wait_for(
                        self.pools[name].handle.stats.remote(), timeout_s
                    )
                except Exception as exc:
                    log.warning("stats: %s pool: %s: %s", name, type(exc).__name__, exc)
                    raise EngineUnavailable(
                        f"the {name} pool did not report its counters within {timeout_s:g} s"
                    ) from None
                books.append(msgspec.to_builtins(stats))
        return {
            "kv": kv,
            "engines": {pool: pool_stats(pool, books) for pool, books in by_pool.items()},
            "engine_replicas": engines,
            "metrics": metrics,
        }

    async def get_session(self, session_id: str, request: Request) -> dict[str, Any]:
        """Where kvtide holds the session's KV now (``record`` is null when nothing is
        offered: never recorded, expired, evicted or closed)."""
        sid, principal = await self._session_of(session_id, request)
        await self.router.settled()
        info = await self.kv.session(sid)
        if not info.known and not principal.is_anonymous:
            raise session_not_found(sid)
        return session_body(info)

    async def renew_session(self, session_id: str, request: Request) -> dict[str, Any]:
        """Extend the session's KV lease (the SDK's heartbeat while a conversation idles)."""
        sid, principal = await self._session_of(session_id, request)
        await self.router.settled()
        info = await self.kv.renew(sid, principal)
        if not info.known:
            raise session_not_found(sid)
        return session_body(info)

    async def close_session(self, session_id: str, request: Request) -> dict[str, Any]:
        """End a session: its kept KV is drained back to prefill (freed on decode now)."""
        sid, principal = await self._session_of(session_id, request)
        await self.router.settled()
        if not await self.kv.close(sid) and not principal.is_anonymous:
            raise session_not_found(sid)
        return {"id": sid, "object": "session.deleted", "deleted": True}

    async def reuse_on(self, request: Request) -> dict[str, Any]:
        """Turn reuse back on for an engine pair an integrity check turned off (the pairs
        are in ``/kvtide/stats``, ``kv.reuse_off``); 404 when it is not off. Operators
        only (403)."""
        require_operator(self.edge.principal(request), "POST /kvtide/integrity/reuse")
        body = parse_reuse_on(await self.edge.body(request))
        prefill, source = body.prefill_engine_id, body.source_engine_id
        if not await self.kv.reuse_on(prefill, source):
            raise NotFound(
                f"reuse is not off for prefill engine {prefill!r} and source engine "
                f"{source!r}; /kvtide/stats lists the pairs that are under kv.reuse_off"
            )
        return {"prefill_engine_id": prefill, "source_engine_id": source, "reuse": "on"}


def _own_only(pair: dict[str, Any], principal: Principal) -> dict[str, Any]:
    """A ``reuse_off`` entry as ``principal`` (not an operator) may see it: the session
    and request ids of another key's turn left out."""
    if pair.get("owner") == principal.name:
        return pair
    return {**pair, "session_id": None, "request_id": None, "owner": None}
