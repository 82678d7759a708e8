"""Admission in front of the engine pools: admit a turn, or refuse it at once.

A turn that cannot finish within its deadline is better refused in a millisecond, with
``Retry-After``, than queued in an engine until the deadline passes: queued work that
nobody will read keeps an engine's seats and KV blocks from the turns that could run.

The inputs are what each engine reports about itself (``EngineLoad``: requests running
and waiting, KV cache use, requests finished so far, when it reported), seen through an
``EngineBook`` that remembers when each engine last made progress. Pure: no clock but
``now_s``, no I/O.

An engine is

* **stalled** when it has requests waiting, none running, and has finished none for
  ``stall_s``: it makes no progress (a KV cache full of blocks nobody reads);
* **full** when it is stalled, has ``max_waiting_per_engine`` requests waiting, or has
  its KV cache at ``max_kv_cache_usage`` or more with requests waiting or with nothing
  running (kept blocks fill it: the KV service then evicts idle sessions' KV from it,
  ``KVLifecycle.make_room``);
* unknown when its last report is older than ``max_report_age_s`` (left out: a silent
  engine is the health check's business, and refusing on old news would refuse forever).

A turn needs its prefill pool and its decode pool. It is refused when no engine of one
of them with a recent report can take it (``Admission.admitted`` False, ``reason`` naming
the pool); a pool with no recent report admits. An engine takes a turn of
``num_sequences`` sequences (a request's ``n`` choices) when it is not full and that many
more waiting stay within ``max_waiting_per_engine``: a turn of one sequence, when it is
not full. ``pool_health`` says the same per pool for
``/health``: ``degraded`` when an engine is stalled or a pool refuses turns.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "Admission",
    "AdmissionSettings",
    "EngineBook",
    "EngineLoad",
    "EngineView",
    "Health",
    "admit",
    "pool_health",
    "short_of_kv",
]

Condition = Literal["ok", "full", "stalled"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionSettings:
    """The thresholds (``admission`` in the config file)."""

    enabled: bool = True
    max_waiting_per_engine: int = 64
    max_kv_cache_usage: float = 0.95
    stall_s: float = 10.0
    max_report_age_s: float = 5.0
    retry_after_s: float = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineLoad:
    """One engine's report of itself at ``reported_s`` (the caller's clock)."""

    engine_id: str
    pool: str
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_finished: int  # requests finished since the engine started (never decreases)
    reported_s: float
    # A decode engine's prefill time per token, as its host measured it at start
    # (``orchestrator.serve.warm_up.measure_prefill``); None: not reported.
    prefill_s_per_token: float | None = None
    # The most prompt tokens of one request it computes in a step beside others (vLLM's
    # ``long_prefill_token_threshold``, fitted by its host to its cost); None: not reported.
    prefill_chunk_tokens: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineView:
    """An engine's latest report and when it last made progress: it had nothing waiting,
    something running, or finished a request since its previous report."""

    load: EngineLoad
    progress_s: float

    def condition(self, settings: AdmissionSettings, now_s: float) -> Condition:
        load = self.load
        if load.num_waiting > 0 and now_s - self.progress_s >= settings.stall_s:
            return "stalled"
        if load.num_waiting >= settings.max_waiting_per_engine:
            return "full"
        # A KV cache this full admits nothing new: not behind requests waiting for it,
        # and not with nothing running (blocks kept for peers fill it; none will free a
        # block until they are read, drained or expire).
        if load.kv_cache_usage >= settings.max_kv_cache_usage and (
            load.num_waiting > 0 or load.num_running == 0
        ):
            return "full"
        return "ok"

    def takes(self, settings: AdmissionSettings, now_s: float, num_sequences: int) -> bool:
        """Whether the engine can take ``num_sequences`` more sequences now."""
        return (
            self.condition(settings, now_s) == "ok"
            and self.load.num_waiting + num_sequences <= settings.max_waiting_per_engine
        )

    def is_recent(self, settings: AdmissionSettings, now_s: float) -> bool:
        return now_s - self.load.reported_s <= settings.max_report_age_s


class EngineBook:
    """Each engine's latest report and its last progress, from successive reports."""

    def __init__(self) -> None:
        self._views: dict[str, EngineView] = {}

    def observe(self, loads: Iterable[EngineLoad]) -> None:
        """Take the engines' reports; an engine missing from ``loads`` is forgotten
        (the reporter no longer knows it: lost, or replaced)."""
        views: dict[str, EngineView] = {}
        for load in loads:
            before = self._views.get(load.engine_id)
            if before is not None and load.reported_s < before.load.reported_s:
                views[load.engine_id] = before  # an older report than the one held
                continue
            progress_s = load.reported_s
            if before is not None and not (
                load.num_waiting == 0
                or load.num_running > 0
                or load.num_finished > before.load.num_finished
            ):
                progress_s = before.progress_s  # no progress since the previous report
            views[load.engine_id] = EngineView(load=load, progress_s=progress_s)
        self._views = views

    def views(self) -> list[EngineView]:
        return sorted(self._views.values(), key=lambda v: v.load.engine_id)


