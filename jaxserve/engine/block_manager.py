"""Host-side KV-cache page bookkeeping: per-replica page pools, page tables, ref counts and prefix caching."""

from __future__ import annotations

import functools
import hashlib
import operator
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from jaxserve.errors import JaxServeError

# Padding rows of a step batch point their page tables at page 0, so the model may write there:
# no sequence may ever own it, and each replica has num_pages - 1 usable pages.
RESERVED_PAGE = 0

# Chain key of the (empty) prefix before the first page.
_ROOT_KEY = b""


class BlockManagerError(JaxServeError, ValueError):
    """The block manager was used wrongly (bad argument, unknown or duplicate sequence id)."""


class UnknownSequenceError(BlockManagerError):
    """The sequence id is not admitted (never admitted, or already freed)."""


class DuplicateSequenceError(BlockManagerError):
    """The sequence id is already admitted."""


class OutOfPagesError(BlockManagerError):
    """`admit` or `fork` was called although the replica has too few pages (check first)."""


def _page_key(parent_key: bytes, tokens: Sequence[int]) -> bytes:
    # A strong digest instead of hash(): a collision would silently serve another prompt's KV.
    # Chaining the parent key makes equal keys mean equal whole prefixes. Fixed-width fields
    # (32-byte parent, 8 bytes per token, always page_size tokens) keep the encoding unambiguous.
    return hashlib.blake2b(parent_key + array("q", tokens).tobytes(), digest_size=32).digest()


