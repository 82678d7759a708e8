"""Errors a caller of `placement` can trigger.

"This engine cannot be placed right now" is not an error: the planner returns an
`Unplaceable` value that explains why. The exceptions below mean the caller asked
for something that can never work as asked, or broke a contract (releasing an
engine that was never placed). Each message names the offending value and what
would fix it.

    PlacementError                  base of everything raised by `placement`
    ├── InvalidTopology             nodes/domains that cannot describe a cluster
    ├── InvalidEngineRequest              an engine request outside what is supported
    │   └── DuplicateEngine         an engine id that is already placed
    ├── UnknownEngine               release of an engine id that is not placed
    ├── InsufficientCapacity        a direct ledger claim for more than is free
    └── DomainDiscoveryError        the NVLink domain of a node cannot be decided
        ├── InvalidDomainId         a configured domain id that is no valid label
        ├── FabricNotReady          the GPU fabric has not (successfully) registered
        └── FabricInconsistent      GPUs of one node report different fabrics

The capacity model's errors (`placement.model_errors`: UnsupportedModel,
InvalidEngineShape, CapacityError, UnknownDevice) are PlacementErrors too.
"""

from __future__ import annotations

__all__ = [
    "DomainDiscoveryError",
    "DuplicateEngine",
    "FabricInconsistent",
    "FabricNotReady",
    "InsufficientCapacity",
    "InvalidDomainId",
    "InvalidEngineRequest",
    "InvalidTopology",
    "PlacementError",
    "UnknownEngine",
]


class PlacementError(Exception):
    """Base class of every exception raised by the `placement` package."""


class InvalidTopology(PlacementError):
    """The nodes given cannot describe a cluster (duplicate ids, no GPUs, ...)."""


class InvalidEngineRequest(PlacementError):
    """An engine request that no cluster could satisfy as written (e.g. TP 17)."""


class DuplicateEngine(InvalidEngineRequest):
    """An engine id that already holds a placement; release it first."""


class UnknownEngine(PlacementError):
    """A release (or lookup) of an engine id that holds no placement."""


class InsufficientCapacity(PlacementError):
    """A direct claim on the ledger for more GPUs or CPUs than a node has free.

    The planners never trigger it; it guards callers that claim nodes themselves.
    """


class DomainDiscoveryError(PlacementError):
    """The NVLink domain of a node cannot be decided from config or the fabric."""


class InvalidDomainId(DomainDiscoveryError):
    """A configured domain id that is not a valid node label value."""


class FabricNotReady(DomainDiscoveryError):
    """The GPU fabric is still registering, or registration failed.

    Fix the fabric (fabric manager / IMEX) and retry, or set the node's domain
    explicitly in kvtide's cluster config.
    """


class FabricInconsistent(DomainDiscoveryError):
    """GPUs of one node report different fabric clusters or cliques."""