def short_of_kv(view: EngineView, settings: AdmissionSettings, now_s: float) -> bool:
    """Whether blocks kept for sessions are what hold the engine back, so that evicting
    idle sessions' KV from it makes room: its KV cache at ``max_kv_cache_usage`` with
    requests waiting or nothing running, or requests waiting and none running (none
    finished) for ``stall_s``. An engine busy running turns is not short of KV."""
    load = view.load
    if load.num_running > 0 and load.num_waiting == 0:
        return False
    if load.kv_cache_usage >= settings.max_kv_cache_usage:
        return True
    return view.condition(settings, now_s) == "stalled"


@dataclass(frozen=True, slots=True, kw_only=True)
class Admission:
    admitted: bool
    reason: str = ""
    pool: str | None = None
    retry_after_s: float = 0.0


ADMIT = Admission(admitted=True)


def _pool_refuses(
    views: Sequence[EngineView],
    pool: str,
    settings: AdmissionSettings,
    now_s: float,
    num_sequences: int = 1,
) -> tuple[bool, bool]:
    """Whether ``pool`` refuses a turn of ``num_sequences`` now (no recently reported
    engine takes it), and whether that is because each of them is stalled."""
    recent = [v for v in views if v.load.pool == pool and v.is_recent(settings, now_s)]
    if not recent or any(v.takes(settings, now_s, num_sequences) for v in recent):
        return False, False
    return True, all(v.condition(settings, now_s) == "stalled" for v in recent)


def admit(
    views: Sequence[EngineView],
    pools: Sequence[str],
    settings: AdmissionSettings,
    now_s: float,
    num_sequences: int = 1,
) -> Admission:
    """Admit a turn of ``num_sequences`` sequences that runs on ``pools`` (its prefill
    and its decode pool), or say why not and when to retry."""
    if not settings.enabled:
        return ADMIT
    for pool in pools:
        refuses, stalled = _pool_refuses(views, pool, settings, now_s, num_sequences)
        if not refuses:
            continue
        many = "" if num_sequences == 1 else f" for {num_sequences} more sequences (n)"
        why = (
            f"makes no progress (requests waiting, none running for {settings.stall_s:g} s)"
            if stalled
            else f"is full{many} (its engines' queues or KV caches are full)"
        )
        return Admission(
            admitted=False,
            reason=f"the {pool} pool {why}; retry after {settings.retry_after_s:g} s",
            pool=pool,
            retry_after_s=settings.retry_after_s,
        )
    return ADMIT


@dataclass(frozen=True, slots=True, kw_only=True)
class Health:
    """``status`` is ``ok`` or ``degraded``; ``admits``: whether turns are admitted
    (False: some pool refuses them); ``engines``: each degraded engine's condition."""

    status: Literal["ok", "degraded"]
    admits: bool
    refusing_pools: tuple[str, ...] = ()
    engines: dict[str, dict[str, object]] = field(default_factory=dict)


def pool_health(
    views: Sequence[EngineView], pools: Sequence[str], settings: AdmissionSettings, now_s: float
) -> Health:
    """The pools' health from the engines' reports: degraded while an engine is stalled
    or a pool refuses turns (with admission enabled)."""
    engines: dict[str, dict[str, object]] = {}
    for v in views:
        if not v.is_recent(settings, now_s):
            continue
        condition = v.condition(settings, now_s)
        if condition != "ok":
            load = v.load
            engines[load.engine_id] = {
                "pool": load.pool,
                "condition": condition,
                "num_running": load.num_running,
                "num_waiting": load.num_waiting,
                "kv_cache_usage": round(load.kv_cache_usage, 3),
                "no_progress_s": round(max(0.0, now_s - v.progress_s), 1),
            }
    refusing = tuple(
        p for p in pools if settings.enabled and _pool_refuses(views, p, settings, now_s)[0]
    )
    stalled = any(e["condition"] == "stalled" for e in engines.values())
    return Health(
        status="degraded" if refusing or stalled else "ok",
        admits=not refusing,
        refusing_pools=refusing,
        engines=engines if refusing or stalled else {},
    )
