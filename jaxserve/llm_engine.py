"""LLMEngine: the engine core over this machine's devices. It builds the device half (mesh, weights,
KV cache, the runner and its executables, speculation's draft) from an EngineConfig, then hands the
host-only `EngineCore` (jaxserve.engine.core) the runner; everything after start-up is the core's.

    engine = LLMEngine(EngineConfig(model="checkpoints/small"))
    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for delta in engine.step(): ...
"""

from __future__ import annotations

import logging
import time

import jax

from jaxserve.config import EngineConfig
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.engine.buckets import BucketTable, executable_counts
from jaxserve.engine.core import EngineCore
from jaxserve.loading.int4_checkpoint import implied_quantization
from jaxserve.loading.model_loader import load_model
from jaxserve.model.kv_cache import init_cache
from jaxserve.model.sharding import make_mesh
from jaxserve.model.weights import param_bytes
from jaxserve.planning.memory import plan_memory
from jaxserve.runner import multihost
from jaxserve.runner.backends import default_scan_layers, resolve_attention, resolve_quantized_matmul
from jaxserve.runner.compilation import CompileCounter, check_memory_mappings, enable_compilation_cache
from jaxserve.runner.executables import attach_executable_store, open_executable_store
from jaxserve.runner.runner import ModelRunner
from jaxserve.runner.weight_control import WeightControl
from jaxserve.spec_decode.decoder import draft_kv_bytes_per_token
from jaxserve.model.step_options import StepOptions

logger = logging.getLogger(__name__)


