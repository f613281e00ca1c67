"""Load Hugging Face checkpoints (config.json + safetensors, single or sharded) into the params pytree.

Tensors are read one at a time from memory-mapped files straight into the stacked host arrays, so
peak host memory stays near one copy of the weights; each stacked array is then placed on its
sharding (only each device's shard is transferred). Pickle checkpoints are refused: loading them
executes code.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve.loading.int4_checkpoint import iter_int4_checkpoint, read_int4_format
from jaxserve.loading.int4_tensor import Int4Tensor
from jaxserve.loading.int8_tensor import Int8Tensor
from jaxserve.loading.quantized_buffers import Int4Host, QuantizedHost, RequantizationReport, int4_buffer
from jaxserve.model import quant
from jaxserve.config import ModelConfig
from jaxserve.config.model_config import resolved_group_size
from jaxserve.errors import ModelLoadError
from jaxserve.model.weights import LayerParams, Params, param_specs

_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def checkpoint_dtype(model_dir: str) -> str | None:
    """The dtype the checkpoint was saved in (config.json `dtype` / `torch_dtype`), if it says."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    dtype = hf.get("dtype") or hf.get("torch_dtype")
    return dtype if dtype in ("float32", "bfloat16", "float16") else None


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files of a directory: the index's shards, or model.safetensors, else a clear error."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(model_dir, s))]
        if missing:
            raise ModelLoadError(f"{model_dir}: the safetensors index names missing shard(s) {missing}")
        return [os.path.join(model_dir, s) for s in shards]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    others = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if others:
        return [os.path.join(model_dir, f) for f in others]
    pickles = sorted(f for f in os.listdir(model_dir) if f.endswith(_PICKLE_SUFFIXES))
    if pickles:
        raise ModelLoadError(
            f"{model_dir} holds only pickle weights ({', '.join(pickles)}); jaxserve loads safetensors only, "
            "because unpickling executes code. Convert once with transformers: "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)"
        )
    raise ModelLoadError(f"{model_dir} has no model.safetensors (nor a sharded model.safetensors.index.json)")


def safetensors_dtypes(paths: list[str]) -> set[str]:
    """The dtypes ("bfloat16", "float32", ...) the tensors of these safetensors files are stored in, from
    their headers alone."""
    kinds = set()
    for path in paths:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        kinds |= {np.dtype(_SAFETENSORS_DTYPES[v["dtype"]]).name for k, v in header.items() if k != "__metadata__"}
    return kinds


def iter_safetensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor of one file, each a view into a read-only memory map."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        (header_len,) = struct.unpack("<Q", mapped[:8])
        header = json.loads(mapped[8 : 8 + header_len])
    except (struct.error, ValueError) as err:
        raise ModelLoadError(f"{path} is not a valid safetensors file ({err})") from None
    base = 8 + header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ModelLoadError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
        yield (
            name,
            np.frombuffer(mapped, dtype=dtype, count=(end - start) // dtype.itemsize, offset=base + start).reshape(
                info["shape"]
            ),
        )


def iter_checkpoint_tensors(model_dir: str) -> Iterator[tuple[str, str, np.ndarray]]:
    """(file, transformers name, array) for every tensor of a model directory: its safetensors files,
    or the GGUF file a GGUF-backed directory stands for (loading/gguf_model.py), dequantized there. An
    AWQ / GPTQ checkpoint's quantized layers come as one Int4Tensor `{prefix}.weight` each
    (loading/int4_checkpoint.py)."""
    from jaxserve.loading.gguf_model import gguf_source, iter_gguf_tensors

    if gguf_source(model_dir) is not None:
        yield from iter_gguf_tensors(model_dir)
        return
    tensors = ((path, name, tensor) for path in safetensors_files(model_dir) for name, tensor in iter_safetensors(path))
    fmt = read_int4_format(model_dir)
    yield from tensors if fmt is None else iter_int4_checkpoint(tensors, fmt)


