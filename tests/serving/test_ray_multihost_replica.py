"""A replica spanning two "hosts": `jaxserve serve-ray --num-processes 2` on a local two-node Ray cluster
(ray.cluster_utils.Cluster, one CPU per node), so the replica's placement group (STRICT_SPREAD, one
bundle per process) puts process 0 (the Serve replica) and process 1 (a follower actor) on different
nodes. Its greedy answers equal a one-process engine's on the same (1, 2) mesh; a follower killed as a
crash would be fails the replica fast (no request hangs) and Serve starts a new one.

The cluster is Ray of its own, driven by the command in a subprocess: this pytest process may
already be connected to tests/serving/conftest.py's Ray, and a process joins one Ray at a time.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from serving_testlib import free_port

# Few buckets (token counts 1 .. 32, powers of two), both processes one CPU device each: tensor parallel
# over the two "hosts", so every step's all-reduces cross them (gloo).
ENGINE = dict(
    dtype="float32",
    page_size=16,
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    token_buckets="powers-of-two",
    num_pages=64,
    mesh_shape="1,2",
    compilation_cache_dir="none",
)
PROMPTS = [[5 + i, 17, 300 + 7 * i, 42, 9, 1000 + i] * (1 + i % 3) for i in range(6)]
MAX_TOKENS = 8
READY_WITHIN = 240  # seconds: two raylets, Serve, two engine processes compiling on 2 shared cores


# Run as a second driver of the cluster: the placement groups Ray made (live ones), with their nodes.
PLACEMENT_QUERY = """
import json, sys, ray
from ray.util import placement_group_table
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(json.dumps([dict(strategy=t["strategy"], nodes=[t["bundles_to_node_id"][i] for i in sorted(t["bundles_to_node_id"])])
                  for t in placement_group_table().values() if t["state"] == "CREATED"]))
