"""How a step is computed: the static choices every compiled step (engine bucket or research call) is
keyed on. Host-free of any device work: a frozen dataclass the engine builds once from its settings."""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Static choices of how a step is computed (hashable: part of the compilation key).

    Which logits a step returns is not an option: the ragged step returns them at its batch's
    `logit_index` (list every token there for all of them); the rectangle research steps take
    `all_logits` as an argument of their own (`jaxserve.steps`)."""

    scan_layers: bool = False
    # One of attention_dispatch.ATTENTION_IMPLS (the engine resolves the user's "auto" | "reference" | "pallas").
    attention_backend: str = "reference"
    # The (data, model) mesh the step runs on. Needed only by the Pallas backends on more than one
    # device: GSPMD cannot split a kernel, so attention then runs per device under jax.shard_map.
    mesh: Mesh | None = None
    # How int8 (QuantArray) weights are multiplied: one of quant.MATMUL_IMPLS (the engine resolves
    # the user's quantized_matmul_backend); float weights ignore it.
    matmul_backend: str = "reference"
    # How a mixture of experts uses the mesh's model axis (sharding.MOE_PARALLELISMS): "expert" runs
    # each device's own experts under shard_map (the params laid out by make_shardings(...,
    # moe_parallelism="expert")); "tensor" leaves the experts, split on their hidden dimension, to GSPMD.
    moe_parallelism: str = "tensor"
    # What a sample's logprobs are of (vLLM's logprobs_mode): "raw_logprobs", the model's distribution, or
    # "processed_logprobs", the one the row draws from (model/sampler.sample).
    logprobs_mode: str = "raw_logprobs"