# HF name (after "model.layers.{i}.") -> (our LayerParams field, transpose?)
_LAYER_NAMES = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.o_proj.bias": ("bo", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}
# Gemma 3 (sandwich norms): post_attention_layernorm normalises the attention output, and the MLP has a
# norm on each side of it.
_SANDWICH_NAMES = {
    "post_attention_layernorm.weight": ("post_attn_norm", False),
    "pre_feedforward_layernorm.weight": ("mlp_norm", False),
    "post_feedforward_layernorm.weight": ("post_mlp_norm", False),
}
# Mixture of experts: the router, and the experts either one tensor per expert (what transformers 5.24
# still writes, and the published checkpoints: Qwen3-MoE mlp.experts.{e}.gate_proj/up_proj/down_proj,
# Mixtral block_sparse_moe.experts.{e}.w1/w3/w2) or fused over the experts (transformers 5's modules:
# mlp.experts.gate_up_proj [E, 2F, D] gate half first, mlp.experts.down_proj [E, D, F]).
_ROUTER_NAMES = {"mlp.gate.weight": ("router", True), "block_sparse_moe.gate.weight": ("router", True)}
_EXPERT_PREFIXES = ("mlp.experts.", "block_sparse_moe.experts.")
_SPLIT_EXPERT_NAMES = {
    "gate_proj.weight": "expert_gate",
    "up_proj.weight": "expert_up",
    "down_proj.weight": "expert_down",
    "w1.weight": "expert_gate",
    "w3.weight": "expert_up",
    "w2.weight": "expert_down",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}
# KV cache scales (vLLM's names after "model.layers.{i}." -> which: "kv" is both) are read on their own
# for an fp8 cache (loading/kv_scales.py), never as weights.
KV_SCALE_NAMES = {
    "self_attn.k_scale": "k",
    "self_attn.v_scale": "v",
    "self_attn.attn.k_scale": "k",
    "self_attn.attn.v_scale": "v",
    "self_attn.k_proj.output_scale": "k",
    "self_attn.v_proj.output_scale": "v",
    "self_attn.kv_scale": "kv",
}
KV_SCALE_SUFFIXES = tuple("." + name for name in KV_SCALE_NAMES)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", *KV_SCALE_SUFFIXES)
# Gemma3ForConditionalGeneration: the text tower under its prefix (transformers >= 5 first, then the
# layout the published checkpoints have), mapped to Gemma3ForCausalLM's names; the vision tower and
# projector are not read.
_TEXT_TOWER_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


