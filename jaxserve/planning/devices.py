"""The one table of accelerator specs (memory, bandwidth, peak FLOPs, interconnect, price) the planner,
benchmarks and docs read; plus how to measure "this CPU", which no table can know.

Figures are per device as JAX sees it (one TPU v4/v5p chip is one megacore device). Sources: the
Cloud TPU system-architecture pages and NVIDIA's data sheets (dense bf16, no sparsity). Prices are
rough on-demand list prices per device-hour at the big clouds in mid-2025; they vary by region,
commitment and provider (specialised GPU clouds often charge a third to a half of these), so the
planner takes `--cost-per-hour` to override.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator, as the roofline sees it."""

    name: str  # the table key, e.g. "h100"
    description: str
    memory_bytes: int  # HBM per device
    hbm_bandwidth: float  # bytes/s, peak
    peak_flops: float  # dense bf16 FLOP/s (weight-only int8 still multiplies in bf16)
    allreduce_bandwidth: float  # bytes/s per device and direction, what a ring all-reduce streams
    cost_per_hour: float  # USD per device-hour, on demand (rough; see the module docstring)
    kind_patterns: tuple[str, ...] = ()  # lower-case substrings of jax's `device.device_kind`
    shared_host: bool = False  # virtual devices of one host share its memory, bandwidth and FLOPs


DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        # TPU all-reduce bandwidth: the pod's all-reduce bandwidth / chips (v4: 1.1 PB/s / 4096; v5e:
        # 51.2 TB/s / 256; v6e: 102.4 TB/s / 256), or half the bidirectional ICI figure (v5p: 1200 GB/s).
        DeviceSpec(
            "tpu-v4",
            "TPU v4 (one chip, 2 TensorCores as a megacore)",
            32 * GiB,
            1200e9,
            275e12,
            268e9,
            3.22,
            ("tpu v4",),
        ),
        DeviceSpec("tpu-v5e", "TPU v5e (v5 lite)", 16 * GiB, 819e9, 197e12, 200e9, 1.20, ("tpu v5 lite", "tpu v5e")),
        DeviceSpec(
            "tpu-v5p", "TPU v5p (one chip, megacore)", 95 * GiB, 2765e9, 459e12, 600e9, 4.20, ("tpu v5p", "tpu v5")
        ),
        DeviceSpec(
            "tpu-v6e",
            "TPU v6e (Trillium, v6 lite)",
            32 * GiB,
            1640e9,
            918e12,
            400e9,
            2.70,
            ("tpu v6 lite", "tpu v6e", "tpu v6"),
        ),
        # NVLink all-reduce bandwidth: half the bidirectional NVLink figure (A100 600 GB/s, H100/H200 900 GB/s;
        # the PCIe cards' NVLink bridges 600 GB/s; L4 has none: PCIe 4.0 x16, 32 GB/s each way). An entry
        # whose pattern another's contains comes first ("h100 pcie" before "h100").
        DeviceSpec("a100", "NVIDIA A100 80GB SXM", 80 * GiB, 2039e9, 312e12, 300e9, 4.00, ("a100-sxm4-80gb",)),
        DeviceSpec("a100-pcie", "NVIDIA A100 80GB PCIe", 80 * GiB, 1935e9, 312e12, 300e9, 3.70, ("a100 80gb",)),
        DeviceSpec("a100-40gb", "NVIDIA A100 40GB (SXM or PCIe)", 40 * GiB, 1555e9, 312e12, 300e9, 3.00, ("a100",)),
        DeviceSpec("h100-pcie", "NVIDIA H100 80GB PCIe", 80 * GiB, 2000e9, 756e12, 300e9, 7.00, ("h100 pcie",)),
        DeviceSpec("h100", "NVIDIA H100 80GB SXM", 80 * GiB, 3350e9, 989e12, 450e9, 8.00, ("h100",)),
        DeviceSpec("h200", "NVIDIA H200 141GB SXM", 141 * GiB, 4800e9, 989e12, 450e9, 10.00, ("h200",)),
        DeviceSpec("l4", "NVIDIA L4 24GB", 24 * GiB, 300e9, 121e12, 32e9, 0.80, ("l4",)),
        # "This CPU": memory is read from the OS and bandwidth / FLOPs measured (see cpu_spec); these
        # placeholders are never used for a plan.
        DeviceSpec("cpu", "this CPU (measured)", 0, 0.0, 0.0, 0.0, 0.10, ("cpu",), shared_host=True),
    )
}

ALIASES = {
    "v4": "tpu-v4",
    "v5e": "tpu-v5e",
    "v5litepod": "tpu-v5e",
    "v5p": "tpu-v5p",
    "v6e": "tpu-v6e",
    "a100-80gb": "a100",
    "h100-80gb": "h100",
}


def get_device(name: str) -> DeviceSpec:
    """The spec of a table name (or alias), case-insensitive; a clear error for an unknown one."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICES)} (or 'auto' for the local one)")
    return DEVICES[key]


def spec_for_device_kind(kind: str) -> DeviceSpec | None:
    """The table entry matching jax's `device.device_kind` (e.g. "NVIDIA H100 80GB HBM3", "TPU v5 lite"): the
    first whose pattern occurs in it as whole words ("l4" is not in "nvidia l40s")."""
    kind = kind.lower()
    for spec in DEVICES.values():  # dict order: "tpu v5 lite" is tried before "tpu v5"
        if any(re.search(rf"(?<![a-z0-9]){re.escape(pattern)}(?![a-z0-9])", kind) for pattern in spec.kind_patterns):
            return spec
    return None


def host_memory_bytes() -> int:
    """Physical memory of this host."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def measure_copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes/s of a numpy copy of `mib` MiB (read + write traffic, best of `repeats`).

    The arrays are far larger than the caches, so this is DRAM bandwidth as one copying thread sees
    it; XLA's CPU decode reads weights at about this rate. A shared machine makes it noisy."""
    import numpy as np

    src = np.ones(mib * 2**20 // 8, np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def measure_matmul_flops(n: int = 1024, repeats: int = 3) -> float:
    """FLOP/s of an f32 numpy matmul of n x n matrices (2 n^3 FLOPs), best of `repeats`."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    a @ a
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def cpu_spec(bandwidth: float | None = None, peak_flops: float | None = None) -> DeviceSpec:
    """ "This CPU": host memory, and bandwidth / FLOPs as given or measured now (about a second)."""
    bandwidth = bandwidth or measure_copy_bandwidth()
    return dataclasses.replace(
        DEVICES["cpu"],
        memory_bytes=host_memory_bytes(),
        hbm_bandwidth=bandwidth,
        peak_flops=peak_flops or measure_matmul_flops(),
        allreduce_bandwidth=bandwidth / 2,  # an all-reduce between virtual devices is memory copies
    )
