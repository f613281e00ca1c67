"""A local Ray cluster with Serve, shared by the tests in tests/serving (one per session: starting
Ray costs seconds). Each test module deploys its own application at "/" and deletes it after."""

from __future__ import annotations

import pytest

from serving_testlib import free_port


@pytest.fixture(scope="session")
def serve_url():
    """The base URL of a Serve HTTP proxy on a fresh local Ray instance (4 logical CPUs, so two engine
    replicas of one CPU each and the ingress fit on a 2-core machine)."""
    import ray
    from ray import serve

    port = free_port()
    ray.init(
        num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}}
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def deploy(serve_url):
    """deploy(spec) -> the base URL once the application is ready; deleted at the module's end."""
    from ray import serve

    from jaxserve.serving.ray.deployments import build_application

    names = []

    def run(spec, name: str = "jaxserve") -> str:
        serve.run(build_application(spec), name=name, route_prefix="/")
        names.append(name)
        return serve_url

    yield run
    for name in names:
        serve.delete(name)
