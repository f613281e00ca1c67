"""The P/D transport between two real processes (`jaxserve.disagg.transport`): pages arrive bit for
bit, an offer ends when pulled, aborted or expired, and every failure is an error in bounded time
(a dead producer, an id it does not hold, a producer that never offers), never a hang."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxserve.disagg.transport import PullTimeout, TransferEndpoint, TransferError

sys.path.insert(0, str(Path(__file__).parent))
from transfer_peer import pages  # noqa: E402


class Peer:
    def __init__(self):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "transfer_peer.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self.remote = json.loads(self.proc.stdout.readline())

    def __call__(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def ended(self) -> dict:
        return {int(k): v for k, v in self("ended")["ended"].items()}


def ended(peer: Peer, transfer_id: int, timeout: float = 10.0) -> str | None:
    """How the producer says `transfer_id` ended, once it has (a loaded machine may take a while)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        how = peer.ended().get(transfer_id)
        if how is not None:
            return how
        time.sleep(0.05)
    return None


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.proc.kill()
    p.proc.wait()


@pytest.fixture(scope="module")
def consumer():
    endpoint = TransferEndpoint()
    yield endpoint
    endpoint.close()


def test_pulled_pages_are_bit_exact_and_the_offer_ends_done(peer, consumer):
    peer("expect 1 30")
    future = consumer.pull(peer.remote, 1, deadline_s=20)  # claimed before the pages are offered: it waits
    time.sleep(0.2)
    peer("offer 1")
    got = future.result(timeout=30)
    want = pages()
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype
        np.testing.assert_array_equal(got[name], want[name])
    assert ended(peer, 1) == "done"


def test_an_unknown_id_and_a_refused_layout_fail_at_once(peer, consumer):
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="unknown"):
        consumer.pull(peer.remote, 999, deadline_s=20).result(timeout=30)

    def refuse(leaves):
        raise TransferError("another layout")

    peer("expect 2 30")
    peer("offer 2")
    with pytest.raises(TransferError, match="another layout"):
        consumer.pull(peer.remote, 2, deadline_s=20, check=refuse).result(timeout=30)
    assert time.monotonic() - t0 < 10
    assert ended(peer, 2) == "aborted"  # refused: the producer frees it now, not at its timeout


def test_an_offer_nobody_pulls_expires_and_a_late_pull_is_refused(peer, consumer):
    peer("expect 3 0.3")
    peer("offer 3")
    time.sleep(0.5)
    assert peer.ended().get(3) == "expired"
    with pytest.raises(TransferError, match="unknown"):
        consumer.pull(peer.remote, 3, deadline_s=20).result(timeout=30)


def test_pages_never_offered_time_out_and_the_producer_frees_them(peer, consumer):
    peer("expect 4 30")
    t0 = time.monotonic()
    with pytest.raises(PullTimeout):
        consumer.pull(peer.remote, 4, deadline_s=0.5).result(timeout=30)
    assert time.monotonic() - t0 < 3
    assert ended(peer, 4) == "aborted"  # the consumer's abort arrived


def test_a_producer_that_dies_fails_the_pull_at_once():
    dead = Peer()
    dead("expect 5 30")
    consumer = TransferEndpoint()
    try:
        future = consumer.pull(dead.remote, 5, deadline_s=60)  # waiting for pages that never come
        time.sleep(0.3)
        t0 = time.monotonic()
        dead.proc.send_signal(signal.SIGKILL)
        dead.proc.wait()
        with pytest.raises(TransferError):
            future.result(timeout=30)
        assert time.monotonic() - t0 < 5
        with pytest.raises(TransferError, match="unreachable"):
            consumer.pull(dead.remote, 5, deadline_s=60).result(timeout=30)
    finally:
        consumer.close()
