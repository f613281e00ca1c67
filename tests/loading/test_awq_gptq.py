"""AWQ and GPTQ 4-bit safetensors checkpoints load into int4 (quant.Int4Array) exactly.

The checkpoints are synthesized here: a tiny random float llama's linear layers quantized per group
by a small numpy quantizer and packed by numpy packers written from the formats' descriptions (AWQ's
interleaved nibble order; GPTQ's rows packed along `in`, v1's zero points stored minus one, act-order
g_idx a random assignment of rows to groups), independent of jaxserve's unpacking. The reference is
(q - z) * s of the synthesized codes, written as a plain float checkpoint for the engine comparisons.

transformers cannot cross-check these on this CPU: it dequantizes AWQ and GPTQ only through the
gptqmodel / autoawq packages (CUDA-oriented builds), which are not installed.
"""

import dataclasses
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.errors import ConfigError
from jaxserve.loading.checkpoint import iter_safetensors, load_hf_params, write_safetensors
from jaxserve.loading.int4_checkpoint import implied_quantization, read_int4_format
from jaxserve.model import quant
from jaxserve.model.llama import forward_dense
from jaxserve.model.sharding import make_mesh, make_shardings

# transformers name (after "model.layers.{i}.") -> our LayerParams field
LINEAR = {
    "self_attn.q_proj": "wq",
    "self_attn.k_proj": "wk",
    "self_attn.v_proj": "wv",
    "self_attn.o_proj": "wo",
    "mlp.gate_proj": "w_gate",
    "mlp.up_proj": "w_up",
    "mlp.down_proj": "w_down",
}
PACK_ORDER_AWQ = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of an AWQ word holds channel PACK_ORDER_AWQ[i] of its 8


@dataclasses.dataclass(frozen=True)
class Variant:
    method: str  # "awq" | "gptq"
    group: int  # -1: one group over all input rows
    act_order: bool = False
    v2: bool = False

    @property
    def id(self) -> str:
        return f"{self.method}{'-v2' if self.v2 else ''}-g{self.group}{'-act' if self.act_order else ''}"

    def config(self) -> dict:
        if self.method == "awq":
            return {
                "quant_method": "awq",
                "bits": 4,
                "group_size": self.group,
                "version": "gemm",
                "zero_point": True,
                "modules_to_not_convert": None,
            }
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": self.group,
            "desc_act": self.act_order,
            "sym": False,
            "checkpoint_format": "gptq_v2" if self.v2 else "gptq",
            "true_sequential": True,
        }


VARIANTS = [
    Variant("awq", 32),
    Variant("awq", 64),
    Variant("gptq", 32),
    Variant("gptq", 64, act_order=True),
    Variant("gptq", -1),
    Variant("gptq", 32, act_order=True),
    Variant("gptq", 64, act_order=True, v2=True),
]


def quantize(w: np.ndarray, g_idx: np.ndarray, groups: int, zero_min: int):
    """Asymmetric 4-bit of w f32[in, out] with row k in group g_idx[k]: codes u8[in, out], zero points
    i64[groups, out] in [zero_min, 15], f16 scales [groups, out]."""
    q = np.empty(w.shape, np.uint8)
    z = np.empty((groups, w.shape[1]), np.int64)
    s = np.empty((groups, w.shape[1]), np.float16)
    for g in range(groups):
        rows = w[g_idx == g]
        lo, hi = rows.min(0), rows.max(0)
        s[g] = np.maximum((hi - lo) / 15, 1e-3).astype(np.float16)
        z[g] = np.clip(np.round(-lo / s[g].astype(np.float32)), zero_min, 15)
        q[g_idx == g] = np.clip(np.round(rows / s[g].astype(np.float32)) + z[g], 0, 15)
    return q, z, s


