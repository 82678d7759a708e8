"""Serve's HAProxy as kvtide runs it: its admin listeners on loopback, and a deadline for
a request to arrive.

Ray Serve's direct ingress starts HAProxy from a config it renders itself (Ray 2.60),
with no setting for two things an operator needs:

- its stats page (``bind *:<stats port>``) and its Prometheus endpoint
  (``bind :<metrics port>``) listen on every interface, without auth;
- no ``timeout http-request``: a client that sends part of a request and stops holds
  its connection for ``timeout client`` (3,600 s).

Ray lets the binary be named (``RAY_SERVE_HAPROXY_BINARY_PATH``), so a local Ray that
kvtide starts names a small wrapper (``write_wrapper``) that runs this file's ``main``:
it rewrites the config HAProxy is given (``rewrite``) and ``exec``s the real binary in
the same process (Ray watches HAProxy by that pid and reloads it with ``-sf``). The
rewrite binds the two admin listeners to loopback and adds, to the ``defaults``
section, ``timeout http-request`` with ``option http-buffer-request`` (the request's
headers and body, up to HAProxy's buffer, must arrive within it; a larger body's rest is
bounded by the ingress itself) and an ``errorfile`` for its 408 in kvtide's JSON error
shape. The HTTP front, ``server.host:server.port``, is left as Ray wrote it.

Standard library only: the wrapper runs this file by path, in whatever environment Ray
starts HAProxy from.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import stat
import sys
from dataclasses import dataclass

__all__ = [
    "FrontSettings",
    "haproxy_binary",
    "main",
    "rewrite",
    "timeout_body",
    "write_wrapper",
]

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class FrontSettings:
    """What the rewrite needs: the admin ports to move to loopback, the request
    deadline (whole seconds) and the file HAProxy answers its 408 from."""

    admin_ports: tuple[int, ...]
    request_timeout_s: int
    timeout_file: str


def timeout_body(timeout_s: float) -> bytes:
    """HAProxy's 408 as an errorfile: a whole HTTP response with kvtide's error body."""
    body = json.dumps(
        {
            "error": {
                "message": f"the request did not arrive within {timeout_s:g} s "
                "(server.request_body_timeout_s); send the whole request at once, or "
                "raise server.request_body_timeout_s",
                "type": "invalid_request_error",
                "param": "server.request_body_timeout_s",
                "code": "request_timeout",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\n"
        "content-type: application/json\r\n"
        "cache-control: no-cache\r\n"
        "connection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


_BIND = re.compile(r"^(\s*bind\s+)(\*|0\.0\.0\.0|::|\[::\])?:(\d+)(\s.*)?$")


def rewrite(config: str, settings: FrontSettings) -> str:
    """``config`` (an HAProxy config as Ray renders it) with the admin listeners on
    loopback and the request deadline in ``defaults`` (see the module doc). Idempotent:
    a config rewritten already is returned unchanged."""
    out: list[str] = []
    for line in config.splitlines():
        bind = _BIND.match(line)
        if bind and int(bind.group(3)) in settings.admin_ports:
            line = f"{bind.group(1)}{LOOPBACK}:{bind.group(3)}{bind.group(4) or ''}"
        out.append(line)
        if line.strip() == "defaults" and "timeout http-request" not in config:
            out += [
                f"    timeout http-request {settings.request_timeout_s}s",
                "    option http-buffer-request",
                f"    errorfile 408 {settings.timeout_file}",
            ]
    return "\n".join(out) + "\n"


def _config_path(args: list[str]) -> str | None:
    for flag, value in itertools.pairwise(args):
        if flag == "-f":
            return value
    return None


def main(argv: list[str] | None = None) -> None:
    """``<this file> <real haproxy> <settings json> <haproxy args...>``: rewrite the
    ``-f`` config in place, then become HAProxy."""
    real, raw, *args = sys.argv[1:] if argv is None else argv
    fields = json.loads(raw)
    settings = FrontSettings(
        admin_ports=tuple(fields["admin_ports"]),
        request_timeout_s=int(fields["request_timeout_s"]),
        timeout_file=fields["timeout_file"],
    )
    path = _config_path(args)
    if path is not None and os.path.isfile(path):
        with open(path) as f:
            text = f.read()
        new = rewrite(text, settings)
        if new != text:
            with open(path, "w") as f:
                f.write(new)
    os.execv(real, [real, *args])


def haproxy_binary() -> str:
    """The HAProxy Serve would run, found as Serve finds it (``RAY_SERVE_HAPROXY_BINARY_PATH``
    when the operator named one, else the one ``ray[serve]`` installs, else ``haproxy``
    on the PATH)."""
    from ray.serve._private.haproxy import get_haproxy_binary

    return str(get_haproxy_binary())


def write_wrapper(
    directory: str,
    *,
    real_binary: str,
    admin_ports: tuple[int, ...],
    request_body_timeout_s: float,
) -> str:
    """Write the wrapper (and HAProxy's 408 file) into ``directory``; its path, for
    ``RAY_SERVE_HAPROXY_BINARY_PATH``."""
    timeout_file = os.path.join(directory, "408.http")
    with open(timeout_file, "wb") as f:
        f.write(timeout_body(request_body_timeout_s))
    settings = json.dumps(
        {
            "admin_ports": list(admin_ports),
            # HAProxy's timeouts are whole seconds; never shorter than the ingress's own.
            "request_timeout_s": max(1, int(-(-request_body_timeout_s // 1))),
            "timeout_file": timeout_file,
        }
    )
    wrapper = os.path.join(directory, "haproxy")
    with open(wrapper, "w") as f:
        f.write(
            "#!/bin/sh\n"
            "# Serve's HAProxy, started by kvtide (orchestrator/cluster/haproxy_front.py)\n"
            f"exec {shlex.quote(sys.executable)} -I {shlex.quote(os.path.abspath(__file__))} "
            f'{shlex.quote(real_binary)} {shlex.quote(settings)} "$@"\n'
        )
    os.chmod(wrapper, os.stat(wrapper).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return wrapper


if __name__ == "__main__":
    main()