class LLMEngine(WeightControl, EngineCore):  # WeightControl: update_weights, pause, sleep (training loops)
    def __init__(self, config: EngineConfig, warm_up: bool = True):
        self.started_at = time.perf_counter()
        s = config = implied_quantization(config)  # an AWQ / GPTQ checkpoint is served as int4
        multihost.initialize(s)  # num_processes > 1: jax.distributed, before any device is touched
        cache_path = enable_compilation_cache(s.compilation_cache_dir, s.compilation_cache)
        logger.info("persistent compilation cache: %s", cache_path or "off")
        store = open_executable_store(s)  # the last start's executables load while the weights do
        platform = jax.default_backend()
        self.mesh = make_mesh(s.mesh_shape)
        scan = s.scan_layers if s.scan_layers is not None else default_scan_layers(platform)
        loaded = load_model(s, self.mesh, stacked=scan)
        s = config = s.replace(quantization_group_size=loaded.group_size)  # the default resolved for the model
        self.dtype, self.shardings = loaded.dtype, loaded.shardings
        memory = plan_memory(
            loaded.cfg, s, loaded.dtype, draft_kv_bytes_per_token=draft_kv_bytes_per_token(s, loaded.dtype)
        )
        logger.info(memory.describe())
        logger.info(memory.capacity_line())
        if param_bytes(loaded.params) != memory.param_bytes - memory.lora_bytes:  # the stacks come later
            logger.warning(
                "loaded params take %d bytes; the config's arithmetic says %d",
                param_bytes(loaded.params),
                memory.param_bytes - memory.lora_bytes,
            )
        options = StepOptions(
            scan_layers=scan,
            mesh=self.mesh,
            moe_parallelism=s.moe_parallelism,
            logprobs_mode=s.logprobs_mode,
            attention_backend=resolve_attention(s.attention_backend, platform, s.mesh_shape),
            matmul_backend=resolve_quantized_matmul(
                s.quantized_matmul_backend, platform, s.mesh_shape, s.quantization, s.activation_quantization
            ),
        )
        buckets = BucketTable.for_settings(s, memory.max_model_len, platform)
        logger.info(
            "token buckets (token_buckets=%s on %s): %s",
            s.token_buckets,
            platform,
            ", ".join(map(str, buckets.token_counts)),
        )
        cache = init_cache(
            loaded.cfg,
            memory.num_pages,
            s.page_size,
            loaded.dtype,
            self.shardings.num_replicas,
            self.shardings.cache,
            s.kv_cache_dtype,
            self.shardings.cache_scale,
            loaded.kv_scales,
        )
        runner = ModelRunner(
            loaded.cfg,
            loaded.params,
            cache,
            buckets,
            options,
            self.shardings,
            num_scheduler_steps=s.num_scheduler_steps,
        )
        attach_executable_store(runner, store)  # serialized executables: taken at warm-up, no tracing
        logger.info("executable store: %s", store.store.directory if store is not None else "off")
        super().__init__(
            s,
            runner,
            model_config=loaded.cfg,
            memory=memory,
            tokenizer=self._load_tokenizer(s, loaded.model_dir),
            speculation=self._speculative_decoder if s.speculation else None,
        )
        if s.enable_lora:
            self._serve_adapters()
        self.warm_up_compiles = None
        if warm_up and not s.enforce_eager:  # enforce_eager: every bucket compiles on first use instead
            self.warm_up()
        # Multi-host: process 0 hands every later device call to the other processes, which run
        # multihost.run_follower(engine) instead of serving (None in a single process and on followers).
        self.multihost = multihost.attach(self)
        self._init_weight_control()

    def _speculative_decoder(self):
        """Speculative decoding (jaxserve.spec_decode): the draft shares the pages and page tables
        (the core calls this once its block manager exists)."""
        from jaxserve.spec_decode import SpeculativeDecoder, load_draft
        from jaxserve.spec_decode.decoder import load_eagle3_head

        s, draft = self.config, None
        if s.speculation == "eagle3":
            draft = load_eagle3_head(s, self.mesh, self.model_config, self.dtype)
        elif s.speculation == "draft":
            draft = load_draft(
                s, self.mesh, self.runner.options.scan_layers, self.model_config, self.tokenizer, self.dtype
            )
        return SpeculativeDecoder(s, self.runner, self.blocks, self.buckets, self.memory.max_model_len, draft)

    def _serve_adapters(self) -> None:
        """LoRA: the runner's device slots (before its steps compile), the host manager over them, and
        the adapters of `lora_modules` loaded."""
        from jaxserve.engine.lora_manager import LoRAManager
        from jaxserve.lora.peft_adapter import load_peft_adapter
        from jaxserve.runner.lora import LoRASlots

        s, cfg = self.config, self.model_config
        slots = LoRASlots(cfg, s.max_loras, s.max_lora_rank, self.dtype, self.mesh, s.lora_target_modules)
        self.runner.enable_lora(slots)
        logger.info(
            "LoRA: %d device slots of rank %d (%.1f MiB), %s adapters kept in host memory",
            s.max_loras,
            s.max_lora_rank,
            slots.nbytes / 2**20,
            s.max_cpu_loras or s.max_loras,
        )
        self.enable_lora(
            LoRAManager(
                max_loras=s.max_loras,
                max_cpu_loras=s.max_cpu_loras,
                write=self.runner.write_lora,
                load=lambda request: load_peft_adapter(
                    request.lora_path, cfg, max_rank=s.max_lora_rank, served=tuple(slots.dims)
                ),
                live=self.scheduler.adapters_in_use,
            )
        )
        for request in s.lora_modules:
            self.add_lora(request)

    @staticmethod
    def _load_tokenizer(config: EngineConfig, model_dir: str):
        from jaxserve.loading.tokenizer import load_tokenizer

        path = config.tokenizer or model_dir
        try:
            return load_tokenizer(path)
        except FileNotFoundError:
            if config.tokenizer is not None:
                raise
            logger.warning("no tokenizer in %s: only prompt_token_ids can be given, and outputs have no text", path)
            return None

    def warm_up(self) -> None:
        """Compile every executable the bucket table plans (and time speculation's steps); with
        compile_in_background, only the opening token buckets' before it returns, the others' on a
        thread (`runner/background_compile.py`)."""
        before = CompileCounter.foreground()  # a background compile thread's are planned, not counted
        background = self._background_compile()
        if background is not None:
            background.open()
        else:
            self.runner.warm_up()
            if self.config.enable_prompt_logprobs:
                self.runner.warm_up(self.runner.score_shapes())
        self.runner.warm_up_page_copies()
        if self.spec is not None:
            self.spec.warm_up()
        self.runner.compiles_at_warm_up = CompileCounter.foreground()
        planned = executable_counts(self.config, self.memory.max_model_len, self.num_replicas, jax.default_backend())
        self.warm_up_compiles = self.runner.compiles_at_warm_up - before  # persistent-cache hits too
        logger.info(
            "warm-up compiled %d executables; the bucket table plans %s", self.warm_up_compiles, planned.describe()
        )
        check_memory_mappings(jax.default_backend())
        if background is not None:
            logger.info(
                "serving %.1f s after start-up began, with token buckets %s of %d (%.1f s compiling them); "
                "compiling the others in the background, in this order: %s",
                time.perf_counter() - self.started_at,
                ", ".join(map(str, background.opening)),
                background.total,
                background.compile_seconds,
                ", ".join(map(str, background.order)) or "none",
            )
            background.start()

    def _background_compile(self):
        """The runner's BackgroundCompile when compile_in_background is on and can be (one process,
        no speculation: runner/background_compile.py says why), else None."""
        s = self.config
        if not s.compile_in_background or self.runner.background is not None:
            return None
        if s.num_processes > 1 or self.spec is not None:
            logger.info("compile_in_background off: %s", "multi-host" if s.num_processes > 1 else "speculation")
            return None
        from jaxserve.runner.background_compile import BackgroundCompile

        keys = self.runner.step_shapes() + (self.runner.score_shapes() if s.enable_prompt_logprobs else [])
        self.runner.background = BackgroundCompile(self.runner, keys, self.scheduler.cap_budget)
        return self.runner.background

    def num_executables(self) -> int:
        return self.runner.num_executables()


def start_async_engine(config: EngineConfig) -> AsyncLLMEngine:
    """The server's engine: an LLMEngine whose steps run on a thread of their own; it serves while
    the larger token buckets compile unless compile_in_background is false."""
    if config.compile_in_background is None:
        config = config.replace(compile_in_background=True)
    return AsyncLLMEngine(LLMEngine(config))
