"""Devices kvtide can plan for, as data: memory, bandwidth, interconnect, domain size.

Every figure carries the vendor document it comes from in `source`. Memory sizes are
the vendor's decimal "GB" (x 10^9 bytes): HBM parts usually report slightly more to
the driver, so plans built on these numbers err on the safe side. Bandwidths are in
GB/s (10^9 bytes per second); `interconnect_bandwidth_gbps` is the scale-up link
bandwidth of one device (both directions added, as vendors quote it) and
`scale_out_bandwidth_gbps` the network bandwidth per device between domains.

A figure the vendor has not published is an estimate: `is_estimate` is True and the
`source` says where the number comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from placement.model_errors import UnknownDevice

__all__ = ["DEVICES", "DeviceSpec", "device_by_name"]

_GB = 10**9


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or host) as the capacity and decode models see it."""

    name: str
    memory_bytes: int
    memory_bandwidth_gbps: float
    interconnect_bandwidth_gbps: float  # per device, inside one scale-up domain
    nvlink_domain_size: int  # devices that share the scale-up fabric (NVL72: 72, HGX: 8)
    scale_out_bandwidth_gbps: float  # per device, between domains
    bf16_dense_tflops: float  # dense (no sparsity) BF16 tensor throughput
    source: str
    is_estimate: bool = False


_CRESCENT_ISLAND = DeviceSpec(
    name="crescent-island",
    memory_bytes=160 * _GB,
    memory_bandwidth_gbps=684.0,
    interconnect_bandwidth_gbps=64.0,
    nvlink_domain_size=8,
    scale_out_bandwidth_gbps=50.0,
    bf16_dense_tflops=200.0,
    source="Intel newsroom, OCP Global Summit 2025 (Crescent Island data center GPU, "
    "Xe3P, 160 GB LPDDR5X, air-cooled PCIe card); Computex 2026 (350 W, partner "
    "designs up to 480 GB). Intel has published no bandwidth or TFLOPS: 684 GB/s is "
    "Tom's Hardware's estimate for a 640-bit LPDDR5X bus; PCIe Gen5 x16 (64 GB/s) "
    "between up to 8 cards in one server and 200 TFLOPS are placeholders",
    is_estimate=True,
)


