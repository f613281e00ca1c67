"""The OpenAI server over the real engine with adapters (the small checkpoint, one device slot): requests
of the base model and of three adapters at once, an adapter loaded and another unloaded while they
run. Nothing is lost, every answer is what it was when asked alone, nothing compiles."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import bench_lora as bl

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.lora.request import LORA_MODULES

MODEL = "checkpoints/small"


def write_adapter(path, cfg, r, targets, seed, std=0.3):
    """A PEFT adapter directory written directly with numpy (the benchmark's writer), random A and B."""
    return bl.write_peft_adapter(str(path), cfg, rank=r, modules=targets, seed=seed, std=std, lora_alpha=2 * r)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from starlette.testclient import TestClient

    from jaxserve.engine.async_engine import AsyncLLMEngine
    from jaxserve.llm_engine import LLMEngine
    from jaxserve.server.api import ServerOptions, create_app

    root = tmp_path_factory.mktemp("adapters")
    cfg = ModelConfig.from_dir(MODEL)
    paths = {
        "a": write_adapter(root / "a", cfg, 8, ("q", "v"), 1),
        "b": write_adapter(root / "b", cfg, 4, ("o", "down", "up"), 2),
        "c": write_adapter(root / "c", cfg, 8, LORA_MODULES, 3),
    }
    settings = EngineConfig(
        model=MODEL,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        page_size=8,
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
        lora_modules=(f"a={paths['a']}",),
    )
    engine = AsyncLLMEngine(LLMEngine(settings))
    engine.start()
    try:
        with TestClient(
            create_app(ServerOptions(served_model_names=("base",), allow_runtime_lora_updating=True), engine),
            raise_server_exceptions=False,
        ) as client:
            yield client, engine, paths
    finally:
        engine.shutdown()


def complete(client, model, prompt, max_tokens=10):
    response = client.post(
        "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    )
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    return response.json()["choices"][0]["text"]


PROMPTS = ["Once upon a time", "def square(x):", "The weather today"]


def test_load_and_unload_under_load_lose_nothing(server):
    client, engine, paths = server
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": paths["b"]}).status_code == 200
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert models["a"]["parent"] == "base" and models["b"]["root"] == paths["b"]
    alone = {(m, p): complete(client, m, p) for m in ("base", "a", "b") for p in PROMPTS}
    for m in ("a", "b"):  # the adapters change the answers
        assert any(alone[(m, p)] != alone[("base", p)] for p in PROMPTS), m
    long_a = complete(client, "a", PROMPTS[0], max_tokens=40)

    jobs = [(m, p) for _ in range(2) for m in ("base", "a", "b") for p in PROMPTS]
    with ThreadPoolExecutor(8) as pool:
        running_a = pool.submit(complete, client, "a", PROMPTS[0], 40)
        while engine.stats()["lora"]["running"].get("a", 0) == 0 and not running_a.done():
            time.sleep(0.01)
        results = [pool.submit(complete, client, m, p) for m, p in jobs if m != "a"]
        # while "a" runs (one slot: b's requests wait for it) c is loaded, a unloaded
        assert client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": paths["c"]}).status_code == 200
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
        assert client.post("/v1/completions", json={"model": "a", "prompt": "x"}).status_code == 404
        results += [pool.submit(complete, client, "c", p) for p in PROMPTS]
        assert running_a.result() == long_a  # unloaded while in use: it finished with its adapter
        texts = [r.result() for r in results]
    assert texts[:-3] == [alone[j] for j in jobs if j[0] != "a"]
    assert texts[-3:] != [alone[("base", p)] for p in PROMPTS]  # c is another adapter
    stats = engine.stats()
    assert stats["compiles_after_warmup"] == 0
    assert stats["lora"]["evictions_total"] > 0  # one slot for three adapters: swapped
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert "vllm:lora_requests_info" in client.get("/metrics").text


def test_offline_chat_takes_an_adapter(tmp_path):
    """LLM.chat(..., lora_request=) as vLLM's: the reply is generate's under that adapter."""
    from jaxserve import LLM, LoRARequest, SamplingParams

    cfg = ModelConfig.from_dir(MODEL)
    adapter = LoRARequest("chatty", 1, write_adapter(tmp_path / "chatty", cfg, 8, LORA_MODULES, 4))
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(
        MODEL,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        page_size=8,
        enable_lora=True,
        max_lora_rank=8,
    ) as llm:
        chat = llm.chat([{"role": "user", "content": "hello"}], greedy, lora_request=adapter, use_tqdm=False)[0]
        ids = list(chat.prompt_token_ids)
        plain = llm.generate(prompt_token_ids=[ids], sampling_params=greedy, lora_request=adapter, use_tqdm=False)[0]
        base = llm.generate(prompt_token_ids=[ids], sampling_params=greedy, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids != base.outputs[0].token_ids


def test_async_generate_takes_an_adapter(server):
    """AsyncLLMEngine.generate(..., lora_request=) as vLLM's: a new LoRARequest registers itself, and
    the text is what the server answers for that adapter."""
    import asyncio

    from jaxserve import LoRARequest, SamplingParams

    client, engine, paths = server
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ids = engine.tokenizer.encode(PROMPTS[1])

    async def run(lora):
        return "".join(
            [
                d.outputs[0].text
                async for d in engine.generate(prompt_token_ids=ids, sampling_params=params, lora_request=lora)
            ]
        )

    text = asyncio.run(run(LoRARequest("d", 99, paths["c"])))
    assert "d" in [r.lora_name for r in engine.list_loras()]
    assert text == complete(client, "d", ids) != asyncio.run(run(None))
