"""Helpers of the tests in tests/serving (a module of its own: `conftest` names several files)."""

from __future__ import annotations

import socket
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, seconds: float) -> bool:
    """Serve's state is only observable by asking it: poll until `predicate()` or the deadline."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


def running_replicas(app: str) -> int:
    """Engine replicas RUNNING in the Serve application `app`."""
    from ray import serve

    return serve.status().applications[app].deployments["JaxserveEngine"].replica_states.get("RUNNING", 0)
