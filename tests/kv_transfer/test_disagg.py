"""Prefill and decode on two engines in one process, through the JaxTransferConnector and its real
transport (jax.experimental.transfer plus the side channel): greedy outputs equal one engine's in
float32 and with an int8 KV cache, only the prompt's last page is recomputed on the decode side,
and every fault (pages nobody pulls, a pull that times out, a producer that is gone, stale params)
ends with the prompt recomputed and no page held on either side."""

import gc
import json
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

SMALL = Path(__file__).resolve().parents[2] / "checkpoints" / "small"
COMMON = dict(
    dtype="float32",
    page_size=16,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=512,
    num_pages=96,
    warm_up=False,
)
GREEDY = SamplingParams(max_tokens=10, temperature=0)


def kv_config(role: str, **extra) -> str:
    config = {"kv_connector": "JaxTransferConnector", "kv_role": role, "kv_connector_extra_config": extra}
    return json.dumps(config)


def prompts(seed: int, lengths=(40, 17, 64, 5)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(5, 500, n)] for n in lengths]


class Pair:
    """A producer (prefill) and a consumer (decode) engine; a thread steps the producer whenever its
    connector holds pages (as AsyncLLMEngine's step thread does)."""

    def __init__(self, kv_cache_dtype: str):
        settings = dict(COMMON, kv_cache_dtype=kv_cache_dtype)
        self.p = LLM(str(SMALL), kv_transfer_config=kv_config("kv_producer", abort_request_timeout=1.5), **settings)
        self.d = LLM(str(SMALL), kv_transfer_config=kv_config("kv_consumer", pull_timeout=2.0), **settings)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self):
        while not self.stop.is_set():
            with self.lock:
                busy = self.p.engine.has_kv_transfers()
                if busy:
                    self.p.engine.step()
            time.sleep(0.001 if busy else 0.01)

    def prefill(self, ids: list[list[int]]) -> list[dict | None]:
        params = SamplingParams(max_tokens=1, temperature=0, kv_transfer_params={"do_remote_decode": True})
        with self.lock:
            outs = self.p.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)
        return [o.kv_transfer_params for o in outs]

    def decode(self, ids, params) -> list[list[int]]:
        sp = [SamplingParams(max_tokens=10, temperature=0, kv_transfer_params=p) for p in params]
        return [
            o.outputs[0].token_ids for o in self.d.generate(prompt_token_ids=ids, sampling_params=sp, use_tqdm=False)
        ]

    def reference(self, ids) -> list[list[int]]:
        with self.lock:
            return [
                o.outputs[0].token_ids
                for o in self.p.generate(prompt_token_ids=ids, sampling_params=GREEDY, use_tqdm=False)
            ]

    def settle(self, timeout=10.0):
        """Wait until the producer holds no pages for a pull."""
        deadline = time.monotonic() + timeout
        while self.p.engine.has_kv_transfers() and time.monotonic() < deadline:
            time.sleep(0.02)

    def stats(self, which) -> dict:
        with self.lock:
            return (self.p if which == "p" else self.d).engine.stats()

    def close(self):
        self.stop.set()
        self.thread.join()
        self.p.close()
        self.d.close()


@pytest.fixture(scope="module")
def pair():
    pair = Pair("auto")
    yield pair
    pair.close()
    del pair
    gc.collect()
    jax.clear_caches()


def no_pages_held(pair):
    pair.settle()
    p, d = pair.stats("p"), pair.stats("d")
    held = {k: v for k, v in p.items() if k.startswith(("kv_", "num_saving", "pages_"))}
    assert p["pages_used"] == [0] and p["num_saving_kv"] == 0 and p["kv_transfer_offers_waiting"] == 0, held
    assert d["pages_used"] == [0] and d["num_waiting_for_kv"] == 0


def test_with_an_int8_cache_disaggregated_greedy_outputs_equal_one_engines():
    pair = Pair("int8")  # its pages and their per-slot scales move together
    try:
        ids = prompts(4, lengths=(40, 33))
        want = pair.reference(ids)
        params = pair.prefill(ids)
        assert pair.decode(ids, params) == want
        stats = pair.stats("d")
        assert stats["kv_transfer_pages_received"] == 5 and stats["kv_loads_failed_total"] == 0
        no_pages_held(pair)
    finally:
        pair.close()


