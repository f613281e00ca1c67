"""Multi-host serving (jaxserve.runner.multihost): the step message codec, and a real 2-process job on CPU.

The job: 2 local processes x 2 virtual CPU devices, jax.distributed over loopback, gloo collectives,
a (1, 4) mesh (tensor parallel across the processes) and a (2, 2) mesh (one replica per process).
Every subprocess runs under a hard timeout, so a hang fails the test instead of CI.
"""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

from array import array

import numpy as np
import pytest

from jaxserve.runner import multihost
from jaxserve.runner.multihost import NoPeers
from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.sampling.row import RowSampling

DRIVER = os.path.join(os.path.dirname(__file__), "multihost_driver.py")
JOB_TIMEOUT = 300  # seconds for a whole job (start-up, compiling on a busy 2-core machine, the workload)
FAIL_WITHIN = 60  # seconds from killing process 1 to process 0's exit


# ---------------------------------------------------------------- settings and message codec (no processes)
def test_distributed_settings_are_checked():
    with pytest.raises(ConfigError, match="coordinator_address"):
        EngineConfig(num_processes=2, process_id=1)
    with pytest.raises(ConfigError, match="process_id"):
        EngineConfig(num_processes=2, process_id=2, coordinator_address="h:1")
    # Speculative decoding runs on every process like any step.
    EngineConfig(num_processes=2, coordinator_address="h:1", speculative_method="ngram", num_speculative_tokens=2)
    settings = EngineConfig.from_cli(
        ["--coordinator-address", "10.0.0.1:1234", "--num-processes", "4", "--process-id", "3"]
    )
    assert (settings.coordinator_address, settings.num_processes, settings.process_id) == ("10.0.0.1:1234", 4, 3)
    assert multihost.initialize(EngineConfig()) is False  # one process: nothing to do


@pytest.fixture(scope="module")
def llm(hf_model_dir):
    from jaxserve import LLM

    path, _ = hf_model_dir("llama")
    return LLM(
        path, dtype="float32", page_size=8, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, warm_up=False
    )


