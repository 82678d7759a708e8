"""Which NVLink domain a node is in: from kvtide's config, or from the GPU fabric.

On GB200/GB300 NVL72 racks every GPU registers with the NVLink fabric, and
`nvidia-smi -q` reports, per GPU, a `Fabric` section:

    Fabric
        State                   : Completed
        Status                  : Success
        CliqueId                : 32766
        ClusterUUID             : 7b1e4f2a-93c8-4d65-a0f7-2c9e81b5d4a3

GPUs that share the cluster UUID and the clique id reach each other over NVLink
(the clique id alone is not unique, the cluster UUID alone can cover several
partitions). Their domain id is `<cluster uuid>.<clique id>`, at most 47
characters and a valid node label value.

An 8-GPU HGX node reports `Completed` / `Success` with clique 0 and an all-zero
cluster UUID (its NVSwitches are inside the node); older drivers, PCIe boards and
single GPUs report `N/A` or `Not Supported`, or no Fabric section at all. Such a
node is its own domain, named after the node.

A fabric that is still registering (`Not Started`, `In Progress`), that finished
with an error status, or whose GPUs disagree, is an error rather than a guess: a
wrong domain would put an engine's shards on GPUs without NVLink between them.
The error says to fix the fabric or to set the domain in the config, which always
wins over detection.

Parsing only: running nvidia-smi is the caller's business (pass its output in).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from enum import Enum

from placement.errors import FabricInconsistent, FabricNotReady, InvalidDomainId

__all__ = [
    "DomainResolution",
    "DomainSource",
    "GpuFabricInfo",
    "discover_domain",
    "parse_nvidia_smi_q",
    "resolve_domain",
]

_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_MAX_LABEL_CHARS = 63
_GPU_HEADER = re.compile(
    r"^GPU\s+([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])\s*$"
)
_FIELD = re.compile(r"^(\s*)([^:]*?\S)\s*:\s?(.*)$")
_MISSING = frozenset({"", "N/A", "Not Supported", "[N/A]", "[Not Supported]"})
_ZERO_UUID = "00000000-0000-0000-0000-000000000000"


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuFabricInfo:
    """The Fabric section of one GPU; None where nvidia-smi reports no value."""

    bus_id: str
    product_name: str | None
    gpu_uuid: str | None
    state: str | None
    status: str | None
    clique_id: int | None
    cluster_uuid: str | None

    @property
    def in_multi_node_fabric(self) -> bool:
        """Registered in a fabric that reaches beyond the node (an NVL72 rack)."""
        return (
            self.state == "Completed"
            and self.status == "Success"
            and self.cluster_uuid is not None
            and self.cluster_uuid != _ZERO_UUID
            and self.clique_id is not None
        )

    @property
    def is_registering_or_failed(self) -> bool:
        """The fabric exists but this GPU is not (successfully) registered in it."""
        if self.state in ("Not Started", "In Progress"):
            return True
        return self.state == "Completed" and self.status != "Success"


class DomainSource(Enum):
    CONFIG = "config"
    FABRIC = "fabric"
    NODE = "node"


@dataclass(frozen=True, slots=True, kw_only=True)
class DomainResolution:
    """A node's domain id, where it came from, and a sentence saying why."""

    domain_id: str
    source: DomainSource
    reason: str


def parse_nvidia_smi_q(text: str) -> tuple[GpuFabricInfo, ...]:
    """Every GPU of an `nvidia-smi -q` text with its Fabric section, in output order.

    Fields are found by their section path ("Fabric" then "State"), so the column
    width of the driver's output and unrelated sections do not matter.
    """
    gpus: list[GpuFabricInfo] = []
    bus_id: str | None = None
    fields: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in text.splitlines():
        header = _GPU_HEADER.match(line)
        if header:
            if bus_id is not None:
                gpus.append(_gpu_from_fields(bus_id, fields))
            bus_id, fields, stack = header.group(1), {}, []
            continue
        if bus_id is None or not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        field = _FIELD.match(line)
        if field is None:
            stack.append((indent, line.strip()))  # a section header such as "Fabric"
            continue
        path = "/".join([name for _, name in stack] + [field.group(2)])
        fields.setdefault(path, field.group(3).strip())
    if bus_id is not None:
        gpus.append(_gpu_from_fields(bus_id, fields))
    return tuple(gpus)


def _value(fields: dict[str, str], path: str) -> str | None:
    value = fields.get(path)
    return None if value is None or value in _MISSING else value


