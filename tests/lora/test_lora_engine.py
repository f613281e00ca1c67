"""LoRA adapters through the engine on a tiny random Llama, against PEFT on transformers.

Three adapters of different ranks and targets (one rsLoRA), max_loras 2: greedy tokens per adapter
equal PEFT's; one batch mixing the three and the base equals each alone (more adapters than slots:
the scheduler holds the third back and the slots swap); the same prompt under two adapters keeps
separate KV pages; loading, unloading and swapping compile nothing; bad adapters are refused by name.
"""

import pytest

from hf_models import assert_same_greedy, hf_greedy
from peft_adapters import ALL_MODULES, make_peft_adapter

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.errors import LoRAError, LoRANotFoundError

ADAPTERS = {  # name: (r, alpha, targets, rslora)
    "qv4": (4, 8, ("q_proj", "v_proj"), False),
    "all8rs": (8, 16, ALL_MODULES, True),
    "mlp16": (16, 32, ("o_proj", "gate_proj", "down_proj"), False),
}
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11, 64, 1, 300, 8, 77, 21], [400, 12, 9, 88, 31, 2, 150, 6]]
STEPS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(hf_model_dir, tmp_path_factory):
    """name -> (adapter dir, PEFT referee model)."""
    model_dir, hf_model = hf_model_dir("llama")
    made = {}
    for seed, (name, (r, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        path = str(tmp_path_factory.mktemp(f"lora-{name}"))
        made[name] = (
            path,
            make_peft_adapter(
                hf_model, path, r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, seed=seed + 1
            ),
        )
    return model_dir, hf_model, made


@pytest.fixture(scope="module")
def llm(adapters):
    model_dir, _, made = adapters
    with LLM(
        model_dir,
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        max_num_seqs=8,
        page_size=4,
        max_model_len=64,
        max_num_batched_tokens=32,
        num_pages=96,
        warm_up=True,
    ) as llm:
        yield llm


def requests(adapters):
    return {name: LoRARequest(name, i + 1, path) for i, (name, (path, _)) in enumerate(adapters[2].items())}


def token_ids(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_each_adapter_matches_peft(adapters, llm):
    _, base_model, made = adapters
    loras = requests(adapters)
    for name, (_, peft_model) in made.items():
        ours = token_ids(
            llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, lora_request=loras[name], use_tqdm=False)
        )
        for prompt, got in zip(PROMPTS, ours):
            want, gaps = hf_greedy(peft_model, prompt, STEPS)
            assert_same_greedy(got, want, gaps, f"adapter {name}")
    base = token_ids(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False))
    for prompt, got in zip(PROMPTS, base):
        want, gaps = hf_greedy(base_model, prompt, STEPS)
        assert_same_greedy(got, want, gaps, "base")


def test_one_batch_of_three_adapters_and_the_base_equals_each_alone(adapters, llm):
    loras = requests(adapters)
    alone = {
        name: token_ids(
            llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY, lora_request=lora, use_tqdm=False)
        )[0]
        for name, lora in loras.items()
    }
    alone[None] = token_ids(llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY, use_tqdm=False))[0]
    assert len({tuple(v) for v in alone.values()}) == 4  # the adapters do move the tokens
    order = [None, "qv4", "all8rs", "mlp16", "qv4", None]
    loads_before = llm.engine.lora.loads_total
    mixed = token_ids(
        llm.generate(
            prompt_token_ids=PROMPTS[:1] * len(order),
            sampling_params=GREEDY,
            lora_request=[None if n is None else loras[n] for n in order],
            use_tqdm=False,
        )
    )
    assert mixed == [alone[n] for n in order]
    assert llm.engine.lora.loads_total > loads_before  # three adapters over two slots: some swapped in
    assert llm.engine.stats()["compiles_after_warmup"] == 0


def test_two_adapters_never_share_kv_pages(adapters, llm):
    loras = requests(adapters)
    prompt = list(range(30, 60))  # several full pages
    blocks = llm.engine.blocks

    def run(name):
        return token_ids(
            llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, lora_request=loras[name], use_tqdm=False)
        )[0]

    blocks.reset_prefix_cache()
    alone = run("all8rs")
    blocks.reset_prefix_cache()
    run("qv4")
    roots = {name: llm.engine.lora.registered[name].prefix_root for name in ("qv4", "all8rs")}
    assert blocks.lookup_prefix(0, prompt, roots["qv4"]) > 0  # its pages are cached under its own key
    assert blocks.lookup_prefix(0, prompt) == 0  # neither the base model's chain
    assert blocks.lookup_prefix(0, prompt, roots["all8rs"]) == 0  # nor another adapter's finds them
    assert run("all8rs") == alone  # computed afresh, not from qv4's K/V


