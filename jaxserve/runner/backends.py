"""Which implementation runs each part of the step on this platform and mesh, logged with the
reason: layer scanning, attention, int8 matmul. Never a silent fallback."""

from __future__ import annotations

import logging

from jaxserve.errors import ConfigError

logger = logging.getLogger(__name__)


def default_scan_layers(backend: str) -> bool:
    """Unrolled layers decode faster on CPU (measured: 23 vs 44 ms/step, SmolLM2-135M shape);
    accelerators scan, which keeps compile time flat in depth: on an H200 an unrolled 30-layer
    SmolLM2-shaped engine was still compiling its weight initialisation after 200 s, while a scanned
    Llama-3-8B-shaped server was ready in 37 s (docs/BENCHMARKS.md, "On an H200")."""
    return backend != "cpu"


def resolve_attention(setting: str, platform: str, mesh_shape: tuple[int, int]) -> str:
    """Which attention implementation runs, logged with the reason; never a silent fallback."""
    sharded = tuple(mesh_shape) != (1, 1)
    if setting == "auto":
        if platform not in ("tpu", "gpu"):
            impl, why = "reference", f"plain-JAX reference on {platform} (the kernels only interpret there)"
        else:
            impl, why = "pallas_" + platform, f"Pallas kernels on {platform}"
    elif setting == "pallas":
        impl = "pallas_" + platform if platform in ("tpu", "gpu") else "pallas_interpret"
        why = "Pallas kernels, as asked" + (" (interpret mode on CPU: slow, for testing)" if platform == "cpu" else "")
    else:
        impl, why = "reference", "plain-JAX reference, as asked"
    if impl != "reference" and sharded:
        why += f", per device under shard_map on the {tuple(mesh_shape)} mesh"
    logger.info("attention: %s (attention_backend=%s): %s", impl, setting, why)
    return impl


def resolve_quantized_matmul(
    setting: str, platform: str, mesh_shape: tuple[int, int], quantization: str, activation_quantization: str = "none"
) -> str:
    """How quantized (int8 or int4) weights are multiplied (one of quant.MATMUL_IMPLS), logged with the reason."""
    if quantization == "none":
        return "reference"  # no int8 weights: nothing to choose
    sharded = tuple(mesh_shape) != (1, 1)
    if activation_quantization == "int8":
        if setting == "pallas":
            raise ConfigError(
                "activation_quantization=int8 (W8A8) multiplies through XLA; the Pallas int8 kernel "
                "is weight-only: use quantized_matmul_backend 'auto' or 'reference'"
            )
        impl, why = "w8a8", "XLA, int8 activations per token times int8 weights (W8A8), int32 accumulation"
    elif setting == "auto":
        if platform not in ("tpu", "gpu") and not sharded:
            impl, why = "xla_cpu", "XLA on CPU, decode rows widening each weight in cache-sized chunks"
        elif platform not in ("tpu", "gpu"):
            impl, why = "reference", f"XLA (int8 -> activation dtype per weight, then the matmul) on {platform}"
        elif sharded:
            impl, why = "reference", "XLA: GSPMD cannot split the Pallas kernel over a multi-device mesh"
        else:
            impl, why = "pallas_" + platform, f"Pallas {quantization}_matmul on {platform}"
    elif setting == "pallas":
        if sharded:
            raise ConfigError(
                "quantized_matmul_backend='pallas' runs on a single device only (no shard_map "
                "wrapper for the int8 matmul yet); use 'auto' or 'reference' with this mesh"
            )
        impl = "pallas_" + platform if platform in ("tpu", "gpu") else "pallas_interpret"
        why = f"Pallas {quantization}_matmul, as asked"
        if platform == "cpu":
            why += " (interpret mode on CPU: slow, for testing)"
    else:
        impl, why = "reference", "XLA, as asked"
    logger.info("%s matmul: %s (quantized_matmul_backend=%s): %s", quantization, impl, setting, why)
    return impl
