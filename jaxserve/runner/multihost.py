"""Multi-host serving on JAX's multi-controller runtime: process 0 schedules, every process runs each step.

One process per host, started with the same settings but `process_id`. `initialize` calls
`jax.distributed.initialize`, after which `jax.devices()` lists every process's devices and the
(data, model) mesh spans them: every process loads its shards of the weights and the cache and runs the
same compiled SPMD steps; XLA's collectives (NCCL, ICI, gloo on CPU) cross the hosts inside the step.

Only process 0 (the leader) has a scheduler, a block manager and the HTTP server. Each engine step
travels as its batch update (`runner/update_codec.py`: the rows new to the batch, the tokens and
pages the others gained, the slots freed, and the mask words of rows under a grammar), as ONE
message in the jax.distributed key-value store (the coordination service process 0 already hosts);
each follower (`follower_loop`) keeps a running batch of its own, applies the update and makes the
same call with the inputs it lays out itself. Steps of rows given whole (research code,
speculation's timing probes) travel as their packed inputs. Every executable is the runner's, so
speculative decoding's steps travel as steps too (followers hold the draft's params and cache as
well). Page copies (forked sequences, both caches) and shutdown travel the same way. This is the
only host-to-host exchange in the step loop; `scripts/bench_multihost.py` measures it.

Message: a fixed header (magic, version, op, sequence number, four int32 arguments: for a step of
whole rows the bucket's kind and up to three sizes) then the update, or each input array of the
bucket in pytree order: its kept width along the last axis, a fill value for the rest, and the kept
bytes. The shapes come from the bucket (both sides know them), so the message carries no shapes;
trimming the padding (page tables, token chunks, the penalty history that is -1 unless a row uses
penalties) keeps such a decode step's message to a few hundred bytes, and an update of a steady
decode step is smaller still (each row's slot, position and one token).

Failure: a process that dies breaks the next collective (gloo / NCCL report the closed peer) or misses
its heartbeats (`distributed_timeout`); the leader then exits at once with a message naming the cause
(`step_failed`), and JAX's coordination service terminates the other processes. A follower exits 0 on
SHUTDOWN, which the leader sends when it stops (explicitly or at interpreter exit).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import logging
import math
import os
import struct
import sys
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from jaxserve.engine.buckets import MULTI_STEP, SCORE
from jaxserve.errors import ConfigError, JaxServeError
from jaxserve.runner.update_codec import decode_update, encode_update

logger = logging.getLogger(__name__)

OP_STEP, OP_COPY_PAGES, OP_SHUTDOWN, OP_UPDATE = 1, 2, 3, 4
# A step message's bucket kind, by its index: the key's trailing tag, after how many sizes. Ragged steps
# (tokens, pages; speculative ones in a speculative engine) and their variants.
STEP_VARIANTS = ((), (SCORE,), (MULTI_STEP,))
_STEP_SIZES = (2, 2, 2)
# magic u32, version u16, op u16, seq u64, four int32 arguments (step: variant, sizes; copy: replica, n)
_MAGIC, _VERSION = 0x4D53584A, 5  # b"JXSM" little-endian; version 5: engine steps travel as batch updates
_HEADER = struct.Struct("<IHHQ4i")
# per input array: layout (_WHOLE or _ROWS), int32 sent as int16 (0/1), the fill value of trimmed rows
_LEAF = struct.Struct("<BBd")
_WHOLE, _ROWS = 0, 1
_KEY_PREFIX = "jaxserve/msg"
_GROUP = 1024  # messages per key-store directory; directories two behind the current one are deleted
EXIT_PEER_FAILED = 3  # exit status of a process that stops because another process of the job failed


class PeerFailureError(JaxServeError, RuntimeError):
    """Another process of a multi-host job died or can no longer be reached."""


# ---------------------------------------------------------------------------------------------- start-up
def initialize(settings: Any) -> bool:
    """`jax.distributed.initialize` from the settings; False (nothing done) for a single process.

    Must run before anything touches a JAX backend. `distributed_timeout` is the heartbeat timeout:
    a process silent that long counts as dead and the job stops."""
    n = settings.num_processes
    if n <= 1:
        return False
    if jax.distributed.is_initialized():
        if jax.process_count() != n or jax.process_index() != settings.process_id:
            raise ConfigError(
                f"jax.distributed is already initialized as process {jax.process_index()} of "
                f"{jax.process_count()}; the settings say {settings.process_id} of {n}"
            )
        check_mesh(settings.mesh_shape)
        return True
    # Collectives between CPU processes need an implementation (gloo is JAX's default; keep a user's choice).
    if jax.config.jax_cpu_collectives_implementation in (None, "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service (checkpoint sync for training) takes over SIGTERM, which would swallow
    # the server's graceful drain; serving has no use for it.
    jax.config.update("jax_enable_preemption_service", False)
    logger.info(
        "jax.distributed: process %d of %d, coordinator %s", settings.process_id, n, settings.coordinator_address
    )
    jax.distributed.initialize(
        coordinator_address=settings.coordinator_address,
        num_processes=n,
        process_id=settings.process_id,
        heartbeat_timeout_seconds=settings.distributed_timeout,
        shutdown_timeout_seconds=max(settings.distributed_timeout, 10),
    )
    logger.info("jax.distributed: %d devices in the job, %d here", jax.device_count(), jax.local_device_count())
    check_mesh(settings.mesh_shape)
    return True


def check_mesh(mesh_shape: tuple[int, ...]) -> None:
    """A multi-host mesh must use every device of the job: a process without devices in it would have
    nothing to run (and no part in the step's collectives)."""
    size = math.prod(mesh_shape)
    if size != jax.device_count():
        raise ConfigError(
            f"in a multi-host job the mesh must use every device: mesh_shape {tuple(mesh_shape)} "
            f"has {size} devices, the job {jax.device_count()} ({jax.process_count()} processes x "
            f"{jax.local_device_count()})"
        )


def _client():
    from jax._src import distributed  # the client behind jax.distributed.initialize (key-value store)

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


# Settings that may differ between the processes of a job: paths (the model and the draft are compared
# by their configs), how a process reached the coordinator, and which process it is; and
# compile_in_background, which `jaxserve serve` turns on for the process serving HTTP and a multi-process
# job never uses (every process compiles every bucket before serving).
_LOCAL_SETTINGS = (
    "process_id",
    "coordinator_address",
    "model",
    "tokenizer",
    "speculative_model",
    "compilation_cache_dir",
    "compile_in_background",
)


def fingerprint(engine: Any) -> dict:
    """What must be equal on every process for the steps to match: the settings (but _LOCAL_SETTINGS),
    the model config, the cache size and the buckets."""
    settings = {k: v for k, v in engine.config.to_dict().items() if k not in _LOCAL_SETTINGS}
    b = engine.buckets
    spec = engine.runner.speculation
    return dict(
        settings=settings,
        num_pages=engine.memory.num_pages,
        max_model_len=engine.memory.max_model_len,
        buckets=[list(b.batch_sizes), list(b.chunk_sizes), list(b.page_counts), list(b.token_counts)],
        model=repr(engine.model_config),
        draft=repr(spec.draft_cfg) if spec is not None else None,
        devices=jax.device_count(),
    )


def check_consistent(engine: Any, timeout_s: float = 3600.0) -> None:
    """Compare this process's fingerprint with process 0's (process 0 with everyone's); a mismatch
    would run different programs on different hosts, so it is refused at start-up. Also a barrier:
    it returns once the compared processes have loaded their model."""
    client, me = _client(), jax.process_index()
    mine = fingerprint(engine)
    client.key_value_set("jaxserve/fingerprint/%d" % me, json.dumps(mine, sort_keys=True))
    others = range(1, jax.process_count()) if me == 0 else [0]
    for other in others:
        theirs = json.loads(client.blocking_key_value_get("jaxserve/fingerprint/%d" % other, int(timeout_s * 1000)))
        if theirs != mine:
            diff = sorted(k for k in mine["settings"] if mine["settings"][k] != theirs["settings"].get(k))
            diff += [k for k in mine if k != "settings" and mine[k] != theirs.get(k)]
            raise ConfigError(
                f"process {other} was started differently from process {me} ({', '.join(diff)}): "
                "every process of a multi-host job needs the same settings but --process-id"
            )


def attach(engine: Any) -> "Leader | None":
    """After every process built its engine: check they match; on process 0 make the runner hand its
    calls to the others (returns the Leader). Followers get None and run `follower_loop`."""
    if jax.process_count() == 1:
        return None
    check_consistent(engine)
    if jax.process_index() != 0:
        return None
    leader = Leader(KVChannel(_client()))
    engine.runner.peers = leader
    atexit.register(leader.shutdown)  # followers exit when process 0 does, however it stops
    return leader


# ---------------------------------------------------------------------------------------------- messages
@functools.lru_cache(maxsize=1024)
def step_input_specs(runner: Any, shape: tuple) -> tuple[list[tuple[tuple[int, ...], np.dtype]], Any]:
    """(shape, dtype) of each input array of bucket `shape`, in pytree order, and the tree structure."""
    leaves, treedef = jax.tree.flatten(runner.step_inputs(shape))
    return [(tuple(x.shape), np.dtype(x.dtype)) for x in leaves], treedef


def _encode_leaf(a: np.ndarray) -> tuple[bytes, list[bytes]]:
    """One input array: (its metadata, its payload parts).

    Arrays of rank >= 3 ([R, B, X]: tokens, page tables, penalty history, targets) are sent as rows,
    each cut after its last entry that differs from the fill value: each row's kept width, then the kept
    entries. The fill is the very last entry, padding unless the last row is full (then little is cut,
    but the message is still exact). int32 values that fit are sent as int16."""
    a = np.asarray(a)
    if a.ndim >= 3 and a.shape[-1] > 0:
        rows = a.reshape(-1, a.shape[-1])
        fill = rows[-1, -1]
        differs = rows != fill
        widths = np.where(differs.any(axis=1), rows.shape[1] - np.argmax(differs[:, ::-1], axis=1), 0)
        widths = widths.astype(np.int32)
        kept = rows[np.arange(rows.shape[1])[None, :] < widths[:, None]]
        layout, parts = _ROWS, [widths.tobytes()]
    else:
        kept, fill, layout, parts = a.ravel(), 0, _WHOLE, []
    narrow = bool(kept.dtype == np.int32 and kept.size > 0 and -(2**15) <= kept.min() and kept.max() < 2**15)
    parts.append((kept.astype(np.int16) if narrow else kept).tobytes())
    return _LEAF.pack(layout, narrow, float(fill)), parts


def _step_args(shape: tuple) -> tuple[int, int, int, int]:
    """A bucket key as the header's four ints: its variant, then its sizes (0-padded)."""
    variant = next(
        i
        for i, (tag, n) in enumerate(zip(STEP_VARIANTS, _STEP_SIZES))
        if len(shape) == n + len(tag) and tuple(shape[n:]) == tag
    )
    sizes = tuple(shape[: _STEP_SIZES[variant]])
    return (variant,) + sizes + (0,) * (3 - len(sizes))


def _step_shape(args: tuple[int, ...]) -> tuple:
    variant = args[0]
    if not 0 <= variant < len(STEP_VARIANTS):
        raise PeerFailureError(f"unknown step variant {variant}")
    return tuple(args[1 : 1 + _STEP_SIZES[variant]]) + STEP_VARIANTS[variant]


def encode_step(seq: int, shape: tuple, leaves: list[np.ndarray]) -> bytes:
    metas, payload = [_HEADER.pack(_MAGIC, _VERSION, OP_STEP, seq, *_step_args(shape))], []
    for a in leaves:
        meta, parts = _encode_leaf(a)
        metas.append(meta)
        payload += parts
    return b"".join(metas + payload)


def encode_copy(seq: int, replica: int, src: np.ndarray, dst: np.ndarray) -> bytes:
    src, dst = np.asarray(src, np.int32), np.asarray(dst, np.int32)
    return _HEADER.pack(_MAGIC, _VERSION, OP_COPY_PAGES, seq, replica, len(src), 0, 0) + src.tobytes() + dst.tobytes()


def encode_update_message(seq: int, update: Any, masks: dict[int, np.ndarray]) -> bytes:
    return _HEADER.pack(_MAGIC, _VERSION, OP_UPDATE, seq, 0, 0, 0, 0) + encode_update(update, masks)


def encode_shutdown(seq: int) -> bytes:
    return _HEADER.pack(_MAGIC, _VERSION, OP_SHUTDOWN, seq, 0, 0, 0, 0)


@dataclasses.dataclass
class Message:
    op: int
    seq: int
    shape: tuple | None = None  # OP_STEP: the bucket; inputs as runner.run_step takes them
    inputs: tuple | None = None
    replica: int = 0  # OP_COPY_PAGES
    src: np.ndarray | None = None
    dst: np.ndarray | None = None
    update: Any = None  # OP_UPDATE: the BatchUpdate, and the constrained rows' masks
    masks: dict | None = None


def decode(data: bytes, runner: Any = None) -> Message:
    magic, version, op, seq, a0, a1, a2, a3 = _HEADER.unpack_from(data)
    if magic != _MAGIC or version != _VERSION:
        raise PeerFailureError(
            f"not a jaxserve step message (magic {magic:#x}, version {version}): "
            "are all processes running the same jaxserve?"
        )
    offset = _HEADER.size
    if op == OP_SHUTDOWN:
        return Message(op, seq)
    if op == OP_COPY_PAGES:
        pages = np.frombuffer(data, np.int32, 2 * a1, offset)
        return Message(op, seq, replica=a0, src=pages[:a1].copy(), dst=pages[a1:].copy())
    if op == OP_UPDATE:
        update, masks = decode_update(data, offset)
        return Message(op, seq, update=update, masks=masks)
    if op != OP_STEP:
        raise PeerFailureError(f"unknown message op {op}")
    shape = _step_shape((a0, a1, a2, a3))
    specs, treedef = step_input_specs(runner, shape)
    metas = [_LEAF.unpack_from(data, offset + i * _LEAF.size) for i in range(len(specs))]
    offset += len(specs) * _LEAF.size
    leaves = []
    for (full, dtype), (layout, narrow, fill) in zip(specs, metas):
        sent = np.dtype(np.int16) if narrow else dtype
        if layout == _WHOLE:
            count = math.prod(full)
            leaves.append(np.frombuffer(data, sent, count, offset).astype(dtype).reshape(full))
        else:
            num_rows, width = math.prod(full[:-1]), full[-1]
            widths = np.frombuffer(data, np.int32, num_rows, offset)
            offset += widths.nbytes
            count = int(widths.sum())
            a = np.full((num_rows, width), fill, dtype)
            a[np.arange(width)[None, :] < widths[:, None]] = np.frombuffer(data, sent, count, offset)
            leaves.append(a.reshape(full))
        offset += count * sent.itemsize
    if offset != len(data):
        raise PeerFailureError(f"step message {seq}: {len(data)} bytes, expected {offset} (version mismatch?)")
    return Message(op, seq, shape=shape, inputs=tuple(jax.tree.unflatten(treedef, leaves)))


# ---------------------------------------------------------------------------------------------- transport
class KVChannel:
    """Ordered messages from process 0 over the jax.distributed key-value store.

    Message n is key `jaxserve/msg/{n // 1024}/{n % 1024}`. The leader deletes a directory once it is
    two directories behind: every step ends in a collective over all processes (its samples are
    replicated), so followers are never more than a step behind the leader."""

    def __init__(self, client: Any, poll_seconds: float = 10.0):
        self.client = client
        self.poll_ms = int(poll_seconds * 1000)

    @staticmethod
    def key(seq: int) -> str:
        return f"{_KEY_PREFIX}/{seq // _GROUP}/{seq % _GROUP}"

    def send(self, seq: int, data: bytes) -> None:
        self.client.key_value_set_bytes(self.key(seq), data)
        if seq % _GROUP == 0 and seq >= 2 * _GROUP:
            self.client.key_value_delete(f"{_KEY_PREFIX}/{seq // _GROUP - 2}")

    def receive(self, seq: int, should_stop: Callable[[], bool] = lambda: False) -> bytes | None:
        """Message `seq`, waiting as long as it takes (an idle server sends nothing); None if
        `should_stop()` turns true meanwhile. If process 0 dies, the coordination service it hosts goes
        with it and JAX terminates this process."""
        while True:
            try:
                return self.client.blocking_key_value_get_bytes(self.key(seq), self.poll_ms)
            except Exception as err:  # noqa: BLE001 - jaxlib raises one runtime error type for all statuses
                if "DEADLINE_EXCEEDED" not in str(err):
                    raise PeerFailureError(f"waiting for step message {seq} from process 0 failed: {err}") from err
                if should_stop():
                    return None


class NoPeers:
    """A job of one process: nobody to hand steps to (the runner's default `peers`; `Leader` has the
    same methods)."""

    def step(self, key: tuple, inputs: tuple) -> None:
        pass

    def execute(self, update: Any, rows: Any, packed: Any) -> None:
        pass

    def copy_pages(self, replica: int, src: np.ndarray, dst: np.ndarray) -> None:
        pass

    def step_failed(self, err: BaseException) -> None:
        pass


class Leader:
    """Process 0's side: numbers and sends every device call of the runner to the other processes."""

    def __init__(self, channel: Any, on_failure: Callable[[BaseException], None] | None = None):
        self.channel = channel
        self.on_failure = on_failure or exit_on_peer_failure
        self.seq = 0
        self.closed = False
        self._lock = threading.Lock()
        self.messages = 0
        self.bytes_sent = 0
        self.send_seconds = 0.0

    def _send(self, encode: Callable[[int], bytes]) -> None:
        with self._lock:
            if self.closed:
                raise PeerFailureError("the other processes were already told to shut down")
            start = time.perf_counter()
            data = encode(self.seq)
            self.channel.send(self.seq, data)
            self.send_seconds += time.perf_counter() - start
            self.seq += 1
            self.messages += 1
            self.bytes_sent += len(data)

    def step(self, shape: tuple, inputs: tuple) -> None:
        leaves = jax.tree.leaves(inputs)
        self._send(lambda seq: encode_step(seq, shape, leaves))

    def execute(self, update: Any, rows: Any, packed: Any) -> None:
        """An engine step: its batch update, and the mask words of its rows sampling under a grammar
        (`packed`: the step's laid-out inputs, whose masks the leader's matchers filled)."""
        masks = {}
        if packed.mask is not None and any(row.grammar is not None for row in rows):
            words = np.asarray(packed.mask.bitmask).reshape(-1, packed.mask.bitmask.shape[-1])
            at = packed.logit_at
            masks = {i: words[at[i]] for i, row in enumerate(rows) if row.grammar is not None and at[i] >= 0}
        self._send(lambda seq: encode_update_message(seq, update, masks))

    def copy_pages(self, replica: int, src: np.ndarray, dst: np.ndarray) -> None:
        self._send(lambda seq: encode_copy(seq, replica, src, dst))

    def shutdown(self) -> None:
        """Tell the followers to exit (idempotent; also registered to run at interpreter exit)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.channel.send(self.seq, encode_shutdown(self.seq))
            except Exception as err:  # noqa: BLE001 - at exit with the job already broken: just say so
                logger.warning("could not send shutdown to the other processes: %s", err)

    def step_failed(self, err: BaseException) -> None:
        self.on_failure(err)

    def stats(self) -> dict:
        return dict(
            multihost_messages_total=self.messages,
            multihost_message_bytes_total=self.bytes_sent,
            multihost_send_seconds_total=self.send_seconds,
        )


def exit_on_peer_failure(err: BaseException) -> None:
    """A failed step leaves the processes out of step, and usually means one of them died: say so and
    exit now. (os._exit: a normal exit would wait in jax.distributed's shutdown barrier for the dead.)"""
    message = (
        f"jaxserve multi-host: process {jax.process_index()} of {jax.process_count()} cannot go on "
        f"({type(err).__name__}: {str(err).strip()[:500]}). Another process of the job has most likely "
        "died or become unreachable; a multi-host job cannot continue without it. Exiting with status "
        f"{EXIT_PEER_FAILED}; restart every process of the job."
    )
    logger.critical(message)
    print(message, file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(EXIT_PEER_FAILED)


# ---------------------------------------------------------------------------------------------- followers
def follower_loop(runner: Any, channel: Any = None, should_stop: Callable[[], bool] = lambda: False) -> int:
    """Run process 0's calls until SHUTDOWN; returns the number of steps run. Any failure raises
    (PeerFailureError for a broken job)."""
    channel = channel or KVChannel(_client())
    seq = steps = 0
    while True:
        data = channel.receive(seq, should_stop)
        if data is None:
            return steps
        message = decode(data, runner)
        if message.seq != seq:
            raise PeerFailureError(f"expected step message {seq}, got {message.seq}")
        if message.op == OP_SHUTDOWN:
            logger.info("process 0 shut down after %d messages (%d steps); exiting", seq, steps)
            return steps
        if message.op == OP_COPY_PAGES:
            runner.copy_pages(message.replica, message.src, message.dst)
        else:
            try:
                # Waited for here, so that a failed collective fails this step's message.
                if message.op == OP_UPDATE:
                    runner.execute(message.update, message.masks).wait()
                else:
                    jax.block_until_ready(runner.run_step(message.shape, message.inputs))
            except Exception as err:  # noqa: BLE001 - a collective with a dead peer, most likely
                raise PeerFailureError(f"step {seq} failed: {type(err).__name__}: {str(err).strip()[:500]}") from err
            steps += 1
        seq += 1


def run_follower(engine: Any) -> int:
    """A follower process's main loop; returns its exit status (0 on SHUTDOWN). A broken job exits
    the process at once with EXIT_PEER_FAILED (not via the shutdown barrier, which would wait)."""
    try:
        steps = follower_loop(engine.runner)
    except PeerFailureError as err:
        exit_on_peer_failure(err)
    logger.info("follower %d ran %d steps", jax.process_index(), steps)
    return 0
