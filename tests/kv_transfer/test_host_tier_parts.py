"""The KV connector's parts without a model: the scheduler's tracking of asynchronous loads and delayed
frees (a fake connector), the host tier's lookups (LoRA roots apart, LRU bound), the settings' errors,
and the page mover on a cache sharded over a mesh."""

import numpy as np
import pytest

from jaxserve.engine.block_manager import BlockManager, chain_keys
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import Sequence, Status
from jaxserve.errors import ConfigError
from jaxserve.kv_transfer.base import (
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVTransferConfig,
)
from jaxserve.kv_transfer.driver import KVConnectorDriver
from jaxserve.kv_transfer.host_tier import HostStore, HostTierScheduler
from jaxserve.sampling.params import SamplingParams

PS = 4


def seq(sid, tokens, lora=None):
    s = Sequence(sid, sid, 0, list(tokens), SamplingParams(max_tokens=4, temperature=0.0), seed=0)
    s.lora = lora
    return s


class FakeConnector(KVConnectorScheduler):
    """Offers `offer` tokens of every prompt asynchronously and asks to keep finished pages."""

    def __init__(self, offer):
        super().__init__(KVTransferConfig("fake", "kv_both"), PS)
        self.offer, self.allocs, self.outputs = offer, [], []

    def get_num_new_matched_tokens(self, seq, num_computed_tokens):
        return self.offer, True

    def update_state_after_alloc(self, seq, page_ids, n):
        self.allocs.append((seq.seq_id, list(page_ids), n))

    def update_connector_output(self, output):
        self.outputs.append(output)

    def request_finished(self, seq, page_ids):
        return True, {"remote_pages": list(page_ids)}


class FakeWorker(KVConnectorWorker):
    def __init__(self):
        super().__init__(KVTransferConfig("fake", "kv_both"))
        self.report = KVConnectorOutput()

    def get_finished(self):
        out, self.report = self.report, KVConnectorOutput()
        return out


def setup(offer=8):
    blocks = BlockManager(num_pages=16, page_size=PS)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    connector, worker = FakeConnector(offer), FakeWorker()
    sched.kv = KVConnectorDriver(connector, worker, sched)
    return blocks, sched, connector, worker


def test_a_sequence_waiting_for_its_kv_is_neither_running_nor_lost_and_runs_once_loaded():
    blocks, sched, connector, worker = setup()
    s = seq("a", range(13))
    sched.add(s)
    out = sched.schedule()
    assert not out.rows and s.status is Status.WAITING_FOR_KV
    assert s not in sched.running and s not in sched.waiting and sched.kv.loading == {"a": s}
    assert connector.allocs == [("a", blocks.page_table("a")[:2], 8)]
    blocks.check_invariants()
    assert blocks.num_free_pages() == 15 - 4  # it holds its pages while it waits
    worker.report = KVConnectorOutput(finished_loading={"a"})
    sched.kv.poll()
    assert s.status is Status.RUNNING and s.num_computed == 8 and not sched.kv.loading
    out = sched.schedule()
    assert [(r.start, r.num_tokens) for r in out.rows] == [(8, 5)]  # only what was not loaded
    blocks.check_invariants()


def test_a_failed_load_is_recomputed_and_a_delayed_free_waits_for_the_save():
    blocks, sched, connector, worker = setup()
    s = seq("a", range(13))
    sched.add(s)
    sched.schedule()
    worker.report = KVConnectorOutput(failed_loading={"a"})
    sched.kv.poll()
    assert s.status is Status.RUNNING and s.num_computed == 0 and sched.kv.num_loads_failed == 1
    assert [(r.start, r.num_tokens) for r in sched.schedule().rows] == [(0, 13)]
    s.num_computed = 13
    sched.finish(s, "stop")
    assert "a" in blocks and sched.kv.saving == {"a": s}  # pages kept for the save
    assert s.kv_transfer_params_out == {"remote_pages": blocks.page_table("a")}
    blocks.check_invariants()
    worker.report = KVConnectorOutput(finished_saving={"a"})
    sched.kv.poll()
    assert "a" not in blocks and blocks.num_free_pages() == 15
    blocks.check_invariants()


def test_aborting_a_sequence_while_it_loads_frees_its_pages():
    blocks, sched, _, _ = setup()
    s = seq("a", range(13))
    sched.add(s)
    sched.schedule()
    sched.finish(s, "abort")
    assert "a" not in blocks and not sched.kv.loading and blocks.num_free_pages() == 15
    blocks.check_invariants()


def test_a_connector_offering_the_last_token_is_refused():
    _, sched, _, _ = setup(offer=12)
    sched.add(seq("a", range(12)))
    with pytest.raises(ValueError, match="last token"):
        sched.schedule()


class Adapter:
    def __init__(self, root):
        self.prefix_root = root


def test_host_tier_extends_the_device_hit_by_chain_keys_and_keeps_adapters_apart():
    store = HostStore(capacity_pages=8)
    tier = HostTierScheduler(KVTransferConfig("OffloadingConnector"), PS, store, page_bytes=100)
    tokens = list(range(17))  # 4 full pages; the last token always computed
    keys = list(chain_keys(tokens, PS))
    for key in keys[1:3]:  # pages 1 and 2 on the host (page 0 on the device, page 3 nowhere)
        store.entries[key] = {"k": np.zeros(1)}
    assert tier.get_num_new_matched_tokens(seq("a", tokens), 4) == (8, False)
    assert tier.get_num_new_matched_tokens(seq("b", tokens), 0) == (0, False)  # page 0 is not here
    lora = seq("c", tokens, lora=Adapter(b"adapter-root"))
    assert tier.get_num_new_matched_tokens(lora, 4) == (0, False)  # another root, other keys


