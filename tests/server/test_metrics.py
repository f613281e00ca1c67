"""The server's MBU peak comes from the one device table (jaxserve.planning.devices), by jax's device kind."""

import sys
import types

import pytest

from jaxserve.server.metrics import detect_device_bandwidth


@pytest.mark.parametrize(
    "platform, kind, peak",
    [
        ("gpu", "NVIDIA H100 80GB HBM3", 3.35e12),
        ("gpu", "NVIDIA H100 PCIe", 2.0e12),
        ("gpu", "NVIDIA A100-SXM4-40GB", 1.555e12),
        ("gpu", "NVIDIA L4", 0.3e12),
        ("gpu", "NVIDIA L40S", None),  # not in the table (and not the L4)
        ("tpu", "TPU v5 lite", 0.819e12),
        ("cpu", "cpu", None),  # measured, not a peak
    ],
)
def test_peak_bandwidth_from_the_device_table(monkeypatch, platform, kind, peak):
    device = types.SimpleNamespace(platform=platform, device_kind=kind)
    monkeypatch.setitem(sys.modules, "jax", types.SimpleNamespace(devices=lambda: [device]))
    assert detect_device_bandwidth() == peak
