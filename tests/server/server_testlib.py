"""Helpers shared by the server tests (a module of its own: importing them from `conftest` breaks when
another tests/ folder's conftest is imported first)."""

from __future__ import annotations
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
import httpx

from jaxserve.testing.mock_engine import EOS_ID, MockAsyncLLMEngine

REPO = Path(__file__).resolve().parents[2]


class ScriptedEngine(MockAsyncLLMEngine):
    """The mock engine answering every request with `reply` (then EOS); records each prompt's text
    (canned model outputs for the tool-call and reasoning parser tests)."""

    reply = ""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompts: list[str] = []

    async def submit(self, request, queue, tag=None):
        self.prompts.append(self.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False))
        await super().submit(request, queue, tag)

    def _token(self, req, sibling, k):
        ids = self.tokenizer.encode(self.reply)
        return ids[k] if k < len(ids) else EOS_ID


def record_submits(client) -> list[tuple]:
    """Wrap the app's engine so each engine request's (SamplingParams, prompt ids) is kept, in order."""
    engine = client.app.state.jaxserve.engine
    calls, original = [], engine.submit

    async def submit(request, queue, tag=None):
        calls.append((request.params, list(request.prompt_token_ids)))
        await original(request, queue, tag)

    engine.submit = submit
    return calls


@contextlib.contextmanager
def default_model_client(max_model_len: int, max_num_batched_tokens: int):
    """A TestClient on the app over the real engine serving the shipped default model (float32, 4
    sequences, pages of 8), served as "default"; the engine is shut down afterwards."""
    from starlette.testclient import TestClient

    from jaxserve.loading import resources
    from jaxserve.config import EngineConfig
    from jaxserve.engine.async_engine import AsyncLLMEngine
    from jaxserve.llm_engine import LLMEngine
    from jaxserve.server.api import ServerOptions, create_app

    settings = EngineConfig(
        model=str(resources.small_checkpoint()),
        dtype="float32",
        max_model_len=max_model_len,
        max_num_seqs=4,
        max_num_batched_tokens=max_num_batched_tokens,
        page_size=8,
    )
    engine = AsyncLLMEngine(LLMEngine(settings, warm_up=False))
    engine.start()
    try:
        with TestClient(
            create_app(ServerOptions(served_model_names=("default",)), engine), raise_server_exceptions=False
        ) as c:
            yield c
    finally:
        engine.shutdown()


def server_kind() -> str:
    """Which engine the subprocess tests serve: the real one, unless JAXSERVE_TEST_SERVER=mock."""
    kind = os.environ.get("JAXSERVE_TEST_SERVER", "real")
    return "real" if kind == "auto" else kind


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m jaxserve.serve ARGS` on a free loopback port; output goes to a log file."""

    def __init__(self, args: list[str], log_path: Path, startup_timeout: float = 120.0):
        self.args = list(args)
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        env = dict(os.environ)
        env.setdefault("JAX_PLATFORMS", "cpu")
        env.pop("XLA_FLAGS", None)  # one CPU device is enough for a served tiny model
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jaxserve.serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--no-access-log",
                *self.args,
            ],
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not healthy within {self.startup_timeout} s:\n{self.log()}")

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-6000:]
        return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()
        return self.proc.returncode

    def model(self) -> str:
        r = httpx.get(self.url + "/v1/models", timeout=10, headers={"Authorization": f"Bearer {TEST_API_KEY}"})
        return r.json()["data"][0]["id"]

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value} (labels kept verbatim)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[name] = float(value)
    return out


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def sse_events(lines) -> list:
    """Parsed `data:` payloads of an SSE stream ('[DONE]' kept as the string)."""
    events = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def sse_chunks(response) -> list[dict]:
    """The JSON chunks of a finished streamed response (without '[DONE]')."""
    return [e for e in sse_events(response.text.splitlines()) if e != "[DONE]"]


# ---- in-process app over the mock engine ---------------------------------------------------------


TEST_API_KEY = "test-key-123"
# Few shape buckets (batch 1-8, one prefill chunk size, 4 or 8 pages), so a real server warms up fast;
# the persistent compilation cache (default ~/.cache/jaxserve/xla) makes later starts faster still.
MAX_MODEL_LEN = 128
MOCK_ARGS = [
    "--mock-engine",
    "--mock-token-delay",
    "0.004",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--num-pages",
    "600",
    "--max-num-seqs",
    "8",
]
