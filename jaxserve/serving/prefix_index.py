"""Which replica holds which prompt prefix, as the router knows it: a chain of hashes over whole
blocks of token ids, each block's key naming its whole prefix (as the block manager keys pages), mapped
to the replicas it was sent to. Plain Python, no Ray: the router's policy is unit-tested alone."""

from __future__ import annotations

import collections
import hashlib
from typing import Hashable, Iterable, Sequence


def block_keys(ids: Sequence[int], block_size: int) -> list[bytes]:
    """One key per whole block of `ids`: blake2b(parent key + the block's ids), so equal keys mean
    equal whole prefixes. A partial last block has no key (a replica caches only full pages)."""
    keys, parent = [], b""
    for start in range(0, len(ids) - block_size + 1, block_size):
        block = ",".join(map(str, ids[start : start + block_size])).encode()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixIndex:
    """Block key -> the replicas sent a prompt with that prefix, least recently used keys dropped past
    `max_blocks` (a replica's cache evicts too, so old entries are guesses at best)."""

    def __init__(self, block_size: int = 16, max_blocks: int = 200_000):
        if block_size < 1 or max_blocks < 1:
            raise ValueError("block_size and max_blocks must be >= 1")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._holders: collections.OrderedDict[bytes, set[Hashable]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def match(self, ids: Sequence[int], replicas: Iterable[Hashable]) -> tuple[list[Hashable], int]:
        """The replicas among `replicas` holding the longest prefix of `ids` (in `replicas`' order), and
        how many blocks long it is; ([], 0) when none holds the first block."""
        alive: list[Hashable] = list(replicas)
        best: list[Hashable] = []
        depth = 0
        for i, key in enumerate(block_keys(ids, self.block_size)):
            holders = self._holders.get(key)
            if not holders:
                break
            here = [r for r in alive if r in holders]
            if not here:
                break
            alive, best, depth = here, here, i + 1
        return best, depth

    def insert(self, ids: Sequence[int], replica: Hashable) -> None:
        """Record that `replica` was sent `ids` (it will hold their whole blocks once it has run them)."""
        for key in block_keys(ids, self.block_size):
            holders = self._holders.get(key)
            if holders is None:
                holders = self._holders[key] = set()
            else:
                self._holders.move_to_end(key)
            holders.add(replica)
        while len(self._holders) > self.max_blocks:
            self._holders.popitem(last=False)

    def remove(self, replica: Hashable) -> None:
        """Forget a replica (it died or was scaled down)."""
        for key in [k for k, holders in self._holders.items() if replica in holders]:
            holders = self._holders[key]
            holders.discard(replica)
            if not holders:
                del self._holders[key]