def _packed(runner, shape, rng, dense):
    """Random step inputs of bucket `shape`; 3-D arrays (tokens, page table, history, targets) get a
    padded tail, except one full-width row when `dense`."""
    import jax

    specs, treedef = multihost.step_input_specs(runner, shape)
    leaves = []
    for full, dtype in specs:
        a = rng.integers(0, 100, full).astype(dtype)
        if len(full) == 3:
            a[..., full[-1] // 2 :] = -1
            if dense:
                a[0, 0, :] = rng.integers(1, 100, full[-1])
        leaves.append(a)
    return tuple(jax.tree.unflatten(treedef, leaves))


@pytest.fixture(scope="module")
def draft_llm(hf_model_dir):
    """A speculative engine (the model as its own draft): its ragged steps are speculative ones."""
    from jaxserve import LLM

    path, _ = hf_model_dir("llama")
    return LLM(
        path,
        dtype="float32",
        page_size=8,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        warm_up=False,
        speculative_model=path,
        num_speculative_tokens=3,
    )


@pytest.mark.parametrize(
    "engine, shape",
    [
        ("llm", (4, 8)),
        ("llm", (32, 8)),
        ("llm", (32, 8, "score")),
        ("llm", (4, 8, "multi-step")),
        ("draft_llm", (4, 8)),
        ("draft_llm", (32, 8)),
    ],
)
def test_step_message_round_trip(request, engine, shape):
    import jax

    llm = request.getfixturevalue(engine)
    rng = np.random.default_rng(0)
    sizes = {}
    for dense in (True, False):
        inputs = _packed(llm.runner, shape, rng, dense)
        data = multihost.encode_step(7, shape, jax.tree.leaves(inputs))
        message = multihost.decode(data, llm.runner)
        assert (message.op, message.seq, message.shape) == (multihost.OP_STEP, 7, shape)
        for got, want in zip(jax.tree.leaves(message.inputs), jax.tree.leaves(inputs), strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
        sizes[dense] = len(data)
    assert sizes[False] < sizes[True]  # padding tails are not sent


def test_decode_step_message_is_small(llm):
    """A decode step of 4 sampled rows without penalties: a few hundred bytes (the [R, B, history]
    penalty history, all padding, is not sent)."""
    import jax

    from jaxserve.runner.step_row import StepRow
    from jaxserve.model.sampler import RowSampling

    sent = []

    class Recorder:
        def step(self, shape, inputs):
            sent.append(multihost.encode_step(len(sent), shape, jax.tree.leaves(inputs)))

    llm.runner.peers = Recorder()
    try:
        llm.runner.execute_rows(
            [
                StepRow([7], 20 + i, [1 + 3 * i, 2 + 3 * i, 3 + 3 * i], RowSampling(temperature=0.7, seed=i))
                for i in range(4)
            ]
        )
    finally:
        llm.runner.peers = NoPeers()
    assert len(sent) == 1 and len(sent[0]) < 600, len(sent[0])
    # 4 decode tokens, at the step's one page-table width
    assert multihost.decode(sent[0], llm.runner).shape == (4, llm.runner.buckets.page_counts[-1])


def test_copy_and_shutdown_messages():
    data = multihost.encode_copy(3, 1, np.array([4, 5]), np.array([9, 10]))
    m = multihost.decode(data)
    assert (m.op, m.seq, m.replica, m.src.tolist(), m.dst.tolist()) == (multihost.OP_COPY_PAGES, 3, 1, [4, 5], [9, 10])
    assert multihost.decode(multihost.encode_shutdown(12)).op == multihost.OP_SHUTDOWN
    with pytest.raises(multihost.PeerFailureError, match="not a jaxserve step message"):
        multihost.decode(b"\0" * 32)


def test_processes_started_differently_are_refused(llm, monkeypatch):
    import jax

    class Store:
        def __init__(self):
            self.kv = {}

        def key_value_set(self, key, value):
            self.kv[key] = value

        def blocking_key_value_get(self, key, timeout_ms):
            return self.kv[key]

    store = Store()
    theirs = multihost.fingerprint(llm.engine)
    store.kv["jaxserve/fingerprint/0"] = json.dumps(theirs)
    monkeypatch.setattr(multihost, "_client", lambda: store)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    multihost.check_consistent(llm.engine)  # the same: passes
    theirs["settings"]["max_num_seqs"] += 1
    theirs["num_pages"] += 1
    store.kv["jaxserve/fingerprint/0"] = json.dumps(theirs)
    with pytest.raises(
        ConfigError, match=r"process 0 was started differently from process 1 \(max_num_seqs, num_pages\)"
    ):
        multihost.check_consistent(llm.engine)


class _ListChannel:
    def __init__(self):
        self.messages = {}

    def send(self, seq, data):
        self.messages[seq] = data

    def receive(self, seq, should_stop=lambda: False):
        return self.messages[seq]


def test_follower_loop_replays_the_leaders_calls():
    calls = []

    class Runner:
        def copy_pages(self, replica, src, dst):
            calls.append(("copy", replica, src.tolist(), dst.tolist()))

    channel = _ListChannel()
    leader = multihost.Leader(channel)
    leader.copy_pages(0, np.array([1]), np.array([2]))
    leader.shutdown()
    leader.shutdown()  # idempotent
    with pytest.raises(multihost.PeerFailureError):
        leader.copy_pages(0, np.array([1]), np.array([2]))
    assert multihost.follower_loop(Runner(), channel) == 0
    assert calls == [("copy", 0, [1], [2])]
    assert leader.stats()["multihost_messages_total"] == 1


def test_update_message_round_trip():
    from types import SimpleNamespace

    from jaxserve.engine.scheduler_output import BatchUpdate, NewRow, RowUpdate
    from jaxserve.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.2, logit_bias={3: -2.0}, logprobs=2)
    update = BatchUpdate(
        [NewRow(2, 0, [5, 6, 7, 8], 3, params, 99, array("i", [4, 9]), SimpleNamespace(slot=1), None, True, True)],
        [RowUpdate(2, 3, 1), RowUpdate(0, 9, 1, 2, 9, [-5], 2, array("i", [11]), [4, 4], 1)],
        [1],
        True,
    )
    words = np.arange(4, dtype=np.int32)
    message = multihost.decode(multihost.encode_update_message(5, update, {1: words}))
    got = message.update
    assert (message.op, message.seq) == (multihost.OP_UPDATE, 5)
    assert (got.finished, got.logprobs) == ([1], True)
    assert [dataclasses.astuple(r) for r in got.rows] == [
        (2, 3, 1, 0, 0, None, 0, None, None, 0),
        (0, 9, 1, 2, 9, [-5], 2, [11], [4, 4], 1),
    ]
    (new,) = got.new_rows
    assert (new.slot, new.token_ids, new.prompt_len, new.seed, list(new.page_ids), new.lora.slot) == (
        2,
        [5, 6, 7, 8],
        3,
        99,
        [4, 9],
        1,
    )
    sampling = RowSampling.from_params(new.params, seed=new.seed, step=0)
    assert sampling == RowSampling.from_params(params, seed=99, step=0)  # logit_bias's keys are ints again
    np.testing.assert_array_equal(message.masks[1].words, words)


def test_a_follower_replays_engine_steps_from_their_updates(hf_model_dir):
    """A leader engine sends each step as its batch update (page copies of n = 2 forks as they are);
    a second engine replaying the messages through `follower_loop` ends with the same KV cache and
    carried samples: it ran the same steps, rebuilt from the diffs (penalties from its own tokens)."""
    import jax

    from jaxserve import LLM, SamplingParams

    path, _ = hf_model_dir("llama")
    settings = dict(
        dtype="float32", page_size=8, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, warm_up=False
    )
    channel = _ListChannel()
    with LLM(path, **settings) as leader, LLM(path, **settings) as follower:
        leader.runner.peers = peers = multihost.Leader(channel)
        prompts = [list(range(3 + i, 20 + 3 * i)) for i in range(5)]
        params = [
            SamplingParams(max_tokens=12, temperature=0.8, seed=1, repetition_penalty=1.3),
            SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=7, temperature=1.0, n=2, seed=4, frequency_penalty=0.5),
            SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=5, temperature=0.5, seed=8),
        ]
        leader.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        peers.shutdown()
        kinds = [multihost.decode(channel.messages[i]).op for i in range(len(channel.messages) - 1)]
        assert multihost.OP_UPDATE in kinds and multihost.OP_COPY_PAGES in kinds and multihost.OP_STEP not in kinds
        assert multihost.follower_loop(follower.runner, channel) == kinds.count(multihost.OP_UPDATE)
        for got, want in zip(jax.tree.leaves(follower.runner.cache), jax.tree.leaves(leader.runner.cache), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(follower.runner.carried), np.asarray(leader.runner.carried))
        stats = peers.stats()
        assert stats["multihost_message_bytes_total"] / stats["multihost_messages_total"] < 1000


