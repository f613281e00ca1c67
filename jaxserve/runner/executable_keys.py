"""The key of a stored step executable: everything that changes the compiled program, computed from
the engine's static description and its arguments' shapes, dtypes and shardings, without tracing.

A loaded executable skips tracing and lowering, so the key must hold whatever tracing would have
seen: jaxserve's own source (a hash of every module of `jaxserve` and `pallas_kernels`), the jax and
jaxlib versions, XLA_FLAGS and the jax options that change lowering, the backend and its version, the
device kind, the device ids and count and the process, the host CPU's features (XLA:CPU's loader
rejects code built for another CPU, jax-ml/jax#38445), the compiler options, the model config,
step options (mesh, kernels, scan), the bucket table and page size, the variant with its settings,
and every argument's abstract value (which carries the dtype and quantization of the weights and
cache). What it cannot see is code changed at run time (a monkeypatched model function): such a
process should run with the store off (`--no-executable-store`; the test suite does).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import re
from typing import Any

import jax
import numpy as np

from jaxserve.model.transfer import Layout
from jaxserve.runner.step_io import split_sparse

# jax options that only say where caches live, what is logged, or how errors are reported.
_CONFIG_IGNORED = re.compile(
    r"compilation_cache|persistent_cache|log|transfer_guard|traceback|pprint|explain_cache|dump|source_url"
    r"|timeout|check_proxy|debug_leaked|cuda_visible|rocm_visible|oneapi_visible"
)
# Environment variables that change how XLA builds a program.
_ENV_VARS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "TPU_TOPOLOGY", "CUDA_VISIBLE_DEVICES", "TF_CPP_MIN_LOG_LEVEL")


@dataclasses.dataclass
class StepSignature:
    """What the table needs to load key's executable: the store key and its hash, the packed inputs'
    layout (as `runner._lower` computes it) and the devices the executable runs on, in order."""

    key: dict
    key_hash: str
    layout: Layout
    devices: list


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """SHA-256 over the relative path and bytes of every .py file of jaxserve and pallas_kernels."""
    digest = hashlib.sha256()
    for package in ("jaxserve", "pallas_kernels"):
        try:
            root = os.path.dirname(__import__(package).__file__)
        except ImportError:
            continue
        files = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
        for path in sorted(files):
            digest.update(f"{package}/{os.path.relpath(path, root)}\0".encode())
            with open(path, "rb") as f:
                digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def host_cpu() -> str:
    """The host CPU's architecture and feature flags (/proc/cpuinfo), hashed."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.split(":")[0].strip() in ("flags", "Features"):
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
                    break
    except OSError:
        flags = platform.processor()
    return platform.machine() + ":" + hashlib.sha256(flags.encode()).hexdigest()[:32]


def environment_key() -> dict:
    """The process-wide part of the key (the same for every executable of a process)."""
    config = {k: describe(v) for k, v in sorted(jax.config.values.items()) if not _CONFIG_IGNORED.search(k)}
    backend = jax.devices()[0].client
    return dict(
        jaxserve_source=source_hash(),
        jax=jax.__version__,
        jaxlib=importlib.metadata.version("jaxlib"),  # jax's own dependency: read, not imported
        environment={k: os.environ[k] for k in _ENV_VARS if k in os.environ},
        jax_config=digest(config),
        backend=backend.platform,
        platform_version=str(backend.platform_version),
        device_kind=jax.devices()[0].device_kind,
        device_count=jax.device_count(),
        process=[jax.process_index(), jax.process_count()],
        host_cpu=host_cpu(),
    )


# Engine settings that change no program: a start differing only in them preloads the same entries.
_START_IGNORED = ("compile_in_background",)


def start_key(settings: Any) -> str:
    """A digest of what a start knows before its weights load: the process-wide key and the engine's
    settings. Entries are written with the start key of the engine that compiled them, and the next
    start with the same one loads them while its weights load (`executables.Preload`); each is only
    used once its whole key (`step_signature`) matches, so a changed checkpoint behind the same
    settings costs the wasted loads, never a wrong program."""
    fields = {k: v for k, v in describe(settings).items() if k not in _START_IGNORED}
    return digest(dict(environment_key(), settings=fields))