def _layer_names(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    """HF name (after "model.layers.{i}.") -> (LayerParams field, transpose?) for this family."""
    names = {**_LAYER_NAMES, **_SANDWICH_NAMES} if cfg.sandwich_norms else _LAYER_NAMES
    return {**names, **_ROUTER_NAMES} if cfg.is_moe else names


def expert_parts(rest: str, tensor: np.ndarray) -> list[tuple[str, int | None, np.ndarray]] | None:
    """An expert tensor (`rest` after "model.layers.{i}.") as (field, expert, array in our [in, out]
    layout) parts, expert None when the array holds every expert; None when it is no expert tensor."""
    prefix = next((p for p in _EXPERT_PREFIXES if rest.startswith(p)), None)
    if prefix is None:
        return None
    name = rest[len(prefix) :]
    if name == "gate_up_proj":  # f[E, 2F, D]
        half = tensor.shape[1] // 2
        return [
            ("expert_gate", None, tensor[:, :half].swapaxes(1, 2)),
            ("expert_up", None, tensor[:, half:].swapaxes(1, 2)),
        ]
    if name == "down_proj":  # f[E, D, F]
        return [("expert_down", None, tensor.swapaxes(1, 2))]
    index, _, weight = name.partition(".")
    if index.isdigit() and weight in _SPLIT_EXPERT_NAMES:  # one expert's [out, in]
        return [(_SPLIT_EXPERT_NAMES[weight], int(index), tensor.T)]
    return None


def _with_model_prefix(name: str) -> str:
    """A bare base model's tensor (`Qwen3Model` / `LlamaModel` saved alone: `layers.0...`,
    `embed_tokens.weight`, `norm.weight`) under the causal LM's `model.` prefix."""
    return "model." + name if name.startswith(_BASE_MODEL_NAMES) else name


_BASE_MODEL_NAMES = ("layers.", "embed_tokens.", "norm.")


def _text_tower_name(name: str, cfg: ModelConfig) -> str | None:
    """`name` as the text model calls it, or None for a tensor of a multimodal checkpoint's other towers."""
    if cfg.architecture != "Gemma3ForConditionalGeneration":
        return name
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix, replacement in _TEXT_TOWER_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    return name


def hf_weight_field(name: str, cfg: ModelConfig) -> tuple[str, int | None, bool] | None:
    """Where a Hugging Face tensor goes: (Params or LayerParams field, layer or None, transpose?), None
    for a tensor no weight takes (rotary tables, KV scales, another tower's); ModelLoadError for a name
    this family has no weight of. Expert tensors are not mapped here (`load_hf_params` reads them)."""
    name = _text_tower_name(name, cfg)
    if name is None or name.endswith(_IGNORED_SUFFIXES):
        return None
    if name in _TOP_NAMES:
        field, transpose = _TOP_NAMES[name]
        return field, None, transpose
    if name.startswith("model.layers."):
        index, _, rest = name[len("model.layers.") :].partition(".")
        field, transpose = _layer_names(cfg).get(rest, (None, False))
        if field is not None and index.isdigit() and int(index) < cfg.num_layers:
            return field, int(index), transpose
    raise ModelLoadError(f"unexpected tensor {name!r} (not a {cfg.architecture} weight)")


class _PerLayer:
    """stacked=False: one host buffer per layer of a weight, placed on its devices as soon as the
    layer's tensors are all in (experts arrive one by one), so the host holds one layer of a weight
    at a time; on a CPU, where the devices are the host, the model is then held once, not twice."""

    def __init__(self, make: Any, place: Any, parts: int):
        self.make, self.place, self.parts = make, place, parts  # a fresh one-layer buffer; (layer, buffer) -> array
        self.open: dict[int, Any] = {}
        self.count: dict[int, int] = {}
        self.placed: dict[int, Any] = {}

    def __getitem__(self, layer: int) -> Any:
        if layer not in self.open:
            self.open[layer] = self.make()
        return self.open[layer]

    def done(self, layer: int, parts: int = 1) -> None:
        self.count[layer] = self.count.get(layer, 0) + parts
        if self.count[layer] >= self.parts:
            self.placed[layer] = self.place(layer, self.open.pop(layer))


def load_hf_params(
    model_dir: str,
    cfg: ModelConfig,
    dtype: Any,
    shardings: Params | None = None,
    stacked: bool = True,
    quantization: str = "none",
    quantize_lm_head: bool = False,
    group_size: int | None = None,
) -> Params:
    """Read every tensor once, check it against the expected shape, stack layers, place on devices.

    With stacked=False the layers come back as a tuple of per-layer arrays (weights.unstack_layers),
    each placed as soon as its tensors are read (`_PerLayer`); `shardings` must then be of that form.
    quantization="int8" quantizes the linear weights (and the lm_head with `quantize_lm_head`) tensor by
    tensor as they are read (`QuantizedHost`); `shardings` must then be of the int8 layout. An AWQ /
    GPTQ checkpoint's 4-bit layers load as they are with quantization="int4" (in its groups, and with
    act-order the layout `make_shardings(..., act_order=True)`), else dequantized.
    """
    specs = param_specs(cfg)
    np_dtype = np.dtype(jnp.dtype(dtype))
    host: dict[str, np.ndarray | QuantizedHost | _PerLayer] = {}  # field -> its host array(s) until placed
    filled: dict[str, set[int]] = {}
    quantized: set[str] = set()
    if quantization in ("int8", "int4"):
        quantized = set(quant.quantized_fields(quantization)) | ({"lm_head"} if quantize_lm_head else set())
        if quantize_lm_head and cfg.tie_word_embeddings:  # the tied table, as the head [D, V] (quant.map_linear)
            quantized.add("embed")

    int4_format = read_int4_format(model_dir) if quantization == "int4" else None
    method = quantization if quantization in ("int8", "int4") else "int8"
    group = resolved_group_size(cfg, method, group_size)
    report = RequantizationReport(quantization, group)

    def buffer(field: str, shape: tuple[int, ...]) -> np.ndarray | QuantizedHost:
        if field in quantized and quantization == "int4":
            return int4_buffer(field, shape, np_dtype, int4_format, group)
        if field in quantized:
            return QuantizedHost(shape, np_dtype, 0 if field.startswith("expert_") else group)
        return np.empty(shape, np_dtype)

    def target(field: str, shape: tuple[int, ...]) -> np.ndarray | QuantizedHost | _PerLayer:
        if field not in host:
            if stacked or field not in layer_specs:
                host[field] = buffer(field, shape)
            else:

                def place_layer(i: int, value: Any, field: str = field) -> Any:
                    return _put(value, getattr(shardings.layers[i], field) if shardings is not None else None)

                parts = cfg.num_experts if field.startswith("expert_") else 1
                host[field] = _PerLayer(lambda: buffer(field, shape[1:]), place_layer, parts)
            filled[field] = set()
        return host[field]

    layer_names = _layer_names(cfg)
    layer_specs = {f: getattr(specs.layers, f) for f in LayerParams.__dataclass_fields__}
    top: dict[str, Any] = {}  # embed, final_norm, lm_head: one tensor each, placed as read
    for path, stored_name, tensor in iter_checkpoint_tensors(model_dir):
        name = _text_tower_name(_with_model_prefix(stored_name), cfg)
        if name is None or name.endswith(_IGNORED_SUFFIXES):
            continue
        if name.startswith("model.layers."):
            index_str, _, rest = name[len("model.layers.") :].partition(".")
            parts = expert_parts(rest, tensor) if cfg.is_moe else None
            if parts is not None:
                _copy_experts(target, layer_specs, int(index_str), parts, filled, cfg, stored_name)
                continue
            field, transpose = layer_names.get(rest, (None, False))
            spec = layer_specs.get(field) if field else None
            layer = int(index_str)
            if spec is None or layer >= cfg.num_layers:
                raise ModelLoadError(f"{path}: unexpected tensor {stored_name} for this config")
            report.add(name, _copy_into(target(field, spec.shape), layer, tensor, transpose, name))
            filled[field].add(layer)
            if isinstance(host[field], _PerLayer):
                host[field].done(layer)
        elif name in _TOP_NAMES:
            field, transpose = _TOP_NAMES[name]
            spec = getattr(specs, field)
            if spec is None:  # lm_head saved alongside tied embeddings: identical, ignore
                continue
            shape = spec.shape
            if field == "embed" and field in quantized:
                shape, transpose = shape[::-1], not transpose
            report.add(name, _copy_into(target(field, shape), None, tensor, transpose, name))
            filled[field].add(0)
            top[field] = _put(host.pop(field), getattr(shardings, field) if shardings is not None else None)
        else:
            raise ModelLoadError(f"{path}: unexpected tensor {stored_name!r} (not a {cfg.architecture} weight)")

    def expected(field: str) -> int:  # expert fields count (layer, expert) pairs
        return cfg.num_layers * (cfg.num_experts if field.startswith("expert_") else 1)

    missing = [f for f in layer_specs if layer_specs[f] is not None and len(filled.get(f, ())) != expected(f)]
    missing += [f for f in ("embed", "final_norm", "lm_head") if getattr(specs, f) is not None and f not in top]
    if missing:
        raise ModelLoadError(f"{model_dir}: checkpoint lacks weights for {', '.join(missing)}")

    def place(field: str, sharding: Any) -> jax.Array:
        return _put(host.pop(field), sharding)  # our host copy dropped as soon as it is on the device

    if stacked:
        layer_shardings = shardings.layers if shardings is not None else None
        layers = LayerParams(
            **{
                f: place(f, getattr(layer_shardings, f) if layer_shardings is not None else None)
                if spec is not None
                else None
                for f, spec in layer_specs.items()
            }
        )
    else:  # every layer was placed as it completed
        per_layer = {f: host.pop(f).placed for f, spec in layer_specs.items() if spec is not None}
        layers = tuple(
            LayerParams(**{f: per_layer[f][i] if f in per_layer else None for f in layer_specs})
            for i in range(cfg.num_layers)
        )
    report.log()
    return Params(embed=top["embed"], layers=layers, final_norm=top["final_norm"], lm_head=top.get("lm_head"))


def _put(value: np.ndarray | QuantizedHost, sharding: Any) -> Any:
    if isinstance(value, QuantizedHost):
        return value.place(sharding)
    return jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value)