# ---------------------------------------------------------------- a real 2-process job
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(model, port, process_id, log_dir, *extra):
    """One driver process; stderr (JAX's logging, chatty) goes to a file so a full pipe never blocks it."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    stderr = open(log_dir / f"process{process_id}.err", "w+")
    proc = subprocess.Popen(
        [sys.executable, DRIVER, "--model", model, "--port", str(port), "--process-id", str(process_id), *extra],
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        env=env,
    )
    proc.stderr_file = stderr
    return proc


def _stderr(proc) -> str:
    proc.stderr_file.seek(0)
    return proc.stderr_file.read()


def _finish(procs, timeout):
    """Wait for every process (killing all at the deadline); returns their exit codes."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"multi-host job did not finish within {timeout} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs]


@pytest.fixture(scope="module")
def single_process_tokens(hf_model_dir):
    import multihost_driver

    from jaxserve import LLM

    path, _ = hf_model_dir("llama")
    settings = {**multihost_driver.SETTINGS, "compilation_cache_dir": None}
    return {mesh: multihost_driver.run(LLM(path, mesh_shape=mesh, **settings)) for mesh in [(1, 4), (2, 2)]}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(1, 4), (2, 2)])
def test_two_processes_match_one(hf_model_dir, single_process_tokens, tmp_path, mesh):
    """Tensor parallel across the processes (1, 4), or one replica per process (2, 2): the same tokens
    as one process over 4 devices, and both processes exit 0 once process 0 is done."""
    path, _ = hf_model_dir("llama")
    port, out = _free_port(), tmp_path / "out.json"
    mesh_arg = ",".join(map(str, mesh))
    procs = [
        _launch(path, port, 0, tmp_path, "--mesh", mesh_arg, "--out", str(out)),
        _launch(path, port, 1, tmp_path, "--mesh", mesh_arg),
    ]
    start = time.monotonic()
    codes = _finish(procs, JOB_TIMEOUT)
    print(f"2-process job on a {mesh} mesh: {time.monotonic() - start:.1f} s")
    for i, (code, proc) in enumerate(zip(codes, procs)):
        assert code == 0, f"process {i} exited {code}:\n{_stderr(proc)[-3000:]}"
    got = json.loads(out.read_text())
    assert got["tokens"] == single_process_tokens[mesh]
    stats = got["stats"]
    # One message per step or page copy, small: a few hundred bytes on average.
    assert stats["multihost_messages_total"] >= 10
    assert stats["multihost_message_bytes_total"] / stats["multihost_messages_total"] < 2000


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_two_processes_speculate(hf_model_dir, single_process_tokens, tmp_path, method):
    """Speculative decoding with one replica per process: its verify steps (and the draft's prefill)
    are the runner's steps, handed to the follower like every other, so both processes run them. The
    greedy rows are those of one process without speculation; the seeded n=2 request samples its
    full length (speculation keeps its law, not its tokens)."""
    import multihost_driver

    path, _ = hf_model_dir("llama")
    port, out = _free_port(), tmp_path / "out.json"
    procs = [
        _launch(path, port, 0, tmp_path, "--mesh", "2,2", "--speculate", method, "--out", str(out)),
        _launch(path, port, 1, tmp_path, "--mesh", "2,2", "--speculate", method),
    ]
    start = time.monotonic()
    # The draft method compiles the most: verify steps with the draft's loop and its prefill buckets.
    codes = _finish(procs, JOB_TIMEOUT * (2 if method == "draft" else 1))
    print(f"2-process {method} speculation job: {time.monotonic() - start:.1f} s")
    for i, (code, proc) in enumerate(zip(codes, procs)):
        assert code == 0, f"process {i} exited {code}:\n{_stderr(proc)[-3000:]}"
    got, want = json.loads(out.read_text()), single_process_tokens[(2, 2)]
    greedy = [i for i, (_, params) in enumerate(multihost_driver.workload()) if params.temperature == 0]
    assert [got["tokens"][i] for i in greedy] == [want[i] for i in greedy]
    sampled = [i for i in range(len(want)) if i not in greedy]
    assert [[len(c) for c in got["tokens"][i]] for i in sampled] == [[len(c) for c in want[i]] for i in sampled]
    stats = got["stats"]
    assert stats["spec_decode_num_steps"] > 0 and stats["spec_decode_num_draft_tokens"] > 0, stats
    if method == "draft":  # the model drafting for itself: every greedy draft is accepted
        assert stats["spec_decode_num_accepted_tokens"] > 0, stats


