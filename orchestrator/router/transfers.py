"""A turn's KV transfers as bytes: those offered (the blocks the sending engine named,
as bytes) and those moved (as the reading engine measured them), into the span's
attributes, the metrics and the turn's report."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engines.kv_params import KVTransferParams
from orchestrator.observability import tracing as tr
from orchestrator.observability.metrics import Metrics
from orchestrator.router.turn_report import TurnReport

__all__ = ["Transfers"]


class Transfers:
    """The bytes of one replica's turn transfers (see the module)."""

    def __init__(
        self, *, metrics: Metrics, block_size_tokens: int, kv_bytes_per_token: int
    ) -> None:
        self.metrics = metrics
        # For the bytes offered to a transfer (blocks x block size x bytes per token).
        self.block_size_tokens = block_size_tokens
        self.kv_bytes_per_token = kv_bytes_per_token

    def attrs(
        self, params: KVTransferParams | None, direction: tr.Direction, moved: int | None
    ) -> dict[str, Any]:
        """A transfer span's attributes: the blocks ``params`` name, offered, and what
        moved (None: not measured)."""
        num_blocks = params.num_blocks if params is not None else 0
        return tr.kv_transfer_attrs(
            num_blocks, self.block_size_tokens, self.kv_bytes_per_token, direction, moved
        )

    def count(self, report: TurnReport, direction: tr.Direction, attrs: Mapping[str, Any]) -> None:
        """A finished transfer into the metrics and the turn's report: the bytes it
        moved (where the reading engine measured them) and those offered."""
        moved: int | None = attrs.get(tr.KV_TRANSFER_BYTES)
        offered = int(attrs[tr.KV_TRANSFER_OFFERED_BYTES])
        if moved is not None:
            self.metrics.add_transfer_bytes(direction, moved)
        self.metrics.add_offered_bytes(direction, offered)
        report.add_transfer(direction, moved, offered)
