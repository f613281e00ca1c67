"""The pooling engine's host half (engine/pooling.py, engine/pooling_config.py) over the fake runner:
chunked prompts pool as whole ones, pages come back, the budget holds, bad prompts are refused by
name, and the pooler config resolves as vLLM's (flag over sentence-transformers files over the
architecture)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.engine.pooling import PoolingCore, embed_prompts
from jaxserve.engine.pooling_config import PoolerConfig, parse_pooler_config, resolve_pooler_config
from jaxserve.errors import ConfigError, RequestError
from jaxserve.testing.fake_pooling import FakePoolingRunner, token_states


def core_of(kind: str, **runner) -> PoolingCore:
    fake = FakePoolingRunner(16, kind, **runner)
    return PoolingCore(fake, PoolerConfig(pooling_type=kind), 16, 512, num_pages=64, max_model_len=64)


def expected(ids, kind, dims=None):
    states = token_states(ids, 16)
    v = {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0]}[kind][:dims]
    return v / np.linalg.norm(v)


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_chunked_prompts_pool_as_whole_ones(kind):
    core = core_of(kind, max_tokens=8, max_rows=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, n).tolist() for n in (3, 30, 1, 17, 8, 9)]
    outs = embed_prompts(core, prompt_token_ids=prompts)
    for ids, out in zip(prompts, outs):
        np.testing.assert_allclose(out.outputs.data, expected(ids, kind), rtol=1e-5, atol=1e-6)
        assert out.prompt_token_ids == ids
    assert all(sum(n for _, n in step) <= 8 and len(step) <= 3 for step in core.runner.steps)
    assert any(start > 0 for step in core.runner.steps for start, _ in step)  # some prompt ran in chunks
    assert core.blocks.num_free_pages(0) == core.blocks.num_usable_pages  # no KV kept after a request
    assert not core.has_unfinished_requests()


def test_bad_prompts_are_refused_by_name():
    core = core_of("MEAN")
    with pytest.raises(RequestError, match="empty"):
        embed_prompts(core, prompt_token_ids=[[1, 2], []])
    with pytest.raises(RequestError, match="maximum context length is 64"):
        embed_prompts(core, prompt_token_ids=list(range(65)))
    with pytest.raises(RequestError, match="token id 512 is outside the vocabulary"):
        embed_prompts(core, prompt_token_ids=[5, 512])
    with pytest.raises(RequestError, match="Matryoshka"):
        embed_prompts(core, prompt_token_ids=[5, 6], dimensions=8)
    with pytest.raises(RequestError, match="exactly one"):
        embed_prompts(core)
    assert not core.has_unfinished_requests() and not core.runner.steps  # nothing was queued


def test_matryoshka_dimensions_cut_then_normalize():
    fake = FakePoolingRunner(16, "LAST")
    pooler = PoolerConfig(pooling_type="LAST", matryoshka=True, matryoshka_dimensions=(4, 8))
    core = PoolingCore(fake, pooler, 16, 512, num_pages=64, max_model_len=64)
    (out,) = embed_prompts(core, [{"prompt_token_ids": [3, 4, 5]}], pooling_params={"dimensions": 8})
    np.testing.assert_allclose(out.outputs.data, expected([3, 4, 5], "LAST", 8), rtol=1e-5)
    with pytest.raises(RequestError, match=r"not one this model was trained for: \[4, 8\]"):
        embed_prompts(core, prompt_token_ids=[3], dimensions=6)


def test_abort_frees_pages():
    core = core_of("MEAN", max_tokens=4)
    core.add_request("a", list(range(20)))
    core.step()
    assert core.blocks.num_free_pages(0) < core.blocks.num_usable_pages
    core.abort_request("a")
    assert core.blocks.num_free_pages(0) == core.blocks.num_usable_pages and not core.has_unfinished_requests()


def write_st_files(path, pooling: dict, normalize: bool):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 16, **pooling}))


def test_pooler_config_resolution(tmp_path):
    qwen3, llama = {"architectures": ["Qwen3ForCausalLM"]}, {"architectures": ["LlamaModel"]}
    assert resolve_pooler_config(str(tmp_path), qwen3, None).pooling_type == "LAST"
    default = resolve_pooler_config(str(tmp_path), llama, None)
    assert (default.pooling_type, default.normalize) == ("MEAN", True)
    write_st_files(tmp_path, {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, normalize=False)
    st = resolve_pooler_config(str(tmp_path), qwen3, None)  # the files over the architecture
    assert (st.pooling_type, st.normalize, st.source) == ("CLS", False, "sentence-transformers files")
    flag = resolve_pooler_config(
        str(tmp_path), qwen3, parse_pooler_config('{"pooling_type": "last", "normalize": true}')
    )
    assert (flag.pooling_type, flag.normalize) == ("LAST", True)
    matryoshka = resolve_pooler_config(str(tmp_path), {**qwen3, "matryoshka_dimensions": [32, 64]}, None)
    assert matryoshka.matryoshka and matryoshka.matryoshka_dimensions == (32, 64)


def test_pooler_config_refusals(tmp_path):
    with pytest.raises(ConfigError, match="unknown keys"):
        parse_pooler_config('{"pooling_typo": "LAST"}')
    with pytest.raises(ConfigError, match="one of LAST, MEAN, CLS"):
        parse_pooler_config({"pooling_type": "MAX"})
    write_st_files(tmp_path, {"pooling_mode": "max"}, normalize=True)
    with pytest.raises(ConfigError, match="'max' is not served"):
        resolve_pooler_config(str(tmp_path), {"architectures": ["LlamaModel"]}, None)


def test_launch_line_flags():
    """vLLM's launch line for an embeddings server parses into the pooling settings."""
    from jaxserve import serve

    ns = serve.build_parser().parse_args(
        ["/m", "--runner", "pooling", "--convert", "embed", "--pooler-config", '{"pooling_type": "MEAN"}']
    )
    settings = serve.settings_from_flags(ns)
    assert settings.pooling and settings.convert == "embed"
    assert parse_pooler_config(settings.pooler_config) == {"pooling_type": "MEAN"}
    with pytest.raises(ConfigError, match="runner='pooling'"):
        serve.settings_from_flags(serve.build_parser().parse_args(["/m", "--convert", "embed"]))


def test_data_parallel_replicas_share_the_prompts():
    """Two replicas: each step packs each replica's rows under its own budget; every prompt pools as
    alone, and both pools are whole afterwards."""
    fake = FakePoolingRunner(16, "MEAN", max_tokens=8, max_rows=2)
    fake.num_replicas = 2
    core = PoolingCore(fake, PoolerConfig(pooling_type="MEAN"), 16, 512, num_pages=64, max_model_len=64)
    prompts = [[i + 1] * (3 + 4 * i) for i in range(6)]
    outs = embed_prompts(core, prompt_token_ids=prompts)
    for ids, out in zip(prompts, outs):
        np.testing.assert_allclose(out.outputs.data, expected(ids, "MEAN"), rtol=1e-5, atol=1e-6)
    assert max(len(step) for step in fake.steps) > 2  # rows of both replicas in one step
    assert all(core.blocks.num_free_pages(r) == core.blocks.num_usable_pages for r in (0, 1))
