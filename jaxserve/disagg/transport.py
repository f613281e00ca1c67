"""Pages between two engine processes: `jax.experimental.transfer` for the arrays, a TCP side channel
for the handshake around them.

The transfer server (tpu-inference's disaggregation transport) moves arrays: the producer offers a
list of arrays under an id (`await_pull`), the consumer pulls them by that id with their shapes
(`pull`). It says nothing else: the producer learns neither that a pull happened nor that one never
will, and on jax 0.10.2's CPU client a pull of an id nobody offers (or whose offer lapsed) waits
until the producer's process exits (the pull's `timeout` argument is not honoured there; measured).
So every pull is wrapped in a small request/response protocol over TCP (JSON lines), one connection
per call:

    consumer -> producer   {"op": "claim", "id": ID}  -> {"ok": true, "leaves": [[name, shape, dtype], ...]}
                                                         (waits until the pages are offered), or
                                                         {"ok": false, "error": "..."}: unknown or expired
    consumer: pull(ID) over the transfer server
    consumer -> producer   {"op": "done", "id": ID}   -> the producer drops the arrays, frees the pages
    consumer -> producer   {"op": "abort", "id": ID}  -> the consumer gave up (its deadline): the producer
                                                         drops the offer, frees the pages, and answers a
                                                         pull still waiting with error arrays

A claimed offer is not expired by the producer's pull timeout (a pull may be moving it); only "done",
"abort", or the claim's own (longer) deadline ends it. A producer that dies closes both sockets: the
claim or the pull raises at once, never hangs. A pull starts only after its claim saw the
pages offered, so it never waits on an id that is not there. A producer that hangs is the
consumer's deadline's business (`PullTimeout`); its waiting thread ends when the producer answers
or dies.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import transfer

logger = logging.getLogger(__name__)


class TransferError(RuntimeError):
    """A pull that failed: the producer is gone, refused the id, or sent arrays of another layout."""


class PullTimeout(TransferError):
    """A pull that did not finish by its deadline."""


def _leaves(pages: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    return sorted(pages.items())


@dataclasses.dataclass
class _Offer:
    leaves: list[list] | None = None  # [[name, shape, dtype]] once offered
    arrays: list[Any] | None = None  # kept alive until done / abort / expiry (the server pulls them)
    expires_at: float = 0.0
    claimed: bool = False
    ended: str | None = None  # "done", "aborted", "expired": the pages may be freed


class TransferEndpoint:
    """One per engine process: a transfer server and its side channel, both on `host`.

    Producer: `expect(id, ttl)` when a request's pages are kept for a pull, `offer(id, pages)` once
    they are read, `take_ended()` each step for the ids whose pages may be freed. Consumer:
    `pull(remote, id, deadline)` (a future of the pages). Thread-safe: the side channel's handler
    threads and the engine's step thread share the offers under one lock."""

    def __init__(self, host: str = "127.0.0.1", claim_grace_s: float = 60.0, max_pulls: int = 4):
        self.host = host
        self.claim_grace_s = claim_grace_s
        self._device = jax.local_devices()[0]
        self._server = transfer.start_transfer_server(self._device.client, f"{host}:0", [f"{host}:0"])
        self._lock = threading.Condition()
        self._offers: dict[int, _Offer] = {}
        self._connections: dict[str, Any] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_pulls, thread_name_prefix="kv-pull")
        endpoint = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                try:
                    message = json.loads(self.rfile.readline())
                    reply = endpoint._answer(message)
                except (ValueError, TypeError, KeyError) as e:  # a malformed message must not take the channel down
                    reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                self.wfile.write((json.dumps(reply) + "\n").encode())

        self._side = socketserver.ThreadingTCPServer((host, 0), Handler, bind_and_activate=False)
        self._side.daemon_threads = True
        self._side.allow_reuse_address = True
        self._side.server_bind()
        self._side.server_activate()
        self._side_thread = threading.Thread(target=self._side.serve_forever, name="kv-side-channel", daemon=True)
        self._side_thread.start()

    @property
    def transfer_address(self) -> str:
        return self._server.address()

    @property
    def side_port(self) -> int:
        return self._side.server_address[1]

    # -- producer ---------------------------------------------------------------------------------

    def expect(self, transfer_id: int, ttl_s: float) -> None:
        """Register `transfer_id` before its pages are read, so a claim arriving first waits for them;
        unpulled, it expires `ttl_s` from now."""
        with self._lock:
            self._offers[transfer_id] = _Offer(expires_at=time.monotonic() + ttl_s)

    def offer(self, transfer_id: int, pages: dict[str, np.ndarray]) -> None:
        """Offer the pages (leaf name -> array, pages on the leading axis) for one pull."""
        leaves = _leaves(pages)
        arrays = [jax.device_put(np.ascontiguousarray(a), self._device) for _, a in leaves]
        with self._lock:
            offer = self._offers.get(transfer_id)
            if offer is None or offer.ended:
                return  # expired or aborted while its pages were read
            # The server drops an offer nobody pulled by then (its copy of the arrays with it).
            until = datetime.datetime.now() + datetime.timedelta(seconds=self._ttl_left(offer) + self.claim_grace_s)
            self._server.await_pull(transfer_id, arrays, timeout=until)
            offer.arrays = arrays
            offer.leaves = [[name, list(a.shape), str(a.dtype)] for name, a in leaves]
            self._lock.notify_all()

    @staticmethod
    def _ttl_left(offer: _Offer) -> float:
        return max(offer.expires_at - time.monotonic(), 0.0)

    def take_ended(self) -> dict[int, str]:
        """Ids whose pages may be freed now (pulled, aborted by the consumer, or expired unclaimed),
        each with how it ended; forgets them."""
        now = time.monotonic()
        out = {}
        with self._lock:
            for tid, offer in list(self._offers.items()):
                if offer.ended is None and now > offer.expires_at:
                    offer.ended = "expired"
                if offer.ended is not None:
                    out[tid] = offer.ended
                    del self._offers[tid]
            self._lock.notify_all()
        return out

    def num_held(self) -> int:
        with self._lock:
            return sum(1 for o in self._offers.values() if o.ended is None)

    def _answer(self, message: dict) -> dict:
        op, tid = message.get("op"), message.get("id")
        with self._lock:
            offer = self._offers.get(tid)
            if offer is None:
                return {"ok": False, "error": f"transfer {tid} is unknown here (expired, freed, or never made)"}
            if op == "claim":
                if offer.ended:
                    return {"ok": False, "error": f"transfer {tid} has ended ({offer.ended})"}
                if offer.claimed:  # a second decode engine (a retry): the first may be mid-pull
                    return {"ok": False, "error": f"transfer {tid} is already claimed by another engine"}
                offer.claimed = True
                offer.expires_at = max(offer.expires_at, time.monotonic() + self.claim_grace_s)
                deadline = time.monotonic() + float(message.get("wait_s", 10.0))
                while offer.leaves is None and not offer.ended:
                    left = deadline - time.monotonic()
                    if left <= 0:  # the consumer gives up on it: free the pages
                        offer.ended = "aborted"
                        return {"ok": False, "error": f"transfer {tid}: the pages were not offered in time"}
                    self._lock.wait(left)
                if offer.ended:
                    return {"ok": False, "error": f"transfer {tid} has ended ({offer.ended})"}
                return {"ok": True, "leaves": offer.leaves}
            if op in ("done", "abort"):
                offer.ended = "done" if op == "done" else "aborted"
                self._lock.notify_all()
                return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    # -- consumer ---------------------------------------------------------------------------------

    def pull(
        self, remote: dict, transfer_id: int, deadline_s: float, check: Callable[[list], None] | None = None
    ) -> concurrent.futures.Future:
        """Pull the pages offered under `transfer_id` by the endpoint `remote` ({"host", "port",
        "transfer_address"}), as leaf name -> numpy array. The future fails with TransferError
        (producer gone, id refused, `check` refused the layout) or PullTimeout (past `deadline_s`,
        after which the producer is told to drop the offer)."""
        inner = self._pool.submit(self._pull, remote, transfer_id, deadline_s, check)
        outer: concurrent.futures.Future = concurrent.futures.Future()
        timer = threading.Timer(deadline_s, self._expire, (outer, remote, transfer_id, deadline_s))
        timer.daemon = True

        def finish(f):
            timer.cancel()
            if outer.done():
                return
            e = f.exception()
            if e is None:
                outer.set_result(f.result())
            else:
                outer.set_exception(e if isinstance(e, TransferError) else TransferError(f"{type(e).__name__}: {e}"))

        inner.add_done_callback(finish)
        timer.start()
        return outer

    def _expire(self, outer, remote, transfer_id, deadline_s):
        if outer.done():
            return
        try:
            outer.set_exception(PullTimeout(f"the pull of transfer {transfer_id} took more than {deadline_s:g} s"))
        except concurrent.futures.InvalidStateError:
            return
        try:
            self._call(remote, {"op": "abort", "id": transfer_id}, timeout=2.0)
        except TransferError as e:  # unreachable: its own pull timeout frees the pages
            logger.info("aborting transfer %s: %s", transfer_id, e)

    def _pull(self, remote: dict, transfer_id: int, deadline_s: float, check) -> dict[str, np.ndarray]:
        # The producer waits a little longer than our deadline, so a pull that times out is always a
        # PullTimeout here (and our abort reaches it before its own wait ends).
        reply = self._call(remote, {"op": "claim", "id": transfer_id, "wait_s": deadline_s + 1}, timeout=deadline_s + 2)
        if not reply.get("ok"):
            raise TransferError(reply.get("error", "the producer refused the claim"))
        leaves = reply["leaves"]
        if check is not None:
            try:
                check(leaves)
            except Exception:
                self._call(remote, {"op": "abort", "id": transfer_id}, timeout=2.0)
                raise
        sharding = jax.sharding.SingleDeviceSharding(self._device)
        specs = [jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding) for _, shape, dtype in leaves]
        arrays = self._connection(remote["transfer_address"]).pull(transfer_id, specs)
        pages = {name: np.asarray(a) for (name, _, _), a in zip(leaves, arrays)}
        self._call(remote, {"op": "done", "id": transfer_id}, timeout=5.0)
        return pages

    def release(self, remote: dict, transfer_id: int) -> None:
        """Tell the producer its offer will not be pulled (the consumer computes the prompt itself), so
        it frees the pages now rather than at its timeout. Fire and forget: an unreachable producer
        frees them at its timeout anyway."""

        def send():
            try:
                self._call(remote, {"op": "abort", "id": transfer_id}, timeout=2.0)
            except TransferError as e:
                logger.info("releasing transfer %s: %s", transfer_id, e)

        self._pool.submit(send)

    def _connection(self, address: str):
        with self._lock:
            if address not in self._connections:
                self._connections[address] = self._server.connect(address)
            return self._connections[address]

    @staticmethod
    def _call(remote: dict, message: dict, timeout: float) -> dict:
        try:
            with socket.create_connection((remote["host"], int(remote["port"])), timeout=timeout) as s:
                s.sendall((json.dumps(message) + "\n").encode())
                line = s.makefile("rb").readline()
        except OSError as e:
            raise TransferError(f"the prefill engine at {remote['host']}:{remote['port']} is unreachable: {e}") from e
        if not line:
            raise TransferError(f"the prefill engine at {remote['host']}:{remote['port']} closed the side channel")
        return json.loads(line)

    def close(self) -> None:
        self._side.shutdown()
        self._side.server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)