def step_signature(runner: Any, key: tuple) -> StepSignature:
    """Executable `key`'s store key, from the runner's static description and its state's abstract
    values (no tracing, no lowering)."""
    ctx = runner.ctx
    variant = runner._variant_of(key)
    packed, fields = split_sparse(runner.step_inputs(key))
    layout = Layout.of(packed)
    sparse = [((f.shape[0], math.prod(f.shape[1:])), str(np.dtype(f.dtype))) for f in fields]
    state = runner.state
    arguments = dict(
        params=abstract(state.params),
        cache=abstract(state.cache),
        carried=abstract(state.carried),
        draft_params=abstract(state.draft_params),
        draft_cache=abstract(state.draft_cache),
        sparse=sparse,
        layout=[str(layout.treedef), describe(layout.fields), layout.replicas],
        buffer_sharding=describe(ctx.buffer_sharding),
    )
    settings = {
        k: describe(v)
        for k, v in sorted(vars(variant).items())
        if not k.startswith("_") and k not in ("ctx", "state") and _plain(v)
    }
    full = dict(
        environment_key(),
        compiler_options=runner.table.compiler_options,
        model=describe(ctx.cfg),
        step_options=describe(ctx.options),
        engine=describe(
            dict(
                buckets=ctx.buckets,
                num_replicas=ctx.num_replicas,
                page_size=ctx.page_size,
                cache_quantized=ctx.cache_quantized,
                num_scheduler_steps=ctx.num_scheduler_steps,
                lora=ctx.lora,
                history_len=ctx.history_len,
                shardings=_shardings(ctx),
            )
        ),
        variant=f"{type(variant).__module__}.{type(variant).__qualname__}",
        variant_static=digest(describe(variant.static(key))),
        variant_settings=settings,
        bucket=describe(key),
        arguments=digest(arguments),
    )
    devices = execution_devices(runner)
    full["devices"] = [d.id for d in devices]
    return StepSignature(full, hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest(), layout, devices)


def execution_devices(runner: Any) -> list:
    """The devices the runner's steps run on, in the mesh's order (one device without a mesh)."""
    shardings = runner.ctx.shardings
    if shardings is not None:
        return list(shardings.mesh.devices.flat)
    leaves = [x for x in jax.tree.leaves(runner.state.params) if isinstance(x, jax.Array)]
    return sorted(leaves[0].sharding.device_set, key=lambda d: d.id) if leaves else [jax.devices()[0]]


def _shardings(ctx: Any) -> Any:
    s = ctx.shardings
    return None if s is None else describe(s.mesh)


def abstract(tree: Any) -> Any:
    """A digest of a pytree's structure and each leaf's shape, dtype and sharding."""
    if tree is None:
        return None
    leaves, treedef = jax.tree.flatten(tree)
    return digest([str(treedef)] + [_leaf(x) for x in leaves])


def _effective_spec(sharding: jax.sharding.NamedSharding) -> str:
    """The spec with mesh axes of size 1 left out (they split nothing): a step's outputs come back
    with XLA's spelling of the same layout (P() for P('data', None, 'model') on a 1 x 1 mesh), so the
    live state's spelling after a step differs from the one the executables were stored under."""
    sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.devices.shape))

    def kept(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        names = tuple(n for n in names if n is not None and sizes.get(n, 1) > 1)
        return None if not names else names[0] if len(names) == 1 else names

    spec = [kept(e) for e in sharding.spec]
    while spec and spec[-1] is None:
        spec.pop()
    return str(jax.sharding.PartitionSpec(*spec))


def _leaf(x: Any) -> Any:
    shape = getattr(x, "shape", None)
    if shape is None:
        return describe(x)
    weak = bool(getattr(x, "weak_type", False) or getattr(getattr(x, "aval", None), "weak_type", False))
    return [list(shape), str(np.dtype(x.dtype)), weak, describe(getattr(x, "sharding", None))]


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")


def _plain(value: Any) -> bool:
    """Whether a variant attribute is a static setting (not a buffer, an executable or a helper)."""
    if value is None or isinstance(value, (bool, int, float, str, enum.Enum)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return dataclasses.is_dataclass(value) and not isinstance(value, type) or isinstance(value, jax.sharding.Sharding)


def describe(value: Any) -> Any:
    """A JSON-able description of a static value that is the same in every process (no addresses)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, (tuple, list)):
        return [describe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (np.dtype, type)) and not dataclasses.is_dataclass(value):
        return str(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return [list(value.shape), str(value.dtype), hashlib.sha256(value.tobytes()).hexdigest()]
    if isinstance(value, jax.sharding.Mesh):
        return dict(
            axes=list(value.axis_names),
            shape=list(value.devices.shape),
            devices=[d.id for d in value.devices.flat],
            types=[str(t) for t in getattr(value, "axis_types", ())],
        )
    if isinstance(value, jax.sharding.NamedSharding):
        return dict(mesh=describe(value.mesh), spec=_effective_spec(value), memory_kind=value.memory_kind)
    if isinstance(value, jax.sharding.SingleDeviceSharding):
        return dict(device=next(iter(value.device_set)).id, memory_kind=value.memory_kind)
    if isinstance(value, jax.sharding.Sharding):
        return _ADDRESS.sub("", repr(value))
    if isinstance(value, jax.ShapeDtypeStruct):
        return _leaf(value)
    if dataclasses.is_dataclass(value):
        fields = {f.name: describe(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"type": f"{type(value).__module__}.{type(value).__qualname__}", **fields}
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return f"{type(value).__qualname__}:{_ADDRESS.sub('', repr(value))}"
