"""Everything compiles at start-up: a varied workload afterwards compiles nothing, and a second
process start with the same settings is served entirely from the persistent compilation cache."""

import json
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np

from jaxserve import LLM, SamplingParams, steps
from jaxserve.engine.buckets import opening_buckets
from jaxserve.runner.compilation import CompileCounter
from jaxserve.model.kv_cache import StepBatch

SETTINGS = dict(dtype="float32", page_size=8, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32)


def test_no_compilation_after_warm_up(hf_model_dir):
    path, _ = hf_model_dir("llama")
    llm = LLM(path, compilation_cache_dir="none", **SETTINGS)
    assert len(llm.runner.step_shapes()) == len(llm.runner.table.executables)
    # On a CPU warm-up runs only the opening buckets once; the others' first calls come with the work.
    opening = set(opening_buckets(llm.runner.buckets))
    assert {key[0] for key in llm.runner.table.ran} == opening != set(llm.runner.buckets.token_counts)
    before = CompileCounter.requests  # every executable asked for, persistent-cache hits included
    rng = np.random.RandomState(0)
    for batch in (1, 3, 4, 2):  # varied batch sizes, prompt lengths and output lengths
        prompts = [rng.randint(0, 512, size=rng.randint(1, 40)).tolist() for _ in range(batch)]
        params = [
            SamplingParams(max_tokens=int(rng.randint(1, 20)), temperature=float(rng.choice([0, 0.8])))
            for _ in range(batch)
        ]
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert CompileCounter.requests == before
    assert llm.runner.unplanned_compiles == 0
    assert {key[0] for key in llm.runner.table.ran} > opening  # prompts ran larger buckets, compiling nothing

    # Negative control: a batch of 3 rows is not a bucket, so calling the step with it compiles.
    cfg = llm.model_config
    batch = StepBatch.build([[1], [2], [3]], [0, 0, 0], [[1], [2], [3]], max_pages=5)
    steps.decode_nodonate(llm.runner.params, llm.runner.cache, batch, cfg=cfg)
    assert CompileCounter.requests > before


SECOND_START = textwrap.dedent("""
    import json, sys
    from jaxserve import LLM
    from jaxserve.runner.compilation import CompileCounter
    llm = LLM(sys.argv[1], compilation_cache_dir=sys.argv[2], dtype="float32", page_size=8,
              max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16)
    print(json.dumps({"compiles": CompileCounter.compiles(), "requests": CompileCounter.requests}))
""")


def test_second_start_compiles_nothing(hf_model_dir, tmp_path):
    path, _ = hf_model_dir("llama")

    def start():
        out = subprocess.run(
            [sys.executable, "-c", SECOND_START, path, str(tmp_path / "xla")],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = start(), start()
    assert first["compiles"] > 0
    assert second["requests"] >= first["compiles"] and second["compiles"] == 0


def test_memory_mapping_use_is_reported_on_cpu(monkeypatch, caplog):
    from jaxserve.runner import compilation as compile_mod

    assert compile_mod.check_memory_mappings("gpu") is None
    fraction = compile_mod.check_memory_mappings("cpu")
    assert 0 < fraction < 1
    monkeypatch.setattr(compile_mod, "MAPPINGS_WARN_FRACTION", 0.0)
    with caplog.at_level("WARNING"):
        compile_mod.check_memory_mappings("cpu")
    assert "vm.max_map_count" in caplog.text
