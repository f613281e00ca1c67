"""Issue 52's 1B target, with tiny shapes: the Llama-3.2-1B config, a random checkpoint written by
scripts/make_random_checkpoint.py and loaded back, the blocked transpose the loader lays weights out
with, the safetensors checkpoint's laid-out weights kept between starts, and the read timing of
scripts/bench_startup_weights.py."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.loading import converted_weights
from jaxserve.loading.checkpoint import hf_tensors, iter_safetensors, load_hf_params, transpose_into
from jaxserve.loading.model_loader import load_model
from jaxserve.model.sharding import make_mesh

REPO = pathlib.Path(__file__).parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import bench_startup  # noqa: E402
import bench_startup_weights  # noqa: E402
import make_random_checkpoint  # noqa: E402

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=300,
)


def test_llama_3_2_1b_config():
    cfg = ModelConfig.from_dir(str(REPO / "configs/models/llama-3.2-1b"))
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2048, 16, 32, 8, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (8192, 128256, 131072)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 500000.0
    scaling = cfg.rope_scaling
    assert (scaling.kind, scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor) == ("llama3", 32, 1, 4)
    assert scaling.original_max_position_embeddings == 8192
    assert round(cfg.num_params() / 1e6) == 1236  # Llama-3.2-1B's 1.24 B
    served = EngineConfig.from_yaml(str(REPO / "configs/llama-3.2-1b.yaml"))
    assert served.dtype == "auto" and served.max_model_len < cfg.max_position_embeddings


def tiny_config_dir(tmp_path, **changes) -> str:
    hf = json.loads((REPO / "configs/models/llama-3.2-1b/config.json").read_text())
    hf.update(TINY, **changes)
    folder = tmp_path / "config"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    return str(folder)


@pytest.mark.parametrize("tied", [True, False])
def test_random_checkpoint_loads_as_written(tmp_path, tied):
    out = str(tmp_path / "ckpt")
    written = make_random_checkpoint.make_checkpoint(
        tiny_config_dir(tmp_path, tie_word_embeddings=tied), out, seed=3, dtype="bfloat16"
    )
    cfg = ModelConfig.from_dir(out)
    assert written["parameters"] == cfg.num_params() and written["tokenizer"] == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads(pathlib.Path(out, "config.json").read_text())["torch_dtype"] == "bfloat16"
    stored = {name: np.array(t) for name, t in iter_safetensors(f"{out}/model.safetensors")}
    assert ("lm_head.weight" in stored) == (not tied)
    assert all(t.dtype == ml_dtypes.bfloat16 for t in stored.values())
    assert np.all(stored["model.norm.weight"].astype(np.float32) == 1)
    q = stored["model.layers.1.self_attn.q_proj.weight"].astype(np.float32)
    assert q.shape == (64, 64) and 0.01 < q.std() < 0.03  # [out, in], normal(0.02)
    for stacked in (True, False):
        params = load_hf_params(out, cfg, ml_dtypes.bfloat16, stacked=stacked)
        back = hf_tensors(params, cfg)
        assert back.keys() == stored.keys()
        for name, tensor in stored.items():
            np.testing.assert_array_equal(back[name].view(np.uint16), tensor.view(np.uint16), err_msg=name)
    (tmp_path / "b").mkdir()
    again = make_random_checkpoint.make_checkpoint(
        tiny_config_dir(tmp_path / "b", tie_word_embeddings=tied), str(tmp_path / "b" / "ckpt"), seed=3
    )
    assert (
        pathlib.Path(again["out"], "model.safetensors").read_bytes()
        == pathlib.Path(out, "model.safetensors").read_bytes()
    )


@pytest.mark.parametrize(
    "src_dtype,dest_dtype,shape",
    [
        (ml_dtypes.bfloat16, ml_dtypes.bfloat16, (600, 37)),
        (ml_dtypes.bfloat16, np.float32, (257, 5)),
        (np.float32, np.float32, (3, 700)),
        (np.float16, np.float32, (256, 256)),
    ],
)
def test_transpose_into(src_dtype, dest_dtype, shape):
    src = np.random.default_rng(0).standard_normal(shape).astype(src_dtype)
    dest = np.empty(shape[::-1], dest_dtype)
    transpose_into(dest, src)
    np.testing.assert_array_equal(dest, src.T.astype(dest_dtype))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_safetensors_layout_is_kept_and_checked(tmp_path, monkeypatch, caplog, dtype):
    """A bfloat16 checkpoint's laid-out copy is mapped on the next load, identical, in bfloat16 even
    when the model runs in float32 (cast back as mapped); damage or a rewritten checkpoint lays it out again."""
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(converted_weights.ENV, "1")
    out = str(tmp_path / "ckpt")
    written = make_random_checkpoint.make_checkpoint(tiny_config_dir(tmp_path), out, seed=1)
    assert converted_weights.stored_dtype(out, dtype) == (ml_dtypes.bfloat16 if dtype == "float32" else None)
    settings = EngineConfig(model=out, dtype=dtype)
    mesh = make_mesh((1, 1))

    def load():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="jaxserve.loading.converted_weights"):
            params = load_model(settings, mesh, stacked=False).params
        assert {x.dtype.name for x in jax.tree.leaves(params)} == {dtype}
        return [np.asarray(x).view(np.uint8) for x in jax.tree.leaves(params)], caplog.text

    laid_out, log = load()
    assert "converted weights cached" in log
    (data,) = converted_weights.cache_dir().glob("*.bin")
    assert data.stat().st_size < 1.1 * written["bytes"]  # float32 kept as the checkpoint's bfloat16
    mapped, log = load()
    assert "mapped from" in log and all(np.array_equal(a, b) for a, b in zip(laid_out, mapped))
    raw = data.read_bytes()
    data.write_bytes(raw[:200] + bytes(b ^ 0x5A for b in raw[200:260]) + raw[260:])
    again, log = load()
    assert "not used" in log and "converted weights cached" in log
    assert all(np.array_equal(a, b) for a, b in zip(laid_out, again))

    (tmp_path / "x").mkdir()
    make_random_checkpoint.make_checkpoint(tiny_config_dir(tmp_path / "x"), out, seed=2)  # rewritten: new weights
    os.utime(f"{out}/model.safetensors", ns=(1, 1))  # even with a reused size, its mtime differs
    fresh, log = load()
    assert "converted weights cached" in log and not all(np.array_equal(a, b) for a, b in zip(laid_out, fresh))
    assert len(list(converted_weights.cache_dir().glob("*.bin"))) == 1  # one entry per model kept

    monkeypatch.setenv(converted_weights.MAX_ENV, str(os.path.getsize(f"{out}/model.safetensors") - 1))
    assert not converted_weights.enabled(out)
    monkeypatch.setenv(converted_weights.ENV, "0")
    monkeypatch.delenv(converted_weights.MAX_ENV)
    assert not converted_weights.enabled(out)


def test_bench_reads_and_log_timestamps(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\1" * 300_000)
    (tmp_path / "config.json").write_text("{}")
    files = bench_startup_weights.weight_files(str(tmp_path))
    assert files == [str(tmp_path / "model.safetensors")]
    reads = bench_startup_weights.read_times(files)
    assert reads["weight_bytes"] == 300_000 and reads["read_cold_s"] >= 0 and reads["read_warm_s"] >= 0
    log = (
        "2026-12-07 20:49:38,249 INFO jaxserve.serve: loading out/x (weights from the checkpoint)\n"
        "2026-12-07 20:49:39,333 INFO jax._src.xla_bridge: other\n"
        "2026-12-07 20:49:55,054 INFO jaxserve.llm_engine: memory plan: params 2.302 GiB\n"
    )
    assert bench_startup.log_seconds(log, "INFO jaxserve.serve: loading ", "memory plan") == 16.8
    assert bench_startup.log_seconds(log, "INFO jaxserve.serve: loading ", "never logged") is None


def test_bench_weights_only(tmp_path):
    """The script's weights-only mode end to end on a tiny checkpoint: the first load writes the copy,
    the next maps it, the one after lays the weights out again."""
    out = str(tmp_path / "ckpt")
    make_random_checkpoint.make_checkpoint(tiny_config_dir(tmp_path), out, seed=0)
    result = bench_startup_weights.main(["--weights-only", "--weights", out, "--rounds", "1", "--no-snapshot"])
    timing = result["weights_only"]
    assert timing["first_load_writing_the_copy_s"] > 0 and len(timing["read_cold_s"]) == 3
    assert len(timing["mapped_copy_s"]) == len(timing["laid_out_at_load_s"]) == 1
