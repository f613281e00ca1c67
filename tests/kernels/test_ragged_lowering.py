"""The ragged step lowered for TPU (Mosaic) and CUDA (Triton) on this CPU: the attention kernels take
the replica's whole stacked KV cache, never a layer sliced (copied) out of it.

For each attention custom call, every operand typed like the stacked cache (k, v f[L, K, NP, S, H],
int8 scales f32[L, K, NP, S], with the replica axis of the vmap when it stays) is followed back
through the StableHLO: across function calls and returns, the scan's `while` carry, reshapes (free),
the K/V write's scatter (in place on the donated buffer) and, on a mesh, the shard_map boundary
(each device's shard of the stack), to an argument of `main`. No
slice, dynamic_slice or gather lies on that path, and none anywhere in the module reads the stacked
cache.

The weights, for the record (the last test): in the scanned step each stacked weight [L, ...] does
reach its dot through a `stablehlo.dynamic_slice` per layer (the scan's per-iteration slice of its
xs, `dynamic_index_in_dim`); whether XLA then fuses that slice into the dot's operand or copies the
layer's weight out first is the TPU/GPU compiler's choice, which this CPU cannot show. The unrolled
step with per-layer (tuple) weights has no such slice: each dot reads its own parameter.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jaxserve.config import ModelConfig
from jaxserve.model.kv_cache import KVCache, RaggedBatch, cache_shape
from jaxserve.model.ragged_step import ragged_step
from jaxserve.model.step_options import StepOptions
from jaxserve.model.weights import init_dummy_params, unstack_layers
from jaxserve.model.sharding import make_mesh

# head_dim 64 and pages of 16 f32 rows (32 int8): both kernels' layout rules (TPU: 8-row tiles, head_dim % 64;
# GPU: powers of two)
CFG = ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64
)
NUM_PAGES = 9
page_size = lambda kv: 16 if kv == "auto" else 32  # noqa: E731  (TPU int8 / float8 pages: whole 32-row tiles)
N, S, P, L = 32, 4, 4, 4  # tokens, rows, pages per row, logits
KERNEL_CALLS = {"tpu": "@tpu_custom_call", "cuda": "@__gpu$xla.gpu.triton"}
SLICING_OPS = ("stablehlo.slice", "stablehlo.dynamic_slice", "stablehlo.gather", "stablehlo.real_dynamic_slice")


def lower(platform: str, scan: bool, kv: str, mesh_shape=None) -> str:
    """The step's StableHLO; with `mesh_shape` (data, model) one replica per `data` device, per device
    under shard_map. kv: the cache's storage, "auto" (f32), "int8" (with its scales) or "fp8" (float8
    pages; their per-head scales apply outside the kernels)."""
    sds = jax.ShapeDtypeStruct
    replicas = mesh_shape[0] if mesh_shape else 1
    shape = cache_shape(CFG, NUM_PAGES, page_size(kv), replicas)
    if kv == "int8":
        cache = KVCache(
            k=sds(shape, jnp.int8),
            v=sds(shape, jnp.int8),
            k_scale=sds(shape[:-1], jnp.float32),
            v_scale=sds(shape[:-1], jnp.float32),
        )
    elif kv == "fp8":
        scale = sds((*shape[:3], 1, 1), jnp.float32)
        cache = KVCache(k=sds(shape, jnp.float8_e4m3fn), v=sds(shape, jnp.float8_e4m3fn), k_scale=scale, v_scale=scale)
    else:
        cache = KVCache(k=sds(shape, jnp.float32), v=sds(shape, jnp.float32))
    i32 = lambda *s: sds((replicas, *s), jnp.int32)  # noqa: E731
    batch = RaggedBatch(
        tokens=i32(N),
        positions=i32(N),
        slots=i32(N),
        token_row=i32(N),
        query_start=i32(S + 1),
        context_lens=i32(S),
        page_table=i32(S, P),
        logit_index=i32(L),
    )
    params = jax.eval_shape(
        lambda: (lambda p: p if scan else unstack_layers(p))(init_dummy_params(CFG, seed=0, dtype=jnp.float32))
    )
    options = StepOptions(
        scan_layers=scan,
        attention_backend="pallas_tpu" if platform == "tpu" else "pallas_gpu",
        mesh=make_mesh(mesh_shape) if mesh_shape else None,
    )
    step = jax.jit(ragged_step, static_argnames=("cfg", "options"), donate_argnames=("cache",))
    return step.trace(params, cache, batch, cfg=CFG, options=options).lower(lowering_platforms=(platform,)).as_text()


class Module:
    """Just enough of StableHLO's text form to follow a value back to where it comes from."""

    def __init__(self, text: str):
        self.args: dict[str, list[str]] = {}  # function -> argument names
        self.defs: dict[str, dict[str, str]] = {}  # function -> SSA name -> its defining line
        self.returns: dict[str, list[str]] = {}  # function -> returned values
        self.calls: dict[str, list[tuple[str, list[str]]]] = {}  # callee -> [(caller, operands)]
        self.carry: dict[str, dict[str, str]] = {}  # function -> while iterArg -> its initial value
        self.manual: dict[str, dict[str, str]] = {}  # function -> shard_map region argument -> operand
        func = None
        for line in text.splitlines():
            head = re.match(r"\s*func\.func (?:public|private) @([\w$.]+)\((.*?)\) ->", line)
            if head:
                func = head.group(1)
                self.args[func] = re.findall(r"(%arg\d+):", head.group(2))
                self.defs[func], self.carry[func], self.manual[func] = {}, {}, {}
                continue
            if func is None:
                continue
            d = re.match(r"\s*(%[\w]+)(?::\d+)? = (.*)", line)
            if d:
                self.defs[func][d.group(1)] = d.group(2)
                for it, init in re.findall(r"(%iterArg[\w]*) = (%[\w#]+)", d.group(2)):
                    self.carry[func][it] = init
                shard_map = re.match(
                    r"sdy\.manual_computation\(([^)]*)\).*manual_axes=\{[^}]*\} \((.*)\) \{", d.group(2)
                )
                if shard_map:  # the body's block arguments are the operands, each device's shard
                    region = re.findall(r"(%arg\d+):", shard_map.group(2))
                    self.manual[func].update(zip(region, _operands(shard_map.group(1))))
            call = re.search(r"\bcall @([\w$.]+)\(([^)]*)\)", line)
            if call:
                self.calls.setdefault(call.group(1), []).append((func, _operands(call.group(2))))
            ret = re.match(r"\s*return (.*?) :", line)
            if ret:
                self.returns[func] = _operands(ret.group(1))

    def origins(self, func: str, value: str, path=(), stack=()) -> list[tuple[str, ...]]:
        """Every path (the ops passed, newest last) from `value` back to an argument of main.

        `stack` holds the call sites entered through their results: an argument of a function entered
        that way comes from that call's operand only, not from every caller (a layer function called once
        per unrolled layer takes the previous call's result, so fanning out there would loop)."""
        name, _, index = value.partition("#")
        if name in self.carry[func]:
            return self.origins(func, self.carry[func][name], path + ("while carry",), stack)
        if name in self.manual[func]:
            return self.origins(func, self.manual[func][name], path + ("shard_map",), stack)
        if name in self.args[func]:
            if func == "main":
                return [path + ("main argument",)]
            pos = self.args[func].index(name)
            if stack:
                caller, ops = stack[-1]
                return self.origins(caller, ops[pos], path + ("call",), stack[:-1])
            return [p for caller, ops in self.calls[func] for p in self.origins(caller, ops[pos], path + ("call",))]
        line = self.defs[func][name]
        call = re.match(r"(?:func\.)?call @([\w$.]+)\(([^)]*)\)", line)
        if call:
            callee, site = call.group(1), (func, _operands(call.group(2)))
            return self.origins(callee, self.returns[callee][int(index or 0)], path + ("return",), stack + (site,))
        op = re.match(r'"?([\w.]+)"?', line).group(1)
        # a view, the in-place K/V write, or float8 pages as bytes and back (kv_cache.as_bytes): follow the cache
        if op in ("stablehlo.reshape", "stablehlo.scatter", "stablehlo.bitcast_convert"):
            first = re.search(r"(%[\w#]+)", line[len(op) :]).group(1)
            return self.origins(func, first, path + (op,), stack)
        return [path + (op,)]  # anything else (a slice, a copy, ...) ends the path and fails the test


