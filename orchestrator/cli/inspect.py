"""``kvtide inspect``: read-only views of a running kvtide, for operators and runbooks.

    kvtide inspect health                 GET /health: exit 0 when the engines answer
    kvtide inspect stats [--json]         GET /kvtide/stats, summarised (or the raw JSON)
    kvtide inspect session ID             GET /kvtide/sessions/ID: where its KV is, its lease
    kvtide inspect domains [--address A]  the Ray cluster's NVLink domains and free GPUs

The HTTP subcommands take ``--url`` (default ``$KVTIDE_URL``, else http://127.0.0.1:8000)
and ``--api-key`` (default ``$KVTIDE_API_KEY``). Every failure (unreachable server,
401, 404, 503, a Ray cluster that is not there) prints one line starting with
``kvtide:`` on stderr and exits 1; nothing here changes the server's state.
docs/runbooks/ shows which command answers which question.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx

from engines.decode_path import STOCK

if TYPE_CHECKING:
    from orchestrator.cluster.ray_nodes import RayNode

__all__ = [
    "DEFAULT_URL",
    "InspectFailed",
    "add_command_group",
    "add_http_options",
    "add_inspect_parser",
    "base_url",
    "cmd_inspect",
    "error_of",
    "format_domains",
    "format_engine_groups",
    "format_session",
    "format_stats",
    "request_json",
]

DEFAULT_URL = "http://127.0.0.1:8000"


class InspectFailed(Exception):
    """What to tell the operator when a command cannot answer (printed, exit 1)."""


def add_inspect_parser(subparsers: Any) -> None:
    """Register ``inspect`` on the ``kvtide`` command's subparsers."""
    sub = add_command_group(
        subparsers,
        "inspect",
        help="read-only views of a running kvtide (health, stats, sessions, domains)",
        description=__doc__,
        run=cmd_inspect,
    )
    health = sub.add_parser("health", help="GET /health: exit 0 when the engines answer")
    stats = sub.add_parser("stats", help="KV lifecycle, engine and metric counters")
    stats.add_argument("--json", action="store_true", help="print the raw JSON")
    session = sub.add_parser("session", help="where a session's KV is held, and its lease")
    session.add_argument("session_id", metavar="ID", help="the session id (x-session-id)")
    for command in (health, stats, session):
        add_http_options(command)
    domains = sub.add_parser("domains", help="NVLink domains, their nodes and free GPUs (Ray)")
    domains.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS") or "auto",
        help="Ray cluster address, host:port of its GCS (default $RAY_ADDRESS or 'auto')",
    )