def test_disaggregated_greedy_outputs_equal_one_engines(pair):
    ids = prompts(0)
    want = pair.reference(ids)  # the producer alone, colocated (its prefix cache then holds them: hits)
    before = pair.stats("d")
    params = pair.prefill(ids)
    for p, prompt in zip(params, ids):
        assert p["do_remote_prefill"] and p["num_remote_tokens"] == len(prompt)
        assert len(p["remote_block_ids"]) == -(-(len(prompt) - 1) // 16)  # every token's but the last
    assert pair.decode(ids, params) == want
    after = pair.stats("d")
    # Every prompt token but the last was pulled (3 + 1 + 4 + 1 pages, the last ones partial) and
    # exactly those tokens counted computed: only each prompt's last token was computed here.
    assert after["kv_transfer_pages_received"] - before["kv_transfer_pages_received"] == 9
    assert after["kv_transfer_loads_done"] - before["kv_transfer_loads_done"] == 4
    hits = after["external_prefix_cache_hits"] - before["external_prefix_cache_hits"]
    assert hits == sum(len(prompt) - 1 for prompt in ids)
    assert after["kv_loads_failed_total"] == before["kv_loads_failed_total"]
    no_pages_held(pair)


def test_pages_nobody_pulls_are_freed_after_the_timeout_and_the_decode_recomputes(pair):
    ids = prompts(1, lengths=(48,))
    want = pair.reference(ids)
    params = pair.prefill(ids)
    assert pair.stats("p")["kv_transfer_pages_held"] == 3  # the pages of its first 47 tokens
    time.sleep(2.0)  # abort_request_timeout 1.5 s
    pair.settle()
    stats = pair.stats("p")
    assert stats["pages_used"] == [0] and stats["kv_transfer_offers_expired"] >= 1
    failed = pair.stats("d")["kv_loads_failed_total"]
    t0 = time.monotonic()
    assert pair.decode(ids, params) == want  # the claim is refused at once: recomputed
    assert time.monotonic() - t0 < 10
    assert pair.stats("d")["kv_loads_failed_total"] == failed + 1
    no_pages_held(pair)


def test_a_pull_that_times_out_is_recomputed_and_frees_the_producers_pages(pair, monkeypatch):
    ids = prompts(2, lengths=(33,))
    want = pair.reference(ids)
    worker = pair.p.engine.scheduler.kv.worker
    monkeypatch.setattr(worker, "_offer_read_pages", lambda: None)  # read, never offered: a hung producer
    params = pair.prefill(ids)
    failed = pair.stats("d")["kv_loads_failed_total"]
    t0 = time.monotonic()
    assert pair.decode(ids, params) == want
    assert time.monotonic() - t0 < 15  # pull_timeout 2 s, then the prompt computed here
    assert pair.stats("d")["kv_loads_failed_total"] == failed + 1
    monkeypatch.undo()
    no_pages_held(pair)  # the decode's abort freed the producer's pages


def test_a_producer_that_is_gone_or_params_for_another_prompt_are_recomputed(pair):
    ids = prompts(3, lengths=(40, 40))
    want = pair.reference(ids)
    params = pair.prefill(ids)
    gone = dict(params[0], remote_port=1)  # nobody listens there
    other = dict(params[1], prompt_hash="0" * 24)  # made for another prompt
    before = pair.stats("d")
    t0 = time.monotonic()
    assert pair.decode(ids, [gone, other]) == want
    assert time.monotonic() - t0 < 15
    after = pair.stats("d")
    assert after["kv_loads_failed_total"] == before["kv_loads_failed_total"] + 1
    assert after["kv_transfer_params_refused"] == before["kv_transfer_params_refused"] + 1
    time.sleep(2.0)  # the first offer, never claimed, expires; the second was released at once
    no_pages_held(pair)


def test_an_offer_that_ends_before_its_save_reaches_the_worker_still_frees_the_pages():
    """The transfer id is registered when the request finishes; its save reaches the worker a step
    later, after that step's poll. A decode engine's abort (or expiry) in between must still free it."""
    from jaxserve.disagg.connector import DisaggWorker
    from jaxserve.kv_transfer.base import KVTransferConfig, PageSave
    from jaxserve.kv_transfer.disagg import DisaggMeta

    class Endpoint:
        ended: dict = {}

        def take_ended(self):
            out, self.ended = self.ended, {}
            return out

    class PageIO:
        def read_pages(self, replica, page_ids):
            raise AssertionError("pages nobody will pull are not read")

    worker = DisaggWorker(KVTransferConfig("JaxTransferConnector", "kv_producer"), Endpoint())
    worker.register_page_io(PageIO())
    worker.endpoint.ended = {42: "aborted"}  # the poll before the save
    assert not worker.get_finished().finished_saving
    worker.start_save_kv(DisaggMeta(saves=[PageSave("seq-1", 0, [3, 4], (42, 120.0))]))
    assert worker.get_finished().finished_saving == {"seq-1"}
    assert not worker.get_finished().finished_saving
