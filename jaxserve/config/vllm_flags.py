"""vLLM's `serve` flags that are not jaxserve settings: each is implemented, accepted with one log line, or refused.

A vLLM launch line should start jaxserve or stop at once with a sentence, never with argparse's
"unrecognized arguments". jaxserve's own settings already carry most of vLLM's spellings
(`--max-model-len`, `-tp`, `--enable-prefix-caching`, ...); this module adds the rest, in three kinds:

- **mapped**: vLLM's flag sets one of our settings with vLLM's meaning (`--block-size` is `page_size`,
  `--num-gpu-blocks-override` `num_pages`, `--kv-cache-memory-bytes` `kv_cache_memory`,
  `--enable-expert-parallel` `moe_parallelism=expert`,
  `--speculative-config` the speculative settings, `--dtype half`, `--quantization awq`, `--load-format gguf`);
- **no-op**: accepted, and one log line says why it changes nothing here (`--trust-remote-code`: no
  remote code runs; `--disable-log-requests`: no request contents are logged);
- **refused**: exit 2 with what to use instead (`--pipeline-parallel-size 2`, `--cpu-offload-gb 8`).

`add_arguments(parser)` registers them on the serve parser (after `EngineConfig.add_cli_arguments`);
`apply(ns)` runs once on the parsed namespace, before the settings are built: it rewrites mapped
flags into settings, logs the no-ops and raises ConfigError for refusals. `docs/coming-from-vllm.md`
is the table a user reads; tests/test_vllm_launch_lines.py feeds real launch lines through both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Callable

from jaxserve.errors import ConfigError

MULTIHOST = (
    "several hosts are one job of --num-processes N --process-id I --coordinator-address HOST:PORT "
    "(docs/multihost.md), or replicas on Ray Serve (jaxserve serve-ray, docs/scale-out.md)"
)


@dataclasses.dataclass(frozen=True)
class Flag:
    """A vLLM flag with no setting here: a no-op (`why` is logged) unless `refuse(value)` says the value asks
    for something jaxserve does not do; then `refusal` is the error. `switch`: takes no value (vLLM's
    `--x` / `--no-x`), else one value."""

    flags: tuple[str, ...]
    why: str
    switch: bool = False
    refuse: Callable[[Any], bool] | None = None
    refusal: str = ""

    @property
    def dest(self) -> str:
        return "vllm_" + self.flags[0].lstrip("-").replace("-", "_")


def _above(limit: float) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        try:
            return float(value) > limit
        except ValueError:
            return True

    return check


def _not_in(*accepted: str) -> Callable[[Any], bool]:
    return lambda value: str(value).lower() not in accepted


_ALWAYS = lambda value: True  # noqa: E731 - a refusal whatever the value

FLAGS = (
    Flag(
        ("--trust-remote-code",),
        "no remote code runs here: jaxserve implements each model family itself (config.json's architecture picks it)",
        switch=True,
    ),
    Flag(
        ("--disable-log-requests",),
        "jaxserve does not log prompts or outputs (the access log lists method and "
        "path only; --no-access-log drops it)",
        switch=True,
    ),
    Flag(("--enable-log-requests",), "jaxserve does not log prompts or outputs", switch=True),
    Flag(("--enable-log-outputs",), "jaxserve does not log prompts or outputs", switch=True),
    Flag(("--max-log-len",), "jaxserve does not log prompts or outputs"),
    Flag(("--disable-log-stats",), "jaxserve logs no periodic stats; /metrics serves them", switch=True),
    Flag(
        ("--enable-chunked-prefill",),
        "prompts are always prefilled in chunks beside the decodes, within "
        "--max-num-batched-tokens per step (the ragged step)",
        switch=True,
    ),
    Flag(("--use-v2-block-manager",), "an old vLLM flag: KV pages are always paged", switch=True),
    Flag(("--swap-space",), "preempted sequences are recomputed, never swapped to host memory"),
    Flag(("--disable-custom-all-reduce",), "collectives are XLA's", switch=True),
    Flag(("--distributed-executor-backend",), "one process drives every local device; " + MULTIHOST),
    Flag(("--max-parallel-loading-workers",), "weights load one file at a time, memory-mapped"),
    Flag(
        ("--disable-frontend-multiprocessing",),
        "the HTTP server and the engine share one process (the engine steps in its own thread)",
        switch=True,
    ),
    Flag(("--max-seq-len-to-capture",), "no CUDA graphs: XLA compiles every step bucket (see --enforce-eager)"),
    Flag(("--cuda-graph-sizes",), "no CUDA graphs: XLA compiles every step bucket (see --enforce-eager)"),
    Flag(
        ("--compilation-config", "-O"),
        "no torch.compile or CUDA graphs: XLA compiles every step bucket at "
        "start-up (--enforce-eager: on first use instead)",
    ),
    Flag(("--guided-decoding-backend",), "structured output always runs on llguidance"),
    Flag(("--structured-outputs-config",), "structured output always runs on llguidance"),
    Flag(
        ("--enable-reasoning",), "--reasoning-parser alone turns reasoning output on, as in current vLLM", switch=True
    ),
    Flag(("--limit-mm-per-prompt",), "jaxserve serves text only: requests with images or audio are refused"),
    Flag(("--model-impl",), "jaxserve runs its own JAX implementation of each model family"),
    Flag(
        ("--disable-sliding-window",),
        "a model's sliding window stays (a model without one, such as Llama, is "
        "unaffected); cap --max-model-len at the window for vLLM's behaviour",
        switch=True,
    ),
    Flag(("--fully-sharded-loras",), "LoRA stacks are sharded as their base weights are", switch=True),
    Flag(("--lora-dtype",), "adapters run in the model's dtype"),
    Flag(("--uvicorn-log-level",), "use --log-level (debug, info, warning, error)"),
    Flag(
        ("--tokenizer-mode",),
        "the tokenizer is the model's tokenizer.json or tokenizer.model",
        refuse=_not_in("auto", "hf", "slow"),
        refusal="jaxserve reads Hugging Face's tokenizer.json or tokenizer.model, not Mistral's tekken files: serve "
        "a checkpoint in Hugging Face's layout (or a GGUF file) and drop the flag",
    ),
    Flag(
        ("--config-format",),
        "config.json is read (Hugging Face's layout)",
        refuse=_not_in("auto", "hf"),
        refusal="jaxserve reads config.json (Hugging Face's layout) or a GGUF file's metadata: serve such a "
        "checkpoint and drop the flag",
    ),
    Flag(
        ("--scheduling-policy",),
        "requests are served first come, first served",
        refuse=_not_in("fcfs"),
        refusal="requests are served first come, first served (no priorities): drop the flag",
    ),
    Flag(
        ("--task",),
        "text generation is what jaxserve serves",
        refuse=_not_in("auto", "generate"),
        refusal="--task serves text generation only here: serve embeddings with --runner pooling --convert embed",
    ),
    Flag(("--language-model-only",), "jaxserve serves text only", switch=True),
    Flag(
        ("--calculate-kv-scales",),
        "an fp8 KV cache's scales are the checkpoint's k_scale / v_scale, else 1.0; "
        "none are computed from the first batch",
        switch=True,
    ),
    Flag(
        ("--api-server-count", "-asc"),
        "one HTTP server process",
        refuse=_above(1),
        refusal="one HTTP server process per engine: more of both are replicas on Ray Serve (jaxserve serve-ray, "
        "docs/scale-out.md)",
    ),
    Flag(
        ("--default-chat-template-kwargs",),
        "",
        refuse=_ALWAYS,
        refusal="no server-wide template arguments: send chat_template_kwargs with each request (e.g. "
        '{"enable_thinking": false}), or give --chat-template a template with the default you want',
    ),
    Flag(
        ("--pipeline-parallel-size", "-pp"),
        "one pipeline stage is what jaxserve runs",
        refuse=_above(1),
        refusal="no pipeline parallelism: split the model over devices with --tensor-parallel-size (-tp), and "
        "across hosts by making the mesh span them: " + MULTIHOST,
    ),
    Flag(
        ("--cpu-offload-gb",),
        "no weights are offloaded",
        refuse=_above(0),
        refusal="weights stay in device memory: shard them over more devices (-tp N) or store them smaller "
        "(--quantization int8 or int4)",
    ),
    Flag(
        ("--hf-overrides",),
        "",
        refuse=_ALWAYS,
        refusal="edit the model's config.json instead (a copy of the model directory)",
    ),
    Flag(
        ("--tool-parser-plugin",),
        "",
        refuse=_ALWAYS,
        refusal="tool-call parsers are built in (--tool-call-parser hermes or llama3_json); no plugins are loaded",
    ),
    Flag(
        ("--ssl-keyfile",),
        "",
        refuse=_ALWAYS,
        refusal="jaxserve serves plain HTTP: terminate TLS in front of it (a reverse proxy or the load balancer)",
    ),
    Flag(
        ("--ssl-certfile",),
        "",
        refuse=_ALWAYS,
        refusal="jaxserve serves plain HTTP: terminate TLS in front of it (a reverse proxy or the load balancer)",
    ),
    Flag(("--headless",), "", switch=True, refuse=lambda value: value, refusal="no headless engines: " + MULTIHOST),
    Flag(
        ("--data-parallel-address",),
        "",
        refuse=_ALWAYS,
        refusal="no multi-node data parallelism of vLLM's kind: " + MULTIHOST,
    ),
    Flag(("--nnodes",), "one node is what a jaxserve process spans", refuse=_above(1), refusal=MULTIHOST),
)

# vLLM's --dtype spellings of our dtypes.
DTYPE_SPELLINGS = {"half": "float16", "float": "float32"}

# vLLM's --quantization methods: the checkpoint method each one names (served as int4 as stored), or None
# for a refusal (the sentence beside it).
QUANTIZATION = {
    "awq": "awq",
    "awq_marlin": "awq",
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "gguf": None,
    "fp8": None,
    "fbgemm_fp8": None,
    "ptpc_fp8": None,
    "modelopt": None,
    "modelopt_fp4": None,
    "mxfp4": None,
    "bitsandbytes": None,
    "compressed-tensors": None,
    "experts_int8": None,
}
_QUANT_REFUSALS = {
    "gguf": "a GGUF file loads without it (its Q8_0 weights as int8 with --quantization int8, Q4_0/Q4_1 as int4 "
    "with --quantization int4); drop the flag",
    "bitsandbytes": "jaxserve quantizes at load itself: --quantization int8 (weight-only) or int4",
    "compressed-tensors": "compressed-tensors checkpoints are not read; AWQ and GPTQ 4-bit ones are "
    "(docs/quantized_checkpoints.md), and a float checkpoint quantizes at load with "
    "--quantization int8 or int4",
    "experts_int8": "--quantization int8 quantizes every linear layer, experts included",
}
_FP_REFUSAL = (
    "no fp8/fp4 weights here: --quantization int8 (weight-only int8, about the same bytes as fp8) or "
    "int4; an fp8 KV cache is --kv-cache-dtype"
)

# vLLM's --load-format values that are not ours: our value, or None for a refusal.
LOAD_FORMATS = {
    "gguf": "auto",
    "pt": None,
    "npcache": None,
    "bitsandbytes": None,
    "mistral": None,
    "tensorizer": None,
    "runai_streamer": None,
    "sharded_state": None,
}
_LOAD_REFUSALS = {
    "pt": "pickle weights (*.bin, *.pt) are refused: loading them runs code; use the model's safetensors",
    "bitsandbytes": "jaxserve quantizes at load itself: --quantization int8 or int4 with the float checkpoint",
    "mistral": "jaxserve reads Hugging Face's layout (config.json + safetensors) or a GGUF file, not Mistral's "
    "consolidated files",
}

SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags that are not settings, in one `--help` group, and vLLM's extra values of shared flags."""
    g = parser.add_argument_group(
        "vLLM flags (docs/coming-from-vllm.md): mapped onto settings, accepted with no effect, or refused"
    )
    for flag in FLAGS:
        if flag.switch:
            g.add_argument(
                *flag.flags,
                dest=flag.dest,
                default=argparse.SUPPRESS,
                action=argparse.BooleanOptionalAction,
                help=flag.refusal or f"no effect: {flag.why}",
            )
        else:
            g.add_argument(
                *flag.flags,
                dest=flag.dest,
                default=argparse.SUPPRESS,
                metavar="VALUE",
                help=(
                    f"refused: {flag.refusal}"
                    if flag.refuse is _ALWAYS
                    else f"no effect: {flag.why}" + (f"; refused otherwise: {flag.refusal}" if flag.refusal else "")
                ),
            )
    g.add_argument(
        "--block-size",
        dest="vllm_block_size",
        default=argparse.SUPPRESS,
        metavar="N",
        help="vLLM's name of --page-size (tokens per KV-cache page)",
    )
    g.add_argument(
        "--num-gpu-blocks-override",
        dest="vllm_num_gpu_blocks_override",
        default=argparse.SUPPRESS,
        metavar="N",
        help="vLLM's name of --num-pages (KV-cache pages per replica)",
    )
    g.add_argument(
        "--kv-cache-memory-bytes",
        dest="vllm_kv_cache_memory_bytes",
        default=argparse.SUPPRESS,
        metavar="BYTES",
        help="vLLM's name of --kv-cache-memory (the KV cache's bytes per replica)",
    )
    g.add_argument(
        "--enable-expert-parallel",
        dest="vllm_enable_expert_parallel",
        default=argparse.SUPPRESS,
        action=argparse.BooleanOptionalAction,
        help="vLLM's spelling of --moe-parallelism expert (whole experts per device)",
    )
    g.add_argument(
        "--speculative-config",
        dest="vllm_speculative_config",
        default=argparse.SUPPRESS,
        metavar="JSON",
        help='vLLM\'s speculative decoding as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}, {"model": DRAFT, "num_speculative_tokens": 4} or {"method": "eagle3", '
        '"model": HEAD, "num_speculative_tokens": 4}; sets the --speculative-* settings (other methods, '
        "such as eagle (EAGLE-1) or mtp, are refused)",
    )
    g.add_argument(
        "--disable-uvicorn-access-log",
        dest="no_access_log",
        action="store_true",
        default=argparse.SUPPRESS,
        help="vLLM's spelling of --no-access-log",
    )
    _widen(parser, "--dtype", DTYPE_SPELLINGS)
    _widen(parser, "--quantization", QUANTIZATION)
    _widen(parser, "--load-format", LOAD_FORMATS)


