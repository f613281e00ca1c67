"""Fixtures for the server tests: the mock engine in-process, and real `python -m jaxserve.serve` subprocesses.

Which engine the subprocess tests serve is one fixture, `server_args`: the real engine over a tiny
random llama with a trained byte-level tokenizer, or the mock engine (`--mock-engine`) with
`JAXSERVE_TEST_SERVER=mock`.
"""

from __future__ import annotations

import pytest

from server_testlib import MAX_MODEL_LEN, MOCK_ARGS, TEST_API_KEY, ServerProcess, server_kind


@pytest.fixture
def make_client():
    """Factory: a starlette TestClient over a fresh app + started mock engine (closed at teardown)."""
    from starlette.testclient import TestClient

    from jaxserve.server.api import ServerOptions, create_app
    from jaxserve.testing.mock_engine import MockAsyncLLMEngine, mock_settings

    made = []

    def make(
        token_delay: float = 0.001,
        settings: dict | None = None,
        tokenizer=None,
        engine_cls=MockAsyncLLMEngine,
        **options,
    ):
        """`engine_cls`: the mock engine's class (a subclass scripting its replies); the client's
        `mock_engine` is the engine behind it."""
        engine = engine_cls(mock_settings(**(settings or {})), token_delay=token_delay, tokenizer=tokenizer)
        engine.start()
        opts = ServerOptions(served_model_names=("mock",), **options)
        client = TestClient(create_app(opts, engine), raise_server_exceptions=False)
        client.mock_engine = engine
        made.append((client, engine))
        return client

    yield make
    for client, engine in made:
        client.close()
        engine.shutdown()


@pytest.fixture
def client(make_client):
    return make_client()


# ---- subprocess servers --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def bytelevel_tokenizer_dir(tmp_path_factory) -> str:
    """A trained byte-level tokenizer of 512 ids (ChatML specials included), no chat template."""
    from tokenizer_training import train_tokenizer

    tok_dir = tmp_path_factory.mktemp("tok-bytelevel-512")
    train_tokenizer(tok_dir, vocab_size=512, kind="bytelevel", max_bytes=300_000)
    return str(tok_dir)


@pytest.fixture(scope="session")
def tiny_text_model(hf_model_dir, bytelevel_tokenizer_dir):
    """(model dir, tokenizer dir): a tiny random llama (vocab 512) and a byte-level tokenizer of 512 ids."""
    model_dir, _ = hf_model_dir("llama")
    return model_dir, bytelevel_tokenizer_dir


@pytest.fixture(scope="session")
def server_args(request):
    """Engine flags of the subprocess servers (the one switch between mock and real engine)."""
    if server_kind() == "real":
        model_dir, tok_dir = request.getfixturevalue("tiny_text_model")
        return [
            "--model",
            model_dir,
            "--tokenizer",
            tok_dir,
            "--dtype",
            "float32",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "16",
            "--num-pages",
            "256",
            "--page-size",
            "16",
        ]
    return list(MOCK_ARGS)


@pytest.fixture
def start_server(tmp_path, server_args):
    """Factory: start a server subprocess with the session's engine flags plus extra flags; stopped at teardown."""
    started: list[ServerProcess] = []

    def start(*extra: str, engine_args: list[str] | None = None) -> ServerProcess:
        args = (server_args if engine_args is None else engine_args) + list(extra)
        timeout = 600.0 if server_kind() == "real" else 60.0
        server = ServerProcess(args, tmp_path / f"server-{len(started)}.log", startup_timeout=timeout)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory, server_args):
    """One server (API key TEST_API_KEY) for the many end-to-end checks and the load test."""
    server = ServerProcess(
        server_args + ["--api-key", TEST_API_KEY],
        tmp_path_factory.mktemp("srv") / "server.log",
        startup_timeout=600.0 if server_kind() == "real" else 60.0,
    )
    server.start()
    yield server
    server.stop()