DEVICES: tuple[DeviceSpec, ...] = (
    DeviceSpec(
        name="h100-sxm",
        memory_bytes=80 * _GB,
        memory_bandwidth_gbps=3350.0,
        interconnect_bandwidth_gbps=900.0,
        nvlink_domain_size=8,
        scale_out_bandwidth_gbps=50.0,
        bf16_dense_tflops=989.0,
        source="NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: 80 GB HBM3, 3.35 TB/s, "
        "NVLink 900 GB/s, BF16 1,979 TFLOPS with sparsity); HGX H100 8-GPU board; "
        "ConnectX-7 400 Gb/s per GPU",
    ),
    DeviceSpec(
        name="h200",
        memory_bytes=141 * _GB,
        memory_bandwidth_gbps=4800.0,
        interconnect_bandwidth_gbps=900.0,
        nvlink_domain_size=8,
        scale_out_bandwidth_gbps=50.0,
        bf16_dense_tflops=989.0,
        source="NVIDIA H200 Tensor Core GPU datasheet (H200 SXM: 141 GB HBM3e, 4.8 TB/s, "
        "NVLink 900 GB/s, BF16 1,979 TFLOPS with sparsity); HGX H200 8-GPU board; "
        "ConnectX-7 400 Gb/s per GPU",
    ),
    DeviceSpec(
        name="b200",
        memory_bytes=180 * _GB,
        memory_bandwidth_gbps=8000.0,
        interconnect_bandwidth_gbps=1800.0,
        nvlink_domain_size=8,
        scale_out_bandwidth_gbps=50.0,
        bf16_dense_tflops=2250.0,
        source="NVIDIA DGX B200 / HGX B200 datasheet (1,440 GB HBM3e over 8 GPUs, 64 TB/s "
        "aggregate, fifth-generation NVLink 1.8 TB/s per GPU, FP16/BF16 2.25 PFLOPS dense "
        "per GPU); ConnectX-7 400 Gb/s per GPU",
    ),
    DeviceSpec(
        name="gb200",
        memory_bytes=186 * _GB,
        memory_bandwidth_gbps=8000.0,
        interconnect_bandwidth_gbps=1800.0,
        nvlink_domain_size=72,
        scale_out_bandwidth_gbps=50.0,
        bf16_dense_tflops=2500.0,
        source="NVIDIA GB200 NVL72 specifications (13.4 TB HBM3e over 72 GPUs = 186 GB each, "
        "576 TB/s aggregate = 8 TB/s each, NVLink 130 TB/s = 1.8 TB/s per GPU, "
        "72-GPU NVLink domain); ConnectX-7 400 Gb/s per GPU",
    ),
    DeviceSpec(
        name="gb300",
        memory_bytes=288 * _GB,
        memory_bandwidth_gbps=8000.0,
        interconnect_bandwidth_gbps=1800.0,
        nvlink_domain_size=72,
        scale_out_bandwidth_gbps=100.0,
        bf16_dense_tflops=2500.0,
        source="NVIDIA GB300 NVL72 specifications (Blackwell Ultra: 288 GB HBM3e per GPU, "
        "20.7 TB per rack, 576 TB/s aggregate = 8 TB/s each, NVLink 130 TB/s = 1.8 TB/s "
        "per GPU, 72-GPU NVLink domain); ConnectX-8 800 Gb/s per GPU",
    ),
    DeviceSpec(
        name="mi355x",
        memory_bytes=288 * _GB,
        memory_bandwidth_gbps=8000.0,
        interconnect_bandwidth_gbps=1075.2,
        nvlink_domain_size=8,
        scale_out_bandwidth_gbps=50.0,
        bf16_dense_tflops=2500.0,
        source="AMD Instinct MI355X product brief (CDNA 4: 288 GB HBM3E, 8 TB/s, 7 Infinity "
        "Fabric links x 153.6 GB/s, FP16/BF16 2.5 PFLOPS dense); 8-GPU OAM platform; "
        "400 Gb/s NIC per GPU",
    ),
    DeviceSpec(
        name="m3-ultra-512gb",
        memory_bytes=512 * _GB,
        memory_bandwidth_gbps=819.0,
        interconnect_bandwidth_gbps=15.0,
        nvlink_domain_size=1,
        scale_out_bandwidth_gbps=15.0,
        bf16_dense_tflops=28.0,
        source="Apple Mac Studio (2025) technical specifications: M3 Ultra, up to 512 GB "
        "unified memory, 819 GB/s; Thunderbolt 5 up to 120 Gb/s. GPU FP16 throughput is "
        "not published: 28 TFLOPS is an estimate (80 GPU cores)",
        is_estimate=True,
    ),
    _CRESCENT_ISLAND,
    # A partner design of the same card with more memory; bandwidth and TFLOPS as for it.
    replace(
        _CRESCENT_ISLAND,
        name="crescent-island-480gb",
        memory_bytes=480 * _GB,
        source="Intel, Computex 2026: Crescent Island partner designs with up to 480 GB "
        "LPDDR5X; bandwidth and TFLOPS as for crescent-island (estimates)",
    ),
    DeviceSpec(
        name="cpu-host",
        memory_bytes=768 * _GB,
        memory_bandwidth_gbps=460.8,
        interconnect_bandwidth_gbps=25.0,
        nvlink_domain_size=1,
        scale_out_bandwidth_gbps=25.0,
        bf16_dense_tflops=20.0,
        source="Generic one-socket server: 12 channels of DDR5-4800 (JEDEC: 38.4 GB/s per "
        "channel) with 64 GB DIMMs, 200 Gb/s NIC; BF16 matrix throughput is an estimate",
        is_estimate=True,
    ),
)


def device_by_name(name: str, devices: tuple[DeviceSpec, ...] = DEVICES) -> DeviceSpec:
    """The catalog entry called `name` (case-insensitive)."""
    for device in devices:
        if device.name == name.lower():
            return device
    known = ", ".join(d.name for d in devices)
    raise UnknownDevice(f"no device named {name!r} in the catalog; known devices: {known}")
