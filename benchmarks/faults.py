"""Multi-turn sessions under faults: what is completed, retried, migrated, lost or run twice.

    python benchmarks/faults.py [--sessions 12] [--turns 4] [--max-tokens 128]
                                [--faults none,kv-service,decode,prefill,overload]

Starts a local Ray and the kvtide app with kvtide's simulated engines (two prefill and
two decode engines on the CPU; no model weights) and two API keys. For each scenario it
runs ``--sessions`` conversations of ``--turns`` turns at once through the Python SDK
(retries with one Idempotency-Key per turn) and, once a third of the turns are done,
injects the fault:

* ``none``: the baseline, the same load without a fault;
* ``kv-service``: the KV lifecycle service actor is killed (Ray restarts it);
* ``decode``: a decode replica's actor is killed mid-stream (Serve replaces it);
* ``prefill``: a prefill replica's actor is killed while it has requests;
* ``overload``: an app of its own with a small decode KV cache and a 4 s deadline
  (``benchmarks/overload.py``), run twice: sessionless turns, then turns each in a
  session of its own (its decode keeps the turn's KV). Offered load
  ``--overload-factor`` (3) times capacity for ``--burst-s`` (30 s), then half the
  capacity for ``--normal-s`` (20 s); it prints per phase the turns completed, rejected
  fast (503 overloaded), timed out and failed, and the time to recover after the burst,
  for each run.

Half the sessions stream. A killed replica is one with requests running (found from the
counters engines send with their heartbeats), so its turns are cut mid-stream.

It prints, per scenario, the turns completed, retried by the SDK, migrated to another
decode engine, prefilled again on another prefill engine, resumed by the SDK after a
stream error event, failed (an error after the SDK's retries), run twice (a completed
Idempotency-Key completed again, from the service's book) and taken over (a session
another key could read afterwards), and the p99 turn latency as a ratio to the baseline.
"""

from __future__ import annotations

import argparse
import hashlib
import secrets
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.cli.table import format_table  # noqa: E402


@dataclass
class Outcome:
    completed: int = 0
    retried: int = 0
    migrated: int = 0
    prefill_retried: int = 0
    resumed: int = 0
    failed: int = 0
    latencies_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0


def busy_replica(base_url: str, key: str, pool: str) -> str | None:
    """The Serve replica id of a ``pool`` engine running requests now, from the counters
    each engine sends with its heartbeat (engine ids are ``<pool>-<replica id>``)."""
    import httpx

    resp = httpx.get(
        f"{base_url}/kvtide/stats", headers={"authorization": f"Bearer {key}"}, timeout=30
    )
    replicas: dict[str, dict[str, Any]] = resp.json().get("engine_replicas", {})
    for engine_id, counters in sorted(replicas.items()):
        if engine_id.startswith(f"{pool}-") and counters.get("num_running", 0) > 0:
            return engine_id.removeprefix(f"{pool}-")
    return None


def kill_fault(name: str, base_url: str, key: str) -> None:
    """Kill what ``name`` says, the way a crashed process dies: the KV service actor, or
    a replica of the pool, one with requests running when there is one (mid-stream)."""
    import ray

    if name == "kv-service":
        from orchestrator.kv.actor import SERVICE_NAMESPACE, service_name

        handle = ray.get_actor(service_name("kvtide"), namespace=SERVICE_NAMESPACE)
        ray.kill(handle, no_restart=False)
        return
    actors = [
        a for a in ray.util.list_named_actors(all_namespaces=True) if f"#{name}-pool#" in a["name"]
    ]
    busy = None
    deadline = time.monotonic() + 10.0
    while busy is None and time.monotonic() < deadline:
        busy = busy_replica(base_url, key, name)
        if busy is None:
            time.sleep(0.05)  # polling the load (not waiting out a race)
    target = next((a for a in actors if busy and a["name"].endswith(f"#{busy}")), actors[0])
    ray.kill(ray.get_actor(target["name"], namespace=target["namespace"]), no_restart=True)


