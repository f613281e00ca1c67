"""The Ray Serve application of prefill and decode apart (`disagg.py` says how a request runs):
two `EngineReplica` deployments, each with its role's connector, behind one `DisaggIngress`."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.serving.ray.deployments import EngineReplica, OpenAIIngress, engine_deployment_options
from jaxserve.serving.ray.disagg import DECODE, PREFILL, DisaggRemoteEngine, role_settings
from jaxserve.serving.ray.remote_engine import RemoteEngine


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
