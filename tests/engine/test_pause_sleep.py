"""pause / resume and sleep / wake_up with vLLM's meanings (issue 53, part 3), offline.

One tiny engine for the module; every test ends with the engine awake, unpaused and serving A's
weights, and checks its greedy outputs are those it gave at the start."""

import jax
import pytest
from test_weight_update import GREEDY, PROMPTS, SETTINGS, generate, perturbed_copy, tensors_of

from jaxserve import LLM
from jaxserve.errors import EnginePausedError, EngineSleepingError, RequestError
from jaxserve.model.weights import param_bytes


@pytest.fixture(scope="module")
def served(hf_model_dir):
    path, _ = hf_model_dir("llama")
    with LLM(path, **SETTINGS) as llm:
        yield llm, generate(llm), path


def live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def no_page_held(engine) -> None:
    engine.blocks.check_invariants()
    assert engine.blocks.num_used_pages() == 0


def test_sleep_level_1_frees_the_devices_and_wakes_to_the_same_outputs(served):
    llm, want, _ = served
    engine = llm.engine
    engine.add_request("held", prompt_token_ids=PROMPTS[1], sampling_params=GREEDY)
    engine.step()
    before, weights = live_bytes(), param_bytes(llm.runner.params)
    cache_bytes = llm.runner.cache.k.nbytes + llm.runner.cache.v.nbytes
    aborted = llm.sleep(1)
    assert [o.outputs[0].finish_reason for o in aborted] == ["abort"] and not engine.requests
    no_page_held(engine)
    assert engine.blocks.num_cached_pages() == 0  # no KV of the discarded cache can be reused
    assert llm.is_sleeping()
    assert before - live_bytes() >= weights + cache_bytes  # weights (now NumPy on the host) and pages freed
    assert all(x.is_deleted() for x in jax.tree.leaves(llm.runner.params))
    with pytest.raises(EngineSleepingError, match="asleep.*wake_up"):
        generate(llm)
    llm.wake_up(["kv_cache"])  # the pool first: still asleep (the weights are on the host)
    assert llm.is_sleeping()
    with pytest.raises(EngineSleepingError, match="weights"):
        generate(llm)
    llm.wake_up(["weights"])
    assert not llm.is_sleeping()
    assert generate(llm) == want
    llm.sleep(1)
    llm.wake_up()  # all at once
    assert generate(llm) == want
    with pytest.raises(RequestError, match="tags"):
        llm.wake_up(["optimizer"])
    with pytest.raises(RequestError, match="level"):
        llm.sleep(3)


def test_sleep_level_2_discards_the_weights_until_update_weights(served, tmp_path):
    llm, want, path = served
    other = perturbed_copy(path, str(tmp_path / "b"))
    llm.sleep(2)
    with pytest.raises(EngineSleepingError, match="discarded.*update_weights"):
        llm.wake_up()
    llm.wake_up(["kv_cache"])
    with pytest.raises(EngineSleepingError, match="leaves out"):  # all weights must come back at once
        llm.update_weights({"model.norm.weight": tensors_of(path)["model.norm.weight"]})
    report = llm.update_weights(tensors_of(other))
    assert report.tensors == 21 and not llm.is_sleeping()
    assert generate(llm) != want
    llm.update_weights(tensors_of(path))
    assert generate(llm) == want
    no_page_held(llm.engine)


def test_pause_keep_abort_and_wait(served):
    llm, want, _ = served
    engine = llm.engine
    # keep: the request stays where it is (no step runs) and finishes after resume as if never paused
    engine.add_request("kept", prompt_token_ids=PROMPTS[1], sampling_params=GREEDY)
    outputs = engine.step()
    assert llm.pause("keep") == []
    tokens = list(engine.requests["kept"].seqs[0].output_token_ids)
    assert engine.step() == [] and engine.step() == []
    assert engine.requests["kept"].seqs[0].output_token_ids == tokens and llm.is_paused()
    with pytest.raises(EnginePausedError, match="resume"):
        generate(llm)
    llm.resume()
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [t for o in outputs for t in o.outputs[0].token_ids] == want[1]
    # abort: ended now, with what it had
    engine.add_request("aborted", prompt_token_ids=PROMPTS[1], sampling_params=GREEDY)
    engine.step()
    (last,) = llm.pause("abort")
    assert last.finished and last.outputs[0].finish_reason == "abort" and not engine.requests
    llm.resume()
    # wait: run to the end first
    engine.add_request("waited", prompt_token_ids=PROMPTS[0], sampling_params=GREEDY)
    finished = [o for o in llm.pause("wait") if o.finished]
    assert [o.outputs[0].finish_reason for o in finished] == ["length"] and not engine.requests
    llm.resume()
    with pytest.raises(RequestError, match="mode"):
        llm.pause("later")
    assert not llm.is_paused()
    no_page_held(engine)
    assert generate(llm) == want


def test_sleep_level_2_keeps_the_lora_slots(served):
    """Level 2 discards the model's weights, which update_weights brings back; the LoRA slots (the
    engine's, not the trainer's) stay on the devices. No step runs: nothing compiles but the slot write."""
    _, _, path = served
    with LLM(path, **SETTINGS, enable_lora=True, max_loras=1, max_lora_rank=4, warm_up=False) as llm:
        slots = jax.tree.leaves([lp.lora for lp in llm.runner.params.layers])
        llm.sleep(2)
        assert not any(x.is_deleted() for x in slots)
        assert llm.runner.params.layers[0].wq.is_deleted()
        llm.wake_up(["kv_cache"])
        llm.update_weights(tensors_of(path))
        assert not llm.is_sleeping()
        assert all(x is y for x, y in zip(jax.tree.leaves([lp.lora for lp in llm.runner.params.layers]), slots))