def add_command_group(
    subparsers: Any,
    name: str,
    *,
    help: str,
    description: str | None,
    run: Callable[[argparse.Namespace], int],
) -> Any:
    """Register the ``kvtide`` command ``name``, run by ``run``, whose subcommands
    (required, in ``args.<name>_command``) go on the subparsers returned. Its
    ``description`` (the module's docstring) is printed as written."""
    group = subparsers.add_parser(
        name,
        help=help,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group.set_defaults(func=run)
    return group.add_subparsers(dest=f"{name}_command", required=True)


def add_http_options(command: argparse.ArgumentParser) -> None:
    """``--url``, ``--api-key`` and ``--timeout``: how a subcommand reaches kvtide."""
    command.add_argument(
        "--url",
        default=os.environ.get("KVTIDE_URL") or DEFAULT_URL,
        help=f"kvtide's base URL (default $KVTIDE_URL or {DEFAULT_URL})",
    )
    command.add_argument(
        "--api-key",
        default=os.environ.get("KVTIDE_API_KEY"),
        help="API key, sent as 'Authorization: Bearer <key>' (default $KVTIDE_API_KEY)",
    )
    command.add_argument(
        "--timeout", type=float, default=30.0, help="seconds per request (default 30)"
    )


def cmd_inspect(args: argparse.Namespace, *, transport: httpx.BaseTransport | None = None) -> int:
    """Run one ``inspect`` subcommand; 0 on an answer, 1 with a message otherwise.

    ``transport`` replaces httpx's network transport (tests pass ``httpx.MockTransport``).
    """
    try:
        if args.inspect_command == "domains":
            print(_domains(args.address))
            return 0
        body = request_json(args, _path(args), transport)
        if args.inspect_command == "health":
            print(f"ok: kvtide at {base_url(args.url)} is healthy (every pool's engine answered)")
        elif args.inspect_command == "stats":
            out = json.dumps(body, indent=2, sort_keys=True) if args.json else format_stats(body)
            print(out)
        else:
            print(format_session(body))
        return 0
    except InspectFailed as exc:
        print(f"kvtide: {exc}", file=sys.stderr)
        return 1


# ---- HTTP -------------------------------------------------------------------------------


def _path(args: argparse.Namespace) -> str:
    if args.inspect_command == "health":
        return "/health"
    if args.inspect_command == "stats":
        return "/kvtide/stats"
    return "/kvtide/sessions/" + quote(args.session_id, safe="")


def base_url(url: str) -> str:
    """The server root; a trailing ``/v1`` (what OpenAI clients are given) is dropped."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def request_json(
    args: argparse.Namespace,
    path: str,
    transport: httpx.BaseTransport | None,
    *,
    method: str = "GET",
    body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``method path`` (with the JSON ``body``) against ``args.url`` with ``args.api_key``
    within ``args.timeout``: the answer's JSON object; ``InspectFailed`` otherwise."""
    base = base_url(args.url)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        with httpx.Client(
            base_url=base, headers=headers, timeout=args.timeout, transport=transport
        ) as client:
            response = client.request(method, path, json=body)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise InspectFailed(
            f"cannot reach kvtide at {base}: {type(exc).__name__}: {exc or 'no detail'}; "
            "is it running? (set --url or $KVTIDE_URL)"
        ) from None
    if response.status_code != 200:
        raise InspectFailed(f"{method} {path}: HTTP {response.status_code}: {error_of(response)}")
    try:
        answer = response.json()
    except ValueError:
        text = response.text[:200]
        raise InspectFailed(f"{method} {path}: the answer is not JSON: {text!r}") from None
    if not isinstance(answer, dict):
        raise InspectFailed(f"{method} {path}: expected a JSON object, got {type(answer).__name__}")
    return answer


def error_of(response: httpx.Response) -> str:
    """The server's own message: OpenAI-style ``{"error": {...}}``, FastAPI's
    ``{"detail": ...}``, or the start of the text."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:300] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            code = f" ({error['code']})" if error.get("code") else ""
            return f"{error['message']}{code}"
        if body.get("detail"):
            return str(body["detail"])
    return json.dumps(body)[:300]


# ---- formatting -------------------------------------------------------------------------


def _bytes(num: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num) < 1024 or unit == "GiB":
            return f"{num:,.0f} {unit}" if unit == "B" else f"{num:,.1f} {unit}"
        num /= 1024
    raise AssertionError("unreachable")


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def _num(value: Any) -> str:
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.3f}"
    return f"{int(value or 0):,}"


def _count(num: int, noun: str) -> str:
    return f"{num:,} {noun}" + ("" if num == 1 else "s")


def _reasons(value: Any) -> list[tuple[str, int]]:
    """``recomputes_by_reason`` as sent: ``[[reason, count], ...]`` (or a mapping)."""
    pairs = value.items() if isinstance(value, Mapping) else (value or [])
    return [(str(reason), int(count)) for reason, count in pairs]


def _host_tier_lines(kv: Mapping[str, Any]) -> list[str]:
    """The host-memory tier's line, when the app has one (``kv.host_tier_mib``)."""
    tier: Mapping[str, Any] | None = kv.get("host_tier")
    if not tier:
        return []
    if "unreachable" in tier:
        return [f"  host tier: store not reachable ({tier['unreachable']})"]
    return [
        f"  host tier: sessions taken in {_num(kv.get('num_host_take_ins'))} (failed "
        f"{_num(kv.get('num_host_take_in_failures'))}, not booked "
        f"{_num(kv.get('num_host_unbooked'))}), released {_num(kv.get('num_host_releases'))}; "
        f"{_num(tier.get('num_stores'))} stores (one per node) hold "
        f"{_num(tier.get('num_entries'))}, {_num(tier.get('num_free_blocks'))} blocks free, "
        f"{_bytes(float(tier.get('bytes_taken_in') or 0))} taken in since they started"
    ]


def format_stats(body: Mapping[str, Any]) -> str:
    """``GET /kvtide/stats`` as a few readable sections."""
    kv: Mapping[str, Any] = body.get("kv") or {}
    service: Mapping[str, Any] = kv.get("service") or {}
    reasons = _reasons(kv.get("recomputes_by_reason"))
    num_recomputes = sum(count for _, count in reasons)
    by_reason = ", ".join(f"{r} {c:,}" for r, c in reasons if c) or "none"
    lines = [
        f"KV lifecycle service: epoch {str(service.get('epoch', '?'))[:12]}, up "
        f"{_duration(float(service.get('uptime_s') or 0))}"
        + (", REBUILDING from the engines' ledgers" if service.get("restoring") else ""),
        f"  restores {_num(service.get('restores'))}: adopted {_num(service.get('adopted'))}, "
        f"skipped as already read {_num(service.get('adopt_skipped_consumed'))}, superseded "
        f"{_num(service.get('adopt_superseded'))}",
        f"  sessions {_num(kv.get('num_sessions'))}, KV records offered "
        f"{_num(kv.get('num_records'))}",
        f"  turns: pulls {_num(kv.get('num_pulls'))}, recomputes {num_recomputes:,}",
        f"  recomputes by reason: {by_reason}",
        f"  failed or declined pulls {_num(kv.get('num_declines'))}, expiries "
        f"{_num(kv.get('num_expiries'))}, evictions {_num(kv.get('num_evictions'))}, "
        f"releases {_num(kv.get('num_releases'))}",
        f"  drains {_num(kv.get('num_drains'))}, drain failures "
        f"{_num(kv.get('num_drain_failures'))}, undrainable {_num(kv.get('num_undrainable'))}",
        f"  engine pairs with reuse off (an integrity check failed): "
        f"{len(kv.get('reuse_off') or [])} (kvtide integrity list)",
        *_host_tier_lines(kv),
        "  KV bytes held for idle sessions, per engine (a host tier's store among them):",
    ]
    held: Mapping[str, Any] = kv.get("bytes_held") or {}
    lines += [f"    {engine}: {_bytes(float(n))}" for engine, n in sorted(held.items())] or [
        "    none"
    ]
    lines += ["", "Engines (per pool, the engine that answered):"]
    engines: Mapping[str, Mapping[str, Any]] = body.get("engines") or {}
    for pool, e in engines.items():
        lines += [
            f"  {pool}: {e.get('engine_id', '?')}: running {_num(e.get('num_running'))}, "
            f"waiting {_num(e.get('num_waiting'))}, KV cache usage "
            f"{100 * float(e.get('kv_cache_usage') or 0):.1f}%",
            f"    tokens: prompt {_num(e.get('num_prompt_tokens'))}, generated "
            f"{_num(e.get('num_generation_tokens'))}; prefix cache hits "
            f"{_num(e.get('num_prefix_cache_hits'))} of {_num(e.get('num_prefix_cache_queries'))}",
            f"    KV transfers {_num(e.get('num_kv_transfers'))} "
            f"({_bytes(float(e.get('kv_transfer_bytes') or 0))}), failures "
            f"{_num(e.get('num_kv_transfer_failures'))}, expired reads "
            f"{_num(e.get('num_kv_expired_reads'))}",
        ]
        paths: Mapping[str, Any] = e.get("decode_paths") or {}
        if paths:
            lines.append(
                "    decode paths: " + ", ".join(f"{p} {_num(n)}" for p, n in paths.items())
            )
    if not engines:
        lines.append("  none reported")
    replicas: Mapping[str, Mapping[str, Any]] = body.get("engine_replicas") or {}
    if replicas:
        lines += ["", "Decode path of each engine (kernels.gate's decision and reason):"]
    for engine_id, e in sorted(replicas.items()):
        reason = e.get("decode_path_reason") or "no reason reported"
        lines.append(f"  {engine_id}: {e.get('decode_path') or STOCK} ({reason})")
    metrics: Mapping[str, Any] = body.get("metrics") or {}
    lines += ["", "Metrics (the ingress replica that answered):"]
    lines += [f"  {key} {_num(value)}" for key, value in sorted(metrics.items())] or ["  none"]
    for key, count in sorted(metrics.items()):
        for name in ("kvtide_ttft_seconds", "kvtide_itl_seconds"):
            if key.startswith(f"{name}_count") and count:
                tags = key[len(f"{name}_count") :]
                mean = float(metrics.get(f"{name}_sum{tags}") or 0) / float(count)
                lines.append(f"  mean {name}{tags}: {mean:.3f} s over {_num(count)}")
    return "\n".join(lines)


def format_session(body: Mapping[str, Any]) -> str:
    """``GET /kvtide/sessions/{id}``: where its KV is held and how long it lives."""
    sid = body.get("id", "?")
    lease = body.get("lease_expires_in_s")
    if lease is None:
        return (
            f"session {sid}: kvtide does not know it (never used, closed, or idle past its "
            "lease); its next turn recomputes (no_record)"
        )
    record: Mapping[str, Any] | None = body.get("record")
    if record is None:
        kv = (
            "  KV: none offered now (expired, evicted, a failed pull, or a turn in flight "
            "is using it); the next turn recomputes"
        )
    else:
        expires = record.get("expires_in_s")
        when = "at an unknown time" if expires is None else f"in {_duration(float(expires))}"
        size = _bytes(float(record.get("bytes_held") or 0))
        kv = (
            f"  KV: {_num(record.get('num_tokens'))} tokens ({size}) on decode engine"
            f" {record.get('engine_id')}; the engine frees it {when}, and "
            "kvtide offers it for pulls until kv.safety_margin_s before that"
        )
    return "\n".join(
        [
            f"session {sid}",
            kv,
            f"  lease: {_duration(float(lease))} left (each turn and each "
            f"POST /kvtide/sessions/{sid}/renew extends it)",
        ]
    )


# ---- Ray: NVLink domains ------------------------------------------------------------------

_NO_GPUS = (
    "Ray reports no alive node with GPUs: there is no NVLink domain to place GPU engines in "
    "(CPU engines, num_gpus 0, need none). For GPU engines start nodes with GPUs and "
    "their domain label: ray start --num-gpus=N --labels nvlink_domain=<domain id>"
)


def _domains(address: str) -> str:
    import logging

    import ray

    from orchestrator.cluster.ray_nodes import read_free_gpus, read_ray_nodes

    hint = "pass --address host:port (the cluster's GCS) or set $RAY_ADDRESS"
    try:
        gcs = _reachable_gcs(address)
        ray.init(address=gcs, logging_level=logging.ERROR, log_to_driver=False)
    except Exception as exc:  # Ray raises ConnectionError, ValueError, RuntimeError, ...
        raise InspectFailed(
            f"cannot connect to Ray at {address!r}: {type(exc).__name__}: "
            f"{str(exc).rstrip('.')}; {hint}"
        ) from None
    try:
        from ray.util.placement_group import placement_group_table

        gcs = ray.get_runtime_context().gcs_address
        nodes = read_ray_nodes(alive_only=False)
        text = format_domains(nodes, read_free_gpus(), address=gcs)
        engines = format_engine_groups(placement_group_table(), nodes)
        return f"{text}\n{engines}" if engines else text
    finally:
        ray.shutdown()


def _reachable_gcs(address: str) -> str:
    """``address`` resolved as ``ray.init`` would ($RAY_ADDRESS, then the local cluster
    for "auto"), after a bounded TCP check: Ray retries an unreachable GCS for minutes."""
    import socket

    from ray._private.services import canonicalize_bootstrap_address

    resolved = canonicalize_bootstrap_address(address)
    if resolved is None:
        raise ConnectionError("the address names no existing cluster")
    host, _, port = resolved.rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
        return resolved


def format_domains(nodes: Sequence[RayNode], free_gpus: Mapping[str, int], *, address: str) -> str:
    """Each NVLink domain with its nodes and total/free GPUs, then the nodes outside any
    labelled domain and the dead ones. ``nodes`` as ``read_ray_nodes(alive_only=False)``."""
    from orchestrator.cluster.ray_nodes import NVLINK_DOMAIN_LABEL, domain_states
    from orchestrator.cluster.topology import topology_from_nodes
    from placement.errors import InvalidTopology

    alive = [n for n in nodes if n.alive]
    by_id = {n.node_id: n for n in alive}
    num_gpu_nodes = sum(n.num_gpus > 0 for n in alive)
    lines = [f"Ray at {address}: {_count(len(alive), 'alive node')}, {num_gpu_nodes} with GPUs"]
    try:
        topology = topology_from_nodes(alive)
    except InvalidTopology:
        lines.append(_NO_GPUS)
    else:
        lines.append("NVLink domains (an engine's shards never span two):")
        for state in domain_states(alive, free_gpus):
            own = not by_id[state.node_ids[0]].labelled
            lines.append(
                f"  {state.domain_id}: {_count(len(state.node_ids), 'node')}, "
                f"{state.num_gpus} GPUs, "
                f"{state.num_free_gpus} free, largest free node {state.largest_free_node_gpus}"
                + (f" (no {NVLINK_DOMAIN_LABEL} label: one node, its own domain)" if own else "")
            )
            for spec in topology.nodes:
                if spec.domain_id == state.domain_id:
                    free = min(free_gpus.get(spec.node_id, 0), spec.num_gpus)
                    lines.append(
                        f"    node {spec.node_id}: {spec.num_gpus} GPUs ({free} free), "
                        f"{spec.num_cpus:g} CPUs"
                    )
    unlabelled = [n for n in alive if not n.labelled]
    if unlabelled:
        lines.append(f"Nodes without an {NVLINK_DOMAIN_LABEL} label:")
        for n in unlabelled:
            what = (
                f"{n.num_gpus} GPUs, its own domain: no engine spans it and another node "
                f"(label nodes that share an NVLink fabric {NVLINK_DOMAIN_LABEL}=<id>)"
                if n.num_gpus
                else "no GPUs: left out of engine placement"
            )
            lines.append(f"  {n.node_id}: {n.num_cpus:g} CPUs, {what}")
    labelled_cpu = [n for n in alive if n.labelled and not n.num_gpus]
    if labelled_cpu:
        lines.append("Labelled nodes without GPUs (left out of engine placement):")
        lines += [f"  {n.node_id}: {NVLINK_DOMAIN_LABEL}={n.domain_id}" for n in labelled_cpu]
    dead = [n for n in nodes if not n.alive]
    if dead:
        lines.append("Dead nodes (their engines' shards are gone):")
        lines += [
            f"  {n.node_id}: "
            + (f"{NVLINK_DOMAIN_LABEL}={n.domain_id}" if n.labelled else "no domain label")
            for n in dead
        ]
    return "\n".join(lines)


def format_engine_groups(table: Mapping[str, Mapping[str, Any]], nodes: Sequence[RayNode]) -> str:
    """The engine replicas' placement groups of every Serve app (pinned pools): each
    one's state and where its GPU bundles are, by domain and node; empty when there are
    none. ``table`` as ``placement_group_table()``."""
    from orchestrator.cluster.supervisor import replica_group_name

    domain_of = {n.node_id: n.domain_id for n in nodes}
    alive = {n.node_id for n in nodes if n.alive}
    rows = []
    for row in table.values():
        parsed = replica_group_name(str(row.get("name") or ""))
        if parsed is None or row.get("state") == "REMOVED":
            continue
        app, deployment, replica = parsed
        bundles = row.get("bundles") or {}
        gpus = [i for i in sorted(bundles) if (bundles[i] or {}).get("GPU")]
        if not gpus:
            continue  # not an engine's group
        placed = row.get("bundles_to_node_id") or {}
        where: dict[str, int] = {}
        for i in gpus:
            node = placed.get(i)
            key = "unplaced" if not node else f"{domain_of.get(node, '?')}/{node}"
            if node and node not in alive:
                key += " (dead)"
            where[key] = where.get(key, 0) + 1
        spread = ", ".join(f"{k}: {v}" for k, v in where.items())
        head = f"  {app}/{deployment} replica {replica}: {len(gpus)} GPUs, {row.get('state')}"
        rows.append(f"{head}; {spread}")
    if not rows:
        return ""
    title = "Engine placement groups (Serve replicas; GPUs by domain/node):"
    return "\n".join([title, *sorted(rows)])
