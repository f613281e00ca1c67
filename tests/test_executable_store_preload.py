"""A warm start loads the last start's executables while its weights load (`executables.Preload`):
entries written under the same start key (settings and environment) are loaded before the engine's
keys are known, and each is used only when its whole key matches, so a checkpoint changed behind the
same settings compiles its own steps and runs them."""

from __future__ import annotations

import shutil

from hf_models import make_hf_model

from jaxserve import LLM, SamplingParams
from jaxserve.engine.buckets import opening_buckets
from jaxserve.runner import executables
from jaxserve.runner.compilation import persistent_cache_bypassed

SETTINGS = {"dtype": "float32", "page_size": 8, "max_model_len": 32, "max_num_seqs": 2, "max_num_batched_tokens": 8}
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 8, 9]]


def _generate(llm) -> list:
    params = SamplingParams(max_tokens=6, temperature=0)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]


def test_a_warm_start_takes_the_preloaded_executables_only_when_their_keys_match(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_EXECUTABLE_STORE", "1")
    model = str(tmp_path / "model")
    make_hf_model(model, "llama")
    settings = dict(SETTINGS, compilation_cache_dir=str(tmp_path / "cache"))
    with persistent_cache_bypassed():  # compiled here, so stored, whatever JAX's cache of this process holds
        cold = LLM(model, **settings)
    keys = cold.runner.step_shapes()
    assert len(cold.runner.table.stored) == len(keys)
    expected = _generate(cold)
    cold.close()

    started = []
    load = executables.Preload._load
    monkeypatch.setattr(executables.Preload, "_load", lambda self, h: started.append(h) or load(self, h))
    warm = LLM(model, **settings)
    assert sorted(warm.runner.table.preloaded) == sorted(keys) and not warm.runner.table.stored
    assert len(started) == len(keys)
    assert _generate(warm) == expected
    warm.close()

    # Serving while the rest load: only the opening buckets preloaded (first), the rest left to the
    # background thread, one at a time.
    started.clear()
    background = LLM(model, compile_in_background=True, **settings)
    opening = set(opening_buckets(background.runner.buckets))
    table = background.runner.table
    assert {k[0] for k in table.preloaded} == opening and len(started) == len(table.preloaded) < len(keys)
    assert background.runner.background.wait(120)
    assert sorted(k for k, _ in table.loaded) == sorted(keys) and not table.stored
    assert _generate(background) == expected
    background.close()

    # Another checkpoint at the same path, other shapes: the same start key, so the same entries
    # preloaded, but none is its program.
    shutil.rmtree(model)
    make_hf_model(model, "llama", intermediate_size=48, seed=1)
    started.clear()
    with persistent_cache_bypassed():
        other = LLM(model, **settings)
    assert len(started) == len(keys) and not other.runner.table.preloaded and not other.runner.table.loaded
    assert len(other.runner.table.stored) == len(keys)
    assert len(_generate(other)[0]) == 6
    other.close()
