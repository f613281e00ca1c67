"""The executable store with several engines of one program in one process (scripts/bench_spec.py's
case): only executables XLA compiled are stored. An executable read back from JAX's persistent cache
serializes without its object code on XLA:CPU, and JAX's in-memory cache hands a later engine that
same executable with no sign of where it came from; stored, it loaded and then failed at its first
run ("Function ... not found"). An entry like that is refused at load and compiled again."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.runner import executable_keys
from jaxserve.runner.compilation import CompileCounter

SETTINGS = dict(dtype="float32", page_size=8, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=8)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 8, 9]]  # the 11-token prompt runs the 8-token bucket


def _generate(llm) -> list:
    params = SamplingParams(max_tokens=6, temperature=0)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]


def test_engines_in_one_process_store_only_what_xla_compiled(hf_model_dir, tmp_path, monkeypatch, caplog):
    from jax.experimental.serialize_executable import serialize

    monkeypatch.setenv("JAXSERVE_EXECUTABLE_STORE", "1")
    path, _ = hf_model_dir("llama")
    settings = dict(SETTINGS, compilation_cache_dir=str(tmp_path / "cache"))
    first = LLM(path, executable_store=False, **settings)  # every step into JAX's persistent cache
    expected = _generate(first)
    first.close()  # JAX's in-memory cache let go too: the next engine reads the persistent cache

    hits = CompileCounter.cache_hits
    from_disk = LLM(path, **settings)
    keys = from_disk.runner.step_shapes()
    if CompileCounter.cache_hits - hits < len(keys):
        pytest.fail("the steps did not come from JAX's persistent cache: this test's premise is gone")
    assert not from_disk.runner.table.stored

    from_memory = LLM(path, **settings)  # the same programs: JAX's in-memory cache returns from_disk's, unannounced
    assert not from_memory.runner.table.stored, "an executable of unknown origin was stored"
    assert _generate(from_memory) == expected
    from_memory.close()

    # Entries as the store used to write them: loaded, they fail at their first run. Refused at load.
    table = from_disk.runner.table
    for key in keys:
        signature = executable_keys.step_signature(from_disk.runner, key)
        table.store.save(signature.key_hash, signature.key, serialize(table.executables[key]), {})
    with caplog.at_level("WARNING"):
        warm = LLM(path, **settings)
    warnings = [r.getMessage() for r in caplog.records if "executable store entry" in r.getMessage()]
    assert len(warnings) == len(keys) and all("no object code" in w for w in warnings), warnings
    assert not warm.runner.table.loaded
    assert _generate(warm) == expected
    warm.close()
    from_disk.close()
