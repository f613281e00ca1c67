"""The executables an engine compiles, counted from the bucket table without compiling them
(`buckets.executable_counts`), and checked against what a warm-up really compiles."""

import jax
import pytest

from jaxserve import LLM
from jaxserve.config import EngineConfig
from jaxserve.engine.buckets import BucketTable, ExecutableCounts, executable_counts, token_ladder
from jaxserve.model.kv_cache import copy_pages_jit

DEFAULT = "configs/small.yaml"
NGRAM = dict(speculative_method="ngram")
DRAFT = dict(speculative_method="draft", speculative_model="checkpoints/small-draft")


E = ExecutableCounts
DEFAULT_COUNTS = [
    # configs/small.yaml (16 rows, 256 batched tokens, 64 pages of 16 tokens; token_buckets: auto),
    # (overrides, on an accelerator, on a CPU). An accelerator's auto is the powers of two: 8 token
    # buckets (1, 4, 8, ... 256), each at the one page table (64). A CPU's is the fine ladder: 16
    # buckets (1, 2, 3, 4, 6, 8, 12, ... 192, 256). With speculative decoding those are speculative
    # steps (verifications are rows): no executable more, but the draft's page copy.
    ({}, E(steps=8, page_copies=1), E(steps=16, page_copies=1)),
    (dict(NGRAM, num_speculative_tokens=4), E(steps=8, page_copies=1), E(steps=16, page_copies=1)),
    (dict(NGRAM, num_speculative_tokens=8), E(steps=8, page_copies=1), E(steps=16, page_copies=1)),
    (dict(DRAFT, num_speculative_tokens=4), E(steps=8, page_copies=2), E(steps=16, page_copies=2)),
    # powers of two on a CPU too with prompt logprobs, whose scoring variants would make 16 + 16 + 1
    (dict(enable_prompt_logprobs=True), E(steps=8, scoring=8, page_copies=1), E(steps=8, scoring=8, page_copies=1)),
    # multi-step: a variant of each decode-sized bucket (the buckets of at most 16 tokens)
    (dict(num_scheduler_steps=4), E(steps=8, multi_step=4, page_copies=1), E(steps=16, multi_step=8, page_copies=1)),
]


@pytest.mark.parametrize(
    "platform, overrides, expected",
    [
        (p, o, cpu if p == "cpu" else accelerator)
        for p in ("gpu", "tpu", "cpu")
        for o, accelerator, cpu in DEFAULT_COUNTS
    ],
)
def test_default_config_executable_counts(platform, overrides, expected):
    """The counts docs/ARCHITECTURE.md states for configs/small.yaml: issue 21 asks at most 10 on
    an accelerator and 30 on a CPU, every variant compiled at start-up counted."""
    settings = EngineConfig.from_yaml(DEFAULT, overrides)
    assert settings.token_buckets == "auto"
    assert executable_counts(settings, platform=platform) == expected
    assert expected.total <= 30
    if platform != "cpu" and not {"enable_prompt_logprobs", "num_scheduler_steps"} & set(overrides):
        assert expected.total <= 10  # (the opt-in variants add theirs: 17 and 13 on an accelerator)


def test_auto_ladder_needs_the_platform():
    settings = EngineConfig.from_yaml(DEFAULT)
    with pytest.raises(ValueError, match="platform"):
        executable_counts(settings)
    # the library's default (LLM(...) without a config) is the powers of two on every platform
    assert executable_counts(EngineConfig(max_model_len=1024)) == ExecutableCounts(steps=9, page_copies=1)


