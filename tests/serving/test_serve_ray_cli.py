"""`jaxserve serve-ray`'s flags: the application they describe (no cluster started here)."""

from __future__ import annotations

import pytest

from jaxserve.serving.ray.cli import app_builder, argv_from_args, build_parser, spec_from_namespace
from jaxserve.errors import ConfigError

SMALL = ["--config", "small", "--model", "checkpoints/small"]


def spec(*flags: str):
    return spec_from_namespace(build_parser().parse_args([*SMALL, *flags]))


def test_fixed_replicas_resources_and_the_prefix_router():
    s = spec("--num-replicas", "3", "--replica-resources", '{"GPU": 1, "CPU": 2}', "--api-key", "k")
    assert s.num_replicas == 3 and s.autoscaling is None and s.prefix_routing
    assert s.replica_resources == {"GPU": 1, "CPU": 2} and s.server["api_key"] == "k"
    assert s.router_kwargs == {"block_size": s.settings.page_size, "imbalance": 8}
    assert s.settings.model.endswith("checkpoints/small") and s.settings.max_num_seqs == 16

    from jaxserve.serving.ray.deployments import engine_deployment_options

    options = engine_deployment_options(s)
    assert options["num_replicas"] == 3 and options["max_ongoing_requests"] == 64
    assert options["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1}
    assert options["request_router_config"].request_router_class.endswith("PrefixAwareRouter")


def test_autoscaling_flags_and_their_conflicts():
    s = spec(
        "--min-replicas",
        "1",
        "--max-replicas",
        "2",
        "--target-ongoing-requests",
        "4",
        "--downscale-delay-s",
        "5",
        "--router",
        "pow2",
    )
    assert s.num_replicas is None and not s.prefix_routing
    assert s.autoscaling == {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 4, "downscale_delay_s": 5}
    with pytest.raises(ConfigError, match="not both"):
        spec("--num-replicas", "2", "--max-replicas", "3")
    with pytest.raises(ConfigError, match="min-replicas"):
        spec("--min-replicas", "3", "--max-replicas", "2")


def test_a_replica_of_several_processes_is_one_placement_group():
    s = spec("--num-processes", "2", "--mesh-shape", "1,2", "--replica-resources", '{"TPU": 4, "CPU": 8}')
    assert s.processes_per_replica == 2 and s.placement_strategy == "STRICT_SPREAD"
    # the replica fills in the job (coordinator, process ids) at start-up
    assert (s.settings.num_processes, s.settings.process_id, s.settings.coordinator_address) == (1, 0, None)

    from jaxserve.serving.ray.deployments import engine_deployment_options

    options = engine_deployment_options(s)
    assert options["placement_group_bundles"] == [{"CPU": 8, "TPU": 4}] * 2
    assert options["placement_group_strategy"] == "STRICT_SPREAD"
    assert options["ray_actor_options"] == {"num_cpus": 8, "num_gpus": 0, "resources": {"TPU": 4}}  # bundle 0
    assert "placement_group_bundles" not in engine_deployment_options(spec())
    assert spec("--num-processes", "2", "--placement-strategy", "PACK").placement_strategy == "PACK"
    with pytest.raises(ConfigError, match="chooses each replica's --coordinator-address"):
        spec("--num-processes", "2", "--coordinator-address", "10.0.0.1:1234")
    with pytest.raises(ConfigError, match="one process"):
        spec("--num-processes", "2", "--mock-engine")


def test_the_cli_refuses_a_bad_mix_with_exit_2(capsys):
    from jaxserve import cli

    assert cli.main(["serve-ray", *SMALL, "--num-replicas", "2", "--min-replicas", "1"]) == 2
    assert "not both" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve-ray", "--replica-resources", "{nope"])


def test_serve_run_args_build_the_same_application():
    args = {
        "config": "small",
        "model": "checkpoints/small",
        "num_replicas": 2,
        "mock_engine": False,
        "replica_resources": {"CPU": 1},
        "served_model_name": ["a", "b"],
    }
    assert argv_from_args(args) == [
        "--config",
        "small",
        "--model",
        "checkpoints/small",
        "--num-replicas",
        "2",
        "--replica-resources",
        '{"CPU": 1}',
        "--served-model-name",
        "a",
        "b",
    ]
    assert argv_from_args(
        {"mock_engine": "true", "enable_prefix_caching": "false", "api_key": "false"}, {"--no-enable-prefix-caching"}
    ) == ["--mock-engine", "--no-enable-prefix-caching"]
    app = app_builder(args)
    assert type(app).__name__ == "Application"


def test_serve_ray_serves_then_drains_on_sigterm(tmp_path):
    """The command end to end (the mock engine, its own local Ray): ready, a response with the replica
    header; SIGTERM mid-stream lets the stream finish, then the command exits 0."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    import httpx

    from serving_testlib import free_port

    port = free_port()
    log = open(tmp_path / "serve-ray.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxserve.serving.ray.cli",
            "--mock-engine",
            "--num-replicas",
            "1",
            "--port",
            str(port),
            "--mock-token-delay",
            "0.01",
            "--grace-seconds",
            "20",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, RAY_ADDRESS=""),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        with httpx.Client(base_url=url, timeout=60) as client:
            while True:  # readiness is only observable over HTTP
                assert proc.poll() is None, (tmp_path / "serve-ray.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "serve-ray was not ready within 120 s"
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            r = client.post("/v1/completions", json={"model": "mock", "prompt": [1, 2, 3], "max_tokens": 3})
            assert r.status_code == 200 and r.headers["x-jaxserve-replica"]
            chunks: list[str] = []
            streaming = threading.Event()

            def stream():
                with client.stream(
                    "POST",
                    "/v1/completions",
                    json={"model": "mock", "prompt": [1, 2], "stream": True, "ignore_eos": True, "max_tokens": 150},
                ) as s:
                    for line in s.iter_lines():
                        if line.startswith("data: "):
                            chunks.append(line[6:])
                            streaming.set()

            reader = threading.Thread(target=stream)
            reader.start()
            assert streaming.wait(30)
            proc.send_signal(signal.SIGTERM)
            reader.join(60)
        assert chunks[-1] == "[DONE]" and len(chunks) == 151, chunks[-3:]  # 150 tokens (the last one finishing), [DONE]
        assert proc.wait(90) == 0, (tmp_path / "serve-ray.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_lora_is_refused_not_dropped():
    """The replicas' ingress carries no adapter yet: --enable-lora stops the start with the reason."""
    with pytest.raises(ConfigError, match="does not serve LoRA adapters"):
        spec("--enable-lora")