def _copy_experts(target, layer_specs, layer: int, parts, filled: dict[str, set], cfg: ModelConfig, name: str) -> None:
    """Copy one layer's expert tensor(s) into the stacked f[L, E, ...] arrays; `filled` gets (layer, expert)."""
    for field, expert, array in parts:
        spec = layer_specs[field]
        if layer >= cfg.num_layers or (expert is not None and expert >= cfg.num_experts):
            raise ModelLoadError(
                f"unexpected tensor {name} for this config ({cfg.num_layers} layers, {cfg.num_experts} experts)"
            )
        dest = target(field, spec.shape)
        if isinstance(array, Int4Tensor) and array.perm is not None:  # act-order: experts' layout has no perm
            array = array.dequantize()
        _copy_into(dest[layer], expert, array, False, name)
        filled[field].update((layer, e) for e in (range(cfg.num_experts) if expert is None else (expert,)))
        if isinstance(dest, _PerLayer):
            dest.done(layer, cfg.num_experts if expert is None else 1)


def _copy_into(
    dest: np.ndarray, layer: int | None, tensor: np.ndarray, transpose: bool, name: str
) -> tuple[float, float] | None:
    """Copy (or quantize) one tensor into its slot; the squared error and norm of what was requantized."""
    src = tensor.T if transpose else tensor
    slot = dest if layer is None else dest[layer]
    if isinstance(src, Int4Tensor) and not isinstance(slot, Int4Host):
        src = src.dequantize()  # an int4 tensor where the model keeps floats (or int8)
    if isinstance(src, Int8Tensor) and type(slot) is not QuantizedHost:
        src = src.dequantize()  # a Q8_0 tensor where the model keeps floats (or int4)
    if src.shape != slot.shape:
        raise ModelLoadError(
            f"tensor {name} has shape {tensor.shape}, config implies {slot.shape[::-1] if transpose else slot.shape}"
        )
    if isinstance(slot, QuantizedHost):
        return slot.assign(src)
    if transpose and type(tensor) is np.ndarray and tensor.ndim == 2:
        transpose_into(slot, tensor)
    else:
        slot[...] = src  # casts to the target dtype
    return None


