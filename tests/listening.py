"""The listening TCP sockets of a set of processes, read from /proc as ``ss -ltnp`` reads
them: each process's socket inodes (``/proc/<pid>/fd``) joined with the kernel's tables
of listening sockets (``/proc/net/tcp``, ``/proc/net/tcp6``)."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Listener", "descendants", "listeners", "listeners_on_port"]

_LISTEN = "0A"


@dataclass(frozen=True, slots=True)
class Listener:
    pid: int
    command: str
    ip: str
    port: int

    @property
    def on_loopback(self) -> bool:
        return ipaddress.ip_address(self.ip).is_loopback


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    kids: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(parent, []).append(int(pid))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def _ip(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # /proc/net/tcp6: four 32-bit words, each in the host's (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    address = ipaddress.IPv6Address(words)
    return str(address.ipv4_mapped or address)


def _table() -> dict[str, tuple[str, int]]:
    """Listening sockets by inode: (ip, port)."""
    found: dict[str, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _LISTEN:
                addr, port = fields[1].split(":")
                found[fields[9]] = (_ip(addr), int(port, 16))
    return found


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def listeners(pids: Iterable[int]) -> list[Listener]:
    """Every listening TCP socket the processes ``pids`` hold."""
    table = _table()
    found: set[Listener] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and (where := table.get(link[8:-1])) is not None:
                found.add(Listener(pid, _command(pid), *where))
    return sorted(found, key=lambda s: (s.port, s.ip, s.pid))


def listeners_on_port(port: int) -> list[str]:
    """The addresses something on this machine listens on at ``port``."""
    return sorted({ip for ip, p in _table().values() if p == port})
