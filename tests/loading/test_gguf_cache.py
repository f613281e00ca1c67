"""The directory a GGUF file is served as (config, tokenizer, tensor index in jaxserve's cache) is
checked against its checksums at every start: a truncated or damaged file there is written again with
a warning, never read (a truncated tokenizer.json used to stop the server at start)."""

import json
import logging
import os
from pathlib import Path

import pytest

from jaxserve.loading import gguf_model
from jaxserve.loading.model_source import resolve_model_path
from jaxserve.loading.tokenizer import load_tokenizer

from gguf_model_writer import write_gguf
from hf_models import make_hf_model
from test_gguf_model import hf_state


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))


def _gguf(tmp_path) -> str:
    model = make_hf_model(str(tmp_path / "hf"), "llama")
    path = str(tmp_path / "llama-F32.gguf")
    write_gguf(path, {**model.config.to_dict(), "model_type": "llama"}, hf_state(model), "F32")
    return path


def test_damaged_metadata_is_rebuilt(tmp_path, caplog):
    gguf = _gguf(tmp_path)
    folder = Path(resolve_model_path(gguf))
    assert gguf_model.check_files(folder) is None
    good = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
    assert {"config.json", "tokenizer.json", gguf_model.SOURCE_FILE, gguf_model.CHECKSUMS} <= set(good)

    damages = {
        "tokenizer.json": lambda b: b[: len(b) // 2],  # truncated: "EOF while parsing a string" before
        "config.json": lambda b: b.replace(b'"hidden_size": ', b'"hidden_size": 1'),  # still valid JSON
        gguf_model.SOURCE_FILE: lambda b: b"",
        gguf_model.CHECKSUMS: lambda b: b[:10],
    }
    for name, damage in damages.items():
        (folder / name).write_bytes(damage(good[name]))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jaxserve.loading.gguf_model"):
            again = Path(resolve_model_path(gguf))
        assert again == folder, name
        assert f"writing it again from {gguf}" in caplog.text, name
        assert {n: (folder / n).read_bytes() for n in os.listdir(folder)} == good, name
    assert load_tokenizer(str(folder)) is not None
    assert json.loads((folder / "config.json").read_text()) == json.loads(good["config.json"])

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxserve.loading.gguf_model"):
        resolve_model_path(gguf)  # intact: read as it is, no warning
    assert not caplog.text


def test_converted_weights_are_mapped_and_damage_converts_again(tmp_path, monkeypatch, caplog):
    import jax
    import numpy as np

    from jaxserve.config import EngineConfig
    from jaxserve.loading import converted_weights
    from jaxserve.loading.model_loader import load_model
    from jaxserve.model.sharding import make_mesh

    monkeypatch.setenv(converted_weights.ENV, "1")
    model = make_hf_model(str(tmp_path / "hf"), "llama")
    gguf = str(tmp_path / "llama-Q4_0.gguf")
    write_gguf(gguf, {**model.config.to_dict(), "model_type": "llama"}, hf_state(model), "Q4_0")
    settings = EngineConfig(model=resolve_model_path(gguf), dtype="float32")
    mesh = make_mesh((1, 1))

    def load():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="jaxserve.loading.converted_weights"):
            params = load_model(settings, mesh, stacked=False).params
        return [np.asarray(x) for x in jax.tree.leaves(params)], caplog.text

    converted, log = load()
    assert "converted weights cached" in log
    (data,) = (converted_weights.cache_dir()).glob("*.bin")
    mapped, log = load()
    assert "mapped from" in log and all(np.array_equal(a, b) for a, b in zip(converted, mapped))

    raw = data.read_bytes()
    for damaged in (raw[: len(raw) // 2], raw[:100] + bytes(b ^ 0x11 for b in raw[100:140]) + raw[140:]):
        data.write_bytes(damaged)
        again, log = load()
        assert "not used" in log and "converted weights cached" in log
        assert all(np.array_equal(a, b) for a, b in zip(converted, again))
    assert "mapped from" in load()[1]
