"""`jaxserve bench`: serve against a mock-engine server (counts and the JSON result's keys), the metric
arithmetic against numpy, and latency / throughput offline on the tiny random llama."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from jaxserve import cli
from jaxserve.bench import datasets, offline
from jaxserve.bench.metrics import RequestResult, meets_slo, parse_goodput, percentile, summarize

REPO = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def mock_server(tmp_path_factory):
    """`jaxserve serve --mock-engine` on a free port (the mock's tokenizer counts bytes: chat prompts are long)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path_factory.mktemp("mock") / "server.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxserve.serve",
            "--mock-engine",
            "--mock-token-delay",
            "0.002",
            "--port",
            str(port),
            "--no-access-log",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--num-pages",
            "2048",
            "--max-num-seqs",
            "8",
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                break
        except OSError:
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def bench_serve(*argv: str) -> int:
    return cli.main(["bench", "serve", "--disable-tqdm", *argv])


def test_serve_random_counts_and_result_keys(mock_server, tmp_path):
    out = tmp_path / "result.json"
    rc = bench_serve(
        "--base-url",
        mock_server,
        "--num-prompts",
        "12",
        "--random-input-len",
        "20",
        "--random-output-len",
        "6",
        "--ignore-eos",
        "--request-rate",
        "100",
        "--max-concurrency",
        "4",
        "--goodput",
        "ttft:60000",
        "tpot:60000",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99.9",
        "--save-result",
        "--result-filename",
        str(out),
        "--metadata",
        "machine=ci",
    )
    assert rc == 0
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"], r["num_prompts"]) == (12, 0, 12)
    assert r["total_input_tokens"] == 12 * 20 and r["total_output_tokens"] == 12 * 6  # ids: exact lengths
    assert (r["model_id"], r["endpoint"], r["request_rate"], r["max_concurrency"]) == (
        "mock",
        "/v1/completions",
        100.0,
        4,
    )
    assert r["machine"] == "ci" and r["goodput_slo_ms"] == {"ttft": 60000.0, "tpot": 60000.0}
    assert r["request_throughput"] == pytest.approx(12 / r["duration"])
    assert r["output_throughput"] == pytest.approx(72 / r["duration"])
    assert r["request_goodput"] == pytest.approx(r["request_throughput"]) and r["slo_attainment"] == 1.0
    for m in ("ttft", "tpot", "itl", "e2el"):
        values = [r[f"{k}_{m}_ms"] for k in ("mean", "median", "std", "p50", "p90", "p99.9")]
        assert all(v == v and v >= 0 for v in values), m  # present, not NaN
        assert r[f"median_{m}_ms"] == r[f"p50_{m}_ms"] <= r[f"p90_{m}_ms"] <= r[f"p99.9_{m}_ms"]
    assert r["mean_ttft_ms"] <= r["mean_e2el_ms"]
    assert "ttfts" not in r  # per-request lists only with --save-detailed


def test_serve_chat_dataset_detailed(mock_server, tmp_path):
    """The chat set on /v1/chat/completions: every request's max_tokens generated (EOS ignored), the
    server's prompt counts taken from its usage."""
    rc = bench_serve(
        "--base-url",
        mock_server,
        "--backend",
        "openai-chat",
        "--dataset-name",
        "chat",
        "--chat-input-len",
        "12",
        "--chat-output-len",
        "5",
        "--num-prompts",
        "6",
        "--ignore-eos",
        "--seed",
        "3",
        "--save-detailed",
        "--save-result",
        "--result-dir",
        str(tmp_path),
    )
    assert rc == 0
    (path,) = tmp_path.glob("openai-chat-infqps-concurrencyinf-mock-*.json")
    r = json.loads(path.read_text())
    sent = datasets.chat_requests(6, 12, 5, seed=3)
    assert r["completed"] == 6 and r["output_lens"] == [q.output_len for q in sent]
    assert r["total_output_tokens"] == sum(q.output_len for q in sent)
    assert len(r["ttfts"]) == 6 and [len(x) for x in r["itls"]] == [q.output_len - 1 for q in sent]
    assert all(n > 0 for n in r["input_lens"]) and r["errors"] == [""] * 6


def test_serve_counts_failures_and_sharegpt_file(mock_server, tmp_path):
    too_long = bench_serve(
        "--base-url",
        mock_server,
        "--num-prompts",
        "3",
        "--random-input-len",
        str(MAX_MODEL_LEN + 10),
        "--random-output-len",
        "4",
        "--save-result",
        "--result-filename",
        str(tmp_path / "failed.json"),
    )
    assert too_long == 1  # nothing completed
    r = json.loads((tmp_path / "failed.json").read_text())
    assert (r["completed"], r["failed"]) == (0, 3) and "HTTP 400" in r["error_kinds"][0]
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": f"question {i} " * 8},
                {"from": "gpt", "value": "answer " * (4 + i)},
            ]
        }
        for i in range(5)
    ]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(conversations))
    rc = bench_serve(
        "--base-url",
        mock_server,
        "--backend",
        "openai-chat",
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(data),
        "--num-prompts",
        "4",
        "--ignore-eos",
        "--save-result",
        "--result-filename",
        str(tmp_path / "sharegpt-result.json"),
    )
    r = json.loads((tmp_path / "sharegpt-result.json").read_text())
    expected = datasets.sharegpt_requests(str(data), 4)
    assert rc == 0 and r["completed"] == 4 and r["total_output_tokens"] == sum(q.output_len for q in expected)


