"""The overload scenario of ``benchmarks/faults.py``: offered load past capacity, then
normal load, against an app whose decode engine has a small KV cache.

The app (``overload_config``): kvtide's simulated engines, one prefill and one decode,
the decode engine with ``DECODE_KV_BLOCKS`` KV blocks, so that it runs ``CAPACITY_TURNS``
turns of ``TURN_MAX_TOKENS`` tokens at once; a short ``request_timeout_s``; admission
control on. ``run_overload`` measures one turn alone, offers ``factor`` times the
capacity (turns per second the engines complete) for ``burst_s`` as an open loop (each
turn sent at its time, whatever came back), then half the capacity for ``normal_s``, and
sorts every turn: completed, rejected fast (``503 overloaded``), timed out (``503
deadline_exceeded``) or failed otherwise. The time to recover is from the end of the
burst to the first turn sent after it from which every later turn completed.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DECODE_KV_BLOCKS = 20  # of 128 tokens (the simulated engine's block on CPU)
TURN_MAX_TOKENS = 1000
TURN_PROMPT = "lorem ipsum " * 20
CAPACITY_TURNS = DECODE_KV_BLOCKS // math.ceil((TURN_MAX_TOKENS + 60) / 128)


def overload_config(
    tmp: Path, *, request_timeout_s: float = 4.0, kv: dict[str, Any] | None = None
) -> Any:
    """The app under overload (see the module); a private Ray temp dir under ``tmp``;
    ``kv``: more of the ``kv`` section."""
    from engines.tiny_model import generate_tiny_model
    from orchestrator.cluster.ports import free_port
    from orchestrator.config import parse_config

    config = parse_config(
        {
            "backend": "simulated",
            "model": {"path": str(tmp / "tiny"), "max_model_len": 4096},
            "prefill": {"num_engines": 1, "cpu_threads_bind": None},
            "decode": {
                "num_engines": 1,
                "cpu_threads_bind": None,
                "num_kv_blocks": DECODE_KV_BLOCKS,
            },
            # Simulated engines in two processes cannot read each other's blocks: the
            # decode computes the prompt itself.
            "kv": {"kv_load_failure_policy": "recompute", "prefill_lease_s": 5, **(kv or {})},
            "server": {"port": free_port(), "request_timeout_s": request_timeout_s},
            "admission": {"max_waiting_per_engine": 4, "stall_s": 3, "retry_after_s": 1},
            "ray": {"temp_dir": str(tmp / "ray"), "num_cpus": 16},
            "observability": {"metrics": False},
        }
    )
    generate_tiny_model(config.model.resolved_path())
    return config


@dataclass(frozen=True, slots=True)
class TurnResult:
    sent_s: float  # on time.monotonic
    elapsed_s: float
    status: int
    code: str | None  # the error body's code
    retry_after: str | None


def send_turn(
    base_url: str,
    model: str,
    timeout_s: float = 60.0,
    *,
    session_id: str | None = None,
    max_tokens: int = TURN_MAX_TOKENS,
) -> TurnResult:
    """One completion of ``max_tokens`` tokens, in ``session_id`` (``x-session-id``) or
    without a session, not retried."""
    import httpx

    body = {"model": model, "prompt": TURN_PROMPT, "max_tokens": max_tokens}
    headers = {} if session_id is None else {"x-session-id": session_id}
    t0 = time.monotonic()
    try:
        resp = httpx.post(
            f"{base_url}/v1/completions", json=body, headers=headers, timeout=timeout_s
        )
    except httpx.HTTPError as exc:
        return TurnResult(t0, time.monotonic() - t0, 0, type(exc).__name__, None)
    code = None
    if resp.status_code != 200:
        try:
            code = resp.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = "unparsed"
    return TurnResult(
        t0, time.monotonic() - t0, resp.status_code, code, resp.headers.get("retry-after")
    )


@dataclass
class Phase:
    results: list[TurnResult] = field(default_factory=list)

    def count(self, code: str | None, status: int | None = None) -> int:
        return sum(
            1 for r in self.results if r.code == code and (status is None or r.status == status)
        )

    @property
    def completed(self) -> int:
        return self.count(None, 200)

    @property
    def rejected_fast(self) -> int:
        return self.count("overloaded")

    @property
    def timed_out(self) -> int:
        return self.count("deadline_exceeded")

    @property
    def failed(self) -> int:
        return len(self.results) - self.completed - self.rejected_fast - self.timed_out


def open_loop(
    base_url: str,
    model: str,
    schedule: list[tuple[float, float]],
    session_prefix: str | None = None,
) -> list[TurnResult]:
    """Send turns at each ``(rate_per_s, duration_s)`` of ``schedule`` in turn, each in
    its own thread, whatever came back (an open loop); every turn's result, by send time.
    With ``session_prefix`` each turn is the first of a session of its own (its decode
    keeps the turn's KV for a next turn, as a session's does)."""
    results: list[TurnResult] = []
    lock = threading.Lock()
    threads: list[threading.Thread] = []

    def one(session_id: str | None) -> None:
        result = send_turn(base_url, model, session_id=session_id)
        with lock:
            results.append(result)

    start = time.monotonic()
    for rate_per_s, duration_s in schedule:
        for i in range(max(1, round(rate_per_s * duration_s))):
            due = start + i / rate_per_s
            time.sleep(max(0.0, due - time.monotonic()))  # the arrival schedule, not a race
            sid = None if session_prefix is None else f"{session_prefix}-{len(threads)}"
            thread = threading.Thread(target=one, args=(sid,))
            thread.start()
            threads.append(thread)
        start += duration_s
    for thread in threads:
        thread.join()
    return sorted(results, key=lambda r: r.sent_s)


def recovery_s(after: Phase, burst_end_s: float) -> float | None:
    """From the burst's end (when the offered load dropped) to the first turn sent after
    it from which every later turn completed; None when the last turn did not complete."""
    first_good: TurnResult | None = None
    for result in after.results:
        if result.status == 200:
            first_good = first_good or result
        else:
            first_good = None
    return None if first_good is None else max(0.0, first_good.sent_s - burst_end_s)


def run_overload(
    base_url: str,
    model: str,
    *,
    factor: float = 3.0,
    burst_s: float = 30.0,
    normal_s: float = 20.0,
    session_prefix: str | None = None,
) -> tuple[list[list[Any]], dict[str, float]]:
    """The scenario (see the module), its turns in sessions of their own with
    ``session_prefix``: table rows (phase, offered/s, turns, completed, rejected fast,
    timed out, failed, median rejection ms) and the measured figures."""
    alone = send_turn(base_url, model)
    if alone.status != 200:
        raise RuntimeError(f"one turn alone failed: {alone.status} {alone.code}")
    capacity = CAPACITY_TURNS / alone.elapsed_s  # turns per second at full batch
    t0 = time.monotonic()
    schedule = [(factor * capacity, burst_s), (0.5 * capacity, normal_s)]
    results = open_loop(base_url, model, schedule, session_prefix)
    burst_end = t0 + burst_s  # when the offered load dropped
    burst = Phase([r for r in results if r.sent_s < burst_end])
    after = Phase([r for r in results if r.sent_s >= burst_end])
    rows = []
    for name, phase, rate in (("burst", burst, factor * capacity), ("after", after, capacity / 2)):
        rejected = sorted(r.elapsed_s for r in phase.results if r.code == "overloaded")
        median = f"{1000 * rejected[len(rejected) // 2]:.0f}" if rejected else "-"
        rows.append(
            [
                name,
                f"{rate:.2f}",
                len(phase.results),
                phase.completed,
                phase.rejected_fast,
                phase.timed_out,
                phase.failed,
                median,
            ]
        )
    recovered = recovery_s(after, burst_end)
    figures = {
        "turn_alone_s": alone.elapsed_s,
        "capacity_per_s": capacity,
        "recover_s": -1.0 if recovered is None else recovered,
    }
    return rows, figures
