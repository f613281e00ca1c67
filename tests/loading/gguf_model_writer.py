"""Write a Hugging Face model as llama.cpp's converter would, with the `gguf` library, for the loader tests.

Tensor names come from gguf-py's own HF -> GGUF name map (an independent referee of the loader's
table); the converter's conventions are applied as `convert_hf_to_gguf.py` applies them: Q/K rows
permuted for llama-architecture files, Gemma's norms stored with 1 added. Quantized types go through
`gguf.quants.quantize`; K-quants, which gguf-py cannot write, are hand-built blocks of random codes
with sane scales (`k_quant_blocks`).
"""

from __future__ import annotations

import numpy as np

# HF model_type -> (GGUF architecture, permute Q/K?, norm offset)
FAMILIES = {
    "llama": ("llama", True, 0.0),
    "mistral": ("llama", True, 0.0),
    "mixtral": ("llama", True, 0.0),
    "qwen2": ("qwen2", False, 0.0),
    "qwen3": ("qwen3", False, 0.0),
    "qwen3_moe": ("qwen3moe", False, 0.0),
    "gemma3_text": ("gemma3", False, 1.0),
}


def byte_level_vocab(vocab_size: int) -> tuple[list[str], list[str]]:
    """A GPT-2-style BPE vocabulary of exactly `vocab_size` tokens: the 256 byte symbols, then merges of
    lowercase letter pairs."""
    table = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols = {b: chr(b) for b in table}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    tokens = [symbols[b] for b in range(256)]
    letters = "abcdefghijklmnopqrstuvwxyz"
    merges = []
    for a in letters:
        for b in letters:
            if len(tokens) >= vocab_size:
                return tokens, merges
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    assert len(tokens) == vocab_size, "vocab_size too large for the letter-pair merges"
    return tokens, merges


def permute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K permutation (rotate-half halves interleaved per head)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def k_quant_blocks(qtype, rows: int, cols: int, rng: np.random.RandomState) -> np.ndarray:
    """uint8[rows, cols / 256 * block bytes] of random K-quant blocks whose f16 scale fields hold
    small finite values (random bytes there would decode to huge numbers, infinities or NaN)."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.randint(0, 256, size=(rows, cols // block, size)).astype(np.uint8)
    name = qtype.name
    # byte offsets of the f16 super-block scales (ggml-common.h's block_qN_K layouts)
    scales = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[name]
    for offset in scales:
        values = rng.uniform(0.002, 0.01, size=(rows, cols // block)).astype(np.float16)
        blocks[..., offset : offset + 2] = values.view(np.uint8).reshape(rows, cols // block, 2)
    if name == "Q6_K":  # int8 sub-block scales: keep them modest
        blocks[..., 192:208] = rng.randint(-8, 9, size=(rows, cols // block, 16)).astype(np.int8).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(
    path: str, hf_config: dict, state_dict: dict[str, np.ndarray], qtype_name: str = "F32", seed: int = 0
) -> dict[str, np.ndarray]:
    """Write `state_dict` (HF names, [out, in] float arrays) as a GGUF file; returns, per GGUF tensor name,
    the dequantized values the file holds (what a correct loader must read)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    model_type = hf_config["model_type"]
    arch, permuted, norm_offset = FAMILIES[model_type]
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    layers = hf_config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch_enum, layers)
    writer = gguf.GGUFWriter(path, arch)
    heads, kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    writer.add_block_count(layers)
    writer.add_context_length(hf_config["max_position_embeddings"])
    writer.add_embedding_length(hf_config["hidden_size"])
    writer.add_feed_forward_length(hf_config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = hf_config.get("rope_parameters") or {}  # transformers 5 keeps rope_theta there
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(float(hf_config.get("rope_theta") or rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(hf_config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(hf_config["vocab_size"])
    if hf_config.get("num_experts") or hf_config.get("num_local_experts"):
        writer.add_expert_count(hf_config.get("num_experts") or hf_config["num_local_experts"])
        writer.add_expert_used_count(hf_config["num_experts_per_tok"])
        if hf_config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(hf_config["moe_intermediate_size"])
    if hf_config.get("sliding_window"):
        writer.add_sliding_window(hf_config["sliding_window"])
    scaling = hf_config.get("rope_scaling")
    if scaling and scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    tokens, merges = byte_level_vocab(hf_config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    rng = np.random.RandomState(seed)
    qtype = Q[qtype_name]
    held: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, value in state_dict.items():
        if hf_name == "lm_head.weight" and hf_config.get("tie_word_embeddings"):
            continue  # llama.cpp writes no output tensor for a tied head
        value = np.asarray(value, np.float32)
        if hf_name.endswith("experts.gate_up_proj"):  # transformers 5 fuses [E, 2F, D], gate half first
            half = value.shape[1] // 2
            for proj, part in (("gate_proj", value[:, :half]), ("up_proj", value[:, half:])):
                gguf_name = names.get_name(hf_name.replace("gate_up_proj", proj)) + ".weight"
                held[gguf_name] = _add(writer, gguf_name, np.ascontiguousarray(part), qtype, rng)
            continue
        if hf_name.endswith("experts.down_proj"):  # [E, D, F]: already llama.cpp's [E, out, in]
            gguf_name = names.get_name(hf_name) + ".weight"
            held[gguf_name] = _add(writer, gguf_name, value, qtype, rng)
            continue
        base, _, suffix = hf_name.rpartition(".")
        if ".experts." in base:  # gather each layer's experts into llama.cpp's stacked tensor
            layer_part, _, expert_part = base.partition(".experts.")
            index, _, proj = expert_part.partition(".")
            key = f"{layer_part}.experts.{proj}"
            experts.setdefault(key, {})[int(index)] = value
            continue
        gguf_name = names.get_name(base)
        assert gguf_name is not None, f"gguf-py maps no name for {hf_name}"
        if permuted and base.endswith(("q_proj", "k_proj")):
            value = permute_rope_rows(value, heads if base.endswith("q_proj") else kv_heads)
        if norm_offset and "norm" in base:
            value = value + norm_offset
        held[gguf_name + "." + suffix] = _add(writer, gguf_name + "." + suffix, value, qtype, rng)
    for key, by_index in experts.items():
        stacked = np.stack([by_index[e] for e in sorted(by_index)])
        gguf_name = names.get_name(key)
        assert gguf_name is not None, f"gguf-py maps no name for {key}"
        held[gguf_name + ".weight"] = _add(writer, gguf_name + ".weight", stacked, qtype, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def _add(writer, name: str, value: np.ndarray, qtype, rng) -> np.ndarray:
    """Add one tensor (1-D tensors stay F32, as llama.cpp keeps norms); returns its dequantized value."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    if value.ndim == 1 or qtype == Q.F32:
        writer.add_tensor(name, value)
        return value
    if qtype == Q.F16:
        writer.add_tensor(name, value.astype(np.float16))
        return value.astype(np.float16).astype(np.float32)
    if qtype.name.endswith("_K"):
        rows = int(np.prod(value.shape[:-1]))
        data = k_quant_blocks(qtype, rows, value.shape[-1], rng).reshape(*value.shape[:-1], -1)
    else:
        data = quants.quantize(value, qtype)
    writer.add_tensor(name, data, raw_dtype=qtype)
    return quants.dequantize(data, qtype)