@pytest.mark.parametrize(
    "argv",
    [
        ["--goodput", "latency:5"],
        ["--dataset-name", "sharegpt"],
        ["--percentile-metrics", "ttft,speed"],
        ["--request-rate", "0"],
    ],
)
def test_serve_refuses_bad_flags(argv):
    with pytest.raises(SystemExit) as err:
        bench_serve(*argv)
    assert err.value.code == 2


def test_metrics_match_numpy_and_vllm_definitions():
    rng = np.random.default_rng(0)
    results = [
        RequestResult(
            i,
            ok=True,
            input_len=10,
            output_tokens=int(n),
            ttft=float(t),
            e2el=float(t + 0.01 * (n - 1)),
            itl=[0.01] * (int(n) - 1),
        )
        for i, (n, t) in enumerate(zip(rng.integers(1, 20, 30), rng.uniform(0.01, 0.5, 30)))
    ]
    results.append(RequestResult(30, error="HTTP 500"))
    s = summarize(results, 2.0, (25, 50, 99), ("ttft", "tpot", "e2el"), {"ttft": 300.0})
    ttfts = np.array([r.ttft for r in results[:30]]) * 1e3
    assert s["completed"] == 30 and s["failed"] == 1 and s["request_throughput"] == 15.0
    for q in (25, 50, 99):
        assert s[f"p{q}_ttft_ms"] == pytest.approx(np.percentile(ttfts, q))
    assert s["std_ttft_ms"] == pytest.approx(ttfts.std()) and s["median_ttft_ms"] == pytest.approx(np.median(ttfts))
    # TPOT: (e2el - ttft) / (n - 1) = 10 ms for every request with more than one token
    assert s["mean_tpot_ms"] == pytest.approx(10.0) and "mean_itl_ms" not in s
    good = int((ttfts <= 300).sum())
    assert s["request_goodput"] == good / 2.0 and s["slo_attainment"] == good / 31
    assert parse_goodput(["ttft:5", "e2el:7.5"]) == {"ttft": 5.0, "e2el": 7.5}
    assert not meets_slo(RequestResult(0, ok=True, output_tokens=3, ttft=0.1, e2el=0.5), {"tpot": 100})
    assert meets_slo(RequestResult(0, ok=True, output_tokens=1, ttft=0.1, e2el=0.1), {"tpot": 1})
    assert np.isnan(percentile([], 50))


def test_random_dataset_lengths_prefix_and_runs():
    a = datasets.random_requests(20, 40, 8, range_ratio=0.5, prefix_len=6, seed=1, token_low=5, token_high=50)
    b = datasets.random_requests(20, 40, 8, range_ratio=0.5, prefix_len=6, seed=1, run=1, token_low=5, token_high=50)
    assert all(len(r.prompt) == r.input_len and 26 <= r.input_len <= 66 and 4 <= r.output_len <= 12 for r in a)
    assert all(5 <= t < 50 for r in a for t in r.prompt) and len({tuple(r.prompt[:6]) for r in a + b}) == 1
    assert [r.input_len for r in a] == [r.input_len for r in b] and all(x.prompt != y.prompt for x, y in zip(a, b))


class _Shared:
    """The module's one engine, handed to each CLI run; the run's `with llm:` leaves it open."""

    def __init__(self, llm):
        self.llm, self.settings = llm, []

    def build(self, settings):
        self.settings.append(settings)
        return self

    def __enter__(self):
        return self.llm

    def __exit__(self, *exc_info):
        return None


ENGINE_FLAGS = [
    "--dtype",
    "float32",
    "--page-size",
    "8",
    "--max-model-len",
    "64",
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "32",
    "--compilation-cache-dir",
    "none",
]


@pytest.fixture(scope="module")
def shared_llm(hf_model_dir):
    path, _ = hf_model_dir("llama")
    flags = ["--model", path, *ENGINE_FLAGS]
    llm = offline.build_llm(offline.engine_settings(offline.build_latency_parser().parse_args(flags)))
    yield flags, llm
    llm.close()


def test_latency_and_throughput_offline(shared_llm, tmp_path, monkeypatch):
    flags, llm = shared_llm
    shared = _Shared(llm)
    monkeypatch.setattr(offline, "build_llm", shared.build)
    latency = tmp_path / "latency.json"
    assert (
        cli.main(
            [
                "bench",
                "latency",
                *flags,
                "--input-len",
                "8",
                "--output-len",
                "4",
                "--batch-size",
                "3",
                "--num-iters-warmup",
                "1",
                "--num-iters",
                "3",
                "--disable-tqdm",
                "--output-json",
                str(latency),
            ]
        )
        == 0
    )
    r = json.loads(latency.read_text())
    assert len(r["latencies"]) == 3 and r["avg_latency"] == pytest.approx(sum(r["latencies"]) / 3)
    assert list(r["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert r["percentiles"]["10"] <= r["percentiles"]["99"] <= max(r["latencies"])
    assert (r["batch_size"], r["settings"]["max_num_seqs"], r["settings"]["page_size"]) == (3, 4, 8)
    throughput = tmp_path / "throughput.json"
    assert (
        cli.main(
            [
                "bench",
                "throughput",
                *flags,
                "--num-prompts",
                "5",
                "--input-len",
                "12",
                "--output-len",
                "3",
                "--disable-tqdm",
                "--output-json",
                str(throughput),
            ]
        )
        == 0
    )
    t = json.loads(throughput.read_text())
    assert (t["num_requests"], t["total_prompt_tokens"], t["total_output_tokens"]) == (5, 60, 15)
    assert t["total_num_tokens"] == 75 and t["requests_per_second"] == pytest.approx(5 / t["elapsed_time"])
    assert t["tokens_per_second"] == pytest.approx(75 / t["elapsed_time"])
    assert [s.max_model_len for s in shared.settings] == [64, 64]  # the flags reached the engine's settings
