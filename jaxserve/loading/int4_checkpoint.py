"""AWQ and GPTQ 4-bit safetensors checkpoints (config.json `quantization_config`) read straight into
jaxserve's int4 layout (quant.Int4Array), exactly: both store w = (q - z) * s per group of input rows
with an integer zero point z, which is scale s and bias -z * s (an f16 scale times a 4-bit integer is
exact in float32).

The formats, per linear layer `{prefix}.weight` of transformers' [out, in] weight:
- AWQ GEMM (AutoAWQ): `qweight` i32[in, out / 8] packs eight output channels per int32, nibble i
  holding channel 8c + AWQ_ORDER[i] (the interleaved order of AWQ's GEMM kernel); `qzeros` i32[in / G,
  out / 8] the same way; `scales` f16[in / G, out].
- GPTQ (AutoGPTQ, GPTQModel, optimum): `qweight` i32[in / 8, out] packs eight input rows per int32,
  nibble j holding row 8r + j; `qzeros` i32[in / G, out / 8] eight output channels per int32 in plain
  order; `scales` f16[in / G, out]; `g_idx` i32[in], the group of each input row. Format v1
  (`checkpoint_format` "gptq", the default) stores z - 1 (the historical off-by-one: a stored nibble
  n means z = n + 1, as every v1 kernel adds it back), v2 ("gptq_v2") stores z.
  With act-order (`desc_act`), g_idx is no run of groups: the rows are stored sorted by group and the
  Int4Array carries the permutation (`perm`), which the matmul applies to the activation.

Anything else (other bit widths, AWQ GEMV / Marlin / exllama layouts, GPTQ Marlin / BitBLAS formats, a
quantized lm_head, other methods) is refused with a ConfigError naming it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Iterator

import numpy as np

from jaxserve.errors import ConfigError, ModelLoadError
from jaxserve.loading.int4_tensor import Int4Tensor

logger = logging.getLogger(__name__)

# AWQ's GEMM packing: nibble i of an int32 holds output channel AWQ_ORDER[i] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx")}
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what to add to a stored zero point


@dataclasses.dataclass(frozen=True)
class Int4Format:
    """What a checkpoint's quantization_config says, once checked: method "awq" or "gptq", the group
    size (None: one group over all input rows, GPTQ's -1), GPTQ's act-order and zero-point offset."""

    method: str
    group_size: int | None
    act_order: bool = False
    zero_offset: int = 0  # added to each stored zero point (GPTQ v1: 1)

    def describe(self) -> str:
        group = "one group per column" if self.group_size is None else f"groups of {self.group_size}"
        if self.method == "awq":
            return f"AWQ 4-bit (GEMM layout, {group})"
        fmt = "v1" if self.zero_offset else "v2"
        return f"GPTQ 4-bit ({fmt}, {group}{', act-order' if self.act_order else ''})"

    def group_for(self, in_features: int) -> int:
        return in_features if self.group_size is None else self.group_size


def read_int4_format(model_dir: str) -> Int4Format | None:
    """The directory's checkpoint quantization (None for a float checkpoint), or a ConfigError naming
    what jaxserve cannot load as it is."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        qc = json.load(f).get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    where = f"{model_dir}: quantization_config"
    if method not in _PARTS:
        raise ConfigError(
            f"{where} has quant_method {method or 'unset'!r}; jaxserve loads AWQ and GPTQ 4-bit "
            "checkpoints only (or a float checkpoint, quantized at load with --quantization)"
        )
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ConfigError(f"{where}: {method.upper()} with {bits} bits; jaxserve's int4 path loads 4-bit only")
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or not (group == -1 or (group > 0 and group % 2 == 0)):
        raise ConfigError(f"{where}: group_size {group!r} (expected an even positive size, or -1)")
    group_size = None if group == -1 else group
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(
                f"{where}: AWQ version {version!r}; jaxserve reads the GEMM layout only "
                "(GEMV, GEMV-fast, Marlin, exllama and IPEX layouts are not supported)"
            )
        if not qc.get("zero_point", True):
            raise ConfigError(f"{where}: AWQ without zero points (zero_point false) is not supported")
        if group_size is None:
            raise ConfigError(f"{where}: AWQ with group_size -1 is not supported")
        return Int4Format("awq", group_size)
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if fmt not in _GPTQ_FORMATS:
        raise ConfigError(
            f"{where}: GPTQ checkpoint_format {fmt!r}; jaxserve reads 'gptq' (v1) and 'gptq_v2' "
            "(not Marlin, BitBLAS or other repacked formats)"
        )
    if qc.get("lm_head"):
        raise ConfigError(
            f"{where}: a GPTQ-quantized lm_head is not supported (serve the float lm_head, "
            "optionally with quantize_lm_head)"
        )
    return Int4Format("gptq", group_size, bool(qc.get("desc_act", False)), _GPTQ_FORMATS[fmt])


def implied_quantization(settings: Any) -> Any:
    """EngineConfig `settings` with quantization="int4" when the model is an AWQ / GPTQ checkpoint:
    its own 4-bit weights are served as they are (as vLLM serves a checkpoint's own method); an explicit
    int8 contradicts them and is refused rather than requantized."""
    if settings.load_format not in ("auto", "safetensors") or settings.model is None:
        return settings
    fmt = read_int4_format(settings.model)
    if fmt is None:
        return settings
    if settings.quantization == "int8":
        raise ConfigError(
            f"{settings.model} is an {fmt.describe()} checkpoint: quantization='int8' would "
            "requantize 4-bit weights; leave quantization unset (or 'int4') to serve them as stored"
        )
    logger.info(
        "%s is an %s checkpoint: its weights load into quantization=int4 as stored%s",
        settings.model,
        fmt.describe(),
        "" if settings.quantization == "int4" else " (quantization 'none' overridden)",
    )
    return settings.replace(quantization="int4")


def iter_int4_checkpoint(
    tensors: Iterator[tuple[str, str, np.ndarray]], fmt: Int4Format
) -> Iterator[tuple[str, str, Any]]:
    """(file, name, tensor) of a checkpoint with every quantized linear layer's parts turned into one
    `{prefix}.weight` Int4Tensor ([out, in], as a float weight would stand). Other tensors pass as they
    come; the parts (memory-mapped, read only when used) are held until the end, then converted one
    layer at a time."""
    parts: dict[str, dict[str, tuple[str, np.ndarray]]] = {}
    suffixes = _PARTS[fmt.method]
    for path, name, tensor in tensors:
        prefix, _, suffix = name.rpartition(".")
        if suffix in suffixes:
            parts.setdefault(prefix, {})[suffix] = (path, tensor)
        else:
            yield path, name, tensor
    for prefix in sorted(parts):
        held = parts[prefix]
        missing = [s for s in suffixes if s not in held and s != "g_idx"]
        if missing:
            raise ModelLoadError(
                f"{held['qweight'][0] if 'qweight' in held else prefix}: {prefix} lacks "
                f"{', '.join(missing)} of its {fmt.method.upper()} weight"
            )
        arrays = {s: t for s, (_, t) in held.items()}
        unpack = unpack_awq if fmt.method == "awq" else unpack_gptq
        yield held["qweight"][0], f"{prefix}.weight", unpack(arrays, fmt, prefix)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """i32[..., m] -> u8[..., m, 8]: nibble i of each int32 (bits 4i..4i+3) at index i."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    return ((words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF).astype(np.uint8)


def _awq_columns(packed: np.ndarray) -> np.ndarray:
    """AWQ's interleaved i32[rows, out / 8] -> u8[rows, out] in channel order."""
    nib = _nibbles(packed)  # [rows, out / 8, 8]: nibble i is channel AWQ_ORDER[i] of its eight
    out = np.empty_like(nib)
    out[..., list(AWQ_ORDER)] = nib
    return out.reshape(packed.shape[0], -1)


def _to_int4(
    codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray, group: int, perm: np.ndarray | None, name: str
) -> Int4Tensor:
    """Codes u8[in, out] (stored order), zero points [in / G, out] and f16 scales as an Int4Tensor:
    scale s, bias -z * s (both exact in float32)."""
    k, n = codes.shape
    if k % group or k % 2 or scales.shape != (k // group, n) or zeros.shape != scales.shape:
        raise ModelLoadError(
            f"{name}: scales {scales.shape} and zero points {zeros.shape} do not fit "
            f"{k} input rows in groups of {group} and {n} outputs"
        )
    s = scales.astype(np.float32)
    packed = codes[0::2] | (codes[1::2] << 4)
    return Int4Tensor(
        values=np.ascontiguousarray(packed), scales=s, biases=-zeros.astype(np.float32) * s, group_size=group, perm=perm
    )


def unpack_awq(parts: dict[str, np.ndarray], fmt: Int4Format, name: str) -> Int4Tensor:
    codes = _awq_columns(parts["qweight"])  # u8[in, out]
    return _to_int4(codes, _awq_columns(parts["qzeros"]), parts["scales"], fmt.group_for(codes.shape[0]), None, name)


def unpack_gptq(parts: dict[str, np.ndarray], fmt: Int4Format, name: str) -> Int4Tensor:
    qweight = parts["qweight"]
    codes = _nibbles(qweight).swapaxes(1, 2).reshape(-1, qweight.shape[1])  # u8[in, out]: row 8r + j
    k = codes.shape[0]
    group = fmt.group_for(k)
    zeros = _nibbles(parts["qzeros"]).reshape(parts["qzeros"].shape[0], -1).astype(np.int32) + fmt.zero_offset
    g_idx = parts.get("g_idx")
    plain = np.arange(k, dtype=np.int32) // group
    if g_idx is None or np.array_equal(g_idx, plain):
        # groups already runs of rows; an act-order layout still carries a perm (the identity), as
        # every weight of a stacked field has one
        return _to_int4(
            codes, zeros, parts["scales"], group, np.arange(k, dtype=np.int32) if fmt.act_order else None, name
        )
    if not fmt.act_order:
        raise ModelLoadError(
            f"{name}: g_idx assigns rows to groups out of order, but the quantization_config says desc_act false"
        )
    g_idx = np.asarray(g_idx, np.int64)
    if (
        g_idx.shape != (k,)
        or g_idx.min() < 0
        or g_idx.max() >= k // group
        or np.any(np.bincount(g_idx, minlength=k // group) != group)
    ):
        raise ModelLoadError(f"{name}: g_idx does not put {group} rows in each of {k // group} groups")
    perm = np.argsort(g_idx, kind="stable").astype(np.int32)  # stored row j is weight row perm[j]
    return _to_int4(codes[perm], zeros, parts["scales"], group, perm, name)
