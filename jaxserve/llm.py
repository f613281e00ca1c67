"""Offline generation in the shape users know from vLLM: `LLM(model=...).generate(prompts, SamplingParams(...))`,
and `LLM.chat(messages)`, rendered with the server's chat template."""

from __future__ import annotations

import itertools
import time
from typing import Any, Mapping, Sequence

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.llm_engine import LLMEngine
from jaxserve.engine.pooling import embed_prompts
from jaxserve.pooling_engine import PoolingEngine
from jaxserve.engine.output_processor import OutputAccumulator
from jaxserve.engine.overlap import Overlap
from jaxserve.engine.processor import EngineRequest, Prompt
from jaxserve.errors import ConfigError, RequestError
from jaxserve.config.generation_config import load_generation_defaults
from jaxserve.loading.model_source import resolve_model_settings
from jaxserve.lora.request import LoRARequest
from jaxserve.planning.memory import apply_memory_utilization
from jaxserve.sampling.params import RequestOutput, SamplingParams


class LLM:
    """Load a model once, then generate for batches of prompts through the continuous-batching engine.

    `model`: a model directory, a GGUF file, a Hugging Face model ID, or None for the default model
    (SmolLM2-135M-Instruct, also named "SmolLM2-135M-Instruct")."""

    def __init__(self, model: str | None = None, *, warm_up: bool = True, **settings: Any):
        if "speculative_config" in settings:  # vLLM's spelling: {"method": ..., "model": ..., ...}
            settings = _with_speculative_config(settings)
        try:
            config = EngineConfig.from_dict({"model": model, **settings})
        except TypeError as err:
            raise ConfigError(str(err)) from None
        # A GGUF file, a hub ID or no model (the default) becomes a local directory, before anything compiles.
        config = resolve_model_settings(config)
        apply_memory_utilization(config.gpu_memory_utilization)  # before JAX's backend starts, if it has not
        # Before the engine compiles: a generation_config that cannot be used fails at once.
        self.generation_defaults = load_generation_defaults(config)
        # runner="pooling": an embeddings engine (LLM.embed, docs/embeddings.md) in place of generation
        self.engine = PoolingEngine(config, warm_up) if config.pooling else LLMEngine(config, warm_up=warm_up)
        self.overlap = None if config.pooling else Overlap(self.engine)  # the step loop: steps in flight
        self._ids = itertools.count()
        self._chat_renderer = None  # built on the first chat() call

    # The pieces tests and research code look at.
    config = property(lambda self: self.engine.config)
    model_config = property(lambda self: self.engine.model_config)
    tokenizer = property(lambda self: self.engine.tokenizer)
    memory = property(lambda self: self.engine.memory)
    runner = property(lambda self: self.engine.runner)
    blocks = property(lambda self: self.engine.blocks)

    def close(self) -> None:
        """Release the engine's compiled executables, weights and KV cache now (idempotent); generating
        afterwards raises EngineClosedError. On a CPU each executable's code is mapped into the process
        and Linux caps the mappings (vm.max_map_count), so a script building several engines closes
        each before the next, or uses `with LLM(...) as llm:`."""
        if self.overlap is not None:
            self.overlap.close()  # the steps still in flight are dropped with the engine
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def embed(
        self,
        prompts: Any = None,
        pooling_params: Any = None,
        use_tqdm: bool = True,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        dimensions: int | None = None,
    ) -> list:
        """vLLM's `LLM.embed` (an engine of runner="pooling"): one output per prompt, in order, each
        with `.outputs.embedding`. `prompts`: a text, texts, or {"prompt_token_ids": [...]} dicts;
        `pooling_params` (or `dimensions`): a Matryoshka model's output size. docs/embeddings.md."""
        return embed_prompts(self.engine, prompts, prompt_token_ids, pooling_params, dimensions)

    # ---- training loops: new weights, pause, sleep (jaxserve/runner/weight_control.py, docs/training_loop.md)
    def update_weights(self, params: Any = None, weight_version: int | str | None = None, **options: Any):
        """Serve new weights from the next generate on, compiling nothing (`LLMEngine.update_weights`:
        a Params pytree, a mapping of HF names to arrays, or (name, array) chunks; `draft_params=`,
        `copy=`). Returns its UpdateReport."""
        self.overlap.flush()  # a step left in flight reads the old weights first
        return self.engine.update_weights(params, weight_version, **options)

    def pause(self, mode: str = "abort") -> list[RequestOutput]:
        """vLLM's pause: "abort", "wait" or "keep" the requests in the engine; generate refuses until resume()."""
        self.overlap.flush()
        return self.engine.pause(mode)

    def resume(self) -> None:
        self.engine.resume()

    def is_paused(self) -> bool:
        return self.engine.is_paused()

    def sleep(self, level: int = 1) -> list[RequestOutput]:
        """vLLM's sleep: level 1 weights to host memory, level 2 discarded; the KV cache discarded."""
        self.overlap.flush()
        return self.engine.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Weights and KV cache back on the devices, or only `tags` ("weights", "kv_cache")."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Every request is validated before any runs.
        `lora_request`: the adapter every prompt runs under, or one per prompt (None: the base model),
        as in vLLM; an adapter not yet loaded is loaded from its `lora_path`."""
        if prompt_token_ids is not None and prompt_token_ids and isinstance(prompt_token_ids[0], (int, np.integer)):
            prompt_token_ids = [prompt_token_ids]
        if isinstance(prompts, str):
            prompts = [prompts]
        return self._generate(self._prompts(prompts, prompt_token_ids), sampling_params, use_tqdm, lora_request)

    def _prompts(self, texts: Sequence[str] | None, ids: Sequence[Sequence[int]] | None) -> list[Prompt]:
        processor = self.engine.processor
        if (texts is None) == (ids is None):
            return [processor.prompt(texts, ids)]  # refused: exactly one of them
        if texts is not None:
            return [processor.prompt(text) for text in texts]
        return [processor.prompt(token_ids=one) for one in ids]

    def _generate(
        self,
        prompts: list[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
    ) -> list[RequestOutput]:
        """Every prompt through the processor (all checked, every grammar compiled) before any is queued."""
        self.engine.check_serving()  # asleep, paused, or weights deleted: refused before anything is queued
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise RequestError(f"{len(sampling_params)} SamplingParams for {len(prompts)} prompts")
        adapters = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(adapters) != len(prompts):
            raise RequestError(f"{len(adapters)} LoRA requests for {len(prompts)} prompts")
        requests = [
            self.engine.processor.process(f"llm-{next(self._ids)}", prompt, params, lora_request=adapter)
            for prompt, params, adapter in zip(prompts, sampling_params, adapters)
        ]
        for adapter in dict.fromkeys(a for a in adapters if a is not None):  # each loaded (or refused) first
            self.engine.resolve_lora(adapter)
        # Structured output: a spec the library rejects raises GrammarError here, with nothing queued.
        for request in requests:
            if request.grammar is not None:
                request.grammar.result()
        for request in requests:
            self.engine.admit(request)
        return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a list of
        them, as vLLM's `LLM.chat`: each is rendered with the chat template /v1/chat/completions uses
        (`chat_template`: a template or a file, else the `chat_template` setting, else the checkpoint's,
        else ChatML), tokenized without special tokens (the template writes its own BOS), and generated
        as `generate(prompt_token_ids=...)` would (`lora_request` too); one RequestOutput per
        conversation, `prompt` the rendered text. sampling_params None: the model's generation defaults."""
        from jaxserve.server.chat import build_chat_renderer

        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        if not conversations:
            raise RequestError("chat needs at least one conversation of at least one message")
        renderer = None  # without a tokenizer the processor refuses chat before it renders
        if chat_template is not None and self.tokenizer is not None:
            renderer = build_chat_renderer(self.tokenizer, chat_template)
        elif self.tokenizer is not None:
            if self._chat_renderer is None:
                self._chat_renderer = build_chat_renderer(self.tokenizer, self.config.chat_template)
            renderer = self._chat_renderer
        prompts = [
            self.engine.processor.chat_prompt(
                conversation,
                renderer,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
            )
            for conversation in conversations
        ]
        return self._generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run(self, requests: list[EngineRequest], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        order = [request.request_id for request in requests]
        done: dict[str, RequestOutput] = {}
        totals = OutputAccumulator()  # the engine emits what is new per step; the caller gets whole outputs
        wanted = set(order)
        start, tokens = time.perf_counter(), 0
        with tqdm(total=len(order), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while len(done) < len(order):
                for delta in self.overlap.step():
                    if delta.request_id not in wanted:  # added to the engine by someone else
                        continue
                    tokens += sum(len(c.token_ids) for c in delta.outputs)
                    out = totals.add(delta)
                    if out.finished:
                        done[out.request_id] = totals.pop(out.request_id)
                        bar.update(1)
                        bar.set_postfix(out_tok_s=f"{tokens / (time.perf_counter() - start):.1f}")
        results = [done[request_id] for request_id in order]
        for result, request in zip(results, requests):
            result.prompt = request.prompt
        return results


def _with_speculative_config(settings: dict[str, Any]) -> dict[str, Any]:
    """`speculative_config` (vLLM's dict, or its JSON) as the speculative settings it names; a setting
    also given on its own must agree."""
    import json

    from jaxserve.config.vllm_flags import speculative_settings

    settings = dict(settings)
    config = settings.pop("speculative_config")
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as err:
            raise ConfigError(f"speculative_config is not JSON: {err}") from None
    for name, value in speculative_settings(config).items():
        value = value if name in ("speculative_method", "speculative_model") else int(value)
        if name in settings and settings[name] != value:
            raise ConfigError(f"speculative_config sets {name}={value!r} but {name}={settings[name]!r} was given too")
        settings[name] = value
    return settings
