"""The Ray Serve application: `EngineReplica` (each replica one AsyncLLMEngine, or the mock engine)
behind `OpenAIIngress` (jaxserve's OpenAI server over a `RemoteEngine`), joined by a handle whose
router is `PrefixAwareRouter` (or Ray's default, power of two choices). With `processes_per_replica` > 1
each engine replica is process 0 of a multi-host engine whose other processes it starts as Ray actors
in its own placement group (multihost_replica.py).

With `prefill_replicas` set, two engine deployments (`JaxservePrefill`, `JaxserveDecode`: prefill and
decode apart, disagg.py) behind a `DisaggIngress`.

`build_application(spec)` binds both from an `AppSpec` (what `jaxserve serve-ray` and the `serve run`
builder in cli.py fill); `serve.run(build_application(spec), route_prefix="/")` serves it. Ray is
imported where it is used, so the module imports without the `[ray]` extra.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.engine.processor import EngineRequest
from jaxserve.serving.ray.disagg import DECODE, PREFILL, DisaggRemoteEngine, on_this_node, role_settings
from jaxserve.serving.ray.metrics import ReplicaMetrics
from jaxserve.serving.ray.multihost_replica import actor_resources, placement_bundles
from jaxserve.serving.ray.remote_engine import RemoteEngine, ReplicaHeader, ReplicaUnavailable

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class AppSpec:
    """Everything the application is built from (plain data: Ray pickles it to every replica)."""

    settings: EngineConfig  # resolved: the model is a local directory on every node
    model_name: str  # the name clients send by default
    server: dict[str, Any] = dataclasses.field(default_factory=dict)  # ServerOptions' plain fields
    num_replicas: int | None = 1  # fixed count; None with `autoscaling`
    autoscaling: dict[str, Any] | None = None  # Ray's autoscaling_config (min/max_replicas, target_ongoing_requests)
    replica_resources: dict[str, float] = dataclasses.field(default_factory=dict)  # {"GPU": 1}, {"TPU": 4}, {"CPU": 2}
    # A replica spanning hosts (multihost_replica.py): its engine's jax.distributed processes, each with
    # replica_resources, placed by a per-replica placement group of this strategy. `settings` stay
    # those of one process (num_processes 1): the replica fills in the job's at start-up.
    processes_per_replica: int = 1
    placement_strategy: str = "STRICT_SPREAD"
    max_ongoing_requests: int | None = None  # per engine replica; default 4 x max_num_seqs
    prefix_routing: bool = True
    router_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # block_size, imbalance
    grace_seconds: float = 30.0
    warm_up: bool = True  # compile every bucket before serving (tests turn it off: first calls compile)
    mock_engine: bool = False
    mock_token_delay: float = 0.002
    # Prefill and decode apart (disagg.py): replicas of each role; None: every replica does both.
    prefill_replicas: int | None = None
    decode_replicas: int | None = None


def _replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


class EngineReplica:
    """One engine per replica. `generate` streams the protocol RemoteEngine reads (remote_engine.py)."""

    def __init__(self, spec: AppSpec):
        self.followers = None  # a multi-host replica's processes 1..N-1 (multihost_replica.FollowerGroup)
        if spec.mock_engine:
            from jaxserve.testing.mock_engine import MockAsyncLLMEngine

            tokenizer = None
            if spec.settings.tokenizer:
                from jaxserve.loading.tokenizer import load_tokenizer

                tokenizer = load_tokenizer(spec.settings.tokenizer)
            self.engine = MockAsyncLLMEngine.from_settings(
                spec.settings, token_delay=spec.mock_token_delay, tokenizer=tokenizer
            )
        else:
            from jaxserve.engine.async_engine import AsyncLLMEngine

            self.engine = AsyncLLMEngine(self._build_engine(spec))
        self.engine.start()
        self.replica_id = _replica_id()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # open requests
        self._broken: str | None = None  # why this replica can serve no more (a follower process died)
        logger.info("engine replica %s is warm", self.replica_id)

    def _build_engine(self, spec: AppSpec) -> Any:
        """This replica's LLMEngine; with several processes per replica, process 0 of a multi-host job
        whose other processes this starts as Ray actors in the replica's placement group."""
        from jaxserve.llm_engine import LLMEngine  # lazy: pulls in JAX

        if spec.processes_per_replica == 1:
            return LLMEngine(on_this_node(spec.settings), warm_up=spec.warm_up)
        from jaxserve.serving.ray import multihost_replica as mh

        settings = mh.process_settings(spec.settings, spec.processes_per_replica, mh.coordinator_address(), 0)
        logger.info(
            "engine replica: process 0 of %d, coordinator %s", settings.num_processes, settings.coordinator_address
        )
        self.followers = mh.FollowerGroup.start(settings, spec.replica_resources, spec.warm_up)
        return self.followers.build_leader(lambda: LLMEngine(settings, warm_up=spec.warm_up))

    def info(self) -> dict[str, Any]:
        return {
            "max_model_len": self.engine.max_model_len,
            "config": self.engine.config,
            "replica": self.replica_id,
            "limits": self.engine.processor.limits,
        }  # the ingress's processor checks against them

    def stats(self) -> dict[str, Any]:
        return dict(self.engine.stats(), replica=self.replica_id)

    async def generate(self, request: EngineRequest):
        """The request the ingress's processor checked, as the protocol in remote_engine.py streams it."""
        request_id = request.request_id
        if self._broken is not None:  # raised, not sent: nothing was accepted, so the ingress tries another replica
            raise ReplicaUnavailable(self._broken)
        queue: asyncio.Queue = asyncio.Queue()
        try:
            await self.engine.submit(request, queue)
        except Exception as err:  # noqa: BLE001 - the request's refusal, sent as a value (the server's 400)
            yield err
            return
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        yield self.replica_id
        finished = False
        try:
            while not finished:
                _, item = await queue.get()
                finished = isinstance(item, BaseException) or item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the ingress went away (client disconnect, abort): free the engine's seat
                self.engine.abort(request_id)

    def check_health(self) -> None:
        if not self.engine.is_alive():
            raise RuntimeError("the engine's step thread has stopped")
        failure = self.followers.failure() if self.followers is not None else None
        if failure is not None:
            self._fail_open_requests(failure)
            raise RuntimeError(f"engine replica {self.replica_id}: {failure}")

    def _fail_open_requests(self, failure: str) -> None:
        """A multi-host engine without one of its processes cannot step again (process 0 may be stuck in
        a collective until JAX's heartbeat timeout): end every open request now with the reason, and
        refuse new ones, while Serve replaces this replica."""
        if self._broken is None:
            self._broken = f"engine replica {self.replica_id} lost a process and is being replaced ({failure})"
            logger.error("%s; failing %d open request(s)", self._broken, len(self._streams))
        for loop, queue in list(self._streams.values()):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (None, ReplicaUnavailable(self._broken)))
            except RuntimeError:  # that request's event loop is closed: nobody is listening
                pass

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()  # process 0 of a multi-host engine: its close() tells the followers to stop
        followers = getattr(self, "followers", None)
        if followers is not None:
            followers.stop()


