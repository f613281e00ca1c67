"""How many jaxserve files a streamed chat completion crosses from the HTTP handler to the compiled step
and back, counted by a profiler hook over one real request (the count docs/ARCHITECTURE.md lists).

What is counted: at each point where the request changes form or place, the call stack of the thread
doing it, cut to jaxserve's own frames (consecutive frames of one file merged). The points:

- its `EngineRequest` is made (the processor),
- it is handed to the step thread (`Intake.put`),
- the compiled step is called (jax's `Compiled.__call__` from jaxserve code),
- the step's samples are fetched (`jax.device_get` from jaxserve code),
- its delta is made (`RequestOutput`),
- the delta is handed back to the event loop (`call_soon_threadsafe`),
- an SSE chunk leaves jaxserve (a jaxserve frame returning or yielding text that starts "data:").

The stacks are merged into one tree; each edge from one file into another is one boundary. A helper
that is called and returns before the next point (the tokenizer, a config lookup) is on none of the
stacks, so it is not counted: the count follows the request, not every function it touches.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest

import jaxserve

PACKAGE = os.path.dirname(jaxserve.__file__) + os.sep
BOUND = 12  # issue 49's bound on the boundaries of this path


def jaxserve_files(frame) -> tuple[str, ...]:
    """The stack's jaxserve files, outermost first, consecutive frames of one file merged."""
    files = []
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(PACKAGE):
            rel = path[len(PACKAGE) :]
            if not files or files[-1] != rel:
                files.append(rel)
        frame = frame.f_back
    return tuple(reversed(files))


class PathRecorder:
    """A profile function (sys.setprofile / threading.setprofile) that records, while `on`, the
    jaxserve stack at each of the request's points."""

    def __init__(self):
        self.on = False
        self.stacks: dict[str, set[tuple[str, ...]]] = {}
        self.calls: set[tuple[str, str]] = set()  # every call from one jaxserve file into another

    def _record(self, point: str, frame) -> None:
        stack = jaxserve_files(frame)
        if stack:
            self.stacks.setdefault(point, set()).add(stack)

    def __call__(self, frame, event, arg):
        if not self.on:
            return
        code = frame.f_code
        caller = frame.f_back
        from_jaxserve = caller is not None and caller.f_code.co_filename.startswith(PACKAGE)
        if event == "call":
            name, path = code.co_name, code.co_filename
            if from_jaxserve and path.startswith(PACKAGE) and path != caller.f_code.co_filename:
                self.calls.add((caller.f_code.co_filename[len(PACKAGE) :], path[len(PACKAGE) :]))
            if name == "__init__" and type(frame.f_locals.get("self")).__name__ in ("EngineRequest", "RequestOutput"):
                self._record(type(frame.f_locals["self"]).__name__, caller)
            elif from_jaxserve and name == "put" and path.endswith(os.path.join("engine", "intake.py")):
                self._record("intake", frame)
            elif from_jaxserve and name == "__call__" and path.endswith(os.path.join("jax", "_src", "stages.py")):
                self._record("compiled step", caller)
            elif from_jaxserve and name == "device_get" and path.endswith(os.path.join("jax", "_src", "api.py")):
                self._record("samples fetched", caller)
            elif from_jaxserve and name == "call_soon_threadsafe":
                self._record("handed back", caller)
        elif event == "return" and code.co_filename.startswith(PACKAGE):
            if isinstance(arg, (str, bytes)) and arg[:5] in ("data:", b"data:"):
                self._record("SSE chunk", frame)

    def boundaries(self) -> list[tuple[str, str]]:
        """Each (caller file, callee file) edge of the merged tree, in order of first appearance."""
        edges, seen = [], set()
        for point in sorted(self.stacks):
            for stack in sorted(self.stacks[point]):
                for depth in range(1, len(stack)):
                    key = stack[: depth + 1]
                    if key not in seen:
                        seen.add(key)
                        edges.append((stack[depth - 1], stack[depth]))
        return edges


@pytest.fixture(scope="module")
def profiled_app(tiny_text_model):
    """The app over the real engine (tiny random llama, compiled ahead), its threads profiled."""
    from starlette.testclient import TestClient

    from jaxserve.config import EngineConfig
    from jaxserve.engine.async_engine import AsyncLLMEngine
    from jaxserve.llm_engine import LLMEngine
    from jaxserve.server.api import ServerOptions, create_app

    model_dir, tok_dir = tiny_text_model
    settings = EngineConfig(
        model=model_dir,
        tokenizer=tok_dir,
        dtype="float32",
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        page_size=16,
        num_pages=16,
    )
    recorder = PathRecorder()
    engine = AsyncLLMEngine(LLMEngine(settings))
    threading.setprofile(recorder)  # the engine's step thread and the client's event-loop thread, made below
    sys.setprofile(recorder)
    try:
        engine.start()
        with TestClient(create_app(ServerOptions(served_model_names=("tiny",)), engine)) as client:
            yield client, recorder
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        engine.shutdown()


def stream_chat(client) -> str:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        return "".join(response.iter_text())


def test_a_streamed_chat_crosses_at_most_twelve_file_boundaries(profiled_app):
    client, recorder = profiled_app
    first = stream_chat(client)  # unprofiled: lazy imports and first calls out of the way
    recorder.on = True
    try:
        again = stream_chat(client)
    finally:
        recorder.on = False
    assert again == first or "data: [DONE]" in again
    assert set(recorder.stacks) == {
        "EngineRequest",
        "intake",
        "compiled step",
        "samples fetched",
        "RequestOutput",
        "handed back",
        "SSE chunk",
    }, sorted(recorder.stacks)
    edges = recorder.boundaries()
    print(f"\n{len(edges)} file boundaries:")
    for caller, callee in edges:
        print(f"  {caller} -> {callee}")
    # For the record: every file-to-file call the request caused, helpers included, and those into
    # files that call on into others (not leaves).
    callers = {a for a, _ in recorder.calls}
    print(
        f"{len(recorder.calls)} distinct file-to-file calls, {sum(b in callers for _, b in recorder.calls)} "
        f"into files that call on"
    )
    assert len(edges) <= BOUND, edges
