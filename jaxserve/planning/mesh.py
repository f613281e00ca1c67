"""An EngineConfig's plan, and the mesh to serve it on: `plan_from_settings` runs the roofline model
(`jaxserve.planning.roofline.make_plan`) on the settings' model, dtype, quantization and KV sizing;
`suggest_mesh` picks the (data, model) mesh for N devices, and for a mixture of experts whether whole
experts or slices of each are split (`choose_expert_parallel`). `python -m jaxserve.plan` prints them.
"""

from __future__ import annotations

import dataclasses

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.loading.model_source import planned_model_dir
from jaxserve.planning.devices import DeviceSpec
from jaxserve.planning.memory import plan_memory
from jaxserve.planning.roofline import Plan, Target, make_plan
from jaxserve.planning.weight_bytes import experts_on_busiest_device


def resolve_dtype(settings: EngineConfig, model_dir: str, spec: DeviceSpec) -> str:
    """The engine's rule (model_loader.resolve_dtype) applied to the *target* device, not the local one:
    auto = float32 on CPU, else the checkpoint's dtype, else bfloat16."""
    if settings.dtype != "auto":
        return settings.dtype
    if spec.name == "cpu":
        return "float32"
    from jaxserve.loading.checkpoint import checkpoint_dtype

    return checkpoint_dtype(model_dir) or "bfloat16"


def configured_pages(cfg: ModelConfig, settings: EngineConfig, dtype: str, param_bytes: int) -> int:
    """Pages per replica the engine allocates for these settings (`plan_memory`)."""
    return plan_memory(cfg, settings, dtype, param_bytes).num_pages


def plan_from_settings(
    settings: EngineConfig,
    target: Target,
    *,
    context: int | None = None,
    batch: int | None = None,
    memory_fraction: float = 0.9,
    prompt_len: int | None = None,
    expert_parallel: bool = False,
) -> Plan:
    """The plan for an EngineConfig: its model, dtype, quantization, page size and KV sizing.

    context defaults to max_model_len (else the model's limit); batch to max_num_seqs, which only
    notes (not refuses) when it does not fit, since the engine then preempts. Architectures jaxserve
    plans but cannot serve yet (config.PLAN_ONLY_ARCHITECTURES) are planned, with a note."""
    model_dir = planned_model_dir(settings)
    cfg = ModelConfig.from_dir(model_dir, plan_only=True)
    dtype = resolve_dtype(settings, model_dir, target.spec)
    context = context or settings.max_model_len or cfg.max_position_embeddings
    engine_pages = None
    if settings.num_pages is not None or settings.kv_cache_memory is not None:
        engine_pages = configured_pages(cfg, settings, dtype, 0)
    return make_plan(
        cfg,
        target,
        dtype=dtype,
        quantization=settings.quantization,
        quantize_lm_head=settings.quantize_lm_head,
        kv_cache_dtype=settings.kv_cache_dtype,
        page_size=settings.page_size,
        context=context,
        batch=batch or settings.max_num_seqs,
        batch_is_required=batch is not None,
        memory_fraction=memory_fraction,
        prompt_len=prompt_len,
        engine_pages=engine_pages,
        model=model_dir,
        expert_parallel=expert_parallel,
        group_size=settings.quantization_group_size,
    )