class OpenAIIngress:
    """jaxserve's OpenAI server; every generation goes to the engine deployment through `engine` (a
    DeploymentHandle). Wrapped by `serve.ingress()` in build_application, which calls
    `__serve_build_asgi_app__` once the replica is constructed."""

    def __init__(self, engine: Any, spec: AppSpec):
        self.handle = engine.options(stream=True)
        self.spec = spec

    async def __serve_build_asgi_app__(self) -> Any:
        from jaxserve.config.generation_config import load_generation_defaults
        from jaxserve.server.api import ServerOptions, create_app
        from jaxserve.server.chat import load_chat_renderer

        info = await self.handle.options(stream=False).info.remote()
        settings = self.spec.settings
        tokenizer = await asyncio.to_thread(_load_tokenizer, settings)
        options = ServerOptions(
            **{"served_model_names": (self.spec.model_name,), "model_path": settings.model, **self.spec.server},
            chat_renderer=None if self.spec.mock_engine else load_chat_renderer(settings),
            generation_defaults=None if self.spec.mock_engine else load_generation_defaults(settings),
        )
        engine = self._remote_engine(tokenizer, info)
        app = create_app(options, engine, shutdown_engine=True)
        app.add_middleware(ReplicaHeader)
        app.add_middleware(
            ReplicaMetrics,
            handle=self.metric_handles(),
            ingress_registry=lambda: getattr(app.state.jaxserve.metrics, "registry", None),
        )
        return app

    def _remote_engine(self, tokenizer: Any, info: dict) -> RemoteEngine:
        return RemoteEngine(self.handle, tokenizer, info["max_model_len"], info["config"], info["limits"])

    def metric_handles(self) -> Any:
        """The engine deployments whose replicas /metrics scrapes."""
        return self.handle


