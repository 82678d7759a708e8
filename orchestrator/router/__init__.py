"""The disaggregated turn (``core.Router``): prefill → NIXL → decode, with the session's
KV reused; what a caller asks (``turn.Turn``), its report (``turn_report``), its engine
streams (``streams``), its hand-over to the KV service (``handover``) and this replica's
turn leases (``held_leases``)."""

from orchestrator.router.core import Router
from orchestrator.router.settings import RouterSettings
from orchestrator.router.streams import abort_stream, bounded
from orchestrator.router.turn import LeaseUse, Turn, TurnSampling
from orchestrator.router.turn_report import KV_SOURCES, LeaseRefused, PoolClient, TurnReport

__all__ = [
    "KV_SOURCES",
    "LeaseRefused",
    "LeaseUse",
    "PoolClient",
    "Router",
    "RouterSettings",
    "Turn",
    "TurnReport",
    "TurnSampling",
    "abort_stream",
    "bounded",
]