def suggest_mesh(
    settings: EngineConfig,
    spec: DeviceSpec,
    num_devices: int,
    *,
    context: int | None = None,
    memory_fraction: float = 0.9,
    device_memory: int | None = None,
    bandwidth: float | None = None,
    peak_flops: float | None = None,
) -> tuple[tuple[int, int], Plan] | None:
    """The mesh for `num_devices` devices: the smallest model axis (fewest all-reduces) on which
    max_num_seqs sequences of `context` tokens fit per replica, else the smallest on which the plan
    fits at all; the remaining devices are data-parallel replicas. Model axes that split the KV heads
    are preferred over ones that replicate them. None when no mesh fits.

    For a mixture of experts on a model axis of more than one device it also chooses how the experts
    split (`choose_expert_parallel`); the returned plan's `expert_parallel` and `mesh_reason` say which
    and why."""
    model_dir = planned_model_dir(settings)
    cfg = ModelConfig.from_dir(model_dir, plan_only=True)
    sizes = [m for m in range(1, num_devices + 1) if num_devices % m == 0 and cfg.num_heads % m == 0]
    sizes.sort(key=lambda m: (cfg.num_kv_heads % m != 0, m))
    fitting = []
    for m in sizes:
        mesh = (num_devices // m, m)
        target = Target.build(spec, mesh, device_memory, bandwidth, peak_flops)
        plan = plan_from_settings(
            settings.replace(mesh_shape=mesh), target, context=context, memory_fraction=memory_fraction
        )
        if plan.fits and cfg.is_moe:
            ep = None
            if m > 1 and cfg.num_experts % m == 0:
                ep = plan_from_settings(
                    settings.replace(mesh_shape=mesh),
                    target,
                    context=context,
                    memory_fraction=memory_fraction,
                    expert_parallel=True,
                )
            plan = choose_expert_parallel(plan, ep if ep is not None and ep.fits else None)
        if plan.fits:
            if plan.max_batch >= settings.max_num_seqs:
                return mesh, plan
            fitting.append((mesh, plan))
    return fitting[0] if fitting else None


def choose_expert_parallel(tp: Plan, ep: Plan | None) -> Plan:
    """Of a mixture of experts' two plans on one mesh (each expert split over the model axis, `tp`, or
    whole experts split, `ep`), the one to use, its `mesh_reason` one sentence of why.

    Both hold the same bytes per device and end each layer in one all-reduce, so the decode bound at
    the planned batch decides: whole experts make the busiest device read more when a step touches
    few experts or routes them unevenly (small batches: `experts_on_busiest_device`), and cost
    nothing once every device's experts are nearly all read; within 2% expert parallelism wins, for
    wider matmuls (moe_intermediate_size columns per expert rather than that / model axis)."""
    cfg, model = tp.cfg, tp.target.mesh_shape[1]
    if ep is None:
        why = (
            "experts: not split, since one device per replica holds all of them whole (the cheapest layout: "
            "no expert collective, full-width matmuls)"
            if model == 1
            else f"experts: tensor-parallel, since the model axis of {model} does not divide the {cfg.num_experts} "
            "experts"
        )
        return dataclasses.replace(tp, mesh_reason=why)
    at = lambda plan: next((d for d in plan.decode if d.batch == plan.batch), plan.decode[-1])  # noqa: E731
    t, e = at(tp), at(ep)
    read = f"at batch {tp.batch} a step reads ~{t.experts_read:.3g} of the {cfg.num_experts} experts per layer"
    fe = cfg.moe_intermediate_size
    if e.seconds <= 1.02 * t.seconds:
        return dataclasses.replace(
            ep,
            mesh_reason=(
                f"experts: expert-parallel ({cfg.num_experts // model} whole expert(s) per device), since {read}, so "
                f"whole experts cost the busiest device no more than slicing each one (decode bound "
                f"{e.seconds * 1e3:.3f} ms against {t.seconds * 1e3:.3f} ms) and keep each expert's matmul {fe} "
                f"columns wide instead of {fe // model}"
            ),
        )
    busiest = experts_on_busiest_device(cfg, tp.batch, model, True)
    return dataclasses.replace(
        tp,
        mesh_reason=(
            f"experts: tensor-parallel (each expert split over the {model} devices), since {read}, and with whole "
            f"experts the busiest device would read ~{busiest:.3g} of its {cfg.num_experts // model} against the "
            f"{t.experts_read / model:.3g} experts' worth of slices each device reads (decode bound "
            f"{e.seconds * 1e3:.3f} ms against {t.seconds * 1e3:.3f} ms)"
        ),
    )