def _load_tokenizer(settings: EngineConfig) -> Any:
    """The tokenizer the replicas load (LLMEngine._load_tokenizer's choice), or None."""
    from jaxserve.loading.tokenizer import load_tokenizer

    path = settings.tokenizer or settings.model
    if not path:
        return None
    try:
        return load_tokenizer(path)
    except FileNotFoundError:
        if settings.tokenizer is not None:
            raise
        return None


def engine_deployment_options(spec: AppSpec) -> dict[str, Any]:
    """The engine deployment's Serve options: replica count or autoscaling, resources, the router."""
    from ray.serve.config import RequestRouterConfig

    from jaxserve.serving.ray import router

    options: dict[str, Any] = {
        "ray_actor_options": actor_resources(spec.replica_resources),
        "max_ongoing_requests": spec.max_ongoing_requests or 4 * spec.settings.max_num_seqs,
        "graceful_shutdown_timeout_s": spec.grace_seconds,
        "health_check_period_s": 5,
    }
    if spec.processes_per_replica > 1:  # one bundle per process; the replica actor (process 0) takes bundle 0
        options["placement_group_bundles"] = placement_bundles(spec.replica_resources, spec.processes_per_replica)
        options["placement_group_strategy"] = spec.placement_strategy
    if spec.autoscaling is not None:
        options["autoscaling_config"] = dict(spec.autoscaling)
    else:
        options["num_replicas"] = spec.num_replicas
    if spec.prefix_routing:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=router.PrefixAwareRouter, request_router_kwargs=dict(spec.router_kwargs)
        )
    return options


def build_application(spec: AppSpec) -> Any:
    """The bound application: `serve.run(build_application(spec), route_prefix="/")`."""
    from ray import serve

    if spec.prefill_replicas is not None:
        return build_disagg_application(spec)
    engine = serve.deployment(EngineReplica, name="JaxserveEngine").options(**engine_deployment_options(spec))
    ingress = serve.deployment(serve.ingress()(OpenAIIngress), name="JaxserveIngress").options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000, graceful_shutdown_timeout_s=spec.grace_seconds
    )
    return ingress.bind(engine.bind(spec), spec)


class DisaggIngress(OpenAIIngress):
    """The OpenAI server over a DisaggRemoteEngine: decode's handle is `self.handle` (the server's
    engine), prefill's the one each request visits first; /metrics scrapes both."""

    def __init__(self, prefill: Any, decode: Any, spec: Any):
        super().__init__(decode, spec)
        self.prefill_handle = prefill.options(stream=True)

    def _remote_engine(self, tokenizer: Any, info: dict) -> RemoteEngine:
        return DisaggRemoteEngine(
            self.prefill_handle, self.handle, tokenizer, info["max_model_len"], info["config"], info["limits"]
        )

    def metric_handles(self) -> Any:
        return [self.prefill_handle, self.handle]


def build_disagg_application(spec: Any) -> Any:
    """Prefill and decode deployments (`JaxservePrefill`, `JaxserveDecode`) behind one ingress."""
    from ray import serve

    deployments = []
    for name, role, count in (
        ("JaxservePrefill", PREFILL, spec.prefill_replicas),
        ("JaxserveDecode", DECODE, spec.decode_replicas),
    ):
        side = dataclasses.replace(spec, settings=role_settings(spec.settings, role), num_replicas=count)
        options = engine_deployment_options(side)
        deployments.append(serve.deployment(EngineReplica, name=name).options(**options).bind(side))
    ingress = serve.deployment(serve.ingress()(DisaggIngress), name="JaxserveIngress").options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000, graceful_shutdown_timeout_s=spec.grace_seconds
    )
    return ingress.bind(*deployments, spec)
