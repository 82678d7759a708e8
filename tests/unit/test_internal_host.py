"""``server.internal_host``: every listener kvtide starts for its own parts (an engine's
NIXL side channel, its KV-event publisher, a host store's NIXL handshake) gets the
configured address, loopback by default; 'node' gives each the address of its own node
(docs/reliability.md#listeners)."""

from __future__ import annotations

import pytest

from engines.vllm_engine import engine_args_for, side_channel_env
from orchestrator.config import parse_config
from orchestrator.config.server import (
    check_internal_host,
    internal_address,
    nixl_transport_env,
)
from orchestrator.errors import ConfigError
from orchestrator.kv.host_tier import host_tier_spec
from orchestrator.serve.engine_host import host_engine_spec

NODE_IP = "10.0.0.7"  # the address Ray knows the engine's node by


def engine_listeners(raw: dict[str, object]) -> dict[str, str]:
    """Where a prefill engine of ``raw``'s config listens: the side channel's variables
    and the KV-event endpoint vLLM is given."""
    config = parse_config({"routing": {"prefix_aware": True}, **raw})
    host = internal_address(config.server.internal_host, NODE_IP)
    spec = host_engine_spec(config, "prefill", None, "p", 25601, host, None, 25701)
    return {
        **side_channel_env(spec),
        "kv_events": engine_args_for(spec)["kv_events_config"]["endpoint"],
        "UCX_NET_DEVICES": dict(spec.env).get("UCX_NET_DEVICES", "(any)"),
    }


def test_by_default_every_listener_is_on_loopback() -> None:
    assert engine_listeners({}) == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "25601",
        # vLLM binds a wildcard endpoint only: libzmq binds the part after ';' (see
        # engines/kv_events.py; test_kv_events.py binds it with vLLM's publisher).
        "kv_events": "tcp://*:0;127.0.0.1:25701",
        # NIXL's own transport (UCX) listens on the loopback device only.
        "UCX_NET_DEVICES": "lo",
    }
    spec = host_tier_spec(parse_config({"kv": {"host_tier_mib": 16}}))
    assert spec is not None
    assert internal_address(spec.internal_host, NODE_IP) == "127.0.0.1"
    assert nixl_transport_env(spec.internal_host) == {"UCX_NET_DEVICES": "lo"}


def test_node_gives_each_listener_its_nodes_address() -> None:
    assert engine_listeners({"server": {"internal_host": "node"}}) == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": NODE_IP,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "25601",
        "kv_events": f"tcp://*:0;{NODE_IP}:25701",
        "UCX_NET_DEVICES": "(any)",
    }
    spec = host_tier_spec(
        parse_config({"server": {"internal_host": "node"}, "kv": {"host_tier_mib": 16}})
    )
    assert spec is not None
    assert internal_address(spec.internal_host, NODE_IP) == NODE_IP


def test_an_address_is_used_as_given() -> None:
    listeners = engine_listeners({"server": {"internal_host": "192.0.2.9"}})
    assert listeners["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "192.0.2.9"
    assert listeners["kv_events"] == "tcp://*:0;192.0.2.9:25701"


def test_a_name_or_interface_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"server\.internal_host.*'eth0'.*'node'"):
        parse_config({"server": {"internal_host": "eth0"}})


def test_loopback_is_refused_on_a_cluster_of_several_hosts() -> None:
    # Nodes on one host (one address) reach each other on loopback.
    check_internal_host("127.0.0.1", {"192.0.2.2"})
    check_internal_host("node", {"10.0.0.7", "10.0.0.8"})
    with pytest.raises(ConfigError, match="internal_host: 'node'") as refused:
        check_internal_host("127.0.0.1", {"10.0.0.7", "10.0.0.8"})
    assert refused.value.field == "server.internal_host"
