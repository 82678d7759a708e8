"""Errors raised while turning placement plans into Ray placement groups.

"No domain can hold this engine now" is not an error: `DomainPlacer.place_engine`
returns the planner's `Unplaceable`, which lists every domain's free GPUs. The
exceptions below mean Ray did not do what the plan said it could.

    KVTideError, placement.errors.PlacementError
    └── PlacementGroupError      a placement group could not be made as planned
        ├── PlacementTimeout     Ray did not place the group within the bound; it was removed
        └── PlacementMismatch    Ray put a bundle outside the planned node or domain

Both carry the engine id; `PlacementTimeout` also carries every domain's free GPUs as
Ray reported them when the wait ran out.
"""

from __future__ import annotations

from orchestrator.errors import KVTideError
from placement.errors import PlacementError
from placement.topology import DomainState

__all__ = ["PlacementGroupError", "PlacementMismatch", "PlacementTimeout"]


class PlacementGroupError(KVTideError, PlacementError):
    """A placement group for `engine_id` could not be made as its plan said."""

    def __init__(self, message: str, *, engine_id: str) -> None:
        super().__init__(message)
        self.engine_id = engine_id


class PlacementTimeout(PlacementGroupError):
    """Ray did not place the group within `timeout_s`; kvtide removed the group.

    Ray leaves a group it cannot place pending forever, without an error. The
    message names what was asked, Ray's scheduling state for the group and every
    domain's free GPUs against it, and what would fix it.
    """

    def __init__(
        self,
        message: str,
        *,
        engine_id: str,
        timeout_s: float,
        scheduling_state: str,
        domains: tuple[DomainState, ...],
    ) -> None:
        super().__init__(message, engine_id=engine_id)
        self.timeout_s = timeout_s
        self.scheduling_state = scheduling_state
        self.domains = domains


class PlacementMismatch(PlacementGroupError):
    """Ray placed a bundle on a node outside the planned node or NVLink domain.

    A guard: with bundles pinned by label selector this means the node labels
    changed under kvtide. The group was removed; check the nodes' `nvlink_domain`
    labels.
    """