def _widen(parser: argparse.ArgumentParser, option: str, extra: dict[str, Any]) -> None:
    """Let argparse take vLLM's values of a shared flag; `apply` maps or refuses them."""
    action = parser._option_string_actions.get(option)
    if action is not None and action.choices is not None:
        action.choices = tuple(action.choices) + tuple(v for v in extra if v not in action.choices)


def apply(ns: argparse.Namespace) -> list[str]:
    """Map or refuse the vLLM flags `ns` holds (ConfigError: refused); returns one line per flag accepted with no
    effect, saying why (the server logs them once its logging is set up: parsing comes first).

    Mapped flags write the settings they stand for into `ns` (absent settings stay absent, so YAML and
    defaults still apply); a mapped flag given beside its setting must agree with it."""
    notes = []
    for flag in FLAGS:
        if not hasattr(ns, flag.dest):
            continue
        value = getattr(ns, flag.dest)
        delattr(ns, flag.dest)
        shown = flag.flags[0] if flag.switch else f"{flag.flags[0]} {value}"
        if flag.switch and not value:
            shown = "--no-" + flag.flags[0][2:]
        if flag.refuse is not None and flag.refuse(value):
            raise ConfigError(f"{shown}: {flag.refusal}")
        notes.append(f"{shown}: accepted, no effect: {flag.why}")
    _map(ns, "vllm_block_size", "page_size", "--block-size", "--page-size", int)
    _map(ns, "vllm_num_gpu_blocks_override", "num_pages", "--num-gpu-blocks-override", "--num-pages", int)
    _map(ns, "vllm_kv_cache_memory_bytes", "kv_cache_memory", "--kv-cache-memory-bytes", "--kv-cache-memory", str)
    if hasattr(ns, "vllm_enable_expert_parallel"):
        value = "expert" if ns.vllm_enable_expert_parallel else "tensor"
        del ns.vllm_enable_expert_parallel
        _set(ns, "moe_parallelism", value, "--enable-expert-parallel", "--moe-parallelism")
    if hasattr(ns, "vllm_speculative_config"):
        _speculative(ns, ns.vllm_speculative_config)
        del ns.vllm_speculative_config
    if getattr(ns, "dtype", None) in DTYPE_SPELLINGS:
        ns.dtype = DTYPE_SPELLINGS[ns.dtype]
    _quantization(ns)
    load_format = getattr(ns, "load_format", None)
    if load_format in LOAD_FORMATS:
        if LOAD_FORMATS[load_format] is None:
            raise ConfigError(
                f"--load-format {load_format}: "
                + _LOAD_REFUSALS.get(
                    load_format,
                    "not a format jaxserve reads: auto (safetensors or orbax; a GGUF file by its name), "
                    "safetensors, orbax or dummy",
                )
            )
        ns.load_format = LOAD_FORMATS[load_format]
    return notes


