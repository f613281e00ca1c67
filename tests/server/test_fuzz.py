"""Property-based fuzzing of the HTTP layer over the app's own OpenAPI schema: no input gives a 5xx,
and every status is one the schema documents (a request that fails validation is a 400, never a 422).

schemathesis generates valid and invalid requests for every operation of /openapi.json and sends
them in-process to the app over the mock engine (no network). Bounded by `max_examples` and a
per-example deadline; the engine's max_model_len is small so no generated request runs long.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error, status_code_conformance  # noqa: E402

from jaxserve.server.api import ServerOptions, create_app  # noqa: E402
from jaxserve.testing.mock_engine import MockAsyncLLMEngine, mock_settings  # noqa: E402

_engine = MockAsyncLLMEngine(mock_settings(max_model_len=48, num_pages=4096, max_num_seqs=256), token_delay=0.0)
_engine.start()
app = create_app(ServerOptions(served_model_names=("mock",), max_body_bytes=64 * 1024), _engine)
schema = schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.fixture(scope="module", autouse=True)
def _stop_engine():
    yield
    _engine.shutdown()


@schema.parametrize()
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case):
    response = case.call()
    case.validate_response(response, checks=[not_a_server_error, status_code_conformance])
    assert response.status_code != 422
    if response.status_code >= 400 and case.path != "/metrics":
        assert "error" in response.json()


def test_engine_pool_whole_after_fuzzing():
    # every fuzzed request finished or was rejected before it reached the engine
    stats = _engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and sum(stats["pages_used"]) == 0
