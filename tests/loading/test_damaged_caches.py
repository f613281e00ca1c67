"""Issue 52's start-up check: with every file over 4 KB under the caches truncated to half (the GGUF
model's metadata, its converted weights, the executable store, JAX's persistent cache), the next start
comes up, warns once for each damaged entry, and answers exactly as before."""

import json
import os
import subprocess
import sys
import textwrap

START = textwrap.dedent("""
    import json, os, sys
    from jaxserve import LLM, SamplingParams
    llm = LLM(sys.argv[1], compilation_cache_dir=sys.argv[2], dtype="float32", page_size=8, max_model_len=32,
              max_num_seqs=2, max_num_batched_tokens=8)
    out = llm.generate(prompt_token_ids=[[1, 2, 3, 4, 5]], sampling_params=SamplingParams(max_tokens=6, temperature=0))
    table = llm.runner.table
    print(json.dumps(dict(tokens=out[0].outputs[0].token_ids, loaded=len(table.loaded), stored=len(table.stored))))
""")


def test_every_cache_file_truncated_still_starts(tmp_path):
    from gguf_model_writer import write_gguf
    from hf_models import make_hf_model
    from test_gguf_model import hf_state

    model = make_hf_model(str(tmp_path / "hf"), "llama")
    gguf = str(tmp_path / "llama-Q4_0.gguf")
    write_gguf(gguf, {**model.config.to_dict(), "model_type": "llama"}, hf_state(model), "Q4_0")
    data, compiled = tmp_path / "data", tmp_path / "compiled"
    env = dict(os.environ, JAXSERVE_CACHE=str(data), JAXSERVE_EXECUTABLE_STORE="1", JAXSERVE_WEIGHTS_CACHE="1")

    def start():
        run = subprocess.run(
            [sys.executable, "-c", START, gguf, str(compiled)], env=env, capture_output=True, text=True, timeout=600
        )
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr

    first, _ = start()
    assert first["stored"] > 0
    damaged = []
    for folder in (data, compiled):
        for path in folder.rglob("*"):
            if path.is_file() and path.stat().st_size > 4096:
                os.truncate(path, path.stat().st_size // 2)
                damaged.append(path.name)
    assert any(n == "tokenizer.json" for n in damaged) and any(n.endswith(".jxe") for n in damaged)
    assert any(n.endswith(".bin") for n in damaged)
    second, log = start()
    assert second["tokens"] == first["tokens"] and second["loaded"] == 0 and second["stored"] == first["stored"]
    assert "tokenizer.json damaged" in log and "converting them again" in log
    assert log.count("compiled again") == first["stored"]
