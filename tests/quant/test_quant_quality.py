"""Quality of int8 on the trained default model: held-out perplexity with int8 weights, an int8 KV
cache and both stays within 0.1% of float32; int4 weights within the issue's 5%. The target is 1%; the full-size run of
scripts/quant_quality.py in docs/BENCHMARKS.md measured changes under 0.01%, so 0.1% still leaves
room for the sample here (16 windows of 256 tokens) while catching a real loss of precision."""

import math
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from jaxserve.config import EngineConfig
from jaxserve.loading.model_loader import load_model
from jaxserve.model.sharding import make_mesh

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from quant_quality import VARIANTS, heldout_windows, mean_nll  # noqa: E402

DEFAULT = str(ROOT / "checkpoints" / "small")
MAX_INCREASE = 0.001  # relative perplexity increase over float32


@pytest.fixture(scope="module")
def perplexities():
    windows = heldout_windows(DEFAULT, 16, 256)  # 4,096 held-out tokens
    loaded = {q: load_model(EngineConfig(model=DEFAULT, dtype="float32", quantization=q), make_mesh((1, 1)),
                            stacked=True) for q in ("none", "int8", "int4")}
    return {name: math.exp(mean_nll(loaded[q].params, loaded[q].cfg, windows, jnp.float32, kv))
            for name, (q, kv) in VARIANTS.items()}


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
