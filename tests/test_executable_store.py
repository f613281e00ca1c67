"""The executable store (issue 52): step executables serialized after their first compile and loaded on
the next start without tracing; damaged or foreign entries compiled again with a warning, never
served; writers racing on one store; `jaxserve compile` then a start compiles nothing."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.runner import executable_keys
from jaxserve.runner.compilation import CompileCounter
from jaxserve.runner.executable_store import ExecutableStore, key_hash
from jaxserve.runner.executables import ExecutableTable

SETTINGS = dict(dtype="float32", page_size=8, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=8)
ON_TWO_DEVICES = {**SETTINGS, "mesh_shape": (1, 2)}  # a sub-mesh of the 4 test devices
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 8, 9]]


def _generate(llm) -> list:
    params = [SamplingParams(max_tokens=6, temperature=0), SamplingParams(max_tokens=6, temperature=0.9, seed=3)]
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]


def _serialized_small():
    """A small compiled function and its serialized parts (the store's payload)."""
    from jax.experimental.serialize_executable import serialize

    compiled = jax.jit(lambda x: jnp.tanh(x) * 2).trace(jax.ShapeDtypeStruct((4,), jnp.float32)).lower().compile()
    return compiled, serialize(compiled)


# ---- the store's files, without a model ----------------------------------------------------------------
def test_entry_round_trip_and_damage(tmp_path):
    store = ExecutableStore.open(str(tmp_path / "store"))
    assert oct(os.stat(store.directory).st_mode & 0o777) == "0o700"
    _, parts = _serialized_small()
    key = {"what": "tanh", "n": 4}
    path = store.save(key_hash(key), key, parts, dict(variant="test", bucket=[4]))
    loaded = store.load(key_hash(key), key)
    assert loaded is not None and loaded.blob == parts[0] and not store.warnings
    assert store.entries()[0]["variant"] == "test" and store.total_bytes() == os.path.getsize(path)

    with open(path, "rb") as f:
        data = f.read()
    for damaged in (data[: len(data) // 2], data[:-100] + bytes(b ^ 0xFF for b in data[-100:]), b"junk"):
        with open(path, "wb") as f:
            f.write(damaged)
        assert store.load(key_hash(key), key) is None
        assert not os.path.exists(path)  # removed: not refused again at every start
    assert len(store.warnings) == 3 and all("compiled again" in w for w in store.warnings)
    assert "truncated" in store.warnings[0] and "checksum" in store.warnings[1]
    assert store.load(key_hash({"other": 1}), {"other": 1}) is None and len(store.warnings) == 3  # absent: silent

    # An entry written for another key (another jax version) under this key's name is refused, not loaded.
    other = dict(key, jax="0.0.1")
    store.save(key_hash(other), other, parts, {})
    os.replace(store.path(key_hash(other)), path)
    assert store.load(key_hash(key), key) is None
    assert "another key (jax: 0.0.1 -> null)" in store.warnings[-1]


def test_unsafe_directory_is_refused(tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with caplog.at_level("WARNING"):
        assert ExecutableStore.open(str(shared)) is None
    assert "written by other users" in caplog.text

    store = ExecutableStore.open(str(tmp_path / "mine"))
    _, parts = _serialized_small()
    store.save("a" * 64, {"k": 1}, parts, {})
    os.chmod(store.path("a" * 64), 0o666)  # an entry others could have replaced
    assert store.load("a" * 64, {"k": 1}) is None and "other users" in store.warnings[-1]


def test_size_bound_evicts_least_recently_used(tmp_path):
    _, parts = _serialized_small()
    store = ExecutableStore.open(str(tmp_path / "store"))
    first = store.save("1" * 64, {"k": 1}, parts, {})
    size = os.path.getsize(first)
    store.max_bytes = int(2.5 * size)
    second = store.save("2" * 64, {"k": 2}, parts, {})
    os.utime(first, (1, 1))  # first is the least recently used
    os.utime(second, (2, 2))
    store.save("3" * 64, {"k": 3}, parts, {})
    assert not os.path.exists(first) and os.path.exists(second) and len(store.entries()) == 2


def test_threads_racing_on_one_entry(tmp_path):
    """Writers of the same entry at once: every read sees a whole entry (temporary file + rename)."""
    _, parts = _serialized_small()
    store = ExecutableStore.open(str(tmp_path / "store"))
    key, errors = {"k": "race"}, []

    def writer():
        for _ in range(20):
            store.save(key_hash(key), key, parts, {})
            if store.load(key_hash(key), key) is None:
                errors.append("unreadable")

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not store.warnings
    assert not glob.glob(os.path.join(store.directory, "*.tmp"))


def test_key_changes_with_what_changes_the_program(monkeypatch):
    base = executable_keys.environment_key()
    monkeypatch.setattr(jax, "__version__", "0.0.1")
    assert executable_keys.environment_key()["jax"] != base["jax"]
    monkeypatch.undo()
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=true")
    assert executable_keys.environment_key()["environment"] != base["environment"]
    monkeypatch.undo()
    jax.config.update("jax_numpy_rank_promotion", "warn")
    try:
        assert executable_keys.environment_key()["jax_config"] != base["jax_config"]
    finally:
        jax.config.update("jax_numpy_rank_promotion", "allow")
    assert executable_keys.environment_key() == base


# ---- an engine on the store ----------------------------------------------------------------------------
def test_warm_start_loads_without_tracing_and_damage_recompiles(hf_model_dir, tmp_path, monkeypatch, caplog):
    """On a mesh of 2 of the 4 devices: a sub-mesh executable loaded without its devices would abort."""
    monkeypatch.setenv("JAXSERVE_EXECUTABLE_STORE", "1")
    path, _ = hf_model_dir("llama")
    root = str(tmp_path / "cache")
    cold = LLM(path, compilation_cache_dir=root, **ON_TWO_DEVICES)
    assert len(cold.engine.mesh.devices.flat) == 2 < jax.device_count()
    keys = cold.runner.step_shapes()
    assert len(cold.runner.table.stored) == len(keys) and not cold.runner.table.loaded
    expected = _generate(cold)
    cold.close()

    def no_lowering(self, key):
        raise AssertionError(f"step {key} was traced on a warm start")

    with monkeypatch.context() as m:
        m.setattr(ExecutableTable, "lower", no_lowering)
        before = CompileCounter.compiles()
        warm = LLM(path, compilation_cache_dir=root, **ON_TWO_DEVICES)
        assert sorted(k for k, _ in warm.runner.table.loaded) == sorted(keys) and not warm.runner.table.stored
        assert CompileCounter.compiles() == before  # the steps loaded, the page copy from XLA's cache
        assert _generate(warm) == expected
        warm.close()

    entries = sorted(glob.glob(os.path.join(root, "executables", "*.jxe")))
    with open(entries[0], "r+b") as f:  # truncated
        f.truncate(os.path.getsize(entries[0]) // 2)
    with open(entries[1], "r+b") as f:  # bytes flipped in the payload
        f.seek(-5000, os.SEEK_END)
        chunk = f.read(64)
        f.seek(-5000, os.SEEK_END)
        f.write(bytes(b ^ 0x5A for b in chunk))
    with caplog.at_level("WARNING"):
        damaged = LLM(path, compilation_cache_dir=root, **ON_TWO_DEVICES)
    warnings = [r.getMessage() for r in caplog.records if "executable store entry" in r.getMessage()]
    assert len(warnings) == 2, warnings
    table = damaged.runner.table
    # the two damaged steps: from JAX's persistent cache, where the cold start also put them; not stored
    # (such executables serialize broken on XLA:CPU; `jaxserve compile` compiles afresh and stores)
    assert len(table.loaded) == len(keys) - 2 and not table.stored
    assert _generate(damaged) == expected
    damaged.close()


COMPILE = [sys.executable, "-m", "jaxserve.precompile", "--compilation-cache-dir"]
START = textwrap.dedent("""
    import json, sys
    from jaxserve import LLM, SamplingParams
    from jaxserve.runner.compilation import CompileCounter
    llm = LLM(sys.argv[1], compilation_cache_dir=sys.argv[2], **json.loads(sys.argv[3]))
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=4, temperature=0))
    table = llm.runner.table
    from jaxserve.runner.executable_keys import source_hash
    print(json.dumps(dict(compiles=CompileCounter.compiles(), loaded=len(table.loaded), stored=len(table.stored),
                          keys=len(llm.runner.step_shapes()), tokens=out[0].outputs[0].token_ids,
                          source=source_hash())))
""")


def test_two_compiles_racing_then_a_start_compiles_nothing(hf_model_dir, tmp_path):
    """`jaxserve compile` twice at once on one empty store (both finish, the store is whole), then an
    engine with the same settings loads every step and compiles nothing at all."""
    path, _ = hf_model_dir("llama")
    root = str(tmp_path / "cache")
    env = dict(os.environ, JAXSERVE_EXECUTABLE_STORE="1")
    source = executable_keys.source_hash.__wrapped__()  # now, not when this process first asked
    flags = [path]
    for name, value in SETTINGS.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    racers = [
        subprocess.Popen(COMPILE + [root, *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=600) for p in racers]
    for p, (out, err) in zip(racers, outputs):
        assert p.returncode == 0, err[-3000:]
        assert "compiled and stored" in out
    listing = subprocess.run(COMPILE + [root, "--list", *flags], env=env, capture_output=True, text=True, check=True)
    assert "entries" in listing.stdout and "GiB" in listing.stdout

    run = subprocess.run(
        [sys.executable, "-c", START, path, root, json.dumps(SETTINGS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if result["source"] != source:  # a shared checkout edited meanwhile: every key changed, as it should
        pytest.skip("jaxserve's source changed while the test ran")
    assert result["loaded"] == result["keys"] and result["stored"] == 0
    assert result["compiles"] == 0  # the steps from the store, the page copy from XLA's cache
    assert len(result["tokens"]) == 4


def test_where_the_store_is(monkeypatch):
    from jaxserve.config import EngineConfig
    from jaxserve.runner.compilation import store_directory

    monkeypatch.setenv("JAXSERVE_EXECUTABLE_STORE", "1")
    monkeypatch.setenv("JAXSERVE_COMPILATION_CACHE_DIR", "/env/root")
    assert store_directory(EngineConfig()) == "/env/root/executables"
    assert store_directory(EngineConfig(compilation_cache_dir="/x")) == "/x/executables"
    for off in (dict(compilation_cache_dir="none"), dict(compilation_cache=False), dict(executable_store=False)):
        assert store_directory(EngineConfig(**off)) is None, off
    monkeypatch.setenv("JAXSERVE_EXECUTABLE_STORE", "0")
    assert store_directory(EngineConfig(compilation_cache_dir="/x")) is None


def test_key_changes_with_the_engine_settings(hf_model_dir):
    """Engines of other settings (not warmed up: nothing compiles) key the same bucket differently."""
    path, _ = hf_model_dir("llama")
    base = {**SETTINGS, "compilation_cache_dir": "none", "enforce_eager": True}
    variants = [{}, {"dtype": "bfloat16"}, {"max_num_seqs": 4}, {"quantization": "int8"}, {"num_scheduler_steps": 2}]
    keys = []
    for extra in variants:
        llm = LLM(path, **{**base, **extra})
        keys.append(executable_keys.step_signature(llm.runner, llm.runner.step_shapes()[0]).key_hash)
        llm.close()
    assert len(set(keys)) == len(keys)
    again = LLM(path, **base)
    assert executable_keys.step_signature(again.runner, again.runner.step_shapes()[0]).key_hash == keys[0]
    again.close()


def test_a_key_is_the_same_after_steps_ran(hf_model_dir):
    """The key of a bucket compiled after start-up (in the background, or unplanned) is the one stored
    at start-up: the state's shardings as a step returns them (XLA's spelling: P() for P('data', None,
    'model') on a 1 x 1 mesh) describe the same layout. It differed, and a warm start compiled every
    bucket it opened after /health."""
    path, _ = hf_model_dir("llama")
    llm = LLM(path, **{**SETTINGS, "compilation_cache_dir": "none"}, warm_up=False)  # as stored: before any step
    key = llm.runner.step_shapes()[-1]
    before = executable_keys.step_signature(llm.runner, key).key_hash
    llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=3), use_tqdm=False)
    assert executable_keys.step_signature(llm.runner, key).key_hash == before
    llm.close()


def test_persistent_cache_bypass_nests(tmp_path):
    """Steps compiled for the store skip JAX's cache (its executables serialize broken on XLA:CPU);
    overlapping bypasses (two engines compiling) leave the cache as it was."""
    from jax._src import compilation_cache as cc

    from jaxserve.runner.compilation import persistent_cache_bypassed

    cc.is_cache_used(jax.devices()[0].client)
    before = cc._cache_used
    outer = persistent_cache_bypassed()
    outer.__enter__()
    with persistent_cache_bypassed():
        assert cc._cache_used is False
    assert cc._cache_used is False
    outer.__exit__(None, None, None)
    assert cc._cache_used == before
