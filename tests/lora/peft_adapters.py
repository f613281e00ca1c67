"""PEFT LoRA adapters for the tests, built and saved by PEFT itself, and PEFT as the referee that runs them.

PEFT initialises lora_B to zeros (an adapter that changes nothing); `make_peft_adapter` draws every
lora_A and lora_B weight from N(0, std) instead. STD 0.08 on the tiny models of tests/hf_models.py
(hidden 64, weights of std 0.25) changes the greedy next token at 30-45% of the positions of random
prompts for a q/v or o-only adapter of rank 4-16, and at 70-99% for one on all seven modules, while
the logits keep the base model's spread (std ~2, max ~9): visibly another model, not an exploded one.
"""

from __future__ import annotations

import copy

from hf_models import hf_greedy

STD = 0.08
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(
    hf_model,
    out_dir: str,
    *,
    r: int,
    lora_alpha: float,
    target_modules,
    use_rslora: bool = False,
    seed: int = 0,
    std: float = STD,
    **lora_options,
):
    """Wrap a copy of `hf_model` (a transformers model, or the directory of one) in a PEFT LoRA of
    rank r, randomise its lora_A / lora_B weights, save_pretrained it to `out_dir` (safetensors) and
    return the PeftModel (eval mode, float32). `lora_options`: any other LoraConfig field
    (rank_pattern, alpha_pattern, layers_to_transform, use_dora, ...). The caller's model is left as
    it was: PEFT injects its layers into the model it is given, so it gets a deep copy."""
    import peft
    import torch
    import transformers

    if isinstance(hf_model, str):
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.float32)
    else:
        base = copy.deepcopy(hf_model)
    config = peft.LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules) if not isinstance(target_modules, str) else target_modules,
        use_rslora=use_rslora,
        lora_dropout=0.0,
        **lora_options,
    )
    if any(p.dtype != torch.float32 for p in base.parameters()):
        base = base.float()  # (a GGUF-loaded model is float32 already, and refuses .float())
    model = peft.get_peft_model(base, config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if (".lora_A." in name or ".lora_B." in name) and name.endswith(".weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def peft_layer(model, layer: int, module: str):
    """The PEFT LoRA layer wrapping `module` (jaxserve's key: q k v o gate up down) of decoder `layer`."""
    block, name = {
        "q": ("self_attn", "q_proj"),
        "k": ("self_attn", "k_proj"),
        "v": ("self_attn", "v_proj"),
        "o": ("self_attn", "o_proj"),
        "gate": ("mlp", "gate_proj"),
        "up": ("mlp", "up_proj"),
        "down": ("mlp", "down_proj"),
    }[module]
    return getattr(getattr(model.base_model.model.model.layers[layer], block), name)


def peft_greedy(model, prompt, steps: int) -> list[int]:
    """The PeftModel's greedy continuation of `prompt` (token ids): `steps` new token ids, by full
    float32 forwards. hf_greedy(model, ...) gives each step's top-2 gap too, for assert_same_greedy."""
    return hf_greedy(model, prompt, steps)[0]
