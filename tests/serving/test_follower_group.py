"""A multi-host replica's followers (multihost_replica.py) on the session's local Ray: the bundles and
actor options a replica asks for, and a follower's death seen by `FollowerGroup.failure` (the
replica's health check) and by `build_leader` (process 0's start-up), fast, instead of a hang."""

from __future__ import annotations

import threading
import time

import pytest

from jaxserve.config import EngineConfig
from jaxserve.serving.ray.multihost_replica import FollowerGroup, actor_resources, placement_bundles, process_settings
from serving_testlib import free_port


def test_one_bundle_per_process_each_with_the_replica_resources():
    assert placement_bundles({}, 3) == [{"CPU": 1}] * 3
    assert placement_bundles({"TPU": 4, "CPU": 8}, 2) == [{"CPU": 8, "TPU": 4}] * 2
    assert placement_bundles({"GPU": 1, "CPU": 0}, 2) == [{"GPU": 1}] * 2  # Ray refuses zero amounts
    with pytest.raises(ValueError, match="nonzero"):
        placement_bundles({"CPU": 0}, 2)
    assert actor_resources({"TPU": 4, "CPU": 8}) == {"num_cpus": 8, "num_gpus": 0, "resources": {"TPU": 4}}
    settings = process_settings(EngineConfig(), 2, "10.0.0.1:1234", 1)
    assert (settings.num_processes, settings.process_id, settings.coordinator_address) == (2, 1, "10.0.0.1:1234")


@pytest.fixture
def waiting_follower(serve_url):
    """Process 1 of a 2-process job whose process 0 never comes: its actor waits in
    jax.distributed.initialize, as a follower waits for process 0 while the replica starts."""
    settings = process_settings(
        EngineConfig(model="checkpoints/small", distributed_timeout=5), 2, f"127.0.0.1:{free_port()}", 0
    )
    group = FollowerGroup.start(settings, {"CPU": 0.5}, warm_up=False)
    yield group
    group.stop()


def test_a_dead_follower_is_seen_by_the_health_check_and_the_start(waiting_follower):
    import ray

    group = waiting_follower
    time.sleep(1.0)
    assert group.failure() is None  # waiting, not failed

    threading.Timer(2.0, lambda: ray.kill(group.actors[0], no_restart=True)).start()
    never = threading.Event()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"could not start: process 1 of the replica's engine failed: \w*ActorDied"):
        group.build_leader(lambda: never.wait(60))  # process 0's engine, waiting for process 1 (here 60 s)
    assert time.monotonic() - start < 30
    assert group.failure().startswith("process 1 of the replica's engine failed")
