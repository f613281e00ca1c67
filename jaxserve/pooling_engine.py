"""PoolingEngine: the embeddings engine (`--runner pooling --convert embed`) over this machine's
devices. Start-up as `LLMEngine`'s (mesh, weights placed by loading/, the KV cache sized by the
memory plan, the bucket table) with the pooling variant's executables in place of the generation
steps; then the host-only `engine.pooling.PoolingCore` runs it. docs/embeddings.md.

    engine = PoolingEngine(EngineConfig(model="Qwen3-Embedding", runner="pooling"))
    engine.add_request("a", [1, 2, 3]); (out,) = engine.run_to_completion(); out.outputs.embedding
"""

from __future__ import annotations

import json
import logging
import os

import jax

from jaxserve.config import EngineConfig
from jaxserve.engine.buckets import BucketTable
from jaxserve.engine.pooling import AsyncPoolingEngine, PoolingCore
from jaxserve.engine.pooling_config import parse_pooler_config, resolve_pooler_config
from jaxserve.loading.model_loader import load_model
from jaxserve.model.kv_cache import init_cache
from jaxserve.model.sharding import make_mesh
from jaxserve.model.step_options import StepOptions
from jaxserve.planning.memory import plan_memory
from jaxserve.runner.backends import default_scan_layers, resolve_attention, resolve_quantized_matmul
from jaxserve.runner.compilation import enable_compilation_cache
from jaxserve.runner.pool_step import PoolingRunner

logger = logging.getLogger(__name__)


class PoolingEngine(PoolingCore):
    def __init__(self, config: EngineConfig, warm_up: bool = True):
        s = config
        if not s.pooling:
            raise ValueError("PoolingEngine needs runner='pooling'")
        if s.num_processes > 1 or s.enable_lora or s.speculation:
            raise ValueError("--runner pooling serves one process without LoRA or speculative decoding")
        enable_compilation_cache(s.compilation_cache_dir, s.compilation_cache)
        platform = jax.default_backend()
        self.mesh = make_mesh(s.mesh_shape)
        scan = s.scan_layers if s.scan_layers is not None else default_scan_layers(platform)
        loaded = load_model(s, self.mesh, stacked=scan)
        s = config = s.replace(quantization_group_size=loaded.group_size)
        memory = plan_memory(loaded.cfg, s, loaded.dtype)
        logger.info(memory.describe())
        options = StepOptions(
            scan_layers=scan,
            mesh=self.mesh,
            moe_parallelism=s.moe_parallelism,
            attention_backend=resolve_attention(s.attention_backend, platform, s.mesh_shape),
            matmul_backend=resolve_quantized_matmul(
                s.quantized_matmul_backend, platform, s.mesh_shape, s.quantization, s.activation_quantization
            ),
        )
        buckets = BucketTable.for_settings(s, memory.max_model_len, platform)
        cache = init_cache(
            loaded.cfg,
            memory.num_pages,
            s.page_size,
            loaded.dtype,
            loaded.shardings.num_replicas,
            loaded.shardings.cache,
            s.kv_cache_dtype,
            loaded.shardings.cache_scale,
            loaded.kv_scales,
        )
        with open(os.path.join(loaded.model_dir, "config.json")) as f:
            hf_config = json.load(f)
        pooler = resolve_pooler_config(loaded.model_dir, hf_config, parse_pooler_config(s.pooler_config))
        logger.info(
            "pooling: %s%s (%s), %d token buckets: %s",
            pooler.pooling_type,
            ", normalized" if pooler.normalize else "",
            pooler.source,
            len(buckets.token_counts),
            ", ".join(map(str, buckets.token_counts)),
        )
        runner = PoolingRunner(
            loaded.cfg, loaded.params, cache, buckets, pooler.pooling_type, options, loaded.shardings
        )
        from jaxserve.llm_engine import LLMEngine

        super().__init__(
            runner,
            pooler,
            hidden_size=loaded.cfg.hidden_size,
            vocab_size=loaded.cfg.vocab_size,
            num_pages=memory.num_pages,
            max_model_len=memory.max_model_len,
            tokenizer=LLMEngine._load_tokenizer(s, loaded.model_dir),
            config=config,
        )
        self.model_config, self.memory, self.dtype = loaded.cfg, memory, loaded.dtype
        if warm_up and not s.enforce_eager:
            runner.warm_up()

    def num_executables(self) -> int:
        return self.runner.num_executables()


def start_async_pooling_engine(config: EngineConfig) -> AsyncPoolingEngine:
    """The server's embeddings engine: a PoolingEngine stepped on a thread of its own."""
    return AsyncPoolingEngine(PoolingEngine(config))
