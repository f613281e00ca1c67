"""Offline generation in the shape users know from vLLM: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import jax
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.compile import BucketTable, enable_compilation_cache
from jaxserve.engine.runner import ModelRunner, RowWork
from jaxserve.errors import ConfigError, RequestError
from jaxserve.kv_cache import init_cache
from jaxserve.memory_plan import plan_memory
from jaxserve.model.weights import param_bytes
from jaxserve.model_loader import load_model
from jaxserve.sharding import make_mesh
from jaxserve.sampling_params import CompletionOutput, RequestOutput, SamplingParams
from jaxserve.steps import StepOptions

logger = logging.getLogger(__name__)


def default_scan_layers(backend: str) -> bool:
    """Unrolled layers decode faster on CPU (measured: 23 vs 44 ms/step, SmolLM2-135M shape);
    TPU deployments scan, which keeps compile time flat in depth."""
    return backend == "tpu"


class LLM:
    """Load a model once, then generate for batches of prompts."""

    def __init__(self, model: str | None = None, *, warm_up: bool = True, **settings: Any):
        try:
            self.settings = EngineConfig.from_dict({"model": model, **settings})
        except TypeError as err:
            raise ConfigError(str(err)) from None
        s = self.settings
        cache_path = enable_compilation_cache(s.compilation_cache_dir)
        logger.info("persistent compilation cache: %s", cache_path or "off")
        self.mesh = make_mesh(s.mesh_shape)
        loaded = load_model(s, self.mesh)
        self.shardings = loaded.shardings
        self.num_replicas = self.shardings.num_replicas
        self.model_config, self.dtype = loaded.cfg, loaded.dtype
        self.plan = plan_memory(loaded.cfg, s, loaded.dtype, param_bytes(loaded.params))
        logger.info(self.plan.describe())
        self.tokenizer = self._load_tokenizer(loaded.model_dir)
        scan = s.scan_layers if s.scan_layers is not None else default_scan_layers(jax.default_backend())
        if s.attention_backend == "pallas":
            raise ConfigError("attention_backend='pallas' is not available yet; use 'auto' or 'reference'")
        options = StepOptions(scan_layers=scan, attention_backend="reference")
        max_chunk = min(s.max_num_batched_tokens, self.plan.max_model_len)
        buckets = BucketTable.build(s.max_num_seqs, max_chunk, self.plan.max_pages_per_seq)
        cache = init_cache(loaded.cfg, self.plan.num_pages, s.page_size, loaded.dtype, self.num_replicas,
                           self.shardings.cache)
        self.runner = ModelRunner(loaded.cfg, loaded.params, cache, buckets, options, self.shardings)
        self.blocks = BlockManager(self.plan.num_pages, s.page_size, self.num_replicas,
                                   enable_prefix_caching=False, watermark=0.0)
        if warm_up:
            self.runner.warm_up()
        self._next_id = 0

    def _load_tokenizer(self, model_dir: str):
        from jaxserve.tokenizer import load_tokenizer

        path = self.settings.tokenizer or model_dir
        try:
            return load_tokenizer(path)
        except FileNotFoundError:
            if self.settings.tokenizer is not None:
                raise
            logger.warning("no tokenizer in %s: only prompt_token_ids can be given, and outputs have no text", path)
            return None

    # ---- validation ----------------------------------------------------------------------------
    def _prompt_ids(self, prompts, prompt_token_ids) -> tuple[list[str | None], list[list[int]]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise RequestError("give exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            if isinstance(prompts, str):
                prompts = [prompts]
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: pass prompt_token_ids, or tokenizer=PATH")
            return list(prompts), [self.tokenizer.encode(p) for p in prompts]
        if prompt_token_ids and isinstance(prompt_token_ids[0], (int, np.integer)):
            prompt_token_ids = [prompt_token_ids]
        return [None] * len(prompt_token_ids), [[int(t) for t in ids] for ids in prompt_token_ids]

    def _check_request(self, ids: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if not ids:
            raise RequestError("a prompt must have at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id(s) {bad[:5]} are outside the vocabulary [0, {vocab})")
        limit = self.plan.max_model_len
        if len(ids) >= limit:
            raise RequestError(
                f"prompt of {len(ids)} tokens leaves no room to generate within max_model_len={limit}"
            )
        needed = -(-min(len(ids) + params.max_tokens, limit) // self.plan.page_size)
        if needed > self.plan.num_pages - 1:
            raise RequestError(
                f"prompt + max_tokens needs {needed} KV pages; the cache has {self.plan.num_pages - 1}"
            )

    # ---- generation ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        texts, all_ids = self._prompt_ids(prompts, prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(all_ids)
        if len(sampling_params) != len(all_ids):
            raise RequestError(f"{len(sampling_params)} SamplingParams for {len(all_ids)} prompts")
        for ids, params in zip(all_ids, sampling_params):
            self._check_request(ids, params)
        requests = list(zip(texts, all_ids, sampling_params))
        outputs: list[RequestOutput] = []
        group: list[tuple[int, str | None, list[int], SamplingParams]] = []
        for text, ids, params in requests:
            total = min(len(ids) + params.max_tokens, self.plan.max_model_len)
            replica = self._pick_replica(group, total)
            if replica is None:
                outputs += self._generate_group(group)
                group = []
                replica = self._pick_replica(group, total)
            seq_id = self._next_id
            self._next_id += 1
            # Reserve pages for the whole request, so a group never runs out mid-way.
            self.blocks.admit(seq_id, replica, ids)
            if not self.blocks.ensure_capacity(seq_id, total):
                raise RequestError(f"no KV pages left for a request of {total} tokens")
            group.append((seq_id, text, ids, params))
        return outputs + self._generate_group(group)

    def _pick_replica(self, group, total_tokens: int) -> int | None:
        """The replica with the most free pages that has room for one more sequence, if any."""
        counts = [0] * self.num_replicas
        for seq_id, *_ in group:
            counts[self.blocks.replica_of(seq_id)] += 1
        fits = [r for r in range(self.num_replicas)
                if counts[r] < self.settings.max_num_seqs and self.blocks.can_admit(r, total_tokens)]
        return max(fits, key=lambda r: (self.blocks.num_free_pages(r), -counts[r]), default=None)

    def _generate_group(self, group) -> list[RequestOutput]:
        """Prefill each prompt in chunks, then decode the whole group together until all stop.

        The continuous-batching engine replaces this loop with iteration-level scheduling.
        """
        seq_ids = [g[0] for g in group]
        all_ids = [g[2] for g in group]
        all_params = [g[3] for g in group]
        generated: list[list[int]] = [[] for _ in group]
        finish: list[str | None] = [None] * len(group)
        chunk = max(self.runner.buckets.chunk_sizes)
        for i, (seq_id, _, ids, params) in enumerate(group):
            for pos in range(0, len(ids), chunk):
                row = RowWork(ids[pos : pos + chunk], pos, self.blocks.page_table(seq_id),
                              self._sampling_row(seq_id, params, 0), self.blocks.replica_of(seq_id))
                token = int(self.runner.execute([row])[0])
            self._append(i, token, ids, params, generated, finish)

        while True:
            active = [i for i in range(len(seq_ids)) if finish[i] is None]
            if not active:
                break
            rows = [
                RowWork([generated[i][-1]], len(all_ids[i]) + len(generated[i]) - 1,
                        self.blocks.page_table(seq_ids[i]),
                        self._sampling_row(seq_ids[i], all_params[i], len(generated[i])),
                        self.blocks.replica_of(seq_ids[i]))
                for i in active
            ]
            for i, token in zip(active, self.runner.execute(rows)):
                self._append(i, int(token), all_ids[i], all_params[i], generated, finish)

        for seq_id in seq_ids:
            self.blocks.free(seq_id)
        return [
            RequestOutput(
                request_id=str(seq_id),
                prompt=text,
                prompt_token_ids=list(ids),
                outputs=[CompletionOutput(0, out, self._detokenize(out), reason)],
                finished=True,
            )
            for (seq_id, text, ids, _), out, reason in zip(group, generated, finish)
        ]

    def _sampling_row(self, seq_id: int, params: SamplingParams, step: int) -> tuple:
        seed = params.seed if params.seed is not None else (self.settings.seed * 1_000_003 + seq_id) % 2**32
        return (params.temperature, params.top_k, params.top_p, seed, step)

    def _append(self, i, token, prompt, params, generated, finish) -> None:
        generated[i].append(token)
        eos = () if params.ignore_eos else self._eos_ids()
        if token in eos or token in params.stop_token_ids:
            finish[i] = "stop"
        elif len(generated[i]) >= params.max_tokens or len(prompt) + len(generated[i]) >= self.plan.max_model_len:
            finish[i] = "length"

    def _eos_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return tuple(self.tokenizer.eos_token_ids)
        return self.model_config.eos_token_ids

    def _detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""