def run_load(
    base_url: str, keys: list[str], args: argparse.Namespace, fault: str, prefix: str
) -> tuple[Outcome, dict[str, str]]:
    from orchestrator.sdk import Client

    outcome = Outcome()
    owners: dict[str, str] = {}
    lock = threading.Lock()
    total = args.sessions * args.turns
    done = threading.Event()

    def converse(i: int) -> None:
        key = keys[i % len(keys)]
        with (
            Client(base_url, api_key=key, timeout=120.0, max_retries=8) as client,
            client.session(session_id=f"{prefix}-{i}") as session,
        ):
            with lock:
                owners[session.id] = key
            for turn in range(args.turns):
                text = f"session {i} turn {turn}: " + "lorem ipsum " * (40 + 10 * turn)
                t0 = time.monotonic()
                try:
                    if i % 2:  # half the sessions stream
                        with session.stream(text, max_tokens=args.max_tokens) as stream:
                            for _ in stream:
                                pass
                        result = stream.result
                    else:
                        result = session.send(text, max_tokens=args.max_tokens)
                except Exception as exc:  # counted: the point of the run
                    with lock:
                        outcome.failed += 1
                        outcome.errors.append(f"{type(exc).__name__}: {exc}"[:160])
                    continue
                with lock:
                    outcome.completed += 1
                    outcome.latencies_s.append(time.monotonic() - t0)
                    outcome.retried += result.num_attempts > 1
                    moves = result.kvtide or {}
                    outcome.migrated += bool(moves.get("migrations"))
                    outcome.prefill_retried += bool(moves.get("prefill_retries"))
                    outcome.resumed += result.num_resumes > 0
                    if outcome.completed + outcome.failed >= total // 3:
                        done.set()

    threads = [threading.Thread(target=converse, args=(i,)) for i in range(args.sessions)]
    for thread in threads:
        thread.start()
    if fault != "none":
        deadline = time.monotonic() + 300
        while not done.wait(0.2) and any(t.is_alive() for t in threads):
            if time.monotonic() > deadline:
                break
        kill_fault(fault, base_url, keys[0])
    for thread in threads:
        thread.join(timeout=900)
    return outcome, owners


def taken_over(base_url: str, owners: dict[str, str], keys: list[str]) -> int:
    """Sessions another key can read (it must get the same 404 as for no session)."""
    import httpx

    count = 0
    for session_id, key in owners.items():
        other = next(k for k in keys if k != key)
        resp = httpx.get(
            f"{base_url}/kvtide/sessions/{session_id}",
            headers={"authorization": f"Bearer {other}"},
            timeout=30,
        )
        count += resp.status_code == 200
    return count


def duplicates(base_url: str, key: str) -> int:
    import httpx

    resp = httpx.get(
        f"{base_url}/kvtide/stats", headers={"authorization": f"Bearer {key}"}, timeout=30
    )
    return int(resp.json()["kv"].get("num_replay_duplicates", 0))


def app_config(tmp: Path) -> tuple[Any, list[str]]:
    """The app under test: simulated engines (two prefill, two decode) on the CPU, two
    API keys (returned), a private Ray temp dir under ``tmp``."""
    from engines.tiny_model import generate_tiny_model
    from orchestrator.cluster.ports import free_port
    from orchestrator.config import parse_config

    keys = [f"kvt-{secrets.token_urlsafe(24)}" for _ in range(2)]
    config = parse_config(
        {
            "backend": "simulated",
            "model": {"path": str(tmp / "tiny"), "max_model_len": 8192},
            "prefill": {"num_engines": 2, "cpu_threads_bind": None},
            "decode": {"num_engines": 2, "cpu_threads_bind": None},
            # Simulated engines in different processes cannot read each other's blocks
            # (their fabric is per process): the decode recomputes the prompt instead.
            "kv": {"kv_load_failure_policy": "recompute"},
            "server": {
                "port": free_port(),
                "request_timeout_s": 120,
                "api_keys": [
                    {"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest()}
                    for name, key in zip(("alice", "bob"), keys, strict=True)
                ],
            },
            "ray": {"temp_dir": str(tmp / "ray"), "num_cpus": 16},
            "observability": {"metrics": False},
        }
    )
    generate_tiny_model(config.model.resolved_path())
    return config, keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--faults",
        default="none,kv-service,decode,prefill,overload",
        help="comma-separated scenarios",
    )
    parser.add_argument("--overload-factor", type=float, default=3.0)
    parser.add_argument("--burst-s", type=float, default=30.0)
    parser.add_argument("--normal-s", type=float, default=20.0)
    args = parser.parse_args()
    faults = args.faults.split(",")
    if "overload" in faults:
        faults.remove("overload")
        overload(args)
    if faults:
        under_faults(args, faults)