def test_host_store_is_lru_within_its_pages():
    class Read:
        def result(self):
            return {"k": np.arange(3)[:, None]}

    store = HostStore(capacity_pages=2)
    store.put_read(Read(), [b"a", b"b"])
    store.touch(b"a")
    store.put_read(Read(), [b"c"])
    assert list(store.entries) == [b"a", b"c"] and store.num_evicted == 1
    assert store.pages([b"c", b"a"])["k"].tolist() == [[0], [0]]


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(kv_transfer_config='{"kv_connector": "Nope"}'), "unknown kv_connector 'Nope'"),
        (dict(kv_transfer_config='{"kv_connector": "OffloadingConnector", "kv_role": "x"}'), "kv_role 'x'"),
        (dict(kv_transfer_config='{"kv_role": "kv_both"}'), 'needs "kv_connector"'),
        (dict(kv_offloading_size=1, kv_transfer_config='{"kv_connector": "OffloadingConnector"}'), "one of them"),
        (dict(kv_offloading_size=-1), "positive GiB"),
        (dict(kv_offloading_size=1, kv_offloading_backend="lmcache"), "native"),
        (dict(kv_offloading_size=1, enable_prefix_caching=False), "enable_prefix_caching"),
    ],
)
def test_settings_refuse_what_they_cannot_serve(settings, message):
    from jaxserve.config import EngineConfig

    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        EngineConfig(**settings)


def test_page_io_round_trips_pages_of_a_cache_sharded_over_kv_heads():
    import jax

    from jaxserve.config import ModelConfig
    from jaxserve.model.kv_cache import init_cache
    from jaxserve.model.sharding import make_mesh, make_shardings
    from jaxserve.runner.page_io import PageIO
    from jaxserve.runner.step_variant import DeviceState

    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
    )
    mesh = make_mesh((1, 2), jax.devices()[:2])
    sh = make_shardings(cfg, mesh)
    cache = init_cache(cfg, 8, PS, np.float32, 1, sh.cache, "int8", sh.cache_scale)
    assert len(cache.k.sharding.device_set) == 2
    io = PageIO(DeviceState(None, cache, None), width=2)
    rng = np.random.RandomState(0)
    pages = {
        "k": rng.randint(-9, 9, (3, 2, 2, PS, 8)).astype(np.int8),
        "v": rng.randint(-9, 9, (3, 2, 2, PS, 8)).astype(np.int8),
        "k_scale": rng.rand(3, 2, 2, PS).astype(np.float32),
        "v_scale": rng.rand(3, 2, 2, PS).astype(np.float32),
    }
    io.write_pages(0, [5, 2, 7], pages)
    assert io.state.cache.k.sharding == cache.k.sharding  # the write keeps the cache's layout
    back = io.read_pages(0, [5, 2, 7]).result()
    for name in pages:
        np.testing.assert_array_equal(back[name], pages[name])
    assert io.page_bytes == 2 * (2 * 2 * PS * 8) + 2 * (2 * 2 * PS * 4)


def test_metrics_show_hits_per_tier_and_bytes_each_way():
    from jaxserve.server.metrics import ServerMetrics

    stats = dict(
        prefix_cache_queries=100,
        prefix_cache_hits=40,
        external_prefix_cache_queries=60,
        external_prefix_cache_hits=32,
        kv_offload_pages_to_host_total=5,
        kv_offload_pages_to_device_total=4,
        kv_offload_bytes_to_host_total=500,
        kv_offload_bytes_to_device_total=400,
        kv_offload_host_pages=5,
        kv_offload_host_capacity_pages=10,
        num_waiting_for_kv=0,
    )
    text = ServerMetrics(lambda: stats, device_bandwidth=1.0).render().decode()
    for line in (
        "jaxserve:prefix_cache_hits_total 40.0",
        "jaxserve:external_prefix_cache_hits_total 32.0",
        'jaxserve:kv_offload_bytes_total{direction="to_host"} 500.0',
        'jaxserve:kv_offload_bytes_total{direction="to_device"} 400.0',
        "jaxserve:kv_offload_host_pages 5.0",
        "jaxserve:num_requests_waiting_for_kv 0.0",
    ):
        assert line in text, line


def test_the_plan_counts_the_host_tier(capsys):
    from jaxserve.plan import main

    args = ["--model", "configs/models/smollm2-135m", "--device", "cpu", "--num-pages", "65"]
    assert main(args + ["--kv-offloading-size", "0.5"]) == 0
    # SmolLM2-135M in float32: 2 x 4 bytes x 64 x 3 KV heads x 30 layers = 46,080 bytes per token.
    page = 16 * 46_080
    line = f"{2**29 // page:,} pages of {page:,} bytes, {(2**29 // page) / 64:.1f}x the device pool"
    assert line in capsys.readouterr().out
    assert main(args) == 0 and "host tier" not in capsys.readouterr().out
