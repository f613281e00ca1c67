"""EngineConfig: every engine setting, frozen and hashable (a static argument of `jax.jit`); one field is
a Python keyword, a YAML key and a `--kebab-case` flag."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxserve.errors import ConfigError
from jaxserve.config.generation_config import parse_override
from jaxserve.config.settings import (
    Settings,
    choice,
    optional,
    parse_bool,
    parse_float,
    parse_int,
    parse_int_tuple,
    parse_positive_int,
    parse_size,
    parse_str,
    parse_token_count,
    setting,
)
from jaxserve.lora.request import parse_lora_modules, parse_lora_target_modules
from jaxserve.sampling.fields import MAX_LOGPROBS

DTYPES = ("auto", "float32", "bfloat16", "float16")


def parse_json_object(value: Any) -> str:
    """A JSON object given as text or a mapping (YAML, Python), kept as its canonical JSON text (the
    settings stay hashable)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(f"not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"expected a JSON object, got {value!r}")
    return json.dumps(value, sort_keys=True)


# --kv-cache-dtype's values, the one list of them (vLLM's spellings where they mean the same).
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
# The float8 ones (model/kv_cache.py: 1 byte per element, a per-layer scale); "fp8" is vLLM's fp8_e4m3.
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


def parse_cache_dir(value: Any) -> str | None:
    """A directory, or "none" / "off" kept as given (caches disabled: `optional` would turn "none" into
    None, the default directory)."""
    return None if value is None else parse_str(value)


@dataclasses.dataclass(frozen=True)
class EngineConfig(Settings):
    """Every engine setting. The same name is a Python keyword, a YAML key and a `--kebab-case` flag."""

    model: str | None = setting(
        None,
        "the model: a model directory (Hugging Face layout), a GGUF file (or a directory holding one), or "
        "a Hugging Face model ID (ORG/NAME, downloaded once into the huggingface_hub cache); default: the "
        "shipped default model (SmolLM2-135M-Instruct)",
        optional(parse_str),
        group="model",
    )
    revision: str | None = setting(
        None,
        "the Hugging Face model ID's revision: a branch, tag or commit hash; default: main",
        optional(parse_str),
        group="model",
    )
    download_dir: str | None = setting(
        None,
        "where Hugging Face model IDs are downloaded (a huggingface_hub cache directory); default: "
        "huggingface_hub's ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)",
        optional(parse_str),
        group="model",
    )
    tokenizer: str | None = setting(
        None, "tokenizer directory or file; default: the model directory", optional(parse_str), group="model"
    )
    dtype: str = setting(
        "auto",
        "parameter and activation dtype; auto = float32 on CPU, else the checkpoint's dtype, else bfloat16",
        choice(*DTYPES),
        group="model",
    )
    load_format: str = setting(
        "auto",
        "auto (orbax if the directory is a jaxserve checkpoint, else safetensors) | "
        "orbax | safetensors | dummy (seeded random weights)",
        choice("auto", "orbax", "safetensors", "dummy"),
        group="model",
    )
    seed: int = setting(0, "seed for dummy weights and default sampling", parse_int, group="model")
    generation_config: str = setting(
        "auto",
        "default sampling values of requests that set none: auto (the model's generation_config.json) | "
        "vllm (ignore it: jaxserve's built-in defaults) | DIR (a generation_config.json there)",
        parse_str,
        group="model",
    )
    override_generation_config: str | None = setting(
        None,
        "JSON object merged over the generation config, e.g. '{\"temperature\": 0.5}'",
        parse_override,
        group="model",
    )
    chat_template: str | None = setting(
        None,
        "chat template (a Jinja file, or the template itself) instead of the checkpoint's",
        optional(parse_str),
        group="model",
    )
    page_size: int = setting(16, "tokens per KV-cache page", parse_int, group="cache")
    num_pages: int | None = setting(
        None, "KV-cache pages per data-parallel replica", optional(parse_int), group="cache"
    )
    kv_cache_memory: int | None = setting(
        None, "bytes for the KV cache per replica (e.g. 4GiB), if num_pages unset", optional(parse_size), group="cache"
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "the fraction of each accelerator's memory (GPU or TPU) for the weights, the KV cache and the "
        "activations, in (0, 1]: the KV cache gets what is left of it after the weights and a reserve for "
        "activations, unless num_pages or kv_cache_memory is set; the server also sets JAX's GPU allocator "
        "to it (XLA_PYTHON_CLIENT_MEM_FRACTION) unless that is set already. Ignored on a CPU (a fixed 2 GiB pool)",
        parse_float,
        group="cache",
    )
    max_model_len: int | None = setting(
        None,
        "longest sequence (prompt + output); default: the model's limit; as vLLM, 32k = 32000 and 32K = 32768",
        optional(parse_token_count),
        group="scheduling",
    )
    max_num_seqs: int = setting(16, "most sequences in one decode step", parse_int, group="scheduling")
    max_num_batched_tokens: int = setting(
        512,
        "tokens in one step of each data-parallel replica, decodes included. It is the step's token budget "
        "(decodes and their draft tokens first, prompt chunks in what is left, so also the longest prompt chunk); "
        "the prompt tokens still to compute below which waiting requests are admitted; the largest token bucket "
        "compiled (max_num_seqs if that is larger); and the rows the activation memory reserved beside the KV "
        "cache is sized for",
        parse_int,
        group="scheduling",
    )
    num_scheduler_steps: int = setting(
        1,
        "decode steps per host round-trip: > 1 runs that many decode steps in one compiled call (less host "
        "overhead per token, burstier streaming, prefills wait longer; compiles a multi-step variant of every "
        "decode bucket)",
        parse_int,
        group="scheduling",
    )
    async_scheduling: bool = setting(
        True,
        "overlap the host with the device: step N+1 is scheduled and dispatched before step N's tokens "
        "reach the host (its inputs take them on the device); false runs every step to completion first. "
        "Multi-step engines always run serially; speculative ones overlap only the steps that verify no drafts",
        parse_bool,
        group="scheduling",
    )
    mesh_shape: tuple[int, ...] = setting(
        (1, 1), "device mesh (data, model), e.g. 1,4", parse_int_tuple, group="parallelism"
    )
    tensor_parallel_size: int | None = setting(
        None,
        "vLLM's spelling of mesh_shape's model axis: devices each replica's weights and KV heads are "
        "split over (mesh_shape=(data, N)); reads None once folded into mesh_shape",
        optional(parse_positive_int),
        group="parallelism",
        short="-tp",
        alias_of=("mesh_shape", 1),
    )
    data_parallel_size: int | None = setting(
        None,
        "vLLM's spelling of mesh_shape's data axis: replicas of the model, each with its own KV cache "
        "and batch (mesh_shape=(N, model)); reads None once folded into mesh_shape",
        optional(parse_positive_int),
        group="parallelism",
        short="-dp",
        alias_of=("mesh_shape", 0),
    )
    moe_parallelism: str = setting(
        "tensor",
        "how a mixture of experts uses the model axis: tensor (every expert split on its hidden "
        "dimension) or expert (whole experts per device, each device computing its own experts' tokens)",
        choice("tensor", "expert"),
        group="parallelism",
    )
    scan_layers: bool | None = setting(
        None,
        "lax.scan over layers (true) or unrolled (false); default per backend",
        optional(parse_bool),
        group="compilation and kernels",
    )
    token_buckets: str = setting(
        "powers-of-two",
        "the ragged step's token-axis sizes, one executable each: powers-of-two (1, 4, 8, 16, ...) | "
        "fine (also the midpoints 2, 3, 6, 12, 24, ...: at most a third of a step padded instead of half, twice the "
        "executables; for a CPU, where a step costs its padded tokens) | auto (fine on a CPU, powers-of-two on "
        "accelerators; configs/small.yaml's)",
        choice("powers-of-two", "fine", "auto"),
        group="compilation and kernels",
    )
    attention_backend: str = setting(
        "auto", "auto | reference | pallas", choice("auto", "reference", "pallas"), group="compilation and kernels"
    )
    enable_prefix_caching: bool = setting(
        True, "reuse the KV pages of shared prompt prefixes", parse_bool, group="cache"
    )
    kv_transfer_config: str | None = setting(
        None,
        'vLLM\'s: a KV connector, as a JSON object {"kv_connector": NAME, "kv_role": kv_producer | kv_consumer | '
        'kv_both, "kv_connector_extra_config": {...}}: pages loaded before a sequence runs and saved after '
        "(docs/kv_offloading.md; OffloadingConnector is the host tier)",
        optional(parse_json_object),
        group="cache",
    )
    kv_offloading_size: float | None = setting(
        None,
        "vLLM's: GiB of host memory for the prefix cache's host tier: full prefix pages the device pool evicts "
        "are kept there (LRU) and loaded back on a prefix hit instead of recomputed (docs/kv_offloading.md)",
        optional(parse_float),
        group="cache",
    )
    kv_offloading_backend: str = setting(
        "native",
        "vLLM's: the host tier's implementation: native (jaxserve's own; vLLM's lmcache is not available)",
        choice("native"),
        group="cache",
    )
    enable_sleep_mode: bool = setting(
        False,
        "vLLM's: serve POST /sleep, /wake_up, /pause, /resume, GET /is_sleeping, /is_paused and SGLang's "
        "POST /update_weights_from_disk, for a trainer (docs/training_loop.md)",
        parse_bool,
        group="cache",
    )
    logprobs_mode: str = setting(
        "raw_logprobs",
        "vLLM's: what sampled and top logprobs are of: raw_logprobs (the model's distribution) | "
        "processed_logprobs (the one each row draws from: after bias, penalties, temperature, top-k/p)",
        choice("raw_logprobs", "processed_logprobs"),
        group="cache",
    )
    max_logprobs: int = setting(
        MAX_LOGPROBS,
        f"vLLM's: the most top logprobs a request may ask for (logprobs, top_logprobs, "
        f"prompt_logprobs); more is a 400. At most {MAX_LOGPROBS}, the count the steps are compiled for",
        parse_int,
        group="scheduling",
    )
    enable_prompt_logprobs: bool = setting(
        False,
        "accept prompt_logprobs (scoring, e.g. lm-eval): compiles a scoring variant of every prefill "
        "bucket at start-up",
        parse_bool,
        group="scheduling",
    )
    scheduling: str = setting(
        "continuous",
        "continuous (iteration-level) or static batching (the baseline)",
        choice("continuous", "static"),
        group="scheduling",
    )
    preemption_mode: str = setting(
        "recompute",
        "recompute: admit greedily, preempt and recompute when pages run out; "
        "reserve: admit only when pages for prompt + max_tokens are free",
        choice("recompute", "reserve"),
        group="scheduling",
    )
    quantization: str = setting(
        "none",
        "none | int8 (weight-only int8 linear layers, a scale per group of input rows; a GGUF's Q8_0 weights "
        "load as they are) | int4 (weight-only, asymmetric per group of input rows, linear layers and experts; a "
        "GGUF's Q4_0/Q4_1 weights load as they are)",
        choice("none", "int8", "int4"),
        group="model",
        short="-q",
    )
    quantization_group_size: int | None = setting(
        None,
        "input rows per quantization scale: int8 default 32 (0 or -1: one scale per output channel), "
        "int4 default 32 (a GGUF's Q4_0/Q4_1 blocks; another size requantizes them); must divide every "
        "quantized weight's input rows (per device when they are sharded)",
        optional(parse_int),
        group="model",
    )
    activation_quantization: str = setting(
        "none",
        "none | int8 (W8A8, SGLang's w8a8_int8: with quantization=int8 and a scale per output channel, "
        "each token's activations are quantized to int8 and multiplied in integers; faster on CPUs at batch "
        "16, slower at batch 1, and less exact than weight-only int8: docs/BENCHMARKS.md)",
        choice("none", "int8"),
        group="model",
    )
    quantize_lm_head: bool = setting(
        False,
        "with quantization=int8 or int4, quantize the lm_head too (a tied one: the embedding table, rows dequantized as gathered)",
        parse_bool,
        group="model",
    )
    kv_cache_dtype: str = setting(
        "auto",
        "auto (the model dtype) | int8 (a scale per token and KV head) | fp8 = fp8_e4m3 | fp8_e5m2 (vLLM's: "
        "float8 pages, a scale per layer: 1.0 unless the checkpoint gives k_scale / v_scale)",
        choice(*KV_CACHE_DTYPES),
        group="cache",
    )
    quantized_matmul_backend: str = setting(
        "auto",
        "int8 weights' matmul: auto (Pallas int8_matmul on one TPU/GPU, else XLA) | reference (XLA) | pallas",
        choice("auto", "reference", "pallas"),
        group="compilation and kernels",
    )
    speculative_model: str | None = setting(
        None,
        "draft model directory for speculative decoding (same vocabulary as the model), or the EAGLE-3 "
        "head's (speculators format) with speculative_method=eagle3",
        optional(parse_str),
        group="speculative decoding",
    )
    speculative_method: str = setting(
        "draft",
        "draft (proposals from the draft model speculative_model) | eagle3 (from the EAGLE-3 head "
        "speculative_model, which reads the model's own hidden states) | ngram (prompt lookup: copy from "
        "earlier tokens)",
        choice("draft", "eagle3", "ngram"),
        group="speculative decoding",
    )
    num_speculative_tokens: int = setting(
        0, "tokens proposed per verify step; 0 = speculative decoding off", parse_int, group="speculative decoding"
    )
    prompt_lookup_min: int = setting(
        1, "ngram speculation: shortest suffix to look up", parse_int, group="speculative decoding"
    )
    prompt_lookup_max: int = setting(
        4, "ngram speculation: longest suffix to look up (tried first)", parse_int, group="speculative decoding"
    )
    speculative_adaptive: bool = setting(
        True,
        "per request, lower the proposals (to none) when the measured acceptance does not pay for them",
        parse_bool,
        group="speculative decoding",
    )
    enable_lora: bool = setting(
        False,
        "serve LoRA adapters (PEFT) over the base model: a request's model names its adapter",
        parse_bool,
        group="lora",
    )
    lora_modules: tuple = setting(
        (),
        'adapters loaded at start: NAME=PATH ... or JSON objects {"name": ..., "path": ..., '
        '"base_model_name": ...} (vLLM\'s --lora-modules)',
        parse_lora_modules,
        group="lora",
    )
    max_loras: int = setting(
        1,
        "adapters resident on the device at once (and used by the running requests at once); more are "
        "swapped in from host memory, the least recently used out",
        parse_positive_int,
        group="lora",
    )
    max_lora_rank: int = setting(
        16,
        "largest adapter rank served: every device slot holds this rank (smaller ranks padded)",
        parse_positive_int,
        group="lora",
    )
    lora_target_modules: tuple = setting(
        (),
        "the modules the device slots adapt: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj (default "
        "all the model has); fewer modules, fewer bytes every decode step reads; an adapter targeting another is "
        "refused at load",
        parse_lora_target_modules,
        group="lora",
    )
    max_cpu_loras: int | None = setting(
        None,
        "adapters kept loaded in host memory (at least max_loras; default max_loras): others are read "
        "from disk again when used",
        optional(parse_positive_int),
        group="lora",
    )
    enforce_eager: bool = setting(
        False,
        "vLLM's: no warm-up; each step bucket compiles when a step first needs it (a quick start, the first "
        "request of each new shape waits for its compile)",
        parse_bool,
        group="compilation and kernels",
    )
    compilation_cache_dir: str | None = setting(
        None,
        "where compiled code is kept between starts: the executable store in DIR/executables, the persistent "
        "XLA cache in DIR/xla; default $JAXSERVE_COMPILATION_CACHE_DIR or ~/.cache/jaxserve; 'none' disables both",
        parse_cache_dir,
        group="compilation and kernels",
    )
    compilation_cache: bool = setting(
        True,
        "keep compiled code between starts (--no-compilation-cache: every start compiles everything)",
        parse_bool,
        group="compilation and kernels",
    )
    executable_store: bool = setting(
        True,
        "load the step executables serialized by an earlier start or `jaxserve compile` (no tracing) and "
        "store those compiled (docs/startup.md); $JAXSERVE_EXECUTABLE_STORE=0 turns it off by default",
        parse_bool,
        group="compilation and kernels",
    )
    compile_in_background: bool | None = setting(
        None,
        "compile the smallest decode and prefill token buckets, start serving, and compile the others on a "
        "thread while steps keep to the ready ones (same outputs, slower until all are ready; docs/startup.md); "
        "default: on for `jaxserve serve`, off for LLM(...) and `jaxserve compile`. Off with num_processes > 1 "
        "or speculative decoding",
        optional(parse_bool),
        group="compilation and kernels",
    )
    executable_store_max_size: int = setting(
        4 * 2**30,
        "bytes the executable store may hold (e.g. 4GiB); past it the least recently used entries are removed",
        parse_size,
        group="compilation and kernels",
    )
    # Multi-host serving (jaxserve.runner.multihost, docs/multihost.md): one process per host, all with the same settings
    # but process_id; process 0 runs the scheduler (and the HTTP server) and hands every step to the others.
    coordinator_address: str | None = setting(
        None,
        "multi-host: HOST:PORT where process 0 hosts the jax.distributed coordinator (every process gives "
        "the same); unset = a single process",
        optional(parse_str),
        group="parallelism",
    )
    num_processes: int = setting(
        1, "multi-host: processes in the job (one per host); 1 = single process", parse_int, group="parallelism"
    )
    process_id: int = setting(
        0,
        "multi-host: this process's index in [0, num_processes); 0 schedules and serves HTTP",
        parse_int,
        group="parallelism",
    )
    distributed_timeout: int = setting(
        30,
        "multi-host: seconds without a heartbeat after which a process counts as dead (the others then exit)",
        parse_int,
        group="parallelism",
    )
    # POST /v1/responses (server/responses.py): its in-memory store of responses (server/response_store.py)
    responses_store: bool = setting(
        True,
        "keep /v1/responses results in memory (store: true, OpenAI's default) for previous_response_id and "
        "GET/DELETE /v1/responses/{id}; --no-responses-store: nothing is kept, and store: true is a 400",
        parse_bool,
        group="responses API",
    )
    responses_store_max_entries: int = setting(
        1024, "the most responses kept; past it the oldest is evicted", parse_positive_int, group="responses API"
    )
    responses_store_max_age: float = setting(
        3600.0, "seconds a stored response is kept", parse_float, group="responses API"
    )
    # Embeddings (docs/embeddings.md): a pooling engine answers /v1/embeddings and LLM.embed, not generation.
    runner: str = setting(
        "auto",
        "vLLM's: generate (text generation; auto is generate) | pooling (embeddings: /v1/embeddings, LLM.embed)",
        choice("auto", "generate", "pooling"),
        group="pooling",
    )
    convert: str = setting(
        "auto",
        "vLLM's: with --runner pooling, what the model is served as: embed (auto is embed)",
        choice("auto", "none", "embed"),
        group="pooling",
    )
    pooler_config: str | None = setting(
        None,
        'vLLM\'s: a JSON object over the model\'s own pooling: {"pooling_type": "LAST" | "MEAN" | "CLS", '
        '"normalize": bool, "dimensions": N, "matryoshka_dimensions": [N, ...]}',
        optional(parse_json_object),
        group="pooling",
    )

    def validate(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size must be a power of two, got {self.page_size}")
        if len(self.mesh_shape) != 2 or min(self.mesh_shape) < 1:
            raise ConfigError(f"mesh_shape must be two positive sizes (data, model), got {self.mesh_shape}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps", "num_pages", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ConfigError(
                f"max_logprobs must be in [0, {MAX_LOGPROBS}] (the top logprobs the steps are compiled "
                f"for; vLLM's -1, the whole vocabulary, is not served), got {self.max_logprobs}"
            )
        if self.num_pages is not None and self.kv_cache_memory is not None:
            raise ConfigError("set num_pages or kv_cache_memory, not both")
        if not self.responses_store_max_age > 0:
            raise ConfigError(f"responses_store_max_age must be positive seconds, got {self.responses_store_max_age}")
        if self.load_format == "dummy" and self.model is None:
            raise ConfigError("load_format='dummy' needs model= a directory with a config.json to take the shape from")
        if self.activation_quantization == "int8" and (
            self.quantization != "int8" or self.quantization_group_size not in (None, 0, -1)
        ):
            raise ConfigError(
                "activation_quantization=int8 (W8A8) needs quantization=int8 with a scale per output "
                "channel (quantization_group_size unset or 0)"
            )
        if self.convert == "embed" and not self.pooling:
            raise ConfigError("convert='embed' needs runner='pooling' (--runner pooling --convert embed)")
        self._validate_speculation()
        self._validate_distributed()
        self._validate_lora()
        from jaxserve.kv_transfer.driver import validate_kv_transfer

        validate_kv_transfer(self)  # --kv-transfer-config, --kv-offloading-size

    def _validate_lora(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("lora_modules needs enable_lora=true (--enable-lora)")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.enable_lora and self.num_processes > 1:
            raise ConfigError("enable_lora is not supported on a multi-host job yet (num_processes > 1)")

    def _validate_distributed(self) -> None:
        n, i = self.num_processes, self.process_id
        if n < 1 or not 0 <= i < n:
            raise ConfigError(f"need num_processes >= 1 and 0 <= process_id < num_processes, got {n}, {i}")
        if n > 1 and not self.coordinator_address:
            raise ConfigError(f"num_processes={n} needs coordinator_address=HOST:PORT (process 0's address)")
        if self.distributed_timeout < 1:
            raise ConfigError(f"distributed_timeout must be at least 1 second, got {self.distributed_timeout}")

    def _validate_speculation(self) -> None:
        k, method = self.num_speculative_tokens, self.speculative_method
        if k < 0:
            raise ConfigError(f"num_speculative_tokens must be >= 0, got {k}")
        if method == "ngram" and self.speculative_model is not None:
            raise ConfigError("speculative_method='ngram' needs no speculative_model; drop one of them")
        if method == "draft" and k > 0 and self.speculative_model is None:
            raise ConfigError(
                "num_speculative_tokens > 0 needs speculative_model=PATH (a draft model), or speculative_method='ngram'"
            )
        if method == "eagle3" and k > 0 and self.speculative_model is None:
            raise ConfigError("speculative_method='eagle3' needs speculative_model=PATH: the EAGLE-3 head's directory")
        if k > 0 and self.num_scheduler_steps > 1:
            raise ConfigError(
                "num_scheduler_steps > 1 and speculative decoding both batch decode work per host "
                "round-trip; use one of them (set num_scheduler_steps=1 or num_speculative_tokens=0)"
            )
        if self.speculation in ("draft", "eagle3") and self.enable_prompt_logprobs:
            # A step scoring prompt tokens runs the plain scoring variant, without the draft, whose
            # cache would then miss those tokens (n-gram speculation has no cache to keep up).
            raise ConfigError(
                f"enable_prompt_logprobs is not supported with speculative_method='{self.speculation}'; "
                "use speculative_method='ngram' or turn one of them off"
            )
        if self.speculative_model is not None and k == 0:
            raise ConfigError(
                "speculative_model is set but num_speculative_tokens is 0: set how many tokens "
                "the draft proposes per step (e.g. 4)"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
                f"{self.prompt_lookup_max}"
            )

    @property
    def pooling(self) -> bool:
        """Whether this engine pools (embeddings) instead of generating (`runner` pooling)."""
        return self.runner == "pooling"

    @property
    def speculation(self) -> str | None:
        """The speculative decoding in use: "draft", "eagle3", "ngram" or None (off)."""
        return self.speculative_method if self.num_speculative_tokens > 0 else None