def overload(args: argparse.Namespace) -> None:
    """The overload scenario twice on one app: sessionless turns, then turns each in a
    session of its own (whose decode keeps its KV); each with its time to recover."""
    from benchmarks.overload import CAPACITY_TURNS, overload_config, run_overload
    from orchestrator import runtime

    config = overload_config(Path(tempfile.mkdtemp(prefix="kvt-overload-")))
    with runtime.running(config, say=lambda m: print(m, file=sys.stderr)) as base_url:
        for kind, prefix in (("without sessions", None), ("with sessions", "overload")):
            rows, figures = run_overload(
                base_url,
                config.model.name,
                factor=args.overload_factor,
                burst_s=args.burst_s,
                normal_s=args.normal_s,
                session_prefix=prefix,
            )
            recovered = figures["recover_s"]
            print(
                f"overload {kind}: simulated engines (1 prefill, 1 decode running "
                f"{CAPACITY_TURNS} turns at once), request_timeout_s "
                f"{config.server.request_timeout_s:g}; one turn alone "
                f"{figures['turn_alone_s']:.2f} s, capacity {figures['capacity_per_s']:.2f} "
                f"turns/s; {args.overload_factor:g}x for {args.burst_s:g} s, then 0.5x for "
                f"{args.normal_s:g} s\n"
            )
            headers = ["phase", "offered/s", "turns", "completed", "rejected fast", "timed out"]
            print(format_table([*headers, "failed", "reject ms p50"], rows))
            print(
                f"\nrecovered ({kind}) "
                + (
                    f"{recovered:.1f} s after the burst"
                    if recovered >= 0
                    else "never (last turn failed)"
                )
                + "\n"
            )


def under_faults(args: argparse.Namespace, faults: list[str]) -> None:
    from orchestrator import runtime

    config, keys = app_config(Path(tempfile.mkdtemp(prefix="kvt-faults-")))
    rows: list[list[Any]] = []
    baseline_p99 = 0.0
    with runtime.running(config, say=lambda m: print(m, file=sys.stderr)) as base_url:
        for fault in faults:
            before = duplicates(base_url, keys[0])
            outcome, owners = run_load(base_url, keys, args, fault, prefix=fault)
            runtime.deploy(config, say=lambda _: None)  # wait until replaced replicas are up
            lost = args.sessions * args.turns - outcome.completed
            late = p99(outcome.latencies_s)
            baseline_p99 = baseline_p99 or late
            rows.append(
                [
                    fault,
                    outcome.completed,
                    outcome.retried,
                    outcome.migrated,
                    outcome.prefill_retried,
                    outcome.resumed,
                    outcome.failed,
                    lost - outcome.failed,
                    duplicates(base_url, keys[0]) - before,
                    taken_over(base_url, owners, keys),
                    f"{late:.2f}",
                    f"{late / baseline_p99:.2f}x" if baseline_p99 else "-",
                ]
            )
            for error in outcome.errors[:3]:
                print(f"  {fault}: {error}", file=sys.stderr)
    print(
        f"{args.sessions} sessions x {args.turns} turns, simulated engines (2 prefill, "
        f"2 decode) on this machine's CPU, SDK retries on, {args.max_tokens} tokens a turn\n"
    )
    print(
        format_table(
            [
                "fault",
                "completed",
                "retried",
                "migrated",
                "prefill again",
                "resumed",
                "failed",
                "hung",
                "run twice",
                "taken over",
                "p99 s",
                "p99 vs none",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