"""


def flags(settings: dict) -> list[str]:
    return [x for key, value in settings.items() for x in ("--" + key.replace("_", "-"), str(value))]


@pytest.fixture(scope="module")
def two_node_cluster():
    """Two Ray nodes of one CPU each. Their workers inherit this environment: one CPU device per
    process (conftest.py gives this process 4)."""
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as env:
        env.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
        env.setenv("JAX_PLATFORMS", "cpu")
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


class ServeRay:
    """`jaxserve serve-ray` in a subprocess, its log in a file."""

    def __init__(self, cluster, log_path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        argv = [
            sys.executable,
            "-m",
            "jaxserve.serving.ray.cli",
            "--config",
            "small",
            "--model",
            "checkpoints/small",
            *flags(ENGINE),
            "--num-processes",
            "2",
            "--distributed-timeout",
            "10",
            "--num-replicas",
            "1",
            "--ray-address",
            cluster.address,
            "--proxy-location",
            "HeadOnly",
            "--port",
            str(self.port),
            "--no-access-log",
        ]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def tail(self) -> str:
        return open(self.log_path).read()[-4000:]

    def wait_ready(self, seconds: float) -> float:
        start = time.monotonic()
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while True:
                assert self.proc.poll() is None, self.tail()
                assert time.monotonic() - start < seconds, f"not ready within {seconds} s:\n{self.tail()}"
                try:
                    if client.get("/health").status_code == 200:
                        return time.monotonic() - start
                except httpx.TransportError:
                    pass
                time.sleep(0.5)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(two_node_cluster, tmp_path_factory):
    served = ServeRay(two_node_cluster, tmp_path_factory.mktemp("serve-ray") / "serve-ray.log")
    try:
        took = served.wait_ready(READY_WITHIN)
        print(f"two-process replica ready in {took:.1f} s")
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def one_process_texts():
    """Greedy texts of one in-process engine with the same settings and the same (1, 2) mesh."""
    from jaxserve import LLM, SamplingParams

    settings = {**ENGINE, "mesh_shape": (1, 2)}
    with LLM("checkpoints/small", warm_up=False, **settings) as llm:
        outs = llm.generate(
            prompt_token_ids=PROMPTS, sampling_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        )
    return [o.outputs[0].text for o in outs]


def complete(client: httpx.Client, ids: list[int]) -> httpx.Response:
    return client.post(
        "/v1/completions",
        json={"model": "checkpoints/small", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0},
    )


def test_a_two_host_replica_answers_like_one_process(server, one_process_texts):
    start = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=120) as client, ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda ids: complete(client, ids), PROMPTS))
        metrics = client.get("/metrics").text
    print(f"{len(PROMPTS)} requests in {time.monotonic() - start:.1f} s")
    assert [r.status_code for r in responses] == [200] * len(PROMPTS), [r.text for r in responses]
    assert len({r.headers["x-jaxserve-replica"] for r in responses}) == 1
    assert [r.json()["choices"][0]["text"] for r in responses] == one_process_texts
    # Process 0 handed its steps to process 1: one message per device call.
    sent = [line for line in metrics.splitlines() if line.startswith("jaxserve:multihost_messages_total")]
    assert sent and float(sent[0].split()[-1]) >= MAX_TOKENS, metrics[-2000:]


def live_placement_groups(cluster) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-c", PLACEMENT_QUERY, cluster.address], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_replica_is_one_placement_group_spread_over_both_nodes(two_node_cluster, server):
    groups = live_placement_groups(two_node_cluster)
    assert len(groups) == 1, groups  # one replica: one group, its two bundles on two different nodes
    assert groups[0]["strategy"] == "STRICT_SPREAD" and len(set(groups[0]["nodes"])) == 2, groups


def follower_processes(cluster) -> list[psutil.Process]:
    """The follower actors' processes (workers of this cluster's raylets, titled by Ray after the
    method they run)."""
    raylets = [
        proc.process.pid
        for node in cluster.list_all_nodes()
        for kind, procs in node.all_processes.items()
        if kind == "raylet"
        for proc in procs
    ]
    found = []
    for pid in raylets:
        for child in psutil.Process(pid).children(recursive=True):
            try:
                if "JaxserveFollower" in " ".join(child.cmdline()):
                    found.append(child)
            except psutil.NoSuchProcess:
                pass
    return found


@pytest.mark.slow
def test_a_dead_follower_fails_the_replica_fast_and_serve_replaces_it(two_node_cluster, server, one_process_texts):
    """SIGKILL of process 1 while a stream is open: the stream ends with an error event (not a hang),
    and the replica is replaced by a new two-process one that answers like the first."""
    with httpx.Client(base_url=server.url, timeout=120) as client:
        first = complete(client, PROMPTS[0])
        assert first.status_code == 200, first.text
        old_replica = first.headers["x-jaxserve-replica"]
        (follower,) = follower_processes(two_node_cluster)
        body = {
            "model": "checkpoints/small",
            "prompt": PROMPTS[1],
            "max_tokens": 100,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
        }
        chunks: list[str] = []
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    chunks.append(line[6:])
                    break
            follower.kill()
            killed = time.monotonic()
            for line in lines:
                if line.startswith("data: "):
                    chunks.append(line[6:])
        ended = time.monotonic() - killed
        print(f"the open stream ended {ended:.1f} s after process 1 was killed: {chunks[-2:]}")
        assert chunks[-1] == "[DONE]" and "error" in json.loads(chunks[-2]), chunks[-2:]
        assert len(chunks) < 100, "the stream ran to its end without process 1"

        start, texts = time.monotonic(), None
        while time.monotonic() - start < READY_WITHIN:  # a new replica: new processes, compiled again
            try:
                responses = [complete(client, ids) for ids in PROMPTS]
            except httpx.TransportError:
                responses = []
            if responses and all(r.status_code == 200 for r in responses):
                texts = [r.json()["choices"][0]["text"] for r in responses]
                new_replica = responses[0].headers["x-jaxserve-replica"]
                break
            time.sleep(1.0)
        print(f"a new replica served {time.monotonic() - start:.1f} s after the stream ended")
    assert texts == one_process_texts, server.tail()
    assert new_replica != old_replica
    assert len(live_placement_groups(two_node_cluster)) == 1  # the old replica's group is gone
