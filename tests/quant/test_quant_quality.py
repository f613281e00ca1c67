"""Quality of int8 on the trained default model: held-out perplexity with int8 weights, an int8 KV
cache and both stays within 0.1% of float32; int4 weights within the issue's 5%. The target is 1%; the full-size run of
scripts/quant_quality.py in docs/BENCHMARKS.md measured changes under 0.01%, so 0.1% still leaves
room for the sample here (16 windows of 256 tokens) while catching a real loss of precision.
A float8 KV cache (vLLM's fp8 = e4m3, and e5m2): perplexity within 0.5%, and the greedy (argmax) token
equal to float32's wherever float32's top-2 margin leaves no near-tie."""

import math
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.loading.model_loader import load_model
from jaxserve.model.sharding import make_mesh

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from quant_quality import VARIANTS, heldout_windows, score  # noqa: E402

DEFAULT = str(ROOT / "checkpoints" / "small")
MAX_INCREASE = 0.001  # relative perplexity increase over float32
# float8 KV (measured on 8 of these windows: e4m3 -0.09%, e5m2 +0.21% perplexity; argmax flips at float32
# margins up to 0.19 and 0.25, 45% of the positions have 0.5 or more; top-1 agreement 98.6% and 95.6%)
FP8_MAX_INCREASE = 0.005
NEAR_TIE = 0.5  # logits: float32's top-2 margin below it is a near-tie
FP8_AGREEMENT = {"fp8 KV": 0.97, "fp8_e5m2 KV": 0.93}


@pytest.fixture(scope="module")
def scores():
    """Each variant's (mean NLL, argmax, top-2 margin) over the same windows (`quant_quality.score`)."""
    windows = heldout_windows(DEFAULT, 16, 256)  # 4,096 held-out tokens
    loaded = {
        q: load_model(EngineConfig(model=DEFAULT, dtype="float32", quantization=q), make_mesh((1, 1)), stacked=True)
        for q in ("none", "int8", "int4")
    }
    return {
        name: score(loaded[q].params, loaded[q].cfg, windows, jnp.float32, kv)
        for name, (q, kv) in VARIANTS.items()
        if name != "w8a8"
    }  # w8a8: int8 weights' numbers here


@pytest.fixture(scope="module")
def perplexities(scores):
    return {name: math.exp(nll) for name, (nll, _, _) in scores.items()}


@pytest.mark.parametrize("variant", ["int8 weights", "int8 KV", "both"])
def test_int8_perplexity_within_a_tenth_of_a_percent_of_float(perplexities, variant):
    base = perplexities["float"]
    assert perplexities[variant] != base, "the variant computed exactly float32's numbers: not quantized?"
    assert perplexities[variant] / base - 1 < MAX_INCREASE, perplexities


def test_int4_perplexity_within_the_target(perplexities):
    """int4 weights (groups of 32): the issue's target is +5% perplexity over float32."""
    base = perplexities["float"]
    assert perplexities["int4 weights"] != base
    assert perplexities["int4 weights"] / base - 1 < 0.05, perplexities


@pytest.mark.parametrize("variant", ["fp8 KV", "fp8_e5m2 KV"])
def test_fp8_kv_perplexity_and_greedy_where_no_near_tie(scores, perplexities, variant):
    base = perplexities["float"]
    assert perplexities[variant] != base and abs(perplexities[variant] / base - 1) < FP8_MAX_INCREASE, perplexities
    _, argmax, _ = scores[variant]
    _, want, margin = scores["float"]
    clear = margin >= NEAR_TIE
    print(
        f"{variant}: perplexity {perplexities[variant] / base - 1:+.3%}, top-1 agreement "
        f"{np.mean(argmax == want):.2%}; {clear.mean():.0%} of positions have no near-tie"
    )
    assert np.mean(argmax == want) >= FP8_AGREEMENT[variant]
    assert clear.mean() > 0.3  # the check below covers most positions
    np.testing.assert_array_equal(argmax[clear], want[clear])