@pytest.mark.slow
def test_killing_process_1_stops_process_0_fast(hf_model_dir, tmp_path):
    path, _ = hf_model_dir("llama")
    port = _free_port()
    ready = tmp_path / "ready"
    leader = _launch(path, port, 0, tmp_path, "--forever", str(ready))
    follower = _launch(path, port, 1, tmp_path)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while not ready.exists():  # then process 0 is generating, the follower in its loop
            assert time.monotonic() < deadline, "the job never became ready"
            assert leader.poll() is None, f"process 0 exited early:\n{_stderr(leader)[-3000:]}"
            time.sleep(0.2)
        time.sleep(1.0)  # mid-run
        follower.kill()
        killed = time.monotonic()
        try:
            leader.wait(timeout=FAIL_WITHIN)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process 0 still running {FAIL_WITHIN} s after process 1 was killed")
        took = time.monotonic() - killed
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                p.kill()
            p.wait()
    print(f"process 0 exited {leader.returncode} {took:.1f} s after process 1 was killed")
    err = _stderr(leader)
    # Either our handler exits with its message, or JAX's coordination service, polling for peer
    # errors, aborts the process first (a race): both fail fast and name the cause.
    if leader.returncode == -6:
        assert "CoordinationService" in err, err[-3000:]
    else:
        assert leader.returncode == multihost.EXIT_PEER_FAILED, err[-3000:]
        assert "Another process of the job has most likely died" in err


@pytest.mark.slow
def test_serve_on_two_processes(hf_model_dir, tmp_path):
    """`python -m jaxserve.serve` with --num-processes 2: process 0 answers HTTP, /metrics counts the step
    messages, and SIGTERM to process 0 stops both processes with status 0."""
    import signal

    import httpx

    path, _ = hf_model_dir("llama")
    coordinator, http = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    procs = []
    for i in range(2):
        stderr = open(tmp_path / f"serve{i}.err", "w+")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jaxserve.serve",
                "--model",
                path,
                "--dtype",
                "float32",
                "--mesh-shape",
                "1,4",
                "--page-size",
                "8",
                "--max-model-len",
                "64",
                "--max-num-seqs",
                "2",
                "--max-num-batched-tokens",
                "16",
                "--compilation-cache-dir",
                "none",
                "--coordinator-address",
                f"127.0.0.1:{coordinator}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "--distributed-timeout",
                "10",
                "--port",
                str(http),
                "--no-access-log",
            ],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=env,
        )
        proc.stderr_file = stderr
        procs.append(proc)
    url = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while True:
            for i, p in enumerate(procs):
                assert p.poll() is None, f"process {i} exited {p.returncode}:\n{_stderr(p)[-3000:]}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(0.5)
        body = {"model": path, "prompt": [[5, 6, 7, 8, 9], [1, 2, 3]], "max_tokens": 6, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 12
        metrics = httpx.get(url + "/metrics", timeout=30).text
        sent = [line for line in metrics.splitlines() if line.startswith("jaxserve:multihost_messages_total")]
        assert sent and float(sent[0].split()[-1]) >= 6, metrics
        procs[0].send_signal(signal.SIGTERM)
        codes = _finish(procs, FAIL_WITHIN)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0], [_stderr(p)[-2000:] for p in procs]
