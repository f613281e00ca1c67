"""Both engines the server runs on satisfy `ServingEngine`: the real `AsyncLLMEngine` (around a stub,
no model built) and the mock engine."""

from __future__ import annotations

import inspect
import types

from jaxserve.config import EngineConfig
from jaxserve.server.engine_protocol import ServerTokenizer, ServingEngine
from jaxserve.engine.intake import Intake
from jaxserve.engine.processor import Limits, Processor
from jaxserve.testing.mock_engine import MockAsyncLLMEngine, MockTokenizer, mock_settings

MEMBERS = ("tokenizer", "max_model_len", "config", "processor", "start", "shutdown", "submit", "abort", "stats")


class StubLLMEngine:
    """What AsyncLLMEngine's server-facing members read from the engine core."""

    def __init__(self):
        self.tokenizer = MockTokenizer()
        self.memory = types.SimpleNamespace(max_model_len=96)
        self.config = EngineConfig(max_model_len=96)
        self.intake = Intake()
        self.processor = Processor(
            Limits(vocab_size=260, max_model_len=96, page_size=16, usable_pages=16, max_num_seqs=4), self.tokenizer
        )

    def close(self) -> None:
        pass


def real_engine():
    from jaxserve.engine.async_engine import AsyncLLMEngine

    return AsyncLLMEngine(StubLLMEngine())


def test_protocol_names_what_the_server_uses():
    assert set(MEMBERS) <= set(dir(ServingEngine))
    assert inspect.iscoroutinefunction(ServingEngine.submit) and not inspect.iscoroutinefunction(ServingEngine.abort)


def test_real_engine_satisfies_the_protocol():
    engine = real_engine()
    assert isinstance(engine, ServingEngine)
    assert engine.max_model_len == 96 and engine.config.max_model_len == 96
    assert isinstance(engine.tokenizer, ServerTokenizer)
    assert inspect.iscoroutinefunction(type(engine).submit) and not inspect.iscoroutinefunction(type(engine).abort)
    assert inspect.isasyncgenfunction(type(engine).generate)  # for research code: the deltas of one request
    for name in MEMBERS:
        assert hasattr(engine, name), name


def test_mock_engine_satisfies_the_protocol():
    engine = MockAsyncLLMEngine(mock_settings(max_model_len=80))
    assert isinstance(engine, ServingEngine)
    assert engine.max_model_len == 80 and engine.config.max_model_len == 80
    assert isinstance(engine.tokenizer, ServerTokenizer)
    assert inspect.iscoroutinefunction(type(engine).submit) and not inspect.iscoroutinefunction(type(engine).abort)
    assert inspect.isasyncgenfunction(type(engine).generate)
    assert set(engine.stats()) >= {"num_running", "num_waiting"}


def test_an_object_lacking_a_member_does_not():
    class NoAbort:
        tokenizer = None
        max_model_len = 8
        config = None
        processor = None

        def start(self): ...
        def shutdown(self): ...
        async def submit(self, request, queue, tag=None): ...
        def stats(self): ...

    assert not isinstance(NoAbort(), ServingEngine)
    NoAbort.abort = lambda self, request_id: None
    assert isinstance(NoAbort(), ServingEngine)
