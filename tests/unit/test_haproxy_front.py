"""Serve's HAProxy as kvtide starts it: the config Ray renders, rewritten so that its
stats page and Prometheus endpoint listen on loopback only and a request must arrive
within ``server.request_body_timeout_s`` (answered with kvtide's JSON 408). Checked on
the config Ray 2.60 renders, with the HAProxy binary ``ray[serve]`` installs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from orchestrator.cluster.haproxy_front import (
    FrontSettings,
    haproxy_binary,
    rewrite,
    timeout_body,
    write_wrapper,
)

STATS, METRICS = 21111, 21112


def _ray_config(tmp: Path) -> str:
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions

    cfg = HAProxyConfig(
        http_options=HTTPOptions(host="0.0.0.0", port=18000),
        socket_path=str(tmp / "admin.sock"),
        stats_port=STATS,
        metrics_port=METRICS,
    )
    api = HAProxyApi(cfg=cfg, config_file_path=str(tmp / "haproxy.cfg"))
    api._generate_config_file_internal()
    return (tmp / "haproxy.cfg").read_text()


def _binds(config: str) -> list[str]:
    return [line.split()[1] for line in config.splitlines() if line.strip().startswith("bind ")]


def test_the_admin_listeners_move_to_loopback_and_the_front_stays(tmp_path: Path) -> None:
    original = _ray_config(tmp_path)
    # What Ray renders: both admin listeners on every interface.
    assert f"*:{STATS}" in _binds(original) and f":{METRICS}" in _binds(original)
    settings = FrontSettings((STATS, METRICS), 30, str(tmp_path / "408.http"))
    new = rewrite(original, settings)
    assert sorted(_binds(new)) == sorted(["*:18000", f"127.0.0.1:{STATS}", f"127.0.0.1:{METRICS}"])
    assert rewrite(new, settings) == new  # a reload's config rewritten again: the same


def test_the_rewritten_config_passes_haproxys_own_check(tmp_path: Path) -> None:
    (tmp_path / "408.http").write_bytes(timeout_body(30.0))
    settings = FrontSettings((STATS, METRICS), 30, str(tmp_path / "408.http"))
    new = rewrite(_ray_config(tmp_path), settings)
    defaults = new.split("\ndefaults\n", 1)[1]
    assert defaults.startswith(
        "    timeout http-request 30s\n    option http-buffer-request\n"
        f"    errorfile 408 {tmp_path / '408.http'}\n"
    )
    (tmp_path / "new.cfg").write_text(new)
    check = subprocess.run(
        [haproxy_binary(), "-c", "-f", str(tmp_path / "new.cfg")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_haproxys_408_is_kvtides_json_error_naming_the_setting() -> None:
    raw = timeout_body(2.5)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert f"content-length: {len(body)}".encode() in head
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout"
    assert error["param"] == "server.request_body_timeout_s"
    assert "2.5 s" in error["message"]


def test_the_wrapper_rewrites_the_config_and_becomes_the_binary_it_names(
    tmp_path: Path,
) -> None:
    """The wrapper ``exec``s: HAProxy keeps the pid Ray started (Ray signals it)."""
    real = tmp_path / "real"
    real.write_text('#!/bin/sh\necho "pid=$$ args=$*"\n')
    real.chmod(0o755)
    config = tmp_path / "haproxy.cfg"
    config.write_text(f"defaults\n    mode http\nlisten stats\n  bind *:{STATS}\n")
    wrapper = write_wrapper(
        str(tmp_path), real_binary=str(real), admin_ports=(STATS,), request_body_timeout_s=2.5
    )
    proc = subprocess.Popen(
        [wrapper, "-db", "-f", str(config), "-sf", "123"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": "/nonexistent"},  # stdlib only
    )
    out, _ = proc.communicate(timeout=60)
    assert out.strip() == f"pid={proc.pid} args=-db -f {config} -sf 123"
    text = config.read_text()
    assert f"bind 127.0.0.1:{STATS}" in text
    assert "timeout http-request 3s" in text  # whole seconds, never below the setting


@pytest.mark.parametrize("line", ["  bind *:8000", "  bind 0.0.0.0:8000 ssl crt x.pem"])
def test_a_listener_on_another_port_is_left_alone(line: str, tmp_path: Path) -> None:
    settings = FrontSettings((STATS,), 30, str(tmp_path / "408.http"))
    assert rewrite(f"frontend x\n{line}\n", settings) == f"frontend x\n{line}\n"
