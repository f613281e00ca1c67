"""Meshes and the one place where logical axis names become mesh axes.

The mesh has axes ("data", "model"): `model` splits heads, KV heads, the MLP hidden dimension and the
vocabulary (Megatron-style tensor parallelism: q/k/v/gate/up column-parallel, o/down row-parallel, so
XLA inserts two all-reduces per layer); `data` splits replicas, each with its own batch and page
pool. Model code names logical axes only; it never writes a PartitionSpec.

A mixture of experts is tensor-parallel like a dense MLP (`moe_parallelism="tensor"`: each expert
split on its hidden dimension over `model`) or expert-parallel (`"expert"`: whole experts split over
`model`, each device computing only its experts' tokens under `ExpertParallel`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxserve.model import quant
from jaxserve.config import ModelConfig
from jaxserve.config.model_config import resolved_group_size
from jaxserve.errors import ConfigError
from jaxserve.model.weights import Params, logical_axes

DATA, MODEL = "data", "model"
MOE_PARALLELISMS = ("tensor", "expert")


def make_mesh(mesh_shape: tuple[int, int], devices: list[Any] | None = None) -> Mesh:
    """A (data, model) mesh over the first data*model devices, with Auto axes.

    jax 0.10's `jax.make_mesh` defaults to Explicit axes, under which a row-parallel matmul raises
    ShardingTypeError; serving wants the compiler to place collectives, so axes are Auto.
    """
    data, model = mesh_shape
    devices = list(devices if devices is not None else jax.devices())
    if data * model > len(devices):
        raise ConfigError(
            f"mesh_shape {mesh_shape} needs {data * model} devices; {len(devices)} available "
            f"({devices[0].platform if devices else 'none'})"
        )
    grid = np.asarray(devices[: data * model], dtype=object).reshape(data, model)
    return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


def logical_rules(cfg: ModelConfig, model_size: int, moe_parallelism: str = "tensor") -> dict[str, str | None]:
    """Logical axis -> mesh axis. KV heads are replicated when the model axis does not divide them.
    `moe_parallelism` (MOE_PARALLELISMS) says how a mixture of experts uses the model axis."""
    if moe_parallelism not in MOE_PARALLELISMS:
        raise ConfigError(f"moe_parallelism must be one of {MOE_PARALLELISMS}, got {moe_parallelism!r}")
    expert_parallel = moe_parallelism == "expert" and cfg.is_moe
    if expert_parallel and cfg.num_experts % model_size:
        raise ConfigError(
            f"expert parallelism: the model axis ({model_size} devices) must divide the {cfg.num_experts} "
            f"experts; choose mesh_shape[1] among "
            f"{[d for d in range(1, cfg.num_experts + 1) if cfg.num_experts % d == 0]}, or moe_parallelism='tensor'"
        )
    if cfg.num_heads % model_size:
        raise ConfigError(
            f"the model axis ({model_size} devices) must divide the {cfg.num_heads} query heads; "
            f"choose mesh_shape[1] among {[d for d in range(1, cfg.num_heads + 1) if cfg.num_heads % d == 0]}"
        )
    split = lambda n: MODEL if n % model_size == 0 else None  # noqa: E731
    return {
        "layers": None,
        "embed": None,
        "embed_replicated": None,
        "head_dim": None,  # per-head weights (Qwen3's q/k norms): every device's heads need all of them
        "heads": MODEL,
        "kv_heads": split(cfg.num_kv_heads),
        "mlp": split(cfg.intermediate_size),
        # Experts tensor-parallel: every device holds all E experts, each split on its hidden dimension like
        # a dense MLP's (gate/up column-, down row-parallel), so GSPMD ends the layer in one all-reduce of the
        # assignment rows, never a gather of expert weights (tests/model/test_moe_models.py).
        # Expert-parallel: E / model whole experts per device, computed per device by `ExpertParallel`
        # (left to GSPMD, sharded experts make it all-reduce the gathered experts' weights in a decode step).
        "experts": MODEL if expert_parallel else None,
        "expert_mlp": split(cfg.moe_intermediate_size) if cfg.is_moe and not expert_parallel else None,
        "vocab": split(cfg.vocab_size),
        "replica": DATA,
    }


def spec_for(axes: tuple[str | None, ...], rules: dict[str, str | None]) -> PartitionSpec:
    return PartitionSpec(*(rules[a] if a is not None else None for a in axes))


@dataclasses.dataclass(frozen=True)
class Shardings:
    """Every sharding the engine needs, derived from the mesh and the model config."""

    mesh: Mesh
    params: Params  # a Params pytree of NamedShardings
    cache: NamedSharding  # f[R, L, K, NP, S, H]
    cache_scale: NamedSharding  # f32[R, L, K, NP, S]  (the int8 cache's scales)
    batch2: NamedSharding  # [R, B]
    batch3: NamedSharding  # [R, B, X]

    @property
    def num_replicas(self) -> int:
        return self.mesh.shape[DATA]


def make_shardings(
    cfg: ModelConfig,
    mesh: Mesh,
    stacked: bool = True,
    quantization: str = "none",
    quantize_lm_head: bool = False,
    moe_parallelism: str = "tensor",
    act_order: bool = False,
    group_size: int | None = None,
) -> Shardings:
    """`stacked=False` gives the shardings of params whose layers are a tuple (weights.unstack_layers);
    quantization="int8" / "int4" those of the quantized layout (a QuantArray / Int4Array of shardings per
    quantized weight, its scales in groups of `group_size` inputs: quant.quantized_layout); `act_order` (an
    act-order GPTQ checkpoint) gives every int4 dense weight a `perm`."""
    rules = logical_rules(cfg, mesh.shape[MODEL], moe_parallelism)
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
    axes = logical_axes(cfg)
    if quantization in ("int8", "int4"):
        group_size = resolved_group_size(cfg, quantization, group_size, mesh.shape[MODEL])
    axes = quant.quantized_layout(axes, quantization, quantize_lm_head, group_size)
    if act_order and quantization == "int4":
        axes = quant.map_linear(
            axes, lambda a: quant.int4_axes(a.values, True, a.group_size), fields=quant.DENSE_FIELDS
        )
    params = jax.tree.map(lambda axes: NamedSharding(mesh, spec_for(axes, rules)), axes, is_leaf=is_axes)
    if not stacked:
        one_layer = jax.tree.map(lambda sh: NamedSharding(mesh, PartitionSpec(*sh.spec[1:])), params.layers)
        params = params.replace(layers=(one_layer,) * cfg.num_layers)
    cache_axes = ("replica", "layers", "kv_heads", None, None, None)
    return Shardings(
        mesh=mesh,
        params=params,
        cache=NamedSharding(mesh, spec_for(cache_axes, rules)),
        cache_scale=NamedSharding(mesh, spec_for(cache_axes[:-1], rules)),
        batch2=NamedSharding(mesh, spec_for(("replica", None), rules)),
        batch3=NamedSharding(mesh, spec_for(("replica", None, None), rules)),
    )


# Each LoRA module's base weight's logical axes (in, out): its `a` [in, M * R] takes the input's, its
# `b` [M * R, out] the output's. So column-parallel modules (q, k, v, gate, up: output split) keep `a`
# whole and split `b` like the weight's columns, and the update lands split as the base output does;
# row-parallel ones (o, down: input split) split `a` like the weight's rows and keep `b` whole, so x a
# is one small all-reduce of [N, M * R] partial sums, and the update is whole like the base output.
LORA_BASE_AXES = {
    "q": ("embed", "heads"),
    "k": ("embed", "kv_heads"),
    "v": ("embed", "kv_heads"),
    "o": ("heads", "embed"),
    "gate": ("embed", "mlp"),
    "up": ("embed", "mlp"),
    "down": ("mlp", "embed"),
}


def lora_shardings(cfg: ModelConfig, mesh: Mesh, lora: Any, stacked: bool) -> Any:
    """The NamedShardings of one layer's `LayerLoRA` (`lora`, any leaves), with a leading layer axis
    when `stacked`."""
    rules = logical_rules(cfg, mesh.shape[MODEL])
    lead = ("layers",) if stacked else ()

    def module(name: str, m: Any) -> Any:
        if m is None:
            return None
        in_axis, out_axis = LORA_BASE_AXES[name]
        return m.replace(
            a=NamedSharding(mesh, spec_for(lead + (in_axis, None), rules)),
            b=NamedSharding(mesh, spec_for(lead + (None, out_axis), rules)),
        )

    return lora.replace(**{name: module(name, getattr(lora, name)) for name in LORA_BASE_AXES})


def per_replica(fn: Callable[..., Any], mesh: Mesh | None) -> Callable[..., Any]:
    """`fn` over arrays whose leading axis is the replica axis, run once per `data` shard under
    `jax.shard_map` (each device on its own replicas' rows) when the mesh has several replicas; `fn`
    itself otherwise.

    For the samplers and the verifier: their `lax.cond`s (penalties, sampled rows, top logprobs)
    made GSPMD replicate their operands, so every device all-gathered every replica's logits
    ([R * L, V] f32) and sampled all of them; per shard each samples its own, and a cond's predicate
    is its own rows'. The vocabulary axis is whole inside (the samplers reduce over it).
    """
    if mesh is None or mesh.shape[DATA] == 1:
        return fn
    spec = PartitionSpec(DATA)
    # check_vma=False: the random draws' keys are built inside from the rows' own seeds.
    return jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)


def local_kv_heads(arrays: tuple[jax.Array, ...], heads_here: int, group: int) -> tuple[jax.Array, ...]:
    """The KV heads (leading axis) that this device's `heads_here` query heads read, from replicated arrays.

    Query head h reads KV head h // group. When the device's query heads all fall in one group (the
    usual case: power-of-two counts, model axis > K) that one head is kept and the group stays; else
    each query head gets its own copy of its KV head (group 1)."""
    first = jax.lax.axis_index(MODEL) * heads_here  # first query head on this device
    if group % heads_here == 0:
        return tuple(jax.lax.dynamic_slice_in_dim(a, first // group, 1, axis=0) for a in arrays)
    ids = (first + jnp.arange(heads_here)) // group
    return tuple(a[ids] for a in arrays)


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Expert parallelism for `moe.moe_mlp(..., expert_parallel=ExpertParallel(cfg, mesh))` (hashable:
    the MoE function is cached on it).

    Called with `local(x f[T, D], p_here, first_expert i32[]) -> f32[T, D]` (moe.moe_local), it gives
    fn(x, p) -> f[T, D] running `local` once per device under `jax.shard_map`: the experts' weights
    (and int8 scales) split on their expert axis as `logical_rules` lays them out, so each device
    holds E / model whole experts and never sees another's; the router replicated; the tokens split
    over the replicas (`data`) and whole on `model`. One psum over `model` adds each device's
    partial output: the only collective (the same bytes as tensor parallelism's all-reduce)."""

    cfg: ModelConfig
    mesh: Mesh

    def __call__(self, local: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
        rules = logical_rules(self.cfg, self.mesh.shape[MODEL], "expert")
        experts_axis, tokens_axis = rules["experts"], rules["replica"]
        experts_spec = spec_for(("experts",), rules)  # the leading axis of every expert array
        mesh = self.mesh

        def per_device(x, p):
            here = p.w_gate.shape[0]
            first = jax.lax.axis_index(experts_axis) * here if experts_axis else jnp.int32(0)
            out = local(x, p, first)
            return (jax.lax.psum(out, experts_axis) if experts_axis else out).astype(x.dtype)

        def wrapped(x, p):
            # x f[T, D]: the replicas' tokens, split over `data` when it divides them (the engine's step
            # flattens R replicas' tokens, R a multiple of the data axis)
            split_tokens = tokens_axis is not None and x.shape[0] % mesh.shape[tokens_axis] == 0
            x_spec = PartitionSpec(tokens_axis if split_tokens else None, None)
            p_specs = jax.tree.map(lambda _: experts_spec, p)
            p_specs = p_specs.replace(router=PartitionSpec())
            return jax.shard_map(per_device, mesh=mesh, in_specs=(x_spec, p_specs), out_specs=x_spec)(x, p)

        return wrapped
