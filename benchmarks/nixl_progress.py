"""What NIXL's UCX progress thread costs while idle, and what a read takes, with NIXL's
own busy polling and with the wait kvtide's connector sets on CPU
(``kv.nixl_progress_wait_ms``, ``engines/kv_connector.py``).

Two agents, as a prefill and a decode engine hold one each: the reader in this
benchmark's child process, the target in another, registered with each other (the
handshake an engine pair makes), one UCX worker thread each (what vLLM's agents run on
CPU). For each setting, in the same run: CPU time both processes' threads take over an
idle window (in cores), then the median and p90 latency of reads of ``--mib`` MiB
(posted, polled to DONE). Each setting runs in fresh processes: the wait is fixed when
an agent is made.

    python benchmarks/nixl_progress.py [--wait-ms 10] [--idle-s 5] [--reads 200] [--mib 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.cli.table import format_table

MARK = "kvtide-bench"  # prefixes this script's own lines among NIXL's log lines


def _cpu_ticks(pid: int) -> int:
    """User + system clock ticks of every thread of ``pid``."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # a thread that ended
            continue
        total += int(fields[11]) + int(fields[12])
    return total


def _agent(name: str, wait_ms: float) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    from engines.kv_connector import progress_wait

    with progress_wait(wait_ms):
        return nixl_agent(name, nixl_agent_config(num_threads=1))


def target_main(wait_ms: float, mib: float) -> None:
    """The target: registers a buffer, prints its metadata, serves reads until stdin ends."""
    import torch

    agent = _agent("target", wait_ms)
    src = torch.ones(int(mib * 2**18))
    agent.register_memory(src)
    region = [src.data_ptr(), src.numel() * src.element_size(), 0]  # address, bytes, device
    print(MARK, agent.get_agent_metadata().hex(), json.dumps(region), flush=True)
    sys.stdin.read()


def reader_main(wait_ms: float, mib: float, idle_s: float, reads: int) -> None:
    """The reader: starts the target, measures idle CPU of both, then the reads."""
    import torch

    target = subprocess.Popen(
        [sys.executable, __file__, "--role", "target", f"--wait-ms={wait_ms}", f"--mib={mib}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert target.stdout is not None and target.stdin is not None
    line = next(line for line in target.stdout if line.startswith(MARK))
    _, hex_metadata, descs = line.split(" ", 2)
    metadata = bytes.fromhex(hex_metadata)
    addr, size, dev = json.loads(descs)
    agent = _agent("reader", wait_ms)
    dst = torch.zeros(int(mib * 2**18))
    agent.register_memory(dst)
    agent.add_remote_agent(metadata)
    local = agent.get_xfer_descs(dst)
    remote = agent.get_xfer_descs([(addr, size, dev)], "DRAM")
    time.sleep(1.0)  # both settled after registration
    pids = (os.getpid(), target.pid)
    before = sum(_cpu_ticks(p) for p in pids)
    time.sleep(idle_s)
    idle_cores = (sum(_cpu_ticks(p) for p in pids) - before) / os.sysconf("SC_CLK_TCK") / idle_s
    latencies = []
    for _ in range(reads):
        started = time.perf_counter()
        handle = agent.initialize_xfer("READ", local, remote, "target")
        agent.transfer(handle)
        while (state := agent.check_xfer_state(handle)) == "PROC":
            pass
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"read ended {state}")
        latencies.append((time.perf_counter() - started) * 1000)
    target.stdin.close()
    target.wait(timeout=30)
    latencies.sort()
    result = {
        "idle_cores": idle_cores,
        "median_ms": statistics.median(latencies),
        "p90_ms": latencies[int(0.9 * (len(latencies) - 1))],
    }
    print(MARK, json.dumps(result), flush=True)


def run(wait_ms: float, args: argparse.Namespace) -> dict[str, float]:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--role",
            "reader",
            f"--wait-ms={wait_ms}",
            f"--mib={args.mib}",
            f"--idle-s={args.idle_s}",
            f"--reads={args.reads}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    line = next(line for line in out.stdout.splitlines() if line.startswith(MARK))
    result: dict[str, float] = json.loads(line.split(" ", 1)[1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["bench", "reader", "target"], default="bench")
    parser.add_argument("--wait-ms", type=float, default=10.0)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--reads", type=int, default=200)
    parser.add_argument("--mib", type=float, default=1.0)
    args = parser.parse_args()
    if args.role == "target":
        target_main(args.wait_ms, args.mib)
        return
    if args.role == "reader":
        reader_main(args.wait_ms, args.mib, args.idle_s, args.reads)
        return
    busy = run(0.0, args)
    waiting = run(args.wait_ms, args)
    rows = [
        [label, f"{r['idle_cores']:.2f}", f"{r['median_ms']:.3f}", f"{r['p90_ms']:.3f}"]
        for label, r in (
            ("NIXL's busy polling (wait 0)", busy),
            (f"kvtide's wait ({args.wait_ms:g} ms)", waiting),
        )
    ]
    print(f"two NIXL agents in two processes, {os.cpu_count()} cores; {args.mib:g} MiB reads")
    print(format_table(["progress thread", "idle cores", "read median ms", "read p90 ms"], rows))
    print(
        f"idle CPU: {waiting['idle_cores'] / max(busy['idle_cores'], 1e-9):.3f}x of busy "
        f"polling; read median {waiting['median_ms'] / busy['median_ms']:.2f}x, "
        f"p90 {waiting['p90_ms'] / busy['p90_ms']:.2f}x"
    )


if __name__ == "__main__":
    main()