def chain_keys(tokens: Sequence[int], page_size: int, root: bytes = _ROOT_KEY, num_pages: int | None = None):
    """The prefix cache's keys of the leading full pages of `tokens` (`num_pages` of them, default all),
    chained from `root`: a KV connector's tier looks pages up by the same keys."""
    key = root
    for i in range(len(tokens) // page_size if num_pages is None else num_pages):
        key = _page_key(key, tokens[i * page_size : (i + 1) * page_size])
        yield key


@dataclass
class _Seq:
    replica: int
    pages: array  # page ids ("i": int32), in token order: copied as one block when a step is packed
    num_computed: int = 0
    # Leading full pages whose chain key is known; `last_key` is the key of the last of them.
    num_hashed: int = 0
    last_key: bytes = _ROOT_KEY
    # False after reset_prefix_cache(): its KV may predate the reset, so it must not seed the cache.
    cacheable: bool = True
    # Leading pages handed back because every layer's sliding window has passed them; their table
    # entries are RESERVED_PAGE placeholders (attention masks those positions, so nothing reads them).
    num_released: int = 0


class _Pool:
    """The pages of one replica."""

    def __init__(self, num_pages: int):
        self.ref = [0] * num_pages
        self.free: deque[int] = deque(range(1, num_pages))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self.key_of: dict[int, bytes] = {}
        self.page_of: dict[bytes, int] = {}
        self.on_evict = None  # a KV connector's hook: (page, key) of a cached page about to be reused

    def num_available(self) -> int:
        return len(self.free) + len(self.evictable)

    def take(self, page: int) -> None:
        """Add a holder to a page that has cached content (a prefix hit)."""
        if self.ref[page] == 0:
            del self.evictable[page]
        self.ref[page] += 1

    def allocate(self) -> int:
        if self.free:
            page = self.free.popleft()
        else:
            page, _ = self.evictable.popitem(last=False)
            key = self.key_of.pop(page)
            del self.page_of[key]
            if self.on_evict is not None:
                self.on_evict(page, key)
        self.ref[page] = 1
        return page

    def release(self, page: int) -> None:
        self.ref[page] -= 1
        if self.ref[page] == 0:
            if page in self.key_of:
                self.evictable[page] = None
            else:
                self.free.append(page)


class BlockManager:
    """Page tables, free lists, ref counts and the prefix cache of every data-parallel replica.

    Layout as in `jaxserve.model.kv_cache`: each replica owns `num_pages` pages of `page_size` token
    slots, page ids local to the replica; token p of a sequence lives in page
    `page_table[p // page_size]`, slot `p % page_size`. Page 0 (`RESERVED_PAGE`) is never handed
    out: it is the padding rows' scratch page.

    Every usable page is in exactly one state:
      * free      - ref count 0, no cached content; handed out first.
      * evictable - ref count 0 but holds a cached full page; reused on a prefix hit, or evicted
                    (least recently freed first) once the free list is empty.
      * used      - ref count > 0: held by that many page tables (prefix hits and forks share).
    Only full, computed pages are ever shared or cached, so no sequence writes into a page that
    another sequence (or the cache) can see. Single-threaded: the scheduler owns it.

    With `sliding_window` W (only when every layer is windowed, as Mistral: a model with global
    layers reads every page), `release_outside_window` hands back a sequence's leading pages that
    lie wholly before `num_computed - W`: no later query of that sequence reads them. A hashed page
    becomes evictable and keeps its cache entry (a later prompt with that prefix still hits it
    while it survives; prefix lookups walk the chained keys and stop at the first one gone), an
    unhashed one goes to the free list, a shared one (fork, prefix hit) just loses a holder. Its
    slot in the page table becomes a RESERVED_PAGE placeholder, so positions still index the table.

    Typical engine use per step: `can_admit` / `admit` new requests (admit allocates pages for the
    whole prompt), `ensure_capacity` for each running sequence's chunk or decode token (False means
    preempt someone), run the model, then `mark_computed`; `free` finished, aborted or preempted
    sequences.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_replicas: int = 1,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        sliding_window: int | None = None,
    ):
        if num_pages < 2:
            raise BlockManagerError(f"num_pages={num_pages}: need at least 2 (page 0 is reserved)")
        if page_size < 1:
            raise BlockManagerError(f"page_size={page_size} must be >= 1")
        if num_replicas < 1:
            raise BlockManagerError(f"num_replicas={num_replicas} must be >= 1")
        if not 0.0 <= watermark < 1.0:
            raise BlockManagerError(f"watermark={watermark} must be in [0, 1)")
        if sliding_window is not None and sliding_window < 1:
            raise BlockManagerError(f"sliding_window={sliding_window} must be >= 1 (or None)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_replicas = num_replicas
        self.enable_prefix_caching = enable_prefix_caching
        self.num_usable_pages = num_pages - 1
        # Admission stops this many pages short of full so running sequences can still grow.
        self.watermark_pages = int(watermark * self.num_usable_pages)
        # Counters for a prefix-cache hit-rate metric (prompt tokens looked up / served from cache).
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0
        # The window every layer attends within (None: pages are held until the sequence is freed).
        self.sliding_window = sliding_window
        self.num_window_released_pages = 0  # pages handed back by release_outside_window, ever
        self._pools = [_Pool(num_pages) for _ in range(num_replicas)]
        self._seqs: dict[Hashable, _Seq] = {}
        self.on_reset = None  # a KV connector's hook: the cache was reset

    def listen(self, on_evict, on_reset) -> None:
        """A KV connector's hooks (`kv_transfer.base`): `on_evict(replica, page, key)` when a cached page is
        evicted for reuse (its content intact until the step being scheduled runs), `on_reset()`."""
        for r, pool in enumerate(self._pools):
            pool.on_evict = functools.partial(on_evict, r)
        self.on_reset = on_reset

    # ---------------------------------------------------------------- queries

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    @property
    def max_admissible_tokens(self) -> int:
        """Longest prompt `can_admit` accepts into an idle replica (without prefix hits)."""
        return (self.num_usable_pages - self.watermark_pages) * self.page_size

    def replica_of(self, seq_id: Hashable) -> int:
        """The replica whose pages the sequence holds."""
        return self._seq(seq_id).replica

    def page_table(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's page ids (local to its replica), in token order; pages released
        outside the sliding window read RESERVED_PAGE."""
        return list(self._seq(seq_id).pages)

    def page_ids(self, seq_id: Hashable) -> array:
        """The same as an int32 `array` copy: the engine packs it into every step, where a buffer copies
        in one block (numpy.asarray reads it without a copy) and a list converts id by id."""
        return self._seq(seq_id).pages[:]

    def live_page_ids(self, seq_id: Hashable) -> tuple[array, int]:
        """The sequence's page ids as held here (not a copy: read them before the table next changes)
        and the table's version. Entries are only appended, except those `release_outside_window`
        replaces, which bumps the version; a fork, a preemption or a new admission makes a new array.
        So the same array at the same version holds the same leading entries: the runner rewrites a
        row's page table only when one of the two changed (`engine.step_writer`)."""
        seq = self._seq(seq_id)
        return seq.pages, seq.num_released

    def num_held_pages(self, seq_id: Hashable) -> int:
        """Pages the sequence holds now (its table less the released placeholders)."""
        seq = self._seq(seq_id)
        return len(seq.pages) - seq.num_released

    def stats(self) -> dict[str, int]:
        """Counters for metrics: prefix-cache lookups and hits (tokens), window-released pages."""
        return {
            "prefix_queried_tokens": self.num_prefix_queried_tokens,
            "prefix_hit_tokens": self.num_prefix_hit_tokens,
            "window_released_pages": self.num_window_released_pages,
        }

    def num_free_pages(self, replica: int = 0) -> int:
        """Pages that can be handed out now: free ones plus evictable cached ones."""
        return self._pool(replica).num_available()

    def num_used_pages(self, replica: int = 0) -> int:
        """Pages held by at least one sequence."""
        return self.num_usable_pages - self._pool(replica).num_available()

    def num_cached_pages(self, replica: int = 0) -> int:
        """Pages holding a registered prefix-cache entry, whether in use or evictable."""
        return len(self._pool(replica).key_of)

    def num_evictable_pages(self, replica: int = 0) -> int:
        """Cached pages no sequence holds (reusable on a hit, evicted first-freed-first)."""
        return len(self._pool(replica).evictable)

    def kv_utilization(self, replica: int = 0) -> float:
        """Computed tokens stored / token slots of used pages (shared pages count once); 0.0 if none."""
        self._pool(replica)  # validates the index
        fill: dict[int, int] = {}
        for seq in self._seqs.values():
            if seq.replica != replica:
                continue
            for i, page in enumerate(seq.pages):
                if i < seq.num_released:
                    continue
                n = min(self.page_size, max(0, seq.num_computed - i * self.page_size))
                if n > fill.get(page, -1):
                    fill[page] = n
        if not fill:
            return 0.0
        return sum(fill.values()) / (len(fill) * self.page_size)

    def lookup_prefix(self, replica: int, prompt_token_ids: Sequence[int], root: bytes = _ROOT_KEY) -> int:
        """Prompt tokens `admit` would report as already computed on this replica (no side effects)."""
        pages, _ = self._match_prefix(self._pool(replica), prompt_token_ids, root)
        return len(pages) * self.page_size

    # ---------------------------------------------------------------- admission

    def can_admit(
        self,
        replica: int,
        num_prompt_tokens: int,
        prompt_token_ids: Sequence[int] | None = None,
        root: bytes = _ROOT_KEY,
    ) -> bool:
        """Whether a prompt's pages fit while leaving the watermark free.

        Without `prompt_token_ids` this is conservative (assumes no prefix hit); with them it counts
        hits exactly and is True iff `admit` would succeed. A prompt longer than
        `max_admissible_tokens` (and no hits) never fits: reject it rather than wait.
        """
        pool = self._pool(replica)
        if prompt_token_ids is None:
            hits: list[int] = []
        else:
            if len(prompt_token_ids) != num_prompt_tokens:
                raise BlockManagerError(
                    f"num_prompt_tokens={num_prompt_tokens} but {len(prompt_token_ids)} token ids given"
                )
            hits, _ = self._match_prefix(pool, prompt_token_ids, root)
        return self._fits(pool, num_prompt_tokens, hits)

    def admit(
        self,
        seq_id: Hashable,
        replica: int,
        prompt_token_ids: Sequence[int],
        reuse_prefix: bool = True,
        root: bytes = _ROOT_KEY,
    ) -> int:
        """Give a new sequence pages for its whole prompt, reusing cached prefix pages (unless
        `reuse_prefix` is False: a request for prompt logprobs must compute every position).
        `root` starts the sequence's chain of page keys: sequences of another root (a LoRA adapter's,
        `engine.lora_manager`) never share its pages.

        Returns how many leading prompt tokens are already computed (a multiple of page_size; the
        engine starts prefill there). Raises OutOfPagesError, changing nothing, if
        `can_admit(replica, len(prompt), prompt)` is False.
        """
        if seq_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {seq_id!r} is already admitted")
        pool = self._pool(replica)
        replica = operator.index(replica)
        n = len(prompt_token_ids)
        if n == 0:
            raise BlockManagerError(f"sequence {seq_id!r}: empty prompt")
        hits, last_key = self._match_prefix(pool, prompt_token_ids, root) if reuse_prefix else ([], root)
        if not self._fits(pool, n, hits):
            raise OutOfPagesError(
                f"replica {replica}: {n}-token prompt does not fit in {pool.num_available()} free pages "
                f"(watermark {self.watermark_pages})"
            )
        # Claim the hits before allocating, or allocation could evict one of them.
        for page in hits:
            pool.take(page)
        pages = hits + [pool.allocate() for _ in range(self.pages_for(n) - len(hits))]
        num_cached = len(hits) * self.page_size
        self._seqs[seq_id] = _Seq(replica, array("i", pages), num_cached, len(hits), last_key)
        if self.enable_prefix_caching:
            self.num_prefix_queried_tokens += n
            self.num_prefix_hit_tokens += num_cached
        return num_cached

    # ---------------------------------------------------------------- running sequences

    def ensure_capacity(self, seq_id: Hashable, total_tokens: int) -> bool:
        """Allocate pages so the sequence can hold `total_tokens` tokens.

        May use the watermark pages. Returns False, changing nothing, if the replica lacks pages
        (the scheduler then preempts something).
        """
        seq = self._seq(seq_id)
        pool = self._pools[seq.replica]
        need = self.pages_for(total_tokens) - len(seq.pages)
        if need <= 0:
            return True
        if need > pool.num_available():
            return False
        seq.pages.extend(pool.allocate() for _ in range(need))
        return True

    def release_outside_window(self, seq_id: Hashable) -> int:
        """Hand back the sequence's leading pages that no query of it will read again; returns how many.

        With `sliding_window` W a query at position p sees keys p - W + 1 .. p. Every later query of
        the sequence sits at or after `num_computed` (what mark_computed last recorded), and even a
        step still in flight whose tokens are already marked queries at `num_computed - 1` at the
        earliest, which sees keys from `num_computed - W` on: the pages wholly before that are dead.
        No-op (0) without a window. Call between steps, before the table is packed for the next one.
        """
        seq = self._seq(seq_id)
        if self.sliding_window is None:
            return 0
        dead = max(0, seq.num_computed - self.sliding_window) // self.page_size
        if dead <= seq.num_released:
            return 0
        pool = self._pools[seq.replica]
        for i in range(seq.num_released, dead):
            pool.release(seq.pages[i])
            seq.pages[i] = RESERVED_PAGE
        released = dead - seq.num_released
        seq.num_released = dead
        self.num_window_released_pages += released
        return released

    def mark_computed(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """Record that the first `num_computed` tokens of the sequence have their KV written.

        `token_ids` is the sequence's full token list so far (prompt + output; at least
        `num_computed` long). Newly full computed pages enter the prefix cache. `num_computed`
        never decreases and must fit in the allocated pages.
        """
        seq = self._seq(seq_id)
        if num_computed < seq.num_computed:
            raise BlockManagerError(
                f"sequence {seq_id!r}: num_computed went back from {seq.num_computed} to {num_computed}"
            )
        if num_computed > len(seq.pages) * self.page_size:
            raise BlockManagerError(
                f"sequence {seq_id!r}: num_computed={num_computed} exceeds its "
                f"{len(seq.pages)} pages of {self.page_size} tokens; call ensure_capacity first"
            )
        if num_computed > len(token_ids):
            raise BlockManagerError(
                f"sequence {seq_id!r}: num_computed={num_computed} but only {len(token_ids)} token ids given"
            )
        seq.num_computed = num_computed
        if not (self.enable_prefix_caching and seq.cacheable):
            return
        pool = self._pools[seq.replica]
        ps = self.page_size
        key = seq.last_key
        full = num_computed // ps
        for i in range(seq.num_hashed, full):
            key = _page_key(key, token_ids[i * ps : (i + 1) * ps])
            if i < seq.num_released:
                continue  # already handed back: the key still chains on to the pages after it
            page = seq.pages[i]
            # Skip if another page already holds this prefix (two sequences computed it at once):
            # ours stays uncached and returns to the free list when released.
            if page not in pool.key_of and key not in pool.page_of:
                pool.key_of[page] = key
                pool.page_of[key] = page
        seq.num_hashed = full
        seq.last_key = key

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[tuple[int, int]]:
        """Start `child_id` as a copy of the parent's computed tokens (n > 1 samples, beam search).

        Full computed pages are shared by ref count; a partially filled last page gets a fresh page
        for the child. Returns the (src_page, dst_page) pairs the device must copy before the next
        step. Call between steps (after mark_computed): uncomputed capacity is not shared. May use
        watermark pages; raises OutOfPagesError, changing nothing, if no page is free for the copy.
        """
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {child_id!r} is already admitted")
        pool = self._pools[parent.replica]
        full, partial = divmod(parent.num_computed, self.page_size)
        if partial and pool.num_available() < 1:
            raise OutOfPagesError(f"replica {parent.replica}: no free page to fork {parent_id!r}")
        pages = parent.pages[:full]
        for page in pages[parent.num_released :]:  # released placeholders are copied, not held
            pool.ref[page] += 1
        copies = []
        if partial:
            dst = pool.allocate()
            copies.append((parent.pages[full], dst))
            pages.append(dst)
        self._seqs[child_id] = _Seq(
            parent.replica,
            pages,
            parent.num_computed,
            parent.num_hashed,
            parent.last_key,
            parent.cacheable,
            parent.num_released,
        )
        return copies

    def free(self, seq_id: Hashable) -> None:
        """Release a finished, aborted or preempted sequence's pages; cached ones stay reusable."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise UnknownSequenceError(f"sequence {seq_id!r} is not admitted")
        pool = self._pools[seq.replica]
        # Tail first: a later page is useless without its prefix, so it should be evicted earlier.
        for page in reversed(seq.pages[seq.num_released :]):
            pool.release(page)

    def reset_prefix_cache(self) -> None:
        """Forget every cached page (e.g. after a weight update); live sequences stop seeding the cache."""
        for pool in self._pools:
            pool.key_of.clear()
            pool.page_of.clear()
            pool.free.extend(pool.evictable)
            pool.evictable.clear()
        for seq in self._seqs.values():
            seq.cacheable = False
        if self.on_reset is not None:
            self.on_reset()

    # ---------------------------------------------------------------- checks

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests)."""

        def expect(cond: bool, msg: str) -> None:
            if not cond:
                raise AssertionError(msg)

        holders = [Counter() for _ in self._pools]
        for sid, seq in self._seqs.items():
            expect(0 <= seq.replica < self.num_replicas, f"{sid!r}: bad replica {seq.replica}")
            held = seq.pages[seq.num_released :]
            expect(
                list(seq.pages[: seq.num_released]) == [RESERVED_PAGE] * seq.num_released,
                f"{sid!r}: released pages {seq.pages[: seq.num_released]} are not placeholders",
            )
            if seq.num_released:
                expect(self.sliding_window is not None, f"{sid!r}: pages released without a window")
                expect(
                    seq.num_released * self.page_size <= seq.num_computed - self.sliding_window,
                    f"{sid!r}: released {seq.num_released} pages still inside the window",
                )
            expect(len(set(held)) == len(held), f"{sid!r}: page twice in its table {seq.pages}")
            expect(RESERVED_PAGE not in held, f"{sid!r} holds the reserved page")
            expect(all(0 < p < self.num_pages for p in held), f"{sid!r}: page id out of range {seq.pages}")
            expect(
                seq.num_computed <= len(seq.pages) * self.page_size,
                f"{sid!r}: {seq.num_computed} computed tokens in {len(seq.pages)} pages",
            )
            expect(seq.num_hashed * self.page_size <= seq.num_computed, f"{sid!r}: hashed beyond computed")
            holders[seq.replica].update(held)
        for r, pool in enumerate(self._pools):
            expect(pool.ref[RESERVED_PAGE] == 0, f"replica {r}: reserved page has refs")
            free = list(pool.free)
            expect(len(set(free)) == len(free), f"replica {r}: duplicate in free list")
            free_set, evict_set = set(free), set(pool.evictable)
            used_set = {p for p in range(1, self.num_pages) if pool.ref[p] > 0}
            expect(not (free_set & evict_set), f"replica {r}: page both free and evictable")
            expect(not (free_set & used_set), f"replica {r}: page both free and used")
            expect(not (evict_set & used_set), f"replica {r}: page both evictable and used")
            expect(
                free_set | evict_set | used_set == set(range(1, self.num_pages)),
                f"replica {r}: free, evictable and used pages do not cover the pool",
            )
            for page in range(self.num_pages):
                expect(
                    pool.ref[page] == holders[r][page],
                    f"replica {r} page {page}: ref {pool.ref[page]} but {holders[r][page]} holders",
                )
            expect(len(pool.key_of) == len(pool.page_of), f"replica {r}: cache maps differ in size")
            for page, key in pool.key_of.items():
                expect(pool.page_of.get(key) == page, f"replica {r} page {page}: cache maps disagree")
            expect(not (free_set & pool.key_of.keys()), f"replica {r}: free page has a cache entry")
            expect(evict_set <= pool.key_of.keys(), f"replica {r}: evictable page without cache entry")
            if not self.enable_prefix_caching:
                expect(not pool.key_of, f"replica {r}: cache entries with prefix caching off")
        # Only full computed pages may be shared: nobody writes into a page another sequence reads.
        for sid, seq in self._seqs.items():
            pool = self._pools[seq.replica]
            for page in seq.pages[seq.num_computed // self.page_size :]:
                expect(pool.ref[page] == 1, f"{sid!r}: writable page {page} is shared")
                expect(page not in pool.key_of, f"{sid!r}: writable page {page} is cached")

    # ---------------------------------------------------------------- internals

    def _seq(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"sequence {seq_id!r} is not admitted") from None

    def _pool(self, replica: int) -> _Pool:
        try:
            r = operator.index(replica)
        except TypeError:
            r = -1
        if not 0 <= r < self.num_replicas:
            raise BlockManagerError(f"replica {replica!r} out of range [0, {self.num_replicas})")
        return self._pools[r]

    def _match_prefix(self, pool: _Pool, prompt: Sequence[int], root: bytes = _ROOT_KEY) -> tuple[list[int], bytes]:
        """Cached pages holding the prompt's leading full pages (chained from `root`), and the chain
        key of the last."""
        if not self.enable_prefix_caching:
            return [], root
        ps = self.page_size
        # The last prompt token is always recomputed: its logits are what the first sample needs,
        # so only full pages of prompt[:-1] can be hits (a page ending at the last token is redone).
        max_pages = max(0, len(prompt) - 1) // ps
        pages: list[int] = []
        key = root
        for i in range(max_pages):
            next_key = _page_key(key, prompt[i * ps : (i + 1) * ps])
            page = pool.page_of.get(next_key)
            if page is None:
                break
            pages.append(page)
            key = next_key
        return pages, key

    def _fits(self, pool: _Pool, num_tokens: int, hits: list[int]) -> bool:
        # Hits on evictable pages leave the available pool just like new pages do.
        consumed = self.pages_for(num_tokens) - len(hits) + sum(1 for p in hits if pool.ref[p] == 0)
        return pool.num_available() - consumed >= self.watermark_pages
