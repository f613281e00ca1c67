"""`jaxserve serve-ray`: jaxserve's OpenAI server over replicas on Ray Serve (docs/scale-out.md).

    jaxserve serve-ray [MODEL] [every flag of jaxserve serve]
        [--num-replicas N | --min-replicas N --max-replicas M [--target-ongoing-requests K]]
        [--ray-address ADDR] [--replica-resources '{"GPU": 1}'] [--router prefix|pow2]
        [--num-processes N [--placement-strategy STRICT_SPREAD|SPREAD|PACK]]

`--num-processes N` makes each replica one multi-host engine of N jax.distributed processes placed
by a placement group per replica (multihost_replica.py); --replica-resources is then per process.

Starts a local Ray instance, or joins `--ray-address` / $RAY_ADDRESS, deploys the application
(deployments.py) at "/" on --host:--port, and serves until SIGTERM/SIGINT, when the application is
deleted: Serve lets in-flight requests finish for up to --grace-seconds. The same application runs
under `serve run` through `app_builder` (its args are these flags' names: `config=small num_replicas=2`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
from typing import Any, Mapping, Sequence

from jaxserve.errors import ConfigError, JaxServeError
from jaxserve.serving.ray.multihost_replica import PLACEMENT_STRATEGIES

logger = logging.getLogger("jaxserve.serve_ray")

# jaxserve serve's flags that serve-ray refuses (spec_from_namespace, _replica_settings): LoRA (the router and
# the replicas' ingress carry no adapter yet) and the multi-host addresses it chooses itself.
REFUSED_FLAGS = {
    "--enable-lora",
    "--no-enable-lora",
    "--lora-modules",
    "--max-loras",
    "--max-lora-rank",
    "--max-cpu-loras",
    "--lora-target-modules",
    "--allow-runtime-lora-updating",
    "--coordinator-address",
    "--process-id",
}


def build_parser(prog: str = "jaxserve serve-ray") -> argparse.ArgumentParser:
    from jaxserve.serve import build_parser as serve_parser

    parser = serve_parser(prog)
    parser.description = "OpenAI-compatible LLM server over jaxserve replicas on Ray Serve."
    for action in parser._actions:  # what serve-ray refuses is not offered in its --help (still refused if given)
        if set(action.option_strings) & REFUSED_FLAGS:
            action.help = argparse.SUPPRESS
    g = parser.add_argument_group("ray serve")
    g.add_argument("--num-replicas", type=int, default=None, help="a fixed number of engine replicas (default 1)")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscaling: the fewest engine replicas")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscaling: the most engine replicas")
    g.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=None,
        help="autoscaling: requests in flight per replica Serve aims for (default: max_num_seqs)",
    )
    g.add_argument("--upscale-delay-s", type=float, default=None, help="autoscaling: Serve's upscale_delay_s")
    g.add_argument("--downscale-delay-s", type=float, default=None, help="autoscaling: Serve's downscale_delay_s")
    g.add_argument(
        "--ray-address",
        default=os.environ.get("RAY_ADDRESS"),
        help="the Ray cluster to join (default: $RAY_ADDRESS, else a local Ray instance)",
    )
    g.add_argument(
        "--replica-resources",
        type=_resources,
        default={},
        help="each engine replica's Ray resources as JSON: '{\"GPU\": 1}', '{\"TPU\": 4}', '{\"CPU\": 2}' "
        "(default: 1 CPU)",
    )
    g.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=None,
        help="requests one engine replica takes at once (default: 4 x max_num_seqs)",
    )
    g.add_argument(
        "--router",
        default="prefix",
        choices=("prefix", "pow2"),
        help="prefix: the replica holding the prompt's prefix (else the less loaded of two); "
        "pow2: Ray's default, the less loaded of two random replicas",
    )
    g.add_argument(
        "--route-imbalance",
        type=int,
        default=8,
        help="prefix router: leave the prefix's replica when its queue is this much longer than the shortest",
    )
    g.add_argument(
        "--prefill-replicas",
        type=int,
        default=None,
        help="prefill and decode apart (docs/disaggregation.md): this many prefill replicas (kv_producer), "
        "with --decode-replicas decode replicas (kv_consumer); each request is prefilled on one, decoded on the other",
    )
    g.add_argument("--decode-replicas", type=int, default=None, help="with --prefill-replicas: the decode replicas")
    g.add_argument("--app-name", default="jaxserve", help="the Serve application's name")
    g.add_argument(
        "--placement-strategy",
        default="STRICT_SPREAD",
        choices=PLACEMENT_STRATEGIES,
        help="with --num-processes N > 1 (each replica one multi-host engine of N processes, each with "
        "--replica-resources): how Ray places a replica's N bundles. STRICT_SPREAD: one process "
        "per node (hosts); PACK: N processes on one node (trying it on one machine)",
    )
    g.add_argument(
        "--proxy-location",
        default="EveryNode",
        choices=("EveryNode", "HeadOnly", "Disabled"),
        help="where Serve runs its HTTP proxy (HeadOnly when several Ray nodes share one machine)",
    )
    return parser


def _resources(text: str) -> dict[str, float]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict) or not all(isinstance(v, (int, float)) and v >= 0 for v in value.values()):
        raise argparse.ArgumentTypeError('give an object of resource amounts, e.g. {"GPU": 1}')
    return value


def spec_from_namespace(ns: argparse.Namespace) -> Any:
    """The AppSpec the flags describe (the model resolved to a local directory). ConfigError: a bad mix."""
    from jaxserve.serving.ray.deployments import AppSpec

    autoscaled = any(v is not None for v in (ns.min_replicas, ns.max_replicas, ns.target_ongoing_requests))
    if autoscaled and ns.num_replicas is not None:
        raise ConfigError(
            "give --num-replicas (a fixed count) or --min-replicas/--max-replicas (autoscaling), not both"
        )
    settings, name, note, processes = _replica_settings(ns)
    if settings.enable_lora:  # the router and the replicas' ingress do not carry an adapter yet
        raise ConfigError(
            "serve-ray does not serve LoRA adapters yet: drop --enable-lora, or serve them with "
            "jaxserve serve (one machine)"
        )
    if processes > 1 and ns.mock_engine:
        raise ConfigError("--mock-engine runs in one process; drop --num-processes")
    disagg = ns.prefill_replicas is not None or ns.decode_replicas is not None
    if disagg:
        if (
            ns.prefill_replicas is None
            or ns.decode_replicas is None
            or min(ns.prefill_replicas, ns.decode_replicas) < 1
        ):
            raise ConfigError("--prefill-replicas and --decode-replicas go together, each >= 1")
        if autoscaled or ns.num_replicas is not None:
            raise ConfigError(
                "--prefill-replicas/--decode-replicas fix the replica counts: drop --num-replicas and autoscaling"
            )
        if ns.mock_engine or processes > 1:
            raise ConfigError(
                "prefill and decode apart need one-process real engines: drop --mock-engine/--num-processes"
            )
    autoscaling = None
    if autoscaled:
        low = 1 if ns.min_replicas is None else ns.min_replicas
        high = ns.max_replicas if ns.max_replicas is not None else max(low, 1)
        if not 0 <= low <= high or high < 1:
            raise ConfigError(f"need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1 (got {low}, {high})")
        autoscaling = {
            "min_replicas": low,
            "max_replicas": high,
            "target_ongoing_requests": ns.target_ongoing_requests or settings.max_num_seqs,
        }
        for key in ("upscale_delay_s", "downscale_delay_s"):
            if getattr(ns, key) is not None:
                autoscaling[key] = getattr(ns, key)
    elif (ns.num_replicas or 1) < 1:
        raise ConfigError("--num-replicas must be >= 1")
    server = dict(
        api_key=ns.api_key or None,
        max_waiting=ns.max_waiting,
        max_body_bytes=ns.max_body_bytes,
        device_bandwidth=ns.device_bandwidth,
        weights_note=note,
        tool_call_parser=ns.tool_call_parser if ns.enable_auto_tool_choice else None,
        reasoning_parser=ns.reasoning_parser,
    )
    if ns.served_model_name:
        server["served_model_names"] = tuple(ns.served_model_name)
    return AppSpec(
        settings=settings,
        model_name=name,
        server=server,
        num_replicas=None if autoscaled else (ns.num_replicas or 1),
        autoscaling=autoscaling,
        replica_resources=dict(ns.replica_resources),
        max_ongoing_requests=ns.max_ongoing_requests,
        prefix_routing=ns.router == "prefix",
        router_kwargs={"block_size": settings.page_size, "imbalance": ns.route_imbalance},
        grace_seconds=ns.grace_seconds,
        mock_engine=ns.mock_engine,
        mock_token_delay=ns.mock_token_delay,
        processes_per_replica=processes,
        placement_strategy=ns.placement_strategy,
        prefill_replicas=ns.prefill_replicas,
        decode_replicas=ns.decode_replicas,
    )


def _replica_settings(ns: argparse.Namespace) -> tuple[Any, str, str | None, int]:
    """resolve_settings for a replica: (settings of one process, name, note, processes per replica).

    `--num-processes N` (flag or YAML) makes each replica one multi-host engine of N processes; the
    replica picks its coordinator address itself (a free port on process 0's node) and gives each
    process its id, so those two settings are refused here."""
    from jaxserve.serve import resolve_settings

    if hasattr(ns, "coordinator_address") or hasattr(ns, "process_id"):  # settings' flags default to absent
        raise ConfigError(
            "serve-ray chooses each replica's --coordinator-address and --process-id itself; give only --num-processes"
        )
    # A placeholder lets a multi-process job's settings validate; no process ever sees it.
    settings, name, note = resolve_settings(argparse.Namespace(**{**vars(ns), "coordinator_address": "serve-ray:0"}))
    if settings.process_id != 0:
        raise ConfigError("serve-ray chooses each process's process_id itself; drop it from the config")
    processes = settings.num_processes
    return settings.replace(num_processes=1, coordinator_address=None), name, note, processes


def argv_from_args(args: Mapping[str, Any], flags: set[str] | None = None) -> list[str]:
    """`serve run` args ({"config": "small", "num_replicas": 2, "mock_engine": true}) as flags. `serve run
    KEY=VALUE` passes strings: "true" / "false" are booleans; false is `--no-KEY` where `flags` (the
    parser's option strings) has it, else left out."""
    argv: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        if value is True:
            argv.append(flag)
        elif value is False:
            negative = "--no-" + flag[2:]
            if flags is not None and negative in flags:
                argv.append(negative)
        elif value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def app_builder(args: dict[str, Any]) -> Any:
    """`serve run jaxserve.serving.ray.cli:app_builder config=small num_replicas=2` (or a Serve config
    file's `import_path` with `args:`): the application, as `jaxserve serve-ray` with those flags builds it."""
    from jaxserve.serving.ray.deployments import build_application

    parser = build_parser()
    return build_application(
        spec_from_namespace(parser.parse_args(argv_from_args(args, set(parser._option_string_actions))))
    )


def main(argv: Sequence[str] | None = None, prog: str = "jaxserve serve-ray") -> int:
    ns = build_parser(prog).parse_args(argv)
    try:
        import ray  # noqa: F401 - checked before the model resolves
    except ImportError:
        print(
            "error: jaxserve serve-ray needs Ray Serve, the [ray] extra: pip install -e '.[ray]' in the "
            "jaxserve checkout",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=getattr(logging, ns.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for line in ns.vllm_notes:  # vLLM flags accepted with no effect here, each with the reason
        logger.info("%s", line)
    try:
        spec = spec_from_namespace(ns)
        if not ns.mock_engine:  # the ingress builds these too: fail here, before Ray starts, if it cannot
            from jaxserve.config.generation_config import load_generation_defaults
            from jaxserve.server.chat import load_chat_renderer

            load_chat_renderer(spec.settings), load_generation_defaults(spec.settings)
    except JaxServeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from ray import serve

    from jaxserve.serving.ray.deployments import build_application

    ray.init(address=ns.ray_address or None)
    joined = bool(ns.ray_address)
    serve.start(proxy_location=ns.proxy_location, http_options={"host": ns.host, "port": ns.port})
    # A signal only wakes the main thread (through the wakeup fd): nothing runs inside the handler,
    # which may interrupt Ray's own code holding a lock.
    wake, woken = socket.socketpair()
    woken.setblocking(False)
    signal.set_wakeup_fd(woken.fileno())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    serve.run(build_application(spec), name=ns.app_name, route_prefix="/", blocking=False)
    logger.info(
        "ready on http://%s:%d (model %r, %s)",
        ns.host,
        ns.port,
        spec.model_name,
        f"{spec.num_replicas} replica(s)" if spec.autoscaling is None else f"autoscaling {spec.autoscaling}",
    )
    stops = {signal.SIGTERM, signal.SIGINT}
    while not stops & set(wake.recv(64)):  # the fd also hears other signals Python handles (SIGCHLD, ...)
        pass
    logger.info("draining: in-flight requests get up to %.0f s", ns.grace_seconds)
    serve.delete(ns.app_name)
    if not joined:
        serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
