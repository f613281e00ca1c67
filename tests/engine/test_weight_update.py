"""update_weights: new weights without a restart (issue 53, part 2).

Two tiny llamas of the same shape, A and B (B = A plus noise, so their greedy outputs differ): an
engine started on A and given B's weights, in each form a trainer holds them, must answer exactly as
an engine started on B, without compiling anything; a same-sharding update serves the caller's
arrays themselves; a deleted (donated) adopted array is named before the next step."""

import os
import shutil

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError, WeightsDeletedError
from jaxserve.loading.checkpoint import iter_safetensors, load_hf_params, write_safetensors
from jaxserve.model.llama import forward_dense
from jaxserve.runner.compilation import CompileCounter

SETTINGS = {
    "dtype": "float32",
    "page_size": 8,
    "max_model_len": 32,
    "max_num_seqs": 2,
    "max_num_batched_tokens": 16,
    "compilation_cache_dir": "none",
}
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12]]


def generate(llm):
    return [
        o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    ]


def perturbed_copy(src: str, dst: str, seed: int = 1) -> str:
    """The model at `src` with every weight moved by noise (same config, other outputs)."""
    shutil.copytree(src, dst)
    rng = np.random.default_rng(seed)
    path = os.path.join(src, "model.safetensors")
    tensors = {name: x + rng.normal(0, 0.05, x.shape).astype(x.dtype) for name, x in iter_safetensors(path)}
    write_safetensors(os.path.join(dst, "model.safetensors"), tensors)
    return dst


@pytest.fixture(scope="module")
def models(hf_model_dir, tmp_path_factory):
    a, _ = hf_model_dir("llama")
    return a, perturbed_copy(a, str(tmp_path_factory.mktemp("weights") / "b"))


def tensors_of(model_dir: str) -> dict:
    return dict(iter_safetensors(os.path.join(model_dir, "model.safetensors")))


@pytest.fixture(scope="module")
def engine_b(models):
    with LLM(models[1], **SETTINGS) as llm:
        yield llm, generate(llm)


@pytest.fixture(scope="module")
def engine_a(models, engine_b):
    """One engine on A for the module (closing an engine drops the compiled steps every engine of these
    settings shares); at the end A's weights are loaded again and must answer as at the start."""
    with LLM(models[0], **SETTINGS) as llm:
        first = generate(llm)
        yield llm, first
        llm.update_weights(tensors_of(models[0]))
        assert generate(llm) == first


def test_every_form_of_new_weights_matches_a_fresh_engine(models, engine_a, engine_b):
    """HF names (a mapping, then chunks streamed), a stacked pytree: each gives B's greedy outputs on
    the engine started with A; nothing compiles; the version counts, or is the caller's."""
    a, b = models
    want = engine_b[1]
    llm, before = engine_a
    assert before != want  # the update must change something
    assert before[0] and all(
        o.weight_version == 0
        for o in llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY, use_tqdm=False)
    )
    executables, compiles = llm.runner.num_executables(), CompileCounter.requests
    new = {name: np.array(x) for name, x in tensors_of(b).items()}  # the trainer's own NumPy arrays
    report = llm.update_weights(new)
    assert (report.tensors, report.copied, report.adopted, report.weight_version) == (21, 21, 0, 1)
    assert generate(llm) == want
    for x in new.values():  # changed in place afterwards (on a CPU a device array could alias them): no effect
        x[...] = 0
    assert generate(llm) == want
    llm.update_weights(tensors_of(a))  # back to A: the engine is not stuck on B
    assert generate(llm) == before
    chunks = iter_safetensors(os.path.join(b, "model.safetensors"))  # a generator: one tensor at a time
    assert llm.update_weights(chunks, weight_version="step-3").weight_version == "step-3"
    out = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == want
    assert {o.weight_version for o in out} == {"step-3"}
    assert CompileCounter.requests == compiles, "an update compiled something"
    llm.update_weights(tensors_of(a))
    stacked = load_hf_params(b, ModelConfig.from_dir(b), np.float32, stacked=True)  # a trainer's layer stack
    llm.update_weights(stacked)
    assert generate(llm) == want
    assert llm.runner.num_executables() == executables  # slicing the stack compiled slices, not steps
    llm.blocks.check_invariants()
    with pytest.raises(ModelLoadError, match="shape"):
        llm.update_weights({"model.norm.weight": np.ones(3, np.float32)})


