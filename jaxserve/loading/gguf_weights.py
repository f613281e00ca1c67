"""A GGUF file's tensors under Hugging Face names and layouts, one at a time, dequantized by `gguf`.

The safetensors loader (jaxserve/loading/checkpoint.py) stacks whatever (name, array) pairs it is given, so a
GGUF file only needs translating: llama.cpp's tensor names to transformers', its quantized blocks to
floats, and the conventions of llama.cpp's converter (`convert_hf_to_gguf.py`) undone where they differ
from transformers' layout. Those conventions are per architecture, not flags in the file:
- llama-architecture files (Mistral and Mixtral are written as llama too) have the rows of Q and K
  permuted from HF's rotate-half RoPE layout to GPT-J's interleaved one (K with the KV head count);
  qwen2, qwen3, qwen3moe and gemma3 files are not permuted.
- Gemma's RMSNorm weights (q/k norms included) are stored with 1 added (llama.cpp computes x * w;
  transformers x * (1 + w)).
- GGUF lists dimensions innermost first; the reader's numpy arrays are already [out, in] row-major,
  transformers' nn.Linear layout.
Each tensor is dequantized to float32 alone and handed on (a Q4_0 / Q4_1 linear weight as an Int4Tensor,
which the loader keeps as int4 or dequantizes), so a load never holds more than one
tensor's float copy beside the stacked weights.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, Iterable, Iterator

import numpy as np

from jaxserve.errors import ModelLoadError, UnsupportedModelError
from jaxserve.loading.int4_tensor import Int4Tensor
from jaxserve.loading.int8_tensor import Int8Tensor, int8_tensor

# llama.cpp block tensor -> transformers name after "model.layers.{i}." (llama / qwen / mistral).
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
# Gemma 3's sandwich norms: ffn_norm is the MLP's pre-norm there.
_GEMMA3_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Mixtral (llama with experts) keeps its router and experts under block_sparse_moe.
_MIXTRAL_NAMES = {**_BLOCK_NAMES, "ffn_gate_inp": "block_sparse_moe.gate"}
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_MIXTRAL_EXPERT_NAMES = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_NORMS = ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm", "attn_q_norm", "attn_k_norm")
_BLOCK = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors llama.cpp files carry that hold nothing transformers' model needs: rope_freqs is folded
# into the config as Llama 3's rope scaling (llama3_rope_scaling).
_IGNORED = ("rope_freqs.weight",)


def dequantize(tensor: Any) -> np.ndarray:
    """One reader tensor as float32 in the reader's [.., out, in] layout, whatever its GGML type."""
    from gguf import GGMLQuantizationType, quants

    kind = tensor.tensor_type
    try:
        values = quants.dequantize(tensor.data, kind)
    except NotImplementedError:
        raise UnsupportedModelError(
            f"tensor {tensor.name} is of GGML type {kind.name}, which the gguf library cannot dequantize"
        ) from None
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        values = values.astype(np.float32, copy=False)
    return values


# Block tensors of these kinds stay int4 when GGML's Q4_0 / Q4_1 (Int4Tensor), the loader choosing
# whether to keep them so (quantization="int4") or dequantize them.
_LINEAR_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
GGUF_GROUP = 32  # values per Q4_0 / Q4_1 block