def _gpu_from_fields(bus_id: str, fields: dict[str, str]) -> GpuFabricInfo:
    clique = _value(fields, "Fabric/CliqueId")
    cluster = _value(fields, "Fabric/ClusterUUID")
    return GpuFabricInfo(
        bus_id=bus_id,
        product_name=_value(fields, "Product Name"),
        gpu_uuid=_value(fields, "GPU UUID"),
        state=_value(fields, "Fabric/State"),
        status=_value(fields, "Fabric/Status"),
        clique_id=int(clique) if clique is not None and clique.isdigit() else None,
        cluster_uuid=cluster.lower() if cluster is not None else None,
    )


def discover_domain(
    node_id: str, *, configured: str | None = None, nvidia_smi_q: str | None = None
) -> DomainResolution:
    """The node's NVLink domain: `configured` if given, else from the fabric.

    Raises `InvalidDomainId` for a configured id that is not a valid label value,
    `FabricNotReady` while the fabric registers or after it failed, and
    `FabricInconsistent` when the node's GPUs report different fabrics.
    """
    if configured is not None:
        if not _is_label_value(configured):
            raise InvalidDomainId(
                f"configured nvlink domain {configured!r} for node {node_id!r} is not a "
                f"valid label value: use 1-{_MAX_LABEL_CHARS} letters, digits, '-', '_' "
                f"or '.', starting and ending with a letter or digit"
            )
        return DomainResolution(
            domain_id=configured,
            source=DomainSource.CONFIG,
            reason=f"node {node_id!r}: domain {configured!r} set in kvtide's cluster config",
        )
    own = _node_domain_id(node_id)
    gpus = parse_nvidia_smi_q(nvidia_smi_q) if nvidia_smi_q is not None else ()
    if not gpus:
        what = "no nvidia-smi output" if nvidia_smi_q is None else "no GPUs in nvidia-smi -q"
        return DomainResolution(
            domain_id=own, source=DomainSource.NODE, reason=f"node {node_id!r}: {what}"
        )
    pending = [gpu for gpu in gpus if gpu.is_registering_or_failed]
    if pending:
        states = ", ".join(f"{g.bus_id} {g.state}/{g.status or 'N/A'}" for g in pending)
        raise FabricNotReady(
            f"node {node_id!r}: GPU fabric not ready ({states}); wait for the fabric "
            f"manager / IMEX to finish registering the GPUs, fix it, or set the node's "
            f"nvlink domain in kvtide's cluster config"
        )
    fabrics = {(g.cluster_uuid, g.clique_id) for g in gpus if g.in_multi_node_fabric}
    if not fabrics:
        return DomainResolution(
            domain_id=own,
            source=DomainSource.NODE,
            reason=f"node {node_id!r}: {len(gpus)} GPUs without a multi-node NVLink "
            f"fabric (e.g. HGX, PCIe); the node is its own domain",
        )
    outside = [g.bus_id for g in gpus if not g.in_multi_node_fabric]
    if len(fabrics) > 1 or outside:
        seen = ", ".join(
            f"{g.bus_id} cluster {g.cluster_uuid or 'N/A'} clique "
            f"{'N/A' if g.clique_id is None else g.clique_id}"
            for g in gpus
        )
        raise FabricInconsistent(
            f"node {node_id!r}: its GPUs report different NVLink fabrics ({seen}); "
            f"check the fabric partition, or set the node's nvlink domain in "
            f"kvtide's cluster config"
        )
    ((cluster_uuid, clique_id),) = fabrics
    return DomainResolution(
        domain_id=f"{cluster_uuid}.{clique_id}",
        source=DomainSource.FABRIC,
        reason=f"node {node_id!r}: {len(gpus)} GPUs in fabric cluster {cluster_uuid} "
        f"clique {clique_id}",
    )


def resolve_domain(
    node_id: str, *, configured: str | None = None, nvidia_smi_q: str | None = None
) -> str:
    """The node's NVLink domain id; see `discover_domain` for the rules and errors."""
    return discover_domain(node_id, configured=configured, nvidia_smi_q=nvidia_smi_q).domain_id


def _is_label_value(value: str) -> bool:
    return len(value) <= _MAX_LABEL_CHARS and _LABEL_VALUE.match(value) is not None


def _node_domain_id(node_id: str) -> str:
    """The node id as a label value: itself when valid, else cleaned and hashed."""
    if _is_label_value(node_id):
        return node_id
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", node_id).strip("-_.") or "node"
    digest = hashlib.sha256(node_id.encode()).hexdigest()[:8]
    return f"{cleaned[: _MAX_LABEL_CHARS - 9].rstrip('-_.')}-{digest}"