_TRANSPOSE_BLOCK = 256  # source rows a block: its rows and the destination's columns stay in the caches


def transpose_into(dest: np.ndarray, src: np.ndarray) -> None:
    """dest[...] = src.T (cast to dest's dtype), a block of source rows at a time, with a bfloat16 or
    float16 copy done on its 16-bit integers. numpy's whole-array transposed copy strides through one
    side a column at a time: a Llama-3.2-1B checkpoint's linear weights (bfloat16) took 14.7 s to lay
    out that way on 2 AVX2 cores, about 3x what blocks take."""
    if dest.dtype == src.dtype and dest.dtype.itemsize in (2, 4) and dest.dtype.kind not in "iub":
        as_int = np.dtype(f"u{dest.dtype.itemsize}")
        dest, src = dest.view(as_int), src.view(as_int)
    for i in range(0, src.shape[0], _TRANSPOSE_BLOCK):
        dest[:, i : i + _TRANSPOSE_BLOCK] = src[i : i + _TRANSPOSE_BLOCK].T


_DTYPE_NAMES = {np.dtype(v): k for k, v in _SAFETENSORS_DTYPES.items()}


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file (header + raw little-endian bytes, 8-byte aligned), bfloat16 included."""
    arrays = {name: np.ascontiguousarray(array) for name, array in tensors.items()}
    write_safetensors_streamed(path, {n: (a.shape, a.dtype) for n, a in arrays.items()}, arrays.__getitem__)


def write_safetensors_streamed(
    path: str, layout: dict[str, tuple[tuple[int, ...], Any]], make: Callable[[str], np.ndarray]
) -> None:
    """A safetensors file whose tensors (name -> (shape, dtype), in file order) are made one at a
    time by `make(name)` as they are written, so a model larger than memory allows twice can be
    written (scripts/make_random_checkpoint.py)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, dtype) in layout.items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {
            "dtype": _DTYPE_NAMES[np.dtype(dtype)],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, (shape, dtype) in layout.items():
            array = np.ascontiguousarray(make(name))
            if array.shape != tuple(shape) or array.dtype != np.dtype(dtype):
                raise ValueError(
                    f"{name}: made {array.dtype}{list(array.shape)}, the header says {np.dtype(dtype)}{list(shape)}"
                )
            f.write(memoryview(array.reshape(-1).view(np.uint8)))


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of a dense model's Hugging Face checkpoint: name -> (shape in its layout, the
    spec's init: "normal", "ones" or "zeros"), the names `load_hf_params` reads."""
    if cfg.is_moe:
        raise ModelLoadError("hf_tensor_shapes: a mixture of experts' per-expert tensors are not listed")
    specs = param_specs(cfg)
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, (field, transpose) in _TOP_NAMES.items():
        spec = getattr(specs, field)
        if spec is not None:
            out[name] = (spec.shape[::-1] if transpose else spec.shape, spec.init)
    for i in range(cfg.num_layers):
        for name, (field, transpose) in _layer_names(cfg).items():
            spec = getattr(specs.layers, field)
            if spec is not None:
                shape = spec.shape[1:]
                out[f"model.layers.{i}.{name}"] = (shape[::-1] if transpose else shape, spec.init)
    return out


def hf_tensors(params: Params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The params under Hugging Face names and layouts ([out, in] linear weights): the inverse of loading."""
    layers = params.layers
    per_layer = (
        layers
        if isinstance(layers, tuple)
        else [jax.tree.map(lambda w, i=i: w[i], layers) for i in range(cfg.num_layers)]
    )
    out: dict[str, np.ndarray] = {}
    for name, (field, transpose) in _TOP_NAMES.items():
        value = getattr(params, field)
        if value is not None:
            out[name] = np.asarray(value).T if transpose else np.asarray(value)
    mixtral = cfg.architecture == "MixtralForCausalLM"
    router_name = "block_sparse_moe.gate.weight" if mixtral else "mlp.gate.weight"
    expert_names = (
        (
            "block_sparse_moe.experts.{}.w1.weight",
            "block_sparse_moe.experts.{}.w3.weight",
            "block_sparse_moe.experts.{}.w2.weight",
        )
        if mixtral
        else ("mlp.experts.{}.gate_proj.weight", "mlp.experts.{}.up_proj.weight", "mlp.experts.{}.down_proj.weight")
    )
    for i, lp in enumerate(per_layer):
        for name, (field, transpose) in _layer_names(cfg).items():
            value = getattr(lp, field)
            if value is not None and field != "router":
                out[f"model.layers.{i}.{name}"] = np.asarray(value).T if transpose else np.asarray(value)
        if lp.router is not None:  # the per-expert layout transformers writes
            out[f"model.layers.{i}.{router_name}"] = np.asarray(lp.router).T
            for field, pattern in zip(("expert_gate", "expert_up", "expert_down"), expert_names):
                for e, w in enumerate(np.asarray(getattr(lp, field))):
                    out[f"model.layers.{i}.{pattern.format(e)}"] = w.T
    return out
