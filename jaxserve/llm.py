"""Offline generation in the shape users know from vLLM: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.errors import ConfigError, RequestError
from jaxserve.generation_config import load_generation_defaults
from jaxserve.sampling_params import RequestOutput, SamplingParams


class LLM:
    """Load a model once, then generate for batches of prompts through the continuous-batching engine."""

    def __init__(self, model: str | None = None, *, warm_up: bool = True, **settings: Any):
        try:
            config = EngineConfig.from_dict({"model": model, **settings})
        except TypeError as err:
            raise ConfigError(str(err)) from None
        # Before the engine compiles: a generation_config that cannot be used fails at once.
        self.generation_defaults = load_generation_defaults(config)
        self.engine = LLMEngine(config, warm_up=warm_up)
        self._ids = itertools.count()

    # The pieces tests and research code look at.
    settings = property(lambda self: self.engine.settings)
    model_config = property(lambda self: self.engine.model_config)
    tokenizer = property(lambda self: self.engine.tokenizer)
    plan = property(lambda self: self.engine.plan)
    runner = property(lambda self: self.engine.runner)
    blocks = property(lambda self: self.engine.blocks)

    def close(self) -> None:
        """Release the engine's compiled executables, weights and KV cache now (idempotent); generating
        afterwards raises EngineClosedError. On a CPU each executable's code is mapped into the process
        and Linux caps the mappings (vm.max_map_count), so a script building several engines closes
        each before the next, or uses `with LLM(...) as llm:`."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no SamplingParams: the model's generation_config.json values
        (`do_sample: false` is greedy) over SamplingParams' own defaults, as vLLM's method of this name."""
        return self.generation_defaults.sampling_params()

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Every request is validated before any runs."""
        if (prompts is None) == (prompt_token_ids is None):
            raise RequestError("give exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            texts = [prompts] if isinstance(prompts, str) else list(prompts)
            all_ids = [self.engine.encode(t) for t in texts]
        else:
            if prompt_token_ids and isinstance(prompt_token_ids[0], (int, np.integer)):
                prompt_token_ids = [prompt_token_ids]
            all_ids = [[int(t) for t in ids] for ids in prompt_token_ids]
            texts = [None] * len(all_ids)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(all_ids)
        if len(sampling_params) != len(all_ids):
            raise RequestError(f"{len(sampling_params)} SamplingParams for {len(all_ids)} prompts")
        for ids, params in zip(all_ids, sampling_params):
            self.engine.check_request(ids, params)

        order = []
        for text, ids, params in zip(texts, all_ids, sampling_params):
            request_id = f"llm-{next(self._ids)}"
            self.engine.add_request(request_id, None, params, ids)
            order.append(request_id)
        return self._run(order, texts, use_tqdm)

    def _run(self, order: list[str], texts: list[str | None], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        done: dict[str, RequestOutput] = {}
        start, tokens = time.perf_counter(), 0
        with tqdm(total=len(order), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while len(done) < len(order):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix(out_tok_s=f"{tokens / (time.perf_counter() - start):.1f}")
        results = [done[request_id] for request_id in order]
        for result, text in zip(results, texts):
            result.prompt = text
        return results
