"""The Ray ingress's prefill-then-decode (`serving/ray/disagg.DisaggRemoteEngine`) over stand-in
deployment handles (no Ray): a prefill replica that fails before its output is final is retried on
another, then the request fails with ReplicaUnavailable (the server's 503), never a hang; the
client's bad input is the replica's own refusal (a 400), not retried; the decode request carries
the prefill's kv_transfer_params and the original max_tokens."""

import asyncio

import pytest

from jaxserve.engine.processor import EngineRequest, Limits
from jaxserve.errors import RequestError
from jaxserve.sampling.params import CompletionOutput, RequestOutput, SamplingParams
from jaxserve.serving.ray.disagg import DisaggRemoteEngine, prefill_request
from jaxserve.serving.ray.remote_engine import ReplicaUnavailable

PARAMS = {"do_remote_prefill": True, "transfer_id": 7}


def final(request_id: str, params=None) -> RequestOutput:
    return RequestOutput(
        request_id, None, [1], [CompletionOutput(0, [5], "x", "length")], True, kv_transfer_params=params
    )


class Stream:
    def __init__(self, items):
        self.items = list(items)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, Exception) and not isinstance(item, RequestError):
            raise item  # Ray's error: the replica died
        return item

    def cancel(self):
        pass


class Handle:
    """`handle.generate.remote(request)`: the next scripted stream, recording the request."""

    def __init__(self, *scripts):
        self.scripts, self.requests = list(scripts), []
        self.generate = self

    def remote(self, request):
        self.requests.append(request)
        return Stream(self.scripts.pop(0)(request))


def engine(prefill: Handle, decode: Handle) -> DisaggRemoteEngine:
    return DisaggRemoteEngine(prefill, decode, None, 256, None, Limits(512, 256, 16, 64, 8), retries=2)


def request(max_tokens=8) -> EngineRequest:
    return EngineRequest("r1", [1, 2, 3], SamplingParams(max_tokens=max_tokens, temperature=0))


async def run(eng: DisaggRemoteEngine, req: EngineRequest) -> list:
    queue: asyncio.Queue = asyncio.Queue()
    await eng.submit(req, queue)
    items = []
    while not items or not (isinstance(items[-1], BaseException) or items[-1].finished):
        items.append((await asyncio.wait_for(queue.get(), 5))[1])
    return items


def ok_prefill(params=PARAMS):
    return lambda r: ["prefill-0", final(r.request_id, params)]


def ok_decode(r):
    return ["decode-0", final(r.request_id)]


def test_the_decode_request_carries_the_prefills_params_and_the_original_request():
    prefill, decode = Handle(ok_prefill()), Handle(ok_decode)
    items = asyncio.run(run(engine(prefill, decode), request(max_tokens=8)))
    assert items[-1].finished
    sent = prefill.requests[0]
    assert sent.params.max_tokens == 1 and sent.params.kv_transfer_params == {"do_remote_decode": True}
    assert decode.requests[0].params.max_tokens == 8 and decode.requests[0].params.kv_transfer_params == PARAMS
    assert prefill_request(request()).request_id == "r1-prefill"


def test_a_prefill_replica_that_dies_is_retried_then_the_request_fails_clearly():
    died = lambda r: [RuntimeError("ActorDiedError: the replica died")]  # noqa: E731
    midway = lambda r: ["prefill-1", RuntimeError("connection lost")]  # noqa: E731
    prefill, decode = Handle(died, midway, ok_prefill()), Handle(ok_decode)
    eng = engine(prefill, decode)
    assert asyncio.run(run(eng, request()))[-1].finished
    assert len(prefill.requests) == 3 and eng.stats()["num_prefill_retries"] == 2
    prefill = Handle(died, died, died)
    with pytest.raises(ReplicaUnavailable, match="no prefill replica finished the request"):
        asyncio.run(run(engine(prefill, Handle(ok_decode)), request()))


def test_the_clients_bad_input_is_refused_once_not_retried():
    refused = lambda r: [RequestError("top_p must be in (0, 1]")]  # noqa: E731
    prefill = Handle(refused, ok_prefill())
    with pytest.raises(RequestError, match="top_p"):
        asyncio.run(run(engine(prefill, Handle(ok_decode)), request()))
    assert len(prefill.requests) == 1


def test_a_prefill_that_kept_no_pages_sends_the_request_as_it_is():
    prefill, decode = Handle(ok_prefill(params=None)), Handle(ok_decode)
    eng = engine(prefill, decode)
    asyncio.run(run(eng, request()))
    assert decode.requests[0].params.kv_transfer_params is None and eng.stats()["num_without_pages"] == 1


def test_serve_ray_takes_prefill_and_decode_replica_counts_together():
    import json

    from jaxserve.errors import ConfigError
    from jaxserve.serving.ray import cli
    from jaxserve.serving.ray.disagg import role_settings

    def spec(*flags):
        return cli.spec_from_namespace(cli.build_parser().parse_args(["--config", "small", *flags]))

    s = spec("--prefill-replicas", "2", "--decode-replicas", "3")
    assert (s.prefill_replicas, s.decode_replicas) == (2, 3)
    config = json.loads(role_settings(s.settings, "kv_producer", {"host": "10.0.0.2"}).kv_transfer_config)
    assert config == {
        "kv_connector": "JaxTransferConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"host": "10.0.0.2"},
    }
    for flags, message in (
        (("--prefill-replicas", "1"), "go together"),
        (("--prefill-replicas", "1", "--decode-replicas", "0"), "go together"),
        (("--prefill-replicas", "1", "--decode-replicas", "1", "--num-replicas", "2"), "fix the replica counts"),
        (("--prefill-replicas", "1", "--decode-replicas", "1", "--mock-engine"), "real engines"),
    ):
        with pytest.raises(ConfigError, match=message):
            spec(*flags)
    other = s.settings.replace(kv_transfer_config=json.dumps({"kv_connector": "OffloadingConnector"}))
    with pytest.raises(ValueError, match="JaxTransferConnector"):
        role_settings(other, "kv_consumer")
