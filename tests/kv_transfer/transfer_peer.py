"""A producer process for the transport tests: a `TransferEndpoint` driven by lines on stdin.

    expect ID TTL     register an offer (expires TTL s from now unless claimed)
    offer ID          offer the fixed pages below under ID
    ended             print {"ended": {id: how}} for offers that ended since the last call
    exit
Each command answers one JSON line.
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from jaxserve.disagg.transport import TransferEndpoint  # noqa: E402


def pages() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "k": rng.integers(-128, 128, (3, 2, 1, 4, 8), dtype=np.int8),
        "k_scale": rng.random((3, 2, 1, 4), dtype=np.float32),
        "v": rng.standard_normal((3, 2, 1, 4, 8)).astype(np.float32),
    }


def main() -> None:
    endpoint = TransferEndpoint()
    print(
        json.dumps({"host": endpoint.host, "port": endpoint.side_port, "transfer_address": endpoint.transfer_address})
    )
    sys.stdout.flush()
    for line in sys.stdin:
        op, *args = line.split()
        if op == "expect":
            endpoint.expect(int(args[0]), float(args[1]))
            print("{}")
        elif op == "offer":
            endpoint.offer(int(args[0]), pages())
            print("{}")
        elif op == "ended":
            print(json.dumps({"ended": {str(k): v for k, v in endpoint.take_ended().items()}}))
        elif op == "exit":
            break
        sys.stdout.flush()


if __name__ == "__main__":
    main()
