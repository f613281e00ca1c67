"""Per-step cost of the multi-host step message on loopback: 2 local processes, jax.distributed on CPU.

    python scripts/bench_multihost.py [--iters 1000] [--batch 16] [--pages 64] [--json OUT]

Process 0 encodes a typical decode step of `--batch` sampled rows (one token each, page tables in a
`--pages` bucket, no penalties, no grammar) as the leader sends it, its batch update
(`multihost.encode_update_message`, `--message update`, the default), or as its packed inputs
(`encode_step`, `--message step`: what steps of whole rows still send) and publishes it in the jax.distributed key-value store, as the Leader does
every step; process 1 receives and decodes it, as a
follower does, and acknowledges with a 1-byte key. Reported per message (mean, p50, p99 in µs):
  encode   process 0 packing the message
  send     process 0's key_value_set_bytes: what the leader's step loop pays
  round    send -> follower receives and decodes -> its ack arrives (one-way delivery ≈ round / 2)
  decode   the follower unpacking it
For comparison, `multihost_utils.broadcast_one_to_all` of the same bytes in a fixed buffer (the next
power of two; a collective over all devices, the other way to hand data from process 0 to the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

VOCAB_SIZE = 32000  # the token mask's width (a Llama-2-sized vocabulary)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--broadcast-iters", type=int, default=200)
    p.add_argument("--batch", type=int, default=16, help="decode rows in the step")
    p.add_argument("--pages", type=int, default=64, help="page-table bucket (max_model_len / page_size)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--message",
        choices=("update", "step"),
        default="update",
        help="update: an engine step's batch update (what the leader sends now); step: its packed inputs",
    )
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


class Layout:
    """The input layout of one plain ragged bucket (N tokens, P pages), as ModelRunner.step_inputs
    gives it with R = 1 and `rows` row slots and logits: (RaggedBatch, SamplingTensors, TokenMask)."""

    def __init__(self, history_len, rows, vocab_size):
        self.history_len, self.rows, self.vocab_size = history_len, rows, vocab_size

    def step_inputs(self, shape):
        import jax.numpy as jnp
        from jax import ShapeDtypeStruct as S

        from jaxserve.model.kv_cache import RaggedBatch
        from jaxserve.model.sampler import SamplingTensors
        from jaxserve.structured.apply import TokenMask

        N, P = shape[:2]
        rows = self.rows

        def i32(*dims):
            return S((1,) + dims, jnp.int32)

        batch = RaggedBatch(
            tokens=i32(N),
            positions=i32(N),
            slots=i32(N),
            token_row=i32(N),
            query_start=i32(rows + 1),
            context_lens=i32(rows),
            page_table=i32(rows, P),
            logit_index=i32(rows),
        )
        return (batch, SamplingTensors.spec((1, rows), self.history_len), TokenMask.spec((1, rows), self.vocab_size))


def decode_step_inputs(batch, pages, page_size, vocab_size, rng):
    """A decode step of `batch` sampled rows (one token each) with 40-90% of the page table in use,
    packed as the runner packs it (`ragged.pack_ragged`, R = 1; no row constrained by a grammar)."""
    from jaxserve.model.kv_cache import RaggedBatch
    from jaxserve.model.ragged import RaggedRow, pack_ragged
    from jaxserve.model.sampler import RowSampling, SamplingTensors
    from jaxserve.structured.apply import TokenMask

    used = rng.integers(int(0.4 * pages), int(0.9 * pages), batch)
    start = used * page_size - rng.integers(1, page_size, batch)
    rows = [
        RaggedRow([int(rng.integers(0, vocab_size))], int(s), rng.choice(np.arange(1, 8 * pages), n, replace=False))
        for s, n in zip(start, used)
    ]
    arrays = pack_ragged(rows, page_size=page_size, num_tokens=batch, num_rows=batch, max_pages=pages, num_logits=batch)
    ragged = RaggedBatch(**{name: value[None] for name, value in vars(arrays).items()})
    sampling = [RowSampling(temperature=0.7, top_p=0.95, seed=int(rng.integers(2**31)), step=int(s)) for s in start]
    st = SamplingTensors.pack(sampling, (1, batch), pages * page_size)
    words = -(-vocab_size // 32)
    mask = TokenMask(np.full((1, batch, words), -1, np.int32), np.zeros((1, batch), bool))
    return ragged, st, mask


def decode_step_update(batch, pages, page_size, vocab_size, rng):
    """The same decode step as the scheduler's batch update of a steady batch: each row's slot,
    position and one new token; one row gains a page (no new rows, nothing freed, no grammar)."""
    from jaxserve.engine.scheduler_output import BatchUpdate, RowUpdate

    used = rng.integers(int(0.4 * pages), int(0.9 * pages), batch)
    start = used * page_size - rng.integers(1, page_size, batch)
    rows = [
        RowUpdate(i, int(s), 1, tokens_from=int(s), tokens=[int(rng.integers(0, vocab_size))])
        for i, s in enumerate(start)
    ]
    rows[0].pages_from, rows[0].page_ids = int(used[0]), [int(rng.integers(1, 8 * pages))]
    return BatchUpdate([], rows, [], False)


def summary(seconds):
    us = np.asarray(seconds) * 1e6
    return dict(mean_us=float(us.mean()), p50_us=float(np.percentile(us, 50)), p99_us=float(np.percentile(us, 99)))


def worker(args) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax

    jax.distributed.initialize(f"127.0.0.1:{args.port}", 2, args.process_id, heartbeat_timeout_seconds=30)
    from jax.experimental import multihost_utils

    from jaxserve.runner import multihost

    client, leader = multihost._client(), args.process_id == 0
    channel = multihost.KVChannel(client)
    shape = (args.batch, args.pages)  # a decode bucket: one token per row
    layout = Layout(args.pages * args.page_size, args.batch, VOCAB_SIZE)
    inputs = decode_step_inputs(args.batch, args.pages, args.page_size, VOCAB_SIZE, np.random.default_rng(0))
    leaves = jax.tree.leaves(inputs)
    full_bytes = sum(x.nbytes for x in leaves)
    update = decode_step_update(args.batch, args.pages, args.page_size, VOCAB_SIZE, np.random.default_rng(0))

    def encode(seq):
        if args.message == "update":
            return multihost.encode_update_message(seq, update, {})
        return multihost.encode_step(seq, shape, leaves)

    timings = {k: [] for k in ("encode", "send", "round", "decode")}
    size = 0
    for seq in range(args.warmup + args.iters):
        keep = seq >= args.warmup
        if leader:
            t0 = time.perf_counter()
            data = encode(seq)
            t1 = time.perf_counter()
            channel.send(seq, data)
            t2 = time.perf_counter()
            client.blocking_key_value_get_bytes(f"bench/ack/{seq}", 60_000)
            t3 = time.perf_counter()
            size = len(data)
            if keep:
                timings["encode"].append(t1 - t0)
                timings["send"].append(t2 - t1)
                timings["round"].append(t3 - t1)
        else:
            data = channel.receive(seq)
            t0 = time.perf_counter()
            message = multihost.decode(data, layout)
            t1 = time.perf_counter()
            client.key_value_set_bytes(f"bench/ack/{seq}", b"1")
            if keep:
                timings["decode"].append(t1 - t0)
            assert message.shape == shape or len(message.update.rows) == args.batch
    data = encode(0)
    buffer = np.zeros(1 << (len(data) - 1).bit_length(), np.uint8)
    buffer[: len(data)] = np.frombuffer(data, np.uint8)
    broadcast = []
    for i in range(args.warmup + args.broadcast_iters):
        t0 = time.perf_counter()
        multihost_utils.broadcast_one_to_all(buffer)
        if i >= args.warmup:
            broadcast.append(time.perf_counter() - t0)
    # The follower's decode timings travel to process 0 through the store too.
    if leader:
        follower = json.loads(client.blocking_key_value_get("bench/decode", 60_000))
        result = dict(
            machine=dict(cpus=os.cpu_count(), jax=jax.__version__, load_average=os.getloadavg()),
            message=dict(
                kind=args.message,
                batch=args.batch,
                pages=args.pages,
                page_size=args.page_size,
                bytes=size,
                unpacked_bytes=full_bytes,
            ),
            iters=args.iters,
            encode=summary(timings["encode"]),
            send=summary(timings["send"]),
            round=summary(timings["round"]),
            decode=follower,
            broadcast_one_to_all=dict(buffer_bytes=len(buffer), **summary(broadcast)),
        )
        print(json.dumps(result, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    else:
        client.key_value_set("bench/decode", json.dumps(summary(timings["decode"])))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.process_id is not None:
        worker(args)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = argv if argv is not None else sys.argv[1:]
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *argv, "--process-id", str(i), "--port", str(port)],
            stderr=subprocess.DEVNULL if i else None,
        )
        for i in range(2)
    ]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