def int4_tensor(tensor: Any) -> Int4Tensor | None:
    """A reader tensor of GGML type Q4_0 or Q4_1 as an Int4Tensor (None for any other type).

    A block is 32 consecutive `in` values of one row: an f16 d (Q4_1: then an f16 m), then 16 bytes
    whose low nibbles are values 0..15 and high nibbles values 16..31."""
    from gguf import GGMLQuantizationType

    kind = tensor.tensor_type
    if kind not in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
        return None
    raw = np.asarray(tensor.data, np.uint8)
    head = 4 if kind == GGMLQuantizationType.Q4_1 else 2
    blocks = raw.reshape(raw.shape[0], -1, head + 16)  # [out, in // 32, block bytes]
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    if kind == GGMLQuantizationType.Q4_1:
        m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    else:
        m = -8.0 * d  # exact: a power of two times an f16
    qs = blocks[..., head:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(raw.shape[0], -1)  # u8[out, in]
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # u8[out, in // 2]
    # the library's own dequantization is the reference: Q4_0's (q - 8) * d rounds once, q * d - 8d may
    # differ by an ulp
    return Int4Tensor(
        values=np.ascontiguousarray(packed.T),
        scales=np.ascontiguousarray(d.T),
        biases=np.ascontiguousarray(m.T),
        group_size=GGUF_GROUP,
        reference=functools.partial(dequantize, tensor),
    )


def _packed(tensor: Any) -> Int4Tensor | Int8Tensor | None:
    """A Q4_0 / Q4_1 / Q8_0 tensor in quantized parts the loader copies as they are (None: another type)."""
    return int4_tensor(tensor) or int8_tensor(tensor, dequantize)


def unpermute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's llama-family Q/K row permutation: within each head, rows 0, 2, 4, ... (the
    first rotary half) and 1, 3, 5, ... were interleaved; transformers keeps the halves apart."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def iter_hf_tensors(arch: str, tensors: Iterable[Any], config: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """(transformers name, float32 array or Int4Tensor) for every weight of a file of architecture `arch`, in file
    order; `tensors` have the reader's `name`, `tensor_type` and `data`."""
    model_type = config["model_type"]
    names = {"gemma3_text": _GEMMA3_NAMES, "mixtral": _MIXTRAL_NAMES}.get(model_type, _BLOCK_NAMES)
    permuted = arch == "llama"
    gemma = model_type == "gemma3_text"
    for tensor in tensors:
        name = tensor.name
        if name in _IGNORED:
            continue
        if name in _TOP_NAMES:
            values = (_packed(tensor) if name != "output_norm.weight" else None) or dequantize(tensor)
            yield _TOP_NAMES[name], values - 1.0 if gemma and name == "output_norm.weight" else values
            continue
        match = _BLOCK.match(name)
        if match is None:
            raise ModelLoadError(f"unexpected GGUF tensor {name!r} for a {arch} model")
        layer, kind, suffix = match.groups()
        prefix = f"model.layers.{layer}."
        if kind in _EXPERT_NAMES:
            yield from _expert_tensors(prefix, kind, dequantize(tensor), model_type)
            continue
        if kind not in names:
            raise ModelLoadError(f"unexpected GGUF tensor {name!r} for a {arch} model")
        packed = _packed(tensor) if kind in _LINEAR_KINDS and suffix == "weight" else None
        values = dequantize(tensor) if packed is None else packed
        if permuted and kind in ("attn_q", "attn_k"):
            heads = config["num_attention_heads"] if kind == "attn_q" else config["num_key_value_heads"]
            if packed is None:
                values = unpermute_rope_rows(values, heads)
            else:
                values = packed.take_out(unpermute_rope_rows(np.arange(packed.shape[0]), heads))
        if gemma and kind in _NORMS:
            values = values - 1.0
        yield f"{prefix}{names[kind]}.{suffix}", values


def _expert_tensors(prefix: str, kind: str, values: np.ndarray, model_type: str) -> Iterator[tuple[str, np.ndarray]]:
    """llama.cpp stacks a layer's experts in one [E, out, in] tensor; transformers names each expert."""
    if values.ndim != 3:
        raise ModelLoadError(f"{prefix}{kind}: expected a stacked [experts, out, in] tensor, got {values.shape}")
    if model_type == "mixtral":
        for e, weight in enumerate(values):
            yield f"{prefix}block_sparse_moe.experts.{e}.{_MIXTRAL_EXPERT_NAMES[kind]}.weight", weight
    else:
        for e, weight in enumerate(values):
            yield f"{prefix}mlp.experts.{e}.{_EXPERT_NAMES[kind]}.weight", weight


def llama3_rope_scaling(factors: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """The rope_scaling that produced a Llama 3.x file's `rope_freqs` tensor (per rotary frequency, the
    divisor llama.cpp applies). llama.cpp's converter computes them from the HF config's llama3 scaling
    and drops the parameters; every Llama 3.1-3.3 checkpoint uses low/high frequency factors 1 and 4
    over an 8192-token original context, so those are tried and checked against the tensor."""
    factors = np.asarray(factors, np.float64).reshape(-1)
    factor = float(factors.max())
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = []
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            expected.append(1.0)
        elif wavelen > low_wavelen:
            expected.append(factor)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            expected.append(1 / ((1 - smooth) / factor + smooth))
    if factors.shape != (head_dim // 2,) or not np.allclose(factors, expected, rtol=1e-4):
        raise UnsupportedModelError(
            "the GGUF file's rope_freqs are not Llama 3's rope scaling (factor "
            f"{factor:g}, low/high 1/4, original context 8192); jaxserve cannot "
            "serve per-frequency RoPE factors of another origin"
        )
    return scaling
