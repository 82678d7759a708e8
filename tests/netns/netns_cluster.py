"""A Ray cluster of fake hosts on this machine: every Ray node is its own host.

On one host every Ray node shares the IP and the process table, and a process that
calls ``ray.init()`` inside an actor (vLLM's engine-core process does) attaches to the
head node's raylet: Ray lists the raylets it can see in the process table, keeps those
of its cluster whose IP is its own, and prefers the head among them
(``ray._private.services.get_node_to_connect_for_driver``). Real hosts have one raylet
each. Here each node gets what a host has:

* its own network namespace with its own IP: a veth pair per namespace into a bridge
  that carries the head's IP; a default route into a dead end, so that "which
  address reaches the world" (Ray's and vLLM's way of finding their own IP) answers the
  node's IP while nothing can leave;
* its own PID namespace with its own ``/proc``: the node's processes see only each
  other, so a new driver finds exactly one raylet, its node's (a network namespace
  alone is not enough: the process table still shows every node's raylet, and the
  driver still picks the head's);
* its own hostname (UTS namespace) that resolves to its IP (its own ``/etc/hosts``,
  bind-mounted in its mount namespace);
* its own Ray temp dir (logs under ``<root>/<node>/session_*/logs``; set
  ``KVTIDE_KEEP_HOST_LOGS=1`` to keep them after the cluster stops).

The head is a host too: the machine's network namespace (the test process connects
through it, as a driver on the head host does), its own PID and UTS namespaces. Each node runs
``sh`` as its PID-namespace init, with ``ray start --block`` as its child: killing the
init (or all the namespace's processes) kills the node the way a host dies, and tearing
down kills nothing this cluster did not start.

Needs root, ``ip`` (iproute2), ``unshare`` and ``mount`` (util-linux);
``unavailable_reason`` says what is missing. Nothing here sends traffic beyond the bridge.
"""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.cluster.ports import free_port

__all__ = ["HostSpec", "NetnsCluster", "unavailable_reason"]

