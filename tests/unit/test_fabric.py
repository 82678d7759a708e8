"""NVLink domain discovery from recorded `nvidia-smi -q` outputs.

tests/data/nvidia_smi holds the outputs of a GB200 tray and a GB300 tray (two racks,
so two fabric clusters), an 8-GPU HGX H100 node, and a GB200 tray whose fabric is
still registering.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from placement.errors import FabricInconsistent, FabricNotReady, InvalidDomainId
from placement.fabric import (
    DomainSource,
    discover_domain,
    parse_nvidia_smi_q,
    resolve_domain,
)
from placement.planner import EngineRequest, PlacementPlan, PlacementPlanner
from placement.topology import ClusterTopology, NodeSpec

DATA = Path(__file__).resolve().parents[1] / "data" / "nvidia_smi"
GB200 = (DATA / "gb200_node.txt").read_text()
GB300 = (DATA / "gb300_node.txt").read_text()
HGX_H100 = (DATA / "hgx_h100_node.txt").read_text()
GB200_REGISTERING = (DATA / "gb200_node_fabric_in_progress.txt").read_text()

GB200_RACK = "7b1e4f2a-93c8-4d65-a0f7-2c9e81b5d4a3.32766"
GB300_RACK = "e2d94b07-5c1a-4f38-b6e2-9a07d3c58f14.4026"


def replace_nth_field(text: str, key: str, n: int, value: str) -> str:
    """The text with the n-th (0-based) `key : ...` line set to `value`."""
    lines, seen = text.splitlines(), 0
    for i, line in enumerate(lines):
        if line.strip().startswith(f"{key} ") and ":" in line:
            if seen == n:
                lines[i] = line[: line.index(":") + 1] + " " + value
                return "\n".join(lines) + "\n"
            seen += 1
    raise AssertionError(f"no field {key!r} #{n}")


def test_gb200_tray_reports_four_gpus_in_one_fabric_clique() -> None:
    gpus = parse_nvidia_smi_q(GB200)

    # Four Blackwell GPUs, in the order nvidia-smi lists them.
    assert [g.bus_id for g in gpus] == [
        "00000008:01:00.0",
        "00000009:01:00.0",
        "00000018:01:00.0",
        "00000019:01:00.0",
    ]
    assert {g.product_name for g in gpus} == {"NVIDIA GB200"}
    assert gpus[0].gpu_uuid == "GPU-3f8e2c41-9b7d-5a06-e1c4-7d20b95a8f13"
    # Every GPU registered with the rack's fabric: same cluster, same clique.
    assert {(g.state, g.status, g.clique_id, g.cluster_uuid) for g in gpus} == {
        ("Completed", "Success", 32766, "7b1e4f2a-93c8-4d65-a0f7-2c9e81b5d4a3")
    }
    assert all(g.in_multi_node_fabric for g in gpus)

    # The domain is cluster UUID + clique id.
    resolution = discover_domain("gb200-r07-tray11", nvidia_smi_q=GB200)
    assert resolution.domain_id == GB200_RACK
    assert resolution.source is DomainSource.FABRIC
    assert resolution.reason == (
        "node 'gb200-r07-tray11': 4 GPUs in fabric cluster "
        "7b1e4f2a-93c8-4d65-a0f7-2c9e81b5d4a3 clique 32766"
    )


def test_trays_of_one_rack_share_a_domain_and_another_rack_has_its_own() -> None:
    # Two trays of the same rack report the same fabric, whatever their node ids.
    assert resolve_domain("gb200-r07-tray11", nvidia_smi_q=GB200) == GB200_RACK
    assert resolve_domain("gb200-r07-tray12", nvidia_smi_q=GB200) == GB200_RACK
    # A GB300 tray in another rack: another cluster UUID and clique.
    assert resolve_domain("gb300-r02-tray04", nvidia_smi_q=GB300) == GB300_RACK
    assert len(GB200_RACK) <= 63  # fits a node label value


def test_hgx_h100_node_is_its_own_domain() -> None:
    gpus = parse_nvidia_smi_q(HGX_H100)

    # Eight Hopper GPUs; the fabric completed, but inside the node only: clique 0
    # and an all-zero cluster UUID.
    assert len(gpus) == 8
    assert gpus[7].bus_id == "00000000:DB:00.0"
    assert {(g.state, g.status, g.clique_id, g.cluster_uuid) for g in gpus} == {
        ("Completed", "Success", 0, "00000000-0000-0000-0000-000000000000")
    }
    assert not any(g.in_multi_node_fabric for g in gpus)

    resolution = discover_domain("hgx-h100-017", nvidia_smi_q=HGX_H100)
    assert resolution.domain_id == "hgx-h100-017"
    assert resolution.source is DomainSource.NODE


def test_configured_domain_wins_over_the_fabric() -> None:
    resolution = discover_domain("gb200-r07-tray11", configured="rack-07", nvidia_smi_q=GB200)
    assert resolution.domain_id == "rack-07"
    assert resolution.source is DomainSource.CONFIG
    # Config is also the way out while the fabric is broken.
    assert (
        resolve_domain("gb200-r08-tray12", configured="rack-08", nvidia_smi_q=GB200_REGISTERING)
        == "rack-08"
    )


def test_configured_domain_must_be_a_label_value() -> None:
    with pytest.raises(InvalidDomainId, match="'rack 07/a' for node 'n1' is not a valid label"):
        resolve_domain("n1", configured="rack 07/a")
    with pytest.raises(InvalidDomainId):
        resolve_domain("n1", configured="r" * 64)


def test_a_fabric_still_registering_is_an_error_not_a_guess() -> None:
    gpus = parse_nvidia_smi_q(GB200_REGISTERING)
    assert {(g.state, g.status, g.clique_id, g.cluster_uuid) for g in gpus} == {
        ("In Progress", None, None, None)
    }
    with pytest.raises(FabricNotReady) as error:
        resolve_domain("gb200-r08-tray12", nvidia_smi_q=GB200_REGISTERING)
    message = str(error.value)
    assert (
        "node 'gb200-r08-tray12': GPU fabric not ready (00000008:01:00.0 In Progress/N/A" in message
    )
    assert "set the node's nvlink domain in kvtide's cluster config" in message


def test_a_fabric_that_completed_with_an_error_is_not_ready() -> None:
    # Registration finished but failed on every GPU (seen as "Insufficient
    # Resources" with clique 0 and a zero cluster UUID).
    failed = GB200
    for n in range(4):
        failed = replace_nth_field(failed, "Status", n, "Insufficient Resources")
        failed = replace_nth_field(failed, "CliqueId", n, "0")
        failed = replace_nth_field(failed, "ClusterUUID", n, "00000000-0000-0000-0000-000000000000")
    with pytest.raises(FabricNotReady, match=re.escape("00000019:01:00.0 Completed/Insufficient")):
        resolve_domain("gb200-r07-tray11", nvidia_smi_q=failed)


def test_gpus_in_different_cliques_on_one_node_are_inconsistent() -> None:
    # The third GPU reports another clique than the other three.
    split = replace_nth_field(GB200, "CliqueId", 2, "32765")
    wanted = "00000018:01:00.0 cluster 7b1e4f2a-93c8-4d65-a0f7-2c9e81b5d4a3 clique 32765"
    with pytest.raises(FabricInconsistent, match=re.escape(wanted)):
        resolve_domain("gb200-r07-tray11", nvidia_smi_q=split)


def test_no_fabric_information_makes_the_node_its_own_domain() -> None:
    # No nvidia-smi output at all (e.g. a CPU node), or no GPUs in it.
    assert (
        discover_domain("cpu-head", nvidia_smi_q=None).reason
        == "node 'cpu-head': no nvidia-smi output"
    )
    assert resolve_domain("cpu-head", nvidia_smi_q="No devices were found\n") == "cpu-head"
    # An older driver prints no Fabric section.
    old_driver = (
        "==============NVSMI LOG==============\n\n"
        "Timestamp                                 : Thu Mar  3 10:20:11 2022\n"
        "Driver Version                            : 470.103.01\n"
        "CUDA Version                              : 11.4\n\n"
        "Attached GPUs                             : 1\n"
        "GPU 00000000:07:00.0\n"
        "    Product Name                          : NVIDIA A100-SXM4-40GB\n"
        "    GPU UUID                              : GPU-5d2a8c31-77e0-4b19-a2f4-9c13e6b0d8f7\n"
        "    Processes                             : None\n"
    )
    (gpu,) = parse_nvidia_smi_q(old_driver)
    assert (gpu.product_name, gpu.state, gpu.cluster_uuid) == ("NVIDIA A100-SXM4-40GB", None, None)
    assert resolve_domain("a100-03", nvidia_smi_q=old_driver) == "a100-03"


def test_a_node_id_that_is_no_label_value_is_cleaned_and_kept_unique() -> None:
    first = resolve_domain("hgx node #1 (rack 3)")
    second = resolve_domain("hgx node #1 [rack 3]")
    assert first.startswith("hgx-node-1-rack-3-")
    assert first != second
    assert len(resolve_domain("n" * 100)) <= 63


def test_discovered_domains_drive_the_planner() -> None:
    # Two GB200 trays of one rack and an HGX node, labelled from their own output.
    def node(node_id: str, output: str, num_gpus: int) -> NodeSpec:
        domain_id = resolve_domain(node_id, nvidia_smi_q=output)
        return NodeSpec(node_id=node_id, domain_id=domain_id, num_gpus=num_gpus, num_cpus=144)

    nodes = (node("tray11", GB200, 4), node("tray12", GB200, 4), node("hgx-017", HGX_H100, 8))
    planner = PlacementPlanner(ClusterTopology(nodes=nodes))
    # A TP8 fits the HGX node exactly; the next one spans the two trays of the rack.
    first = planner.place(EngineRequest(engine_id="e0", tp_size=8, role="decode"))
    second = planner.place(EngineRequest(engine_id="e1", tp_size=8, role="decode"))
    assert isinstance(first, PlacementPlan) and isinstance(second, PlacementPlan)
    assert (first.domain_id, first.node_ids) == ("hgx-017", ("hgx-017",))
    assert (second.domain_id, second.node_ids) == (GB200_RACK, ("tray11", "tray12"))