def _set(ns: argparse.Namespace, name: str, value: Any, vllm_flag: str, our_flag: str) -> None:
    if hasattr(ns, name) and str(getattr(ns, name)) != str(value):
        raise ConfigError(f"{vllm_flag} and {our_flag} disagree ({value} against {getattr(ns, name)}): give one")
    setattr(ns, name, value)


def _map(ns: argparse.Namespace, dest: str, name: str, vllm_flag: str, our_flag: str, kind: type) -> None:
    if not hasattr(ns, dest):
        return
    raw = getattr(ns, dest)
    delattr(ns, dest)
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigError(f"{vllm_flag} takes a number, got {raw!r}") from None
    _set(ns, name, value, vllm_flag, our_flag)


def _speculative(ns: argparse.Namespace, text: str) -> None:
    """vLLM's --speculative-config JSON -> speculative_method, speculative_model, num_speculative_tokens,
    prompt_lookup_min/max (each also a flag here; given twice, they must agree)."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"--speculative-config is not JSON: {err}") from None
    for name, value in speculative_settings(config, "--speculative-config").items():
        _set(ns, name, value, "--speculative-config", "--" + name.replace("_", "-"))


def speculative_settings(config: Any, where: str = "speculative_config") -> dict[str, str]:
    """vLLM's speculative config (a dict: `--speculative-config`'s JSON, `LLM(speculative_config=...)`)
    as jaxserve's settings, each value a string for its parser."""
    if not isinstance(config, dict):
        raise ConfigError(f'{where} takes a JSON object such as {{"method": "ngram", "num_speculative_tokens": 4}}')
    unknown = sorted(set(config) - set(SPECULATIVE_KEYS))
    if unknown:
        raise ConfigError(
            f"{where}: {', '.join(map(repr, unknown))} not served here; the keys read are {', '.join(SPECULATIVE_KEYS)}"
        )
    method = config.get("method") or ("draft_model" if config.get("model") else None)
    if method == "ngram":
        values = {"speculative_method": "ngram"}
    elif method in ("draft_model", "draft", "eagle3"):
        if not config.get("model"):
            what = "an EAGLE-3 head" if method == "eagle3" else "a draft model"
            raise ConfigError(f'{where}: {what} needs "model": a directory or Hugging Face ID')
        values = {
            "speculative_method": "eagle3" if method == "eagle3" else "draft",
            "speculative_model": str(config["model"]),
        }
    else:
        raise ConfigError(
            f'{where} method {method!r}: jaxserve speculates with an EAGLE-3 head ({{"method": "eagle3", '
            '"model": HEAD, ...}), a draft model ({"model": DRAFT, ...}) or n-gram prompt lookup '
            '({"method": "ngram", ...}); EAGLE-1, MTP, Medusa and suffix decoding are not implemented'
        )
    for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
        if key in config:
            values[key] = str(config[key])
    return values


def _quantization(ns: argparse.Namespace) -> None:
    """vLLM's --quantization methods: AWQ / GPTQ name the checkpoint's own 4-bit weights (served as int4 once
    `check_checkpoint_quantization` has seen the checkpoint), the rest are refused with what to use."""
    value = getattr(ns, "quantization", None)
    if value not in QUANTIZATION:
        return
    method = QUANTIZATION[value]
    if method is None:
        raise ConfigError(f"--quantization {value}: " + _QUANT_REFUSALS.get(value, _FP_REFUSAL))
    del ns.quantization  # the checkpoint decides (implied_quantization); the method is checked against it
    ns.vllm_quantization_method = method