START_TIMEOUT_S = 120.0
START_ATTEMPTS = 3
DEATH_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class HostSpec:
    """One fake host: its Ray resources and labels."""

    name: str
    num_cpus: int
    num_gpus: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason() -> str | None:
    """Why fake hosts cannot run here (None: they can). Creates and removes a probe
    namespace: root, iproute2, util-linux and kernel support are all checked for real."""
    if os.geteuid() != 0:
        return "fake hosts need root (network and PID namespaces); run as root"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("mount", "mount")):
        if shutil.which(tool) is None:
            return f"fake hosts need `{tool}` (install {package})"
    probe = f"kvtp{os.getpid() % 100000}"
    try:
        made = _run("ip", "netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"`ip netns add` failed: {made.stderr.strip()}"
        unshare = ("unshare", "--pid", "--fork", "--mount-proc", "--uts")
        script = "hostname kvt-probe && mount --bind /etc/hosts /etc/hosts"
        host_ns = _run("ip", "netns", "exec", probe, *unshare, "sh", "-c", script, check=False)
        if host_ns.returncode != 0:
            return f"`unshare {' '.join(unshare[1:])}` failed: {host_ns.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no interface or route of this machine uses."""
    used = _run("ip", "-4", "route", "show", "table", "all").stdout
    used += _run("ip", "-4", "addr").stdout
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{rng.randint(64, 250)}.{rng.randint(0, 255)}.0/24")
        prefix = str(net.network_address).rsplit(".", 1)[0] + "."
        if prefix not in used:
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet for the fake hosts' bridge")


_AUTH_MODE = "RAY_AUTH_MODE"


def _set_auth_mode(mode: str | None) -> None:
    """Set (None: unset) this process's Ray auth mode; Ray caches it in its config."""
    from ray._raylet import Config

    if mode is None:
        os.environ.pop(_AUTH_MODE, None)
    else:
        os.environ[_AUTH_MODE] = mode
    Config.initialize("")


def _node_env() -> dict[str, str]:
    """The environment of a fake host's Ray processes: the test's, less anything that
    would point them at another Ray or engine setup."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "VLLM_", "KVTIDE_"))}
    env |= {
        "RAY_USAGE_STATS_ENABLED": "0",
        # Ray turns token auth on when ~/.ray/auth_token exists, which another Ray on
        # this machine may create at any moment: the hosts would disagree. The cluster
        # listens only on its own bridge.
        _AUTH_MODE: "disabled",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        # Ray's prestarted workers run at nice 15 and starve beside engines on 2 cores.
        "RAY_worker_niceness": "0",
        # Workers import kvtide from this checkout, as the test process does.
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }
    return env


@dataclass
class _Host:
    spec: HostSpec
    ip: str
    netns: str | None  # None: the head, in this machine's network namespace
    temp_dir: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    node_id: str = ""
    dead: bool = False


class NetnsCluster:
    """A head (this machine's network) and worker hosts (own namespaces) on a bridge.

    ``start()`` brings every host up and connects nothing; ``connect()`` makes this
    process a driver on the head host. ``kill(name)`` kills a host; ``close()`` removes
    everything (idempotent, safe after a failed start).
    """

    def __init__(
        self, head: HostSpec, workers: Sequence[HostSpec], *, system_config: Mapping[str, Any]
    ) -> None:
        self._tag = f"{os.getpid() % 10000:04d}{random.randint(0, 99):02d}"
        self.root = Path(tempfile.mkdtemp(prefix="kvn-"))  # short: socket paths < 107 chars
        self.subnet = _free_subnet()
        hosts = list(self.subnet.hosts())
        self.bridge = f"kvb{self._tag}"
        self._system_config = dict(system_config)
        self._hosts: dict[str, _Host] = {}
        for index, spec in enumerate([head, *workers]):
            self._hosts[spec.name] = _Host(
                spec=spec,
                ip=str(hosts[index]),
                netns=None if index == 0 else f"kvn{self._tag}-{spec.name}",
                temp_dir=self.root / spec.name,
                log=self.root / f"{spec.name}.log",
            )
        self.head_name = head.name
        self.port = 0
        self._bridge_made = False
        self._closed = False
        self.driver_connected = False
        self._saved_auth_mode: list[str | None] = []  # set while connect() overrides it

    # ---- what tests read ------------------------------------------------------------

    @property
    def address(self) -> str:
        """The GCS address (host:port on the bridge)."""
        return f"{self._hosts[self.head_name].ip}:{self.port}"

    @property
    def names(self) -> list[str]:
        return list(self._hosts)

    def ip(self, name: str) -> str:
        return self._hosts[name].ip

    def node_id(self, name: str) -> str:
        return self._hosts[name].node_id

    def name(self, node_id: str) -> str:
        return next(n for n, h in self._hosts.items() if h.node_id == node_id)

    def alive(self) -> list[str]:
        return [n for n, h in self._hosts.items() if not h.dead]

    def log_dirs(self) -> dict[str, Path]:
        """Each host's Ray log directory (the newest session's)."""
        out = {}
        for name, host in self._hosts.items():
            sessions = sorted(host.temp_dir.glob("session_2*"))
            if sessions:
                out[name] = sessions[-1] / "logs"
        return out

    # ---- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        try:
            self._make_network()
            head = self._hosts[self.head_name]
            self.port = free_port(head.ip)
            self._start_host(head)
            self._wait_started(head)
            workers = [h for h in self._hosts.values() if h.netns is not None]
            for host in workers:
                self._start_host(host)
            for host in workers:
                self._wait_started_or_restart(host)
        except BaseException:
            self.close()
            raise

    def connect(self) -> None:
        """Connect this process to the cluster (a driver on the head host) and learn
        each host's Ray node id from Ray's node table."""
        import ray

        # This process may be in token-auth mode already (Ray switches a process to it
        # when it starts a local cluster and ~/.ray/auth_token exists); as a token-mode
        # driver it would refuse its own workers' replies. Match the hosts until close().
        self._saved_auth_mode = [os.environ.get(_AUTH_MODE)]
        _set_auth_mode("disabled")
        ray.init(address=self.address, logging_level="WARNING", log_to_driver=False)
        self.driver_connected = True
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            by_ip = {row["NodeManagerAddress"]: row for row in ray.nodes() if row["Alive"]}
            if all(h.ip in by_ip for h in self._hosts.values()):
                break
            if time.monotonic() > deadline:
                missing = [n for n, h in self._hosts.items() if h.ip not in by_ip]
                raise RuntimeError(f"fake hosts {missing} did not join within {START_TIMEOUT_S} s")
            time.sleep(0.5)
        for host in self._hosts.values():
            host.node_id = by_ip[host.ip]["NodeID"]

    def kill(self, name: str) -> None:
        """Kill every process of a worker host at once (a host crash), then wait (bounded)
        until Ray's node table says the node is dead."""
        import ray

        host = self._hosts[name]
        assert host.netns is not None, "the head host is not killed; stop the cluster instead"
        self._kill_host(host)
        deadline = time.monotonic() + DEATH_TIMEOUT_S
        while any(r["NodeID"] == host.node_id and r["Alive"] for r in ray.nodes()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Ray still lists {name} as alive {DEATH_TIMEOUT_S} s after")
            time.sleep(0.5)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.driver_connected:
            import ray

            ray.shutdown()
            self.driver_connected = False
        if self._saved_auth_mode:
            _set_auth_mode(self._saved_auth_mode.pop())
        for host in reversed(list(self._hosts.values())):
            self._kill_host(host)
        for host in self._hosts.values():
            if host.netns is not None:
                _run("ip", "netns", "del", host.netns, check=False)
        if self._bridge_made:
            _run("ip", "link", "del", self.bridge, check=False)
        if os.environ.get("KVTIDE_KEEP_HOST_LOGS"):
            print(f"fake hosts' Ray logs kept under {self.root}", file=sys.stderr)
        else:
            shutil.rmtree(self.root, ignore_errors=True)

    # ---- internals ------------------------------------------------------------------

    def _make_network(self) -> None:
        head = self._hosts[self.head_name]
        prefix = self.subnet.prefixlen
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._bridge_made = True
        _run("ip", "addr", "add", f"{head.ip}/{prefix}", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for index, host in enumerate(self._hosts.values()):
            if host.netns is None:
                continue
            ns, outside = host.netns, f"kvv{self._tag}{index:02d}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", outside, "master", self.bridge, "up")
            inside = ("ip", "netns", "exec", ns, "ip")
            _run(*inside, "addr", "add", f"{host.ip}/{prefix}", "dev", "eth0")
            _run(*inside, "link", "set", "eth0", "up")
            _run(*inside, "link", "set", "lo", "up")
            # A default route that goes nowhere (into a veth pair whose both ends stay
            # in the namespace): address lookups answer eth0's IP, nothing leaves.
            _run(*inside, "link", "add", "nowhere", "type", "veth", "peer", "name", "nowhere1")
            _run(*inside, "link", "set", "nowhere", "up")
            _run(*inside, "link", "set", "nowhere1", "up")
            _run(*inside, "route", "add", "default", "dev", "nowhere")

    def _ray_start_args(self, host: _Host) -> list[str]:
        import json

        ray_cli = str(Path(sys.executable).with_name("ray"))
        spec = host.spec
        args = [
            ray_cli,
            "start",
            "--block",
            f"--node-ip-address={host.ip}",
            f"--num-cpus={spec.num_cpus}",
            f"--num-gpus={spec.num_gpus}",
            f"--temp-dir={host.temp_dir}",
            "--object-store-memory=150000000",
            "--disable-usage-stats",
        ]
        if spec.labels:
            args.append("--labels=" + ",".join(f"{k}={v}" for k, v in spec.labels.items()))
        if host.netns is None:
            args += [
                "--head",
                f"--port={self.port}",
                "--include-dashboard=false",
                f"--system-config={json.dumps(self._system_config)}",
            ]
        else:
            args.append(f"--address={self.address}")
        return args

    def hostname(self, name: str) -> str:
        return f"kvt-{name}"

    def _start_host(self, host: _Host) -> None:
        host.temp_dir.mkdir(parents=True, exist_ok=True)
        # The host's name resolves to its own IP, as on a real host (Gloo, which vLLM's
        # CPU workers talk over, binds the address the hostname resolves to; this
        # machine's name resolves to loopback).
        hosts_file = self.root / f"{host.spec.name}.hosts"
        hosts_file.write_text(
            "127.0.0.1 localhost\n"
            + "".join(f"{h.ip} {self.hostname(n)}\n" for n, h in self._hosts.items())
        )
        # sh is the PID namespace's init: it reaps orphans and, when `ray start --block`
        # ends, exits, which kills whatever is left in the namespace.
        script = 'hostname "$1" && mount --bind "$2" /etc/hosts || exit 1; shift 2; "$@" & wait $!'
        init = [
            *("unshare", "--pid", "--fork", "--mount-proc", "--uts", "sh", "-c", script, "sh"),
            *(self.hostname(host.spec.name), str(hosts_file)),
        ]
        netns = [] if host.netns is None else ["ip", "netns", "exec", host.netns]
        with open(host.log, "ab") as log:
            host.proc = subprocess.Popen(
                [*netns, *init, *self._ray_start_args(host)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=_node_env(),
                cwd=os.getcwd(),
                start_new_session=True,
            )

    def _wait_started_or_restart(self, host: _Host) -> None:
        """Ray gives a joining node 30 s to register with the GCS, which hosts starting
        together on a busy two-core machine can miss ("The current node timed out during
        startup"); such a host is started again."""
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self._wait_started(host)
                return
            except RuntimeError:
                if attempt == START_ATTEMPTS:
                    raise
            self._kill_host(host)
            host.dead, host.proc = False, None
            self._start_host(host)

    def _wait_started(self, host: _Host) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while b"Ray runtime started" not in host.log.read_bytes():
            assert host.proc is not None
            if host.proc.poll() is not None or time.monotonic() > deadline:
                tail = host.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"fake host {host.spec.name} did not start:\n{tail}")
            time.sleep(0.3)

    def _kill_host(self, host: _Host) -> None:
        """SIGKILL the host's PID-namespace init: the kernel then kills every process in
        the namespace. Only processes this cluster started are touched."""
        if host.dead or host.proc is None:
            host.dead = True
            return
        host.dead = True
        import psutil

        try:
            launcher = psutil.Process(host.proc.pid)
            # ip netns exec execs unshare, which forks the namespace's init (sh).
            for child in launcher.children():
                child.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
        try:
            host.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            host.proc.kill()
            host.proc.wait(timeout=10)