def test_same_sharding_update_adopts_the_arrays_and_names_a_donated_one(engine_a, engine_b):
    """Arrays already on the engine's devices and sharding are served as they are (the same objects,
    the same buffers); once one is deleted or donated, the next generate says which and why."""
    llm_b, want = engine_b
    llm = engine_a[0]
    new = jax.tree.map(lambda x: x + 0, llm_b.runner.params)  # the trainer's own arrays, B's values
    report = llm.update_weights(new)
    assert report.adopted == report.tensors == 21 and report.copied == 0
    served, given = jax.tree.leaves(llm.runner.params), jax.tree.leaves(new)
    assert all(x is y for x, y in zip(served, given))
    assert [x.unsafe_buffer_pointer() for x in served] == [y.unsafe_buffer_pointer() for y in given]
    assert generate(llm) == want
    # A trainer step donating its params deletes the engine's weights with them.
    jax.jit(lambda w: w * 2, donate_argnums=0)(new.layers[1].wq)
    with pytest.raises(WeightsDeletedError, match=r"layers\[1\]\.wq.*donat"):
        generate(llm)
    assert not llm.engine.requests  # refused before anything was queued
    with pytest.raises(WeightsDeletedError, match="deleted"):
        llm.update_weights(new)  # giving the deleted array again is refused too
    fresh = jax.tree.map(lambda x: x + 0, llm_b.runner.params)
    assert llm.update_weights(fresh, copy=True).adopted == 0  # copies of its own: the trainer may donate
    jax.tree.map(lambda x: x.delete(), fresh)
    assert generate(llm) == want


def test_int8_engine_requantizes_as_it_loads(models):
    """An int8 engine given float weights quantizes them as a fresh int8 engine on B does."""
    a, b = models
    settings = {**SETTINGS, "quantization": "int8"}
    with LLM(b, **settings) as llm_b, LLM(a, **settings) as llm:  # both open: the second compiles nothing
        want = generate(llm_b)
        executables = llm.runner.num_executables()
        report = llm.update_weights(tensors_of(b))
        assert report.quantized == 14  # 7 linear weights in each of the 2 layers
        assert generate(llm) == want
        assert llm.runner.num_executables() == executables


def test_update_while_requests_run_keeps_their_pages(models, engine_a):
    """Requests running through an update go on (their pages theirs, the prefix cache emptied); every
    page is back in the pool afterwards."""
    engine = engine_a[0].engine
    engine.add_request("r", prompt_token_ids=PROMPTS[1], sampling_params=GREEDY)
    engine.step()
    engine.update_weights(tensors_of(models[1]))
    assert engine.blocks.num_cached_pages() == 0
    while engine.has_unfinished_requests():
        engine.step()
    engine.blocks.check_invariants()
    assert engine.blocks.num_used_pages() == 0


