"""Meshes and the one place where logical axis names become mesh axes.

The mesh has axes ("data", "model"): `model` splits heads, KV heads, the MLP hidden dimension and the
vocabulary (Megatron-style tensor parallelism: q/k/v/gate/up column-parallel, o/down row-parallel, so
XLA inserts two all-reduces per layer); `data` splits replicas, each with its own batch and page
pool. Model code names logical axes only; it never writes a PartitionSpec.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxserve.config import ModelConfig
from jaxserve.errors import ConfigError
from jaxserve.model.weights import Params, logical_axes

DATA, MODEL = "data", "model"


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


def logical_rules(cfg: ModelConfig, model_size: int) -> dict[str, str | None]:
    """Logical axis -> mesh axis. KV heads are replicated when the model axis does not divide them."""
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
        "heads": MODEL,
        "kv_heads": split(cfg.num_kv_heads),
        "mlp": split(cfg.intermediate_size),
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
    batch2: NamedSharding  # [R, B]
    batch3: NamedSharding  # [R, B, X]

    @property
    def num_replicas(self) -> int:
        return self.mesh.shape[DATA]


def make_shardings(cfg: ModelConfig, mesh: Mesh, stacked: bool = True) -> Shardings:
    """`stacked=False` gives the shardings of params whose layers are a tuple (weights.unstack_layers)."""
    rules = logical_rules(cfg, mesh.shape[MODEL])
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
    params = jax.tree.map(lambda axes: NamedSharding(mesh, spec_for(axes, rules)), logical_axes(cfg), is_leaf=is_axes)
    if not stacked:
        one_layer = jax.tree.map(lambda sh: NamedSharding(mesh, PartitionSpec(*sh.spec[1:])), params.layers)
        params = params.replace(layers=(one_layer,) * cfg.num_layers)
    cache_axes = ("replica", "layers", "kv_heads", None, None, None)
    return Shardings(
        mesh=mesh,
        params=params,
        cache=NamedSharding(mesh, spec_for(cache_axes, rules)),
        batch2=NamedSharding(mesh, spec_for(("replica", None), rules)),
        batch3=NamedSharding(mesh, spec_for(("replica", None, None), rules)),
    )