def test_load_unload_at_run_time_compiles_nothing(adapters, llm, tmp_path):
    loras = requests(adapters)
    engine = llm.engine
    path = adapters[2]["qv4"][0]
    engine.add_lora(LoRARequest("runtime", 77, path))
    with pytest.raises(LoRAError, match="already loaded"):
        engine.add_lora(LoRARequest("runtime", 78, path))
    runtime = token_ids(
        llm.generate(
            prompt_token_ids=PROMPTS[:1],
            sampling_params=GREEDY,
            lora_request=LoRARequest("runtime", 77, path),
            use_tqdm=False,
        )
    )
    qv4 = token_ids(
        llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY, lora_request=loras["qv4"], use_tqdm=False)
    )
    assert runtime == qv4
    assert "runtime" in [r.lora_name for r in engine.list_loras()]
    engine.remove_lora("runtime")
    with pytest.raises(LoRANotFoundError):
        engine.remove_lora("runtime")
    with pytest.raises(LoRANotFoundError):
        llm.generate(
            prompt_token_ids=PROMPTS[:1],
            sampling_params=GREEDY,
            lora_request=LoRARequest("runtime", 77),
            use_tqdm=False,
        )
    assert engine.stats()["compiles_after_warmup"] == 0


def test_bad_adapters_are_refused_by_name(adapters, llm, tmp_path):
    engine = llm.engine
    with pytest.raises(LoRAError, match="max-lora-rank"):
        big = str(tmp_path / "big")
        make_peft_adapter(adapters[1], big, r=32, lora_alpha=32, target_modules=["q_proj"])
        engine.add_lora(LoRARequest("big", 90, big))
    with pytest.raises(LoRAError, match="adapter_config.json|does not exist|no such"):
        engine.add_lora(LoRARequest("missing", 91, str(tmp_path / "nowhere")))
    assert "big" not in [r.lora_name for r in engine.list_loras()]


def test_lora_needs_enable_lora(adapters):
    with pytest.raises(Exception, match="enable_lora|enable-lora"):
        LLM(adapters[0], dtype="float32", lora_modules=["a=/x"], warm_up=False)


@pytest.mark.parametrize(
    "variant",
    [
        dict(speculative_method="ngram", num_speculative_tokens=3),
        dict(num_scheduler_steps=4),
        dict(async_scheduling=False),
        dict(mesh_shape=(1, 2)),
    ],
    ids=["ngram-speculation", "multi-step", "serial", "tensor-parallel"],
)
def test_speculation_and_step_variants_keep_each_adapters_tokens(adapters, llm, variant):
    """The same mixed batch through n-gram speculation (the target verifies under each row's adapter),
    multi-step decoding, serial scheduling and a (1, 2) mesh: the tokens of the plain engine."""
    model_dir, _, _ = adapters
    loras = requests(adapters)
    order = [None, "qv4", "all8rs", "mlp16"]
    prompts = [PROMPTS[0] + PROMPTS[0][:6]] * len(order)  # a repeat for the n-gram proposer to find
    chosen = [None if n is None else loras[n] for n in order]
    want = token_ids(
        llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, lora_request=chosen, use_tqdm=False)
    )
    with LLM(
        model_dir,
        dtype="float32",
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
        max_num_seqs=8,
        page_size=4,
        max_model_len=64,
        max_num_batched_tokens=32,
        num_pages=96,
        **variant,
    ) as other:
        got = token_ids(
            other.generate(prompt_token_ids=prompts, sampling_params=GREEDY, lora_request=chosen, use_tqdm=False)
        )
        assert other.engine.stats()["compiles_after_warmup"] == 0
    assert got == want


def test_target_modules_narrow_the_slots(adapters, llm):
    """lora_target_modules q_proj v_proj: slots for those two only (fewer bytes each step), the q/v
    adapter's tokens unchanged, an adapter of other modules refused at load naming them."""
    from jaxserve.config import EngineConfig

    model_dir = adapters[0]
    loras = requests(adapters)
    want = token_ids(
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, lora_request=loras["qv4"], use_tqdm=False)
    )
    with LLM(
        model_dir,
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        max_num_seqs=8,
        page_size=4,
        max_model_len=64,
        max_num_batched_tokens=32,
        num_pages=96,
        lora_target_modules="q_proj,v_proj",
    ) as narrow:
        lora = narrow.engine.runner.params.layers[0].lora
        assert (lora.q, lora.v) != (None, None) and (lora.k, lora.o, lora.gate, lora.up, lora.down) == (None,) * 5
        assert narrow.engine.runner.lora.nbytes < llm.engine.runner.lora.nbytes / 3
        assert (
            token_ids(
                narrow.generate(
                    prompt_token_ids=PROMPTS, sampling_params=GREEDY, lora_request=loras["qv4"], use_tqdm=False
                )
            )
            == want
        )
        with pytest.raises(
            LoRAError, match="k_proj, o_proj, gate_proj, up_proj, down_proj; this engine adapts q_proj, v_proj only"
        ):
            narrow.engine.add_lora(loras["all8rs"])
    args = EngineConfig.from_cli(["--enable-lora", "--lora-target-modules", "q_proj", "v_proj"])
    assert args.lora_target_modules == ("q", "v")