def test_arrays_on_another_sharding_are_resharded_one_at_a_time(models):
    """A trainer's arrays on one device, the engine tensor-parallel over two: each weight lands on the
    engine's sharding with the trainer's values, the trainer's arrays untouched, and the engine's
    device memory never holds more than the served weights (each old tensor is freed before its new
    one is placed; no step runs: no compile)."""
    a, _ = models
    with LLM(a, **SETTINGS, tensor_parallel_size=2, warm_up=False) as llm:
        served = llm.runner.params
        shardings = [x.sharding for x in jax.tree.leaves(served)]
        trainer = jax.tree.map(lambda x: jax.device_put(x + 1, jax.devices()[3]), served)
        updater = llm.engine.weights
        mesh = set(jax.devices()[:2])

        def engine_bytes() -> int:  # live arrays on the engine's devices (the trainer's are on another)
            return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted() and x.sharding.device_set <= mesh)

        before, extra, place = engine_bytes(), [], updater._place

        def placed(*args, **kwargs):  # each new tensor placed, the old one not yet deleted
            out = place(*args, **kwargs)
            extra.append(engine_bytes() - before)
            return out

        updater._place = placed
        report = llm.update_weights(trainer)
        assert report.copied == report.tensors == 21 and report.adopted == 0
        assert engine_bytes() == before  # the old weights deleted (before NumPy reads the shards below)
        new = jax.tree.leaves(llm.runner.params)
        assert [x.sharding for x in new] == shardings
        assert all(np.array_equal(x, y) for x, y in zip(new, jax.tree.leaves(trainer)))
        assert not any(x.is_deleted() for x in jax.tree.leaves(trainer))
        assert len(extra) == 21 and max(extra) <= 0  # each old tensor freed before its new one is placed


def test_rollout_logprobs_equal_the_dense_forward_after_an_update(models, engine_a, engine_b):
    """Sampled rollouts after update_weights: each token's logprob (`sampled_logprobs()`, an array)
    equals what the trainer's dense forward gives on the same weights, within 1e-4 in float32."""
    a, b = models
    llm, cfg = engine_a[0], engine_a[0].model_config
    llm.update_weights(tensors_of(b))
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    dense = jax.jit(lambda p, t: jax.nn.log_softmax(forward_dense(p, t, cfg=cfg), axis=-1))
    worst, kl = 0.0, []
    for prompt, out in zip(PROMPTS, outs):
        sample = out.outputs[0]
        got = sample.sampled_logprobs()
        assert got.dtype == np.float32 and got.shape == (len(sample.token_ids),)
        tokens = np.asarray([prompt + sample.token_ids], np.int32)
        table = np.asarray(dense(engine_b[0].runner.params, tokens))[0]  # f32[T, V]
        want = table[np.arange(len(prompt) - 1, tokens.shape[1] - 1), sample.token_ids]
        worst = max(worst, float(np.abs(got - want).max()))
        d = want.astype(np.float64) - got
        kl.append(float(np.mean(np.exp(d) - 1 - d)))  # the k3 estimate of KL(engine || trainer)
    print(f"rollout vs dense logprobs: largest difference {worst:.2e}, mismatch KL {max(kl):.2e}")
    assert worst < 1e-4
    llm.update_weights(tensors_of(a))


def test_a_draft_model_is_kept_unless_its_weights_are_given(models):
    """With a draft model (speculative decoding), update_weights states that the draft keeps its weights,
    or updates them from `draft_params` (here the target's own layout and names: the same tiny model)."""
    a, b = models
    settings = {**SETTINGS, "speculative_model": a, "num_speculative_tokens": 2}
    with LLM(a, **settings, warm_up=False) as llm:
        state = llm.runner.state
        draft_before = [np.asarray(x) for x in jax.tree.leaves(state.draft_params)]
        assert llm.update_weights(tensors_of(b)).draft == "kept"
        assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(state.draft_params), draft_before))
        report = llm.update_weights(tensors_of(b), draft_params=tensors_of(b))
        assert report.draft == "updated" and report.tensors == 42
        target, draft = jax.tree.leaves(state.params), jax.tree.leaves(state.draft_params)
        assert all(np.array_equal(x, y) for x, y in zip(target, draft))


def test_int4_engine_requantizes_as_a_fresh_engine_loads(models):
    """An int4 engine given float weights holds what a fresh int4 engine on them holds (codes, scales,
    biases), without running a step (no compile)."""
    a, b = models
    settings = {**SETTINGS, "quantization": "int4", "warm_up": False}
    with LLM(b, **settings) as fresh, LLM(a, **settings) as llm:
        report = llm.update_weights(tensors_of(b))
        assert report.quantized == 14
        served, want = jax.tree.leaves(llm.runner.params), jax.tree.leaves(fresh.runner.params)
        assert len(served) == len(want) and all(np.array_equal(x, y) for x, y in zip(served, want))