def _operands(text: str) -> list[str]:
    return re.findall(r"%[\w#]+", text)


def kernel_cache_operands(module_text: str, platform: str, stacked_types: set[str]):
    """[(function, operand)] of every kernel custom call's operands typed like the stacked cache."""
    found = []
    func = None
    for line in module_text.splitlines():
        head = re.match(r"\s*func\.func (?:public|private) @([\w$.]+)\(", line)
        if head:
            func = head.group(1)
        if f"stablehlo.custom_call {KERNEL_CALLS[platform]}(" not in line:
            continue
        ops = _operands(re.search(r"custom_call @[\w$.]+\(([^)]*)\)", line).group(1))
        types = re.findall(r"tensor<[^>]*>", line.rsplit("} : (", 1)[1].split(") ->")[0])
        assert len(types) == len(ops)
        found += [(func, op) for op, t in zip(ops, types) if t in stacked_types]
    return found


def stacked_types(kv: str, mesh_shape=None) -> dict[str, set[str]]:
    """The stacked cache's tensor types, with and without the replica axis, whole and (on a mesh)
    one device's shard of it (one replica, K / model KV heads)."""
    data, model = mesh_shape or (1, 1)
    whole = cache_shape(CFG, NUM_PAGES, page_size(kv), data)
    shard = (1, whole[1], whole[2] // model, *whole[3:])
    element = {"int8": "i8", "fp8": "f8E4M3FN"}.get(kv, "f32")

    def types(shapes, dt):
        return {"tensor<" + "x".join(map(str, d)) + f"x{dt}>" for shape in shapes for d in (shape, shape[1:])}

    scales = types((whole[:-1], shard[:-1]), "f32") if kv == "int8" else set()
    return dict(kv=types((whole, shard), element), scale=scales)


CASES = [
    ("tpu", True, "auto", None),
    ("tpu", False, "auto", None),
    ("cuda", True, "auto", None),
    ("cuda", False, "auto", None),
    ("tpu", True, "int8", None),
    ("cuda", False, "int8", None),
    ("tpu", True, "auto", (2, 2)),
    ("cuda", True, "int8", (2, 2)),  # per device: one replica, one KV head
    ("tpu", True, "fp8", None),
    ("cuda", False, "fp8", (2, 2)),
]  # float8 pages reach the kernels as stored


@pytest.mark.parametrize("platform,scan,kv,mesh_shape", CASES)
def test_kernels_take_the_whole_stacked_cache(platform, scan, kv, mesh_shape):
    text = lower(platform, scan, kv, mesh_shape)
    types = stacked_types(kv, mesh_shape)
    module = Module(text)
    calls = kernel_cache_operands(text, platform, types["kv"])
    assert len(calls) == 2, "one custom call taking the whole k and v stacks (called once per layer)"
    if kv == "int8":
        assert len(kernel_cache_operands(text, platform, types["scale"])) == 2, "the whole stacked scales too"
    for func, operand in calls + kernel_cache_operands(text, platform, types["scale"]):
        paths = module.origins(func, operand)
        assert len(paths) == (1 if scan else CFG.num_layers), paths  # one call site per layer when unrolled
        for path in paths:
            assert path[-1] == "main argument", path
            # bitcast_convert: float8 pages move as bytes (kv_cache.as_bytes), the same buffer reinterpreted
            assert set(path) <= {
                "call",
                "return",
                "while carry",
                "stablehlo.reshape",
                "stablehlo.scatter",
                "stablehlo.bitcast_convert",
                "shard_map",
                "main argument",
            }, path
            assert ("while carry" in path) == scan, path
            assert ("shard_map" in path) == (mesh_shape is not None), path
    # Nothing anywhere slices the stacked cache (a per-layer copy would need one of these ops).
    every = set().union(*types.values())
    for line in text.splitlines():
        if any(op in line for op in SLICING_OPS):
            operand_types = re.findall(r"tensor<[^>]*>", line.split(" : (", 1)[-1].split(") ->")[0])
            assert not every & set(operand_types[:1]), line.strip()[:200]


def test_scanned_weights_reach_their_dots_through_a_dynamic_slice():
    """Recorded, not a goal: see the module docstring."""
    scanned, unrolled = lower("tpu", True, False), lower("tpu", False, False)
    wq = f"tensor<{CFG.num_layers}x{CFG.hidden_size}x{CFG.num_heads * CFG.head_dim}xf32>"
    sliced = [line for line in scanned.splitlines() if "stablehlo.dynamic_slice" in line and f"({wq}" in line]
    assert sliced, "the scan slices each stacked weight per layer"
    assert not any("dynamic_slice" in line for line in unrolled.splitlines() if f"({wq}" in line)
    assert wq not in unrolled  # the tuple form has no stacked weights at all
