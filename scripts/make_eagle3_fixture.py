"""Build the tiny EAGLE-3 head and the logits that referee jaxserve's EAGLE-3 forward (issue 54).

The referee is the `speculators` library's own PyTorch Eagle3 model (vLLM's format for trained
speculators): this script builds a head with its classes, saves it with its `save_pretrained`, and runs
its `forward` to record the logits. jaxserve's test loads the saved head with jaxserve's loader and
must reproduce those logits within 1e-4 (float32), so the format and the math are checked against the
library that defines them rather than against our own reading of it. The exact semantics are written
up in /tmp/coord/eagle3_semantics.md (copied into docs by the lead if wanted).

It runs in a separate virtualenv, never in jaxserve's (speculators pins transformers and pulls
torchvision/torchaudio); it does not import jaxserve. The virtualenv was made with (2026-12-07):

    python3 -m venv /work/spec-venv
    /work/spec-venv/bin/pip install torch==2.13.0          # the CPU build on this machine's disk
    /work/spec-venv/bin/pip install --no-deps speculators==0.9.0
    /work/spec-venv/bin/pip install 'transformers>=5.0.0,<=5.19.0' safetensors 'pydantic>=2' \
        pydantic-settings loguru 'numpy>=2,<=2.5.4' 'tqdm>=4.66.3,<=4.70.1' rich click typer psutil \
        huggingface-hub 'openai>=2.0.0' httpx 'datasets>=4.0.0,<=5.1.0'
    /work/spec-venv/bin/pip install --no-deps hs-connectors==0.9.0

(torchvision and torchaudio are declared by speculators but not imported by its Eagle3 model, so they
are left out.) Then, from the repository root:

    /work/spec-venv/bin/python scripts/make_eagle3_fixture.py

Outputs (all float32 unless said):
  tests/fixtures/eagle3_tiny/         config.json + model.safetensors, no embed_tokens (shared from the
                                      target), and reference.npz (see REFERENCE_KEYS below)
  tests/fixtures/eagle3_tiny_embed/   the same head saved with its own embed_tokens (config + safetensors)
  tests/fixtures/eagle3_tiny_bf16/    the same head cast to bfloat16 (config + safetensors, no embed_tokens)

The tiny target it stands for is a 4-layer Llama: hidden 64, 4 heads, 2 KV heads, head_dim 16,
intermediate 128, vocab 512, rms_norm_eps 1e-6, rope_theta 10000; aux layers [0, 1, 3]; draft vocab
128 (128 target ids drawn at random, sorted; d2t is not the identity).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import LlamaConfig, LlamaForCausalLM

HIDDEN = 64
TARGET_VOCAB = 512
DRAFT_VOCAB = 128
AUX_LAYERS = [0, 1, 3]
SEQ_LEN = 8
TTT_STEPS = 3
WEIGHT_STD = 0.15
SEED = 1234

REFERENCE_KEYS = """
input_ids      int64 [T]        draft input tokens (target vocab ids): row i holds the token at sequence
                                 position i+1, paired with the target hidden of position i (vLLM's shift)
positions      int64 [T]        RoPE positions of the rows (vLLM convention: the hidden's position, 0..T-1)
aux_hidden     f32 [T, 3*64]    the 3 aux hidden states of each row, concatenated in layer order [0, 1, 3]
embed_tokens   f32 [512, 64]    the target's embedding matrix (the head file has none: pass it as shared)
d2t            int64 [128]      draft id -> offset; target id = draft id + d2t[draft id]
draft_ids      int64 [128]      the target ids of the draft vocabulary (= arange(128) + d2t), sorted
logits         f32 [T, 128]     one draft forward over the T rows, causal attention: draft-vocab logits
hidden_out     f32 [T, 64]      that forward's pre-norm output (the hidden fed to the next draft step)
ttt_input_ids  int64 [S, T]     speculators' training-time-test unroll (S=3 steps): tokens fed at step s;
                                 step 0 = input_ids, step s>0 = input_ids shifted left by s, 0-padded
ttt_positions  int64 [S, T]     positions at step s (= positions + s)
ttt_logits     f32 [S, T, 128]  logits at step s; ttt_logits[0] == logits
ttt_hidden_out f32 [S, T, 64]   pre-norm output at step s; step s+1 is fed hidden ttt_hidden_out[s]
                                 (at step s>0 row i attends to rows <= i of step 0 and to its own row
                                 of steps 1..s only)
chain_row      int64 []         a row r whose unroll is a greedy draft chain: for s = 0, 1:
                                 input_ids[r+s+1] == draft_ids[argmax(ttt_logits[s, r])]
chain_tokens   int64 [S]        the tokens fed to row r at steps 0..S-1 (= ttt_input_ids[:, r])
nbr_ttt_logits f32 [S, T, 128]  ttt_logits of the same weights with norm_before_residual=true (the
                                 trainer CLI's default; the saved config says false): flip the flag to test
"""


def tiny_layer_config() -> LlamaConfig:
    """The decoder layer's config: the tiny target's shapes, one layer (the head)."""
    return LlamaConfig(
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=TARGET_VOCAB,
        num_hidden_layers=1,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )


def head_config(attn: str, norm_before_residual: bool = False) -> Eagle3SpeculatorConfig:
    layer_config = tiny_layer_config()
    # speculators' trainer offers simple_flex_attention (its default), sdpa and eager; flex needs the
    # sequence padded to its 128-row blocks for the unroll, so the reference uses eager and main()
    # checks flex on the padded sequence against it.
    layer_config._attn_implementation = attn
    return Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=norm_before_residual,
        target_hidden_size=None,
        eagle_aux_hidden_state_layer_ids=AUX_LAYERS,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=TTT_STEPS)],
            default_proposal_method="greedy",
            # No verifier path in the committed config (a path here would be this machine's);
            # verify() points a reloaded copy at a temporary tiny target instead.
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )


def build_head(gen: torch.Generator) -> tuple[Eagle3DraftModel, torch.Tensor]:
    """A head with random weights of a wide spread (so logits are well apart) and a non-identity d2t."""
    model = Eagle3DraftModel(head_config("eager"))
    draft_ids = torch.sort(torch.randperm(TARGET_VOCAB, generator=gen)[:DRAFT_VOCAB]).values
    d2t = draft_ids - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(TARGET_VOCAB, dtype=torch.bool)
    t2d[draft_ids] = True
    model.load_vocab_mappings(t2d, d2t)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                # Norm weights away from 1 so that a missing or misplaced norm shows.
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=gen))
            elif name == "embed_tokens.weight":
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                param.copy_(WEIGHT_STD * torch.randn(param.shape, generator=gen))
    model.eval()
    return model, draft_ids


class Recorder:
    """Captures lm_head's output and the decoder stack's output at each unrolled step."""

    def __init__(self, model: Eagle3DraftModel):
        self.logits: list[torch.Tensor] = []
        self.hidden: list[torch.Tensor] = []
        model.lm_head.register_forward_hook(lambda _m, _i, out: self.logits.append(out.detach().clone()))
        model.layers[-1].register_forward_hook(lambda _m, _i, out: self.hidden.append(out.detach().clone()))

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        logits, hidden = torch.cat(self.logits), torch.cat(self.hidden)
        self.logits.clear()
        self.hidden.clear()
        return logits, hidden  # [steps, T, V], [steps, T, H]


def run(model, rec, aux, ids, positions, steps, doc_ids=None):
    with torch.no_grad():
        model(
            hidden_states=aux[None],
            input_ids=ids[None],
            document_ids=(torch.zeros(1, ids.shape[0], dtype=torch.long) if doc_ids is None else doc_ids[None]),
            position_ids=positions[None],
            ttt_steps=steps,
        )
    return rec.take()


def check_flex(model, aux, ids, positions, ttt_logits) -> None:
    """The trainer's default attention (flex, rows padded to 128 with document id -1) gives the same logits."""
    flex = Eagle3DraftModel(head_config("simple_flex_attention")).eval()
    flex.load_state_dict(model.state_dict())
    pad = 128 - ids.shape[0]
    doc_ids = torch.cat([torch.zeros_like(ids), torch.full((pad,), -1)])
    logits, _ = run(
        flex,
        Recorder(flex),
        torch.cat([aux, aux.new_zeros(pad, aux.shape[1])]),
        torch.cat([ids, ids.new_zeros(pad)]),
        torch.cat([positions, positions[-1] + 1 + torch.arange(pad)]),
        TTT_STEPS,
        doc_ids,
    )
    err = float((logits[:, : ids.shape[0]] - ttt_logits).abs().max())
    print(f"flex attention (padded to 128) vs eager: max |logits diff| = {err:.2e}")
    assert err < 1e-5, err


def greedy_chain_inputs(model, rec, aux, ids, positions, draft_ids, row):
    """Make row `row`'s teacher-forced unroll a greedy chain.

    speculators' TTT feeds step s the ground-truth token input_ids[row+s]; row `row`'s step-s logits do
    not depend on rows after it, so setting input_ids[row+s+1] to the draft's own argmax at step s
    (mapped to the target vocab) and rerunning turns that row's unroll into the chain the engine drafts.
    """
    ids = ids.clone()
    for s in range(TTT_STEPS - 1):
        logits, _ = run(model, rec, aux, ids, positions, TTT_STEPS)
        ids[row + s + 1] = draft_ids[int(torch.argmax(logits[s, row]))]
    return ids


def check_margin(logits: torch.Tensor, what: str) -> None:
    top2 = torch.topk(logits, 2, dim=-1).values
    margin = float((top2[..., 0] - top2[..., 1]).min())
    spread = float(logits.std())
    print(f"{what}: logit std {spread:.3f}, smallest top-1/top-2 gap {margin:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures"))
    args = parser.parse_args()
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)

    model, draft_ids = build_head(gen)
    embed = model.embed_tokens.weight.detach().clone()
    rec = Recorder(model)

    # Target hidden states of different scales per layer, as in a real residual stream.
    scales = torch.tensor([1.0, 2.0, 4.0]).repeat_interleave(HIDDEN)
    aux = torch.randn(SEQ_LEN, 3 * HIDDEN, generator=gen) * scales
    ids = torch.randint(0, TARGET_VOCAB, (SEQ_LEN,), generator=gen)
    positions = torch.arange(SEQ_LEN)
    chain_row = SEQ_LEN - TTT_STEPS
    ids = greedy_chain_inputs(model, rec, aux, ids, positions, draft_ids, chain_row)

    logits1, hidden1 = run(model, rec, aux, ids, positions, 1)
    ttt_logits, ttt_hidden = run(model, rec, aux, ids, positions, TTT_STEPS)
    assert torch.allclose(ttt_logits[0], logits1[0], atol=1e-6), "step 0 of the unroll is the single forward"
    for s in range(TTT_STEPS - 1):
        assert int(ids[chain_row + s + 1]) == int(draft_ids[int(torch.argmax(ttt_logits[s, chain_row]))])
    check_margin(ttt_logits, "draft logits")
    check_flex(model, aux, ids, positions, ttt_logits)

    nbr = Eagle3DraftModel(head_config("eager", norm_before_residual=True)).eval()
    nbr.load_state_dict(model.state_dict())
    nbr_logits, _ = run(nbr, Recorder(nbr), aux, ids, positions, TTT_STEPS)
    assert float((nbr_logits - ttt_logits).abs().max()) > 0.1, "the flag must change the logits"
    check_margin(nbr_logits, "draft logits, norm_before_residual")

    ttt_ids = torch.stack([torch.cat([ids[s:], ids.new_zeros(s)]) if s else ids for s in range(TTT_STEPS)])
    ttt_positions = torch.stack([positions + s for s in range(TTT_STEPS)])

    out = args.out
    plain, with_embed, bf16 = out / "eagle3_tiny", out / "eagle3_tiny_embed", out / "eagle3_tiny_bf16"
    for path in (plain, with_embed, bf16):
        path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(with_embed)
    # The shipped layout: no embed_tokens (vLLM and speculators then take the target's).
    model._keys_to_ignore_on_save = [*model._keys_to_ignore_on_save, "embed_tokens.weight"]
    model.save_pretrained(plain)
    model.to(torch.bfloat16).save_pretrained(bf16)
    model.to(torch.float32)
    for path in (plain, with_embed, bf16):
        # save_pretrained copies speculators' config module beside config.json (for auto_map); it is
        # third-party source, not needed to load the head, so it is not kept.
        (path / "config.py").unlink(missing_ok=True)

    np.savez(
        plain / "reference.npz",
        input_ids=ids.numpy(),
        positions=positions.numpy(),
        aux_hidden=aux.numpy(),
        embed_tokens=embed.numpy(),
        d2t=model.d2t.numpy(),
        draft_ids=draft_ids.numpy(),
        logits=logits1[0].numpy(),
        hidden_out=hidden1[0].numpy(),
        ttt_input_ids=ttt_ids.numpy(),
        ttt_positions=ttt_positions.numpy(),
        ttt_logits=ttt_logits.numpy(),
        ttt_hidden_out=ttt_hidden.numpy(),
        chain_row=np.int64(chain_row),
        chain_tokens=ttt_ids[:, chain_row].numpy(),
        nbr_ttt_logits=nbr_logits.numpy(),
    )
    (plain / "REFERENCE.txt").write_text(
        "reference.npz, written by scripts/make_eagle3_fixture.py with speculators 0.9.0:\n" + REFERENCE_KEYS
    )
    verify(out, aux, ids, positions, embed, ttt_logits)


def save_tiny_verifier(path: Path, embed: torch.Tensor) -> None:
    """A 4-layer tiny Llama target whose embedding is the reference's: speculators' from_pretrained needs a
    verifier to load a head at all, and takes embed_tokens from it when the head's file has none."""
    cfg = tiny_layer_config()
    cfg.num_hidden_layers = 4
    cfg.architectures = ["LlamaForCausalLM"]
    target = LlamaForCausalLM(cfg)
    with torch.no_grad():
        target.model.embed_tokens.weight.copy_(embed)
    target.save_pretrained(path)


def load_head(path: Path, verifier: Path, dtype: torch.dtype) -> Eagle3DraftModel:
    config = Eagle3SpeculatorConfig.from_pretrained(path)
    config.speculators_config.verifier.name_or_path = str(verifier)
    config.transformer_layer_config._attn_implementation = "eager"
    return Eagle3DraftModel.from_pretrained(path, config=config, dtype=dtype).eval()


def verify(out, aux, ids, positions, embed, ttt_logits) -> None:
    """Reload each saved head with speculators' own from_pretrained and rerun it."""
    tmp = tempfile.TemporaryDirectory()
    verifier = Path(tmp.name)
    save_tiny_verifier(verifier, embed)
    for name, dtype, tol in (("eagle3_tiny", torch.float32, 1e-6), ("eagle3_tiny_embed", torch.float32, 1e-6)):
        path = out / name
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            keys = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f}
        print(name, json.dumps(keys))
        model = load_head(path, verifier, dtype)
        if "embed_tokens.weight" not in keys:
            # speculators 0.9.0 fills a missing embed_tokens from the verifier only where it is NaN, but
            # transformers 5 leaves a weight missing from the file uninitialised (not NaN), so the shared
            # embedding must be pulled in explicitly (the path speculators' DFlash takes).
            model._load_verifier_weights(overwrite_embed_tokens=True)
        assert torch.equal(model.embed_tokens.weight.float(), embed), "embed_tokens from the file or the target"
        rec = Recorder(model)
        logits, _ = run(model, rec, aux, ids, positions, TTT_STEPS)
        err = float((logits - ttt_logits).abs().max())
        print(f"{name}: reloaded, max |logits - reference| = {err:.2e}")
        assert err <= tol, err
    model = load_head(out / "eagle3_tiny_bf16", verifier, torch.bfloat16)
    assert model.fc.weight.dtype == torch.bfloat16
    model._load_verifier_weights(overwrite_embed_tokens=True)
    rec = Recorder(model)
    logits, _ = run(model, rec, aux.to(torch.bfloat16), ids, positions, 1)
    err = float((logits[0].float() - ttt_logits[0]).abs().max())
    print(f"eagle3_tiny_bf16: reloaded in bf16, max |logits - f32 reference| = {err:.2e} (bf16 rounding)")


if __name__ == "__main__":
    main()