def test_fine_token_ladder():
    """`token_buckets: fine` adds the midpoints: 16 token buckets for configs/small.yaml (within the
    30 issue 21 allows on a CPU), and no step padded by more than a third of its slots."""
    assert token_ladder(256, "powers-of-two") == (1, 4, 8, 16, 32, 64, 128, 256)
    assert token_ladder(256, "fine") == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    assert token_ladder(20, "fine") == (1, 2, 3, 4, 6, 8, 12, 16, 20)  # the budget itself always
    assert token_ladder(2, "fine") == (1, 2) and token_ladder(1, "powers-of-two") == (1,)
    fine = token_ladder(4096, "fine")
    assert all(b / a <= 1.5 for a, b in zip(fine[1:], fine[2:]))
    settings = EngineConfig.from_yaml(DEFAULT, dict(token_buckets="fine"))
    assert executable_counts(settings) == ExecutableCounts(steps=16, page_copies=1)  # on any platform
    assert executable_counts(settings.replace(num_scheduler_steps=4)) == ExecutableCounts(
        steps=16, multi_step=8, page_copies=1
    )  # 1, 2, 3, 4, 6, 8, 12, 16 tokens <= 16 rows
    with pytest.raises(ValueError, match="token ladder"):
        token_ladder(256, "coarse")


def test_counts_follow_the_table():
    settings = EngineConfig.from_yaml(
        DEFAULT,
        dict(
            max_num_seqs=4,
            max_model_len=64,
            max_num_batched_tokens=32,
            mesh_shape=[2, 1],
            token_buckets="powers-of-two",
        ),
    )
    table = BucketTable.for_settings(settings, 64)
    assert table == BucketTable(
        batch_sizes=(1, 2, 4), chunk_sizes=(16, 32), page_counts=(4,), token_counts=(1, 4, 8, 16, 32)
    )
    # tokens 1, 4 .. 32 at the one page count; one page copy per replica
    assert executable_counts(settings) == ExecutableCounts(steps=5, page_copies=2)
    unset = settings.replace(max_model_len=None)
    with pytest.raises(ValueError, match="max_model_len"):
        executable_counts(unset)
    assert executable_counts(unset, max_model_len=64) == executable_counts(settings)


SMALL = dict(
    dtype="float32",
    page_size=8,
    max_model_len=64,
    max_num_seqs=2,
    max_num_batched_tokens=32,
    compilation_cache_dir="none",
)


@pytest.mark.parametrize(
    "extra",
    [
        dict(enable_prompt_logprobs=True),
        dict(speculative_method="ngram", num_speculative_tokens=3),
        dict(num_scheduler_steps=2),
        "draft",
        dict(token_buckets="auto"),  # the fine ladder on this CPU: 10 buckets up to 32 tokens
    ],
    ids=["prompt-logprobs", "ngram", "multi-step", "draft", "auto-ladder"],
)
def test_warm_up_compiles_what_the_table_counts(hf_model_dir, extra):
    """A warm-up compiles exactly the executables counted from the table, and /metrics' executables
    gauge (stats()["executables"]) reports them."""
    path, _ = hf_model_dir("llama")
    if extra == "draft":
        extra = dict(speculative_method="draft", speculative_model=path, num_speculative_tokens=2)
    copies_before = copy_pages_jit._cache_size()
    with LLM(path, **SMALL, **extra) as llm:
        planned = executable_counts(llm.config, platform=jax.default_backend())
        if llm.config.token_buckets == "auto":
            assert planned.steps == len(token_ladder(32, "fine")) == 10
        # The page copy is one module-level jitted function: an engine whose cache layout an earlier
        # engine of this process had reuses that executable instead of compiling its own.
        new_copies = copy_pages_jit._cache_size() - copies_before
        assert llm.engine.warm_up_compiles == planned.total - planned.page_copies + new_copies
        assert llm.engine.stats()["executables"] == planned.total


def test_executables_gauge_in_metrics():
    from jaxserve.server.metrics import ServerMetrics

    text = ServerMetrics(lambda: {"executables": 41}).render().decode()
    assert "jaxserve:executables 41.0" in text


def test_fine_ladder_greedy_tokens_match(hf_model_dir):
    """The fine ladder's buckets (2, 3, 6, 12, 24 tokens) change padding, never tokens: greedy outputs
    of prompts of mixed lengths equal those of the powers-of-two ladder."""
    from jaxserve import SamplingParams

    path, _ = hf_model_dir("llama")
    prompts = [list(range(3, 3 + n)) for n in (5, 11, 2, 23)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for ladder in ("powers-of-two", "fine"):
        with LLM(path, **dict(SMALL, max_num_seqs=4), token_buckets=ladder) as llm:
            outs[ladder] = [
                o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)
            ]
    assert outs["fine"] == outs["powers-of-two"]