def pack_columns(a: np.ndarray, order: list[int]) -> np.ndarray:
    """u8[rows, cols] -> i32[rows, cols / 8]: nibble i of word c holds column 8c + order[i]."""
    out = np.zeros((a.shape[0], a.shape[1] // 8), np.uint32)
    for i, col in enumerate(order):
        out |= a[:, col::8].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


def pack_rows(a: np.ndarray) -> np.ndarray:
    """u8[rows, cols] -> i32[rows / 8, cols]: nibble j of word r holds row 8r + j (GPTQ's qweight)."""
    out = np.zeros((a.shape[0] // 8, a.shape[1]), np.uint32)
    for j in range(8):
        out |= a[j::8].astype(np.uint32) << np.uint32(4 * j)
    return out.view(np.int32)


def quantized_parts(w_out_in: np.ndarray, v: Variant, rng: np.random.RandomState):
    """One linear weight's checkpoint tensors and its reference dequantization f32[in, out]."""
    w = np.asarray(w_out_in, np.float32).T
    k = w.shape[0]
    group = k if v.group == -1 else v.group
    g_idx = np.arange(k) // group
    if v.act_order:
        g_idx = rng.permutation(g_idx)  # each group's rows scattered over the input
    v1 = v.method == "gptq" and not v.v2
    q, z, s = quantize(w, g_idx, k // group, zero_min=1 if v1 else 0)  # v1 cannot store z = 0
    ref = (q.astype(np.float32) - z[g_idx].astype(np.float32)) * s[g_idx].astype(np.float32)
    if v.method == "awq":
        parts = {
            "qweight": pack_columns(q, PACK_ORDER_AWQ),
            "qzeros": pack_columns(z.astype(np.uint8), PACK_ORDER_AWQ),
            "scales": s,
        }
    else:
        stored = (z - 1 if v1 else z).astype(np.uint8)
        parts = {
            "qweight": pack_rows(q),
            "qzeros": pack_columns(stored, list(range(8))),
            "scales": s,
            "g_idx": g_idx.astype(np.int32),
        }
    return parts, ref


def synthesize(src: str, out: str, v: Variant) -> tuple[str, str, dict]:
    """The float model at `src` as a `v` checkpoint in out/quantized, its reference dequantization as
    a float checkpoint in out/reference; returns both and the references {(layer, field): f32[in, out]}."""
    rng = np.random.RandomState(7)
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    quantized, reference, refs = {}, {}, {}
    for _, name, tensor in (t for t in _tensors(src)):
        prefix, _, suffix = name.rpartition(".")
        module = prefix.split(".", 3)[-1] if prefix.startswith("model.layers.") else None
        if module in LINEAR and suffix == "weight":
            parts, ref = quantized_parts(tensor, v, rng)
            quantized.update({f"{prefix}.{p}": a for p, a in parts.items()})
            reference[name] = ref.T
            refs[int(prefix.split(".")[2]), LINEAR[module]] = ref
        else:
            quantized[name] = reference[name] = np.asarray(tensor)
    dirs = []
    for kind, tensors, cfg in (
        ("quantized", quantized, {**config, "quantization_config": v.config()}),
        ("reference", reference, config),
    ):
        path = os.path.join(out, kind)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f)
        write_safetensors(os.path.join(path, "model.safetensors"), tensors)
        dirs.append(path)
    return dirs[0], dirs[1], refs


def _tensors(model_dir: str):
    return ((None, name, t) for name, t in iter_safetensors(os.path.join(model_dir, "model.safetensors")))


@pytest.fixture(scope="module")
def float_model(hf_model_dir):
    return hf_model_dir("llama")[0]  # hidden 64, MLP 128, 2 layers: groups of 32, 64 and all rows fit


@pytest.fixture(scope="module")
def checkpoints(float_model, tmp_path_factory):
    made = {}

    def get(v: Variant):
        if v not in made:
            made[v] = synthesize(float_model, str(tmp_path_factory.mktemp(v.id)), v)
        return made[v]

    return get


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.id)
def test_every_quantized_layer_loads_as_its_reference_dequantization(checkpoints, v):
    path, ref_path, refs = checkpoints(v)
    cfg = ModelConfig.from_dir(path)
    q4 = load_hf_params(path, cfg, jnp.float32, quantization="int4")
    for (layer, field), ref in refs.items():
        w = getattr(q4.layers, field)
        assert isinstance(w, quant.Int4Array), field
        assert w.group_size == (ref.shape[0] if v.group == -1 else v.group)
        assert (w.perm is not None) == v.act_order
        np.testing.assert_array_equal(np.asarray(quant.dequantize_int4(w)[layer]), ref, err_msg=f"{layer} {field}")
    assert q4.lm_head.dtype == q4.embed.dtype == jnp.float32  # left float by the checkpoint, float here
    # quantization "none" reads the same checkpoint as the dequantized floats (Int4Tensor.dequantize)
    floats = load_hf_params(path, cfg, jnp.float32)
    for (layer, field), ref in refs.items():
        np.testing.assert_array_equal(np.asarray(getattr(floats.layers, field)[layer]), ref, err_msg=field)
    # the logits: the reference float model's, through the XLA reference (stacked layers) and the CPU's
    # chunked decode path (per-layer weights, 12 rows)
    ref_params = load_hf_params(ref_path, cfg, jnp.float32)
    ids = jnp.asarray([np.random.RandomState(3).randint(0, cfg.vocab_size, 12).tolist()])
    forward = jax.jit(forward_dense, static_argnames="cfg")
    want = np.asarray(forward(ref_params, ids, cfg=cfg))
    per_layer = load_hf_params(path, cfg, jnp.float32, stacked=False, quantization="int4")
    for kernel, params in (("reference", q4), ("xla_cpu", per_layer)):
        got = forward(quant.with_kernel(params, kernel), ids, cfg=cfg)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0, err_msg=kernel)


def test_engine_serves_the_checkpoint_as_its_dequantized_float_model(checkpoints, caplog):
    """LLM(path) of an act-order GPTQ checkpoint, no quantization given, serves int4 (and says so); its
    greedy tokens and logprobs (prefill chunks and decode rows: both CPU matmul paths) are the reference
    float model's."""
    path, ref_path, _ = checkpoints(Variant("gptq", 32, act_order=True))
    kw = dict(
        dtype="float32",
        page_size=8,
        max_model_len=32,
        max_num_seqs=1,
        max_num_batched_tokens=4,
        compilation_cache_dir="none",
    )
    prompts = [np.random.RandomState(0).randint(0, 512, size=11).tolist()]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    with caplog.at_level(logging.INFO, logger="jaxserve.loading.int4_checkpoint"):
        with LLM(path, **kw) as llm:
            assert llm.config.quantization == "int4" and "int4 dense linear layers" in llm.memory.describe()
            assert isinstance(llm.runner.params.layers[0].w_down, quant.Int4Array)
            got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert "checkpoint: its weights load into quantization=int4 as stored" in caplog.text
    with LLM(ref_path, **kw) as ref_llm:
        want = ref_llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ours, theirs in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert ours.keys() == theirs.keys()
            np.testing.assert_allclose([ours[t] for t in ours], [theirs[t] for t in ours], atol=2e-4)


def test_act_order_on_a_tensor_parallel_mesh(checkpoints):
    """Act-order perms follow the `in` axis: on a (1, 2) mesh the row-parallel o/down projections hold
    half the stored rows each and GSPMD gathers the activation across the shards; the logits are the
    single device's. One group over all rows cannot be split over the model axis: a clear error."""
    path, ref_path, _ = checkpoints(Variant("gptq", 32, act_order=True))
    cfg = ModelConfig.from_dir(path)
    mesh = make_mesh((1, 2))
    sh = make_shardings(cfg, mesh, quantization="int4", act_order=True)
    assert tuple(sh.params.layers.w_down.perm.spec) == tuple(sh.params.layers.w_down.values.spec)[:-1]
    sharded = load_hf_params(path, cfg, jnp.float32, sh.params, quantization="int4")
    assert sharded.layers.w_down.perm.addressable_shards[0].data.shape == (cfg.num_layers, cfg.intermediate_size // 2)
    ids = jnp.asarray([np.random.RandomState(5).randint(0, cfg.vocab_size, 12).tolist()])
    forward = jax.jit(forward_dense, static_argnames="cfg")
    want = np.asarray(forward(load_hf_params(ref_path, cfg, jnp.float32), ids, cfg=cfg))
    np.testing.assert_allclose(np.asarray(forward(sharded, ids, cfg=cfg)), want, atol=1e-4, rtol=0)

    whole, _, _ = checkpoints(Variant("gptq", -1))
    with pytest.raises(ConfigError, match="cannot be split over the mesh"):
        load_hf_params(
            whole, cfg, jnp.float32, make_shardings(cfg, mesh, quantization="int4").params, quantization="int4"
        )


def _with_quantization_config(tmp_path, float_model, qc: dict) -> str:
    with open(os.path.join(float_model, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    path = tmp_path / qc.get("quant_method", "none")
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return str(path)


@pytest.mark.parametrize(
    "qc,message",
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8 bits"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3 bits"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": False}, "zero_point"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, "lm_head"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 33}, "group_size 33"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "'fp8'"),
    ],
)
def test_unsupported_quantization_configs_are_clear_errors(tmp_path, float_model, qc, message):
    path = _with_quantization_config(tmp_path, float_model, qc)
    with pytest.raises(ConfigError, match=message):
        read_int4_format(path)
    with pytest.raises(ConfigError, match=message):
        LLM(path, dtype="float32", warm_up=False)  # before anything is loaded or compiled


def test_the_checkpoint_decides_the_quantization(tmp_path, float_model):
    path = _with_quantization_config(tmp_path, float_model, Variant("gptq", 64, act_order=True).config())
    fmt = read_int4_format(path)
    assert (fmt.method, fmt.group_size, fmt.act_order, fmt.zero_offset) == ("gptq", 64, True, 1)
    assert implied_quantization(EngineConfig(model=path)).quantization == "int4"
    assert implied_quantization(EngineConfig(model=path, quantization="int4")).quantization == "int4"
    with pytest.raises(ConfigError, match="quantization='int8' would requantize"):
        implied_quantization(EngineConfig(model=path, quantization="int8"))
    assert implied_quantization(EngineConfig(model=float_model)).quantization == "none"  # a float checkpoint
