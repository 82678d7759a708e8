"""``kvtide integrity``: the engine pairs whose KV reuse an integrity check turned off,
and turning one back on (docs/kv_lifecycle.md#integrity-check).

    kvtide integrity list                             GET /kvtide/stats: kv.reuse_off
    kvtide integrity reuse-on --prefill P --source S  POST /kvtide/integrity/reuse

Both take ``--url`` (default ``$KVTIDE_URL``, else http://127.0.0.1:8000), ``--api-key``
(default ``$KVTIDE_API_KEY``) and ``--timeout``. A failure prints one line starting with
``kvtide:`` on stderr and exits 1 (a pair that is not off: the server's 404). With API
keys configured, ``reuse-on`` needs an operator's key (the server's 403 otherwise), and
``list`` with another key shows only that key's turns' session and request ids.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from orchestrator.cli.inspect import (
    InspectFailed,
    add_command_group,
    add_http_options,
    request_json,
)

__all__ = ["add_integrity_parser", "cmd_integrity", "format_reuse_off"]


def add_integrity_parser(subparsers: Any) -> None:
    """Register ``integrity`` on the ``kvtide`` command's subparsers."""
    sub = add_command_group(
        subparsers,
        "integrity",
        help="engine pairs whose KV reuse an integrity check turned off",
        description=__doc__,
        run=cmd_integrity,
    )
    listing = sub.add_parser("list", help="the pairs whose reuse is off, and why")
    on = sub.add_parser("reuse-on", help="turn reuse back on for one pair")
    on.add_argument("--prefill", required=True, help="the prefill engine id (pulled the KV)")
    on.add_argument("--source", required=True, help="the source engine id (kept the KV)")
    for command in (listing, on):
        add_http_options(command)


def cmd_integrity(args: argparse.Namespace, *, transport: httpx.BaseTransport | None = None) -> int:
    """Run one ``integrity`` subcommand; 0 on an answer, 1 with a message otherwise.
    ``transport`` replaces httpx's network transport (tests pass ``httpx.MockTransport``)."""
    try:
        if args.integrity_command == "list":
            stats = request_json(args, "/kvtide/stats", transport)
            print(format_reuse_off((stats.get("kv") or {}).get("reuse_off") or []))
        else:
            body = {"prefill_engine_id": args.prefill, "source_engine_id": args.source}
            request_json(args, "/kvtide/integrity/reuse", transport, method="POST", body=body)
            print(f"reuse is on again from {args.source} into {args.prefill}")
        return 0
    except InspectFailed as exc:
        print(f"kvtide: {exc}", file=sys.stderr)
        return 1


def format_reuse_off(pairs: Sequence[Mapping[str, Any]]) -> str:
    """``kv.reuse_off`` of ``/kvtide/stats``, one pair a line."""
    if not pairs:
        return "reuse is on for every engine pair (no integrity check has failed)"
    lines = ["reuse off (an integrity check failed), prefill <- source:"]
    for p in pairs:
        lines.append(
            f"  {p.get('prefill_engine_id')} <- {p.get('source_engine_id')}: turn "
            f"{p.get('request_id')} of session {p.get('session_id')}, decoded on "
            f"{p.get('decode_engine_id')}, log probabilities off by up to "
            f"{float(p.get('max_abs_diff') or 0):.4g} (tolerance "
            f"{float(p.get('tolerance') or 0):.4g})"
        )
    return "\n".join(lines)
