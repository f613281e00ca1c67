"""The host half of LoRA serving on its own (no jax, no model): registration, device slots (LRU among
adapters no running request uses), host memory (LRU past max_cpu_loras, never a live adapter's), and
the scheduler's max_loras rule."""

import pytest

from jaxserve.engine.lora_manager import LoRAManager
from jaxserve.errors import LoRAError, LoRANotFoundError
from jaxserve.lora.request import LoRARequest


class Device:
    """What the manager drives: reads (counted) and slot writes (recorded)."""

    def __init__(self):
        self.reads, self.writes, self.live = [], [], set()

    def load(self, request):
        if "missing" in request.lora_path:
            raise LoRAError(f"LoRA adapter directory {request.lora_path} does not exist")
        self.reads.append(request.lora_name)
        return f"weights of {request.lora_name}"

    def manager(self, max_loras=2, max_cpu_loras=None):
        return LoRAManager(
            max_loras=max_loras,
            max_cpu_loras=max_cpu_loras,
            load=self.load,
            write=lambda slot, w: self.writes.append((slot, w)),
            live=lambda: set(self.live),
        )


def req(name, i):
    return LoRARequest(name, i, f"/adapters/{name}")


def test_registration_refuses_taken_names_ids_and_bad_adapters():
    device = Device()
    m = device.manager()
    m.add(req("a", 1))
    with pytest.raises(LoRAError, match="already loaded"):
        m.add(req("a", 2))
    with pytest.raises(LoRAError, match="lora_int_id 1 is already used by the adapter 'a'"):
        m.add(req("b", 1))
    with pytest.raises(LoRAError, match="does not exist"):
        m.add(LoRARequest("c", 3, "/missing"))
    assert [r.lora_name for r in m.snapshot] == ["a"]
    with pytest.raises(LoRAError, match="is loaded as id 1"):
        m.resolve(req("a", 9))
    with pytest.raises(LoRANotFoundError):
        m.resolve(LoRARequest("nameless", 5))  # no path: cannot register itself
    assert m.resolve(req("z", 7)).name == "z"  # offline: a new request registers itself
    with pytest.raises(LoRANotFoundError):
        m.remove("nope")


def test_slots_fill_then_swap_the_least_recently_used_adapter_not_in_the_step():
    device = Device()
    m = device.manager(max_loras=2)
    a, b, c = (m.add(req(n, i)) for i, n in enumerate("abc", 1))
    m.prepare({a})
    m.prepare({b})
    assert (a.slot, b.slot) == (0, 1)
    m.prepare({a})  # a used again: b is now the least recently used
    m.prepare({a, c})
    assert (a.slot, b.slot, c.slot) == (0, None, 1)
    assert device.writes == [(0, "weights of a"), (1, "weights of b"), (1, "weights of c")]
    assert (m.loads_total, m.evictions_total) == (3, 1)
    with pytest.raises(RuntimeError, match="max_loras is 2"):
        m.prepare({a, b, c})
    m.prepare({c, a})  # resident: nothing written
    assert len(device.writes) == 3


def test_host_memory_keeps_live_adapters_and_drops_the_oldest_past_its_size():
    device = Device()
    m = device.manager(max_loras=1, max_cpu_loras=2)
    a, b = m.add(req("a", 1)), m.add(req("b", 2))
    device.live = {a}
    c = m.add(req("c", 3))  # three held: b (not live) goes, a (live) stays
    assert (a.weights, b.weights, c.weights) == ("weights of a", None, "weights of c")
    assert m.stats([a], [c]) == {
        "max_loras": 1,
        "running": {"a": 1},
        "waiting": {"c": 1},
        "resident": [],
        "cpu_cached": ["a", "c"],
        "loads_total": 0,
        "evictions_total": 0,
    }
    m.resolve(req("b", 2))  # read again from its files
    assert device.reads == ["a", "b", "c", "b"]


def test_unloading_a_running_adapter_keeps_it_until_its_requests_end():
    device = Device()
    m = device.manager(max_loras=2)
    a = m.add(req("a", 1))
    m.prepare({a})
    device.live = {a}
    m.remove("a")
    assert a.weights is not None and a.slot == 0 and "a" not in m.registered
    m.prepare({a})  # its running requests still get their slot
    again = m.add(req("a", 2))  # a new registration of the name: another adapter (its own pages)
    assert again is not a and again.prefix_root != a.prefix_root


def test_scheduler_admits_at_most_max_loras_adapters_at_once():
    from jaxserve.engine.block_manager import BlockManager
    from jaxserve.engine.scheduler import Scheduler
    from jaxserve.engine.sequence import Sequence
    from jaxserve.sampling.params import SamplingParams

    device = Device()
    m = device.manager(max_loras=2)
    a, b, c = (m.add(req(n, i)) for i, n in enumerate("abc", 1))
    scheduler = Scheduler(BlockManager(64, 4, 1), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32)
    scheduler.max_loras = 2
    seqs = [
        Sequence(f"s{i}", f"r{i}", 0, [1, 2, 3], SamplingParams(max_tokens=4), 0, lora=lora)
        for i, lora in enumerate([a, b, c, None, a])
    ]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.schedule()
    assert [s.seq_id for s in scheduler.running] == ["s0", "s1", "s3", "s4"]  # c passed over, the rest in order
    assert scheduler.adapters_in_use(waiting=False) == {a, b}
    assert [s.seq_id for s in scheduler.waiting] == ["s2"]
