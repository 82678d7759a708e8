"""The ingress's admission gate: the engines' load as the KV service last heard it.

Each engine host sends its engine's counters with its heartbeat every second; each
ingress replica reads them from the service every second (``engine_loads``, one call,
off every turn's path) into an ``EngineBook`` (``policies.admission``). A turn is
checked against the book before anything is claimed or queued: ``check`` raises
``Overloaded`` (503 with Retry-After) when its prefill or decode pool cannot take it now.
``health`` is the same judgement for ``/health``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from orchestrator.errors import InvalidRequest, Overloaded
from orchestrator.kv.service import KVServiceAPI, engine_pool
from orchestrator.observability.metrics import Metrics
from policies.admission import (
    AdmissionSettings,
    EngineBook,
    EngineLoad,
    Health,
    admit,
    pool_health,
)

__all__ = ["AdmissionGate"]

log = logging.getLogger("kvtide.admission")


class AdmissionGate:
    """One ingress replica's view of the engines (see the module). ``clock`` is the
    replica's; the service's reports carry their age, not its clock."""

    def __init__(
        self,
        settings: AdmissionSettings,
        *,
        pools: Sequence[str],
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.pools = tuple(pools)  # the app's pools, for /health
        self.metrics = metrics
        self.clock = clock
        self.book = EngineBook()

    def observe(self, reports: Mapping[str, Mapping[str, float]]) -> None:
        """The service's ``engine_loads`` answer, read now."""
        now = self.clock()
        self.book.observe(
            EngineLoad(
                engine_id=engine_id,
                pool=engine_pool(engine_id),
                num_running=int(report.get("num_running", 0)),
                num_waiting=int(report.get("num_waiting", 0)),
                kv_cache_usage=float(report.get("kv_cache_usage", 0.0)),
                num_finished=int(report.get("num_requests", 0)),
                reported_s=now - float(report.get("age_s", 0.0)),
                prefill_s_per_token=_positive(report.get("prefill_s_per_token")),
                prefill_chunk_tokens=_whole(report.get("prefill_chunk_tokens")),
            )
            for engine_id, report in reports.items()
        )

    async def refresh(self, kv: KVServiceAPI) -> None:
        """Read the engines' loads from the service (bounded by its client's deadline)."""
        self.observe(await kv.engine_loads())

    def check(self, pools: Sequence[str], num_sequences: int = 1) -> None:
        """Admit a turn of ``num_sequences`` sequences (a request's ``n`` choices) that
        runs on ``pools``, or raise ``Overloaded``; ``InvalidRequest`` naming ``n`` for
        more sequences than an engine ever takes (``max_waiting_per_engine``)."""
        most = self.settings.max_waiting_per_engine
        if self.settings.enabled and num_sequences > most:
            raise InvalidRequest(
                f"n is {num_sequences}; this deployment admits at most {most} sequences per "
                "request (admission.max_waiting_per_engine). Send n of at most "
                f"{most}, or several requests.",
                param="n",
            )
        views = self.book.views()
        decision = admit(views, pools, self.settings, self.clock(), num_sequences)
        if decision.admitted:
            return
        if self.metrics is not None:
            self.metrics.inc("kvtide_admission_refusals_total", pool=decision.pool or "")
        raise Overloaded(decision.reason, retry_after_s=decision.retry_after_s)

    def health(self) -> Health:
        return pool_health(self.book.views(), self.pools, self.settings, self.clock())


def _positive(value: object) -> float | None:
    """A reported figure that is a positive number, else None (not reported)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def _whole(value: object) -> int | None:
    """A reported count that is a positive whole number, else None (not reported). The
    service's answer types every figure a float (``engine_loads``): 34.0 is 34."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 1:
        if float(value).is_integer():
            return int(value)
    return None
