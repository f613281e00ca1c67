"""Structured output end to end on the shipped default model: LLM.generate with a JSON schema, a regex or
a choice gives outputs that parse and match; unconstrained rows sharing the batch are unchanged; nothing
compiles after warm-up; n > 1, multi-step decode and preemption keep each sequence's grammar."""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.processor import Processor
from jaxserve.loading import resources
from jaxserve.runner.compilation import CompileCounter
from jaxserve.errors import RequestError
from jaxserve.structured import GrammarError, StructuredSpec

SETTINGS = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, page_size=8)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
PROMPTS = ["A person, as JSON:", "Once upon a time", "The user record is", "{"]
REGEX = r"[a-z]{2,5}-\d{3}"
CHOICES = ["red", "green", "blue", "dark purple"]


def check_schema(doc) -> None:
    """SCHEMA's constraints, checked by hand (no jsonschema dependency)."""
    assert isinstance(doc, dict) and set(doc) <= set(SCHEMA["properties"]) and {"name", "age", "role"} <= set(doc)
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 10
    assert isinstance(doc["age"], int) and not isinstance(doc["age"], bool) and 0 <= doc["age"] <= 120
    assert doc["role"] in ("admin", "user", "guest")
    if "tags" in doc:
        assert isinstance(doc["tags"], list) and len(doc["tags"]) <= 3
        assert all(isinstance(t, str) and len(t) <= 6 for t in doc["tags"])
    if "home" in doc:
        assert set(doc["home"]) == {"city"} and isinstance(doc["home"]["city"], str) and len(doc["home"]["city"]) <= 8


@pytest.fixture(scope="module")
def llm():
    with LLM(str(resources.small_checkpoint()), **SETTINGS) as llm:
        yield llm


def generate(llm, prompts, params):
    return [o.outputs for o in llm.generate(prompts, params, use_tqdm=False)]


def test_json_schema_outputs_parse_and_validate_with_no_compile(llm):
    before = CompileCounter.requests
    spec = StructuredSpec.json_schema(SCHEMA)
    params = [
        SamplingParams(max_tokens=200, temperature=1.0, top_p=0.95, seed=seed, structured=spec) for seed in range(8)
    ]
    outs = generate(llm, [PROMPTS[i % 4] for i in range(8)], params)
    texts = []
    for (c,) in outs:
        assert c.finish_reason == "stop", c.text
        check_schema(json.loads(c.text))
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', '""', c.text))  # compact: no whitespace
        texts.append(c.text)
    assert len(set(texts)) > 1  # seeded sampling, not one forced document
    again = generate(llm, [PROMPTS[0]], params[:1])[0][0]
    assert again.text == outs[0][0].text  # the seed decides, as without a grammar
    assert CompileCounter.requests == before and llm.runner.unplanned_compiles == 0
    stats = llm.engine.stats()
    assert stats["grammar_masked_rows_total"] >= sum(len(c.token_ids) for (c,) in outs)
    assert stats["grammar_mask_seconds_total"] > 0


def test_regex_and_choice_match(llm):
    regex, choice = StructuredSpec.regex(REGEX), StructuredSpec.choice(CHOICES)
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=s, structured=regex) for s in range(6)] + [
        SamplingParams(max_tokens=20, temperature=1.0, seed=s, structured=choice) for s in range(6)
    ]
    outs = generate(llm, [PROMPTS[i % 4] for i in range(12)], params)
    for (c,) in outs[:6]:
        assert re.fullmatch(REGEX, c.text) and c.finish_reason == "stop", c.text
    for (c,) in outs[6:]:
        assert c.text in CHOICES and c.finish_reason == "stop", c.text


def test_greedy_unconstrained_rows_unchanged_beside_constrained_ones(llm):
    free = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * 2
    alone = generate(llm, PROMPTS[:2], free)
    schema = StructuredSpec.json_schema(SCHEMA)
    constrained = [
        SamplingParams(max_tokens=60, temperature=0.7, seed=3, structured=schema),
        SamplingParams(max_tokens=20, temperature=0, structured=StructuredSpec.regex(REGEX)),
    ]
    mixed = generate(
        llm, [PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[1]], [constrained[0], free[0], constrained[1], free[1]]
    )
    assert [mixed[1][0].token_ids, mixed[3][0].token_ids] == [alone[0][0].token_ids, alone[1][0].token_ids]
    assert re.fullmatch(REGEX, mixed[2][0].text)


def test_n_samples_each_follow_the_grammar(llm):
    spec = StructuredSpec.json_schema(SCHEMA)
    params = SamplingParams(n=3, max_tokens=200, temperature=1.0, seed=11, structured=spec)
    (outs,) = generate(llm, [PROMPTS[0]], [params])
    assert len(outs) == 3
    for c in outs:
        check_schema(json.loads(c.text))


def test_cut_by_max_tokens_is_length(llm):
    params = SamplingParams(max_tokens=3, temperature=0, structured=StructuredSpec.json_schema(SCHEMA))
    ((c,),) = generate(llm, [PROMPTS[0]], [params])
    assert c.finish_reason == "length" and len(c.token_ids) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.text)


def test_refusals(llm):
    spec = StructuredSpec.json_object()
    with pytest.raises(RequestError, match="ignore_eos"):
        SamplingParams(structured=spec, ignore_eos=True)
    with pytest.raises(RequestError, match="min_tokens"):
        SamplingParams(structured=spec, min_tokens=2, max_tokens=4)
    with pytest.raises(RequestError, match="StructuredSpec"):
        SamplingParams(structured={"type": "json_object"})
    with pytest.raises(GrammarError, match="backreference"):
        llm.generate(
            ["x", "y"],
            [
                SamplingParams(structured=StructuredSpec.regex("a+")),
                SamplingParams(structured=StructuredSpec.regex(r"(a)\1")),
            ],
            use_tqdm=False,
        )
    assert not llm.engine.has_unfinished_requests()


def test_speculative_decoding_with_structured_output_is_refused(llm, monkeypatch):
    import dataclasses

    speculative = dataclasses.replace(llm.engine.config, num_speculative_tokens=3, speculative_method="ngram")
    monkeypatch.setattr(llm.engine, "config", speculative)
    with pytest.raises(RequestError, match="speculative decoding"):
        Processor(llm.engine.limits).process(
            "s", None, SamplingParams(structured=StructuredSpec.json_object()), [1, 2, 3]
        )


def test_multi_step_and_preemption_keep_the_grammar(llm):
    """num_scheduler_steps=4 runs constrained rows one step at a time beside multi-step free rows, and a
    cache too small for every row preempts and recomputes: outputs still parse, and every row matches
    what a single-step engine with room for all gives."""
    free = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    small_schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    spec = StructuredSpec.json_schema(small_schema)
    params = [
        free,
        SamplingParams(max_tokens=60, temperature=1.0, seed=5, structured=spec),
        free,
        SamplingParams(max_tokens=60, temperature=1.0, seed=6, structured=spec),
    ]
    prompts = PROMPTS
    with LLM(
        str(resources.small_checkpoint()), **SETTINGS, num_scheduler_steps=4, num_pages=16, warm_up=False
    ) as small:
        outs = generate(small, prompts, params)
        preempted = small.engine.scheduler.num_preemptions
    want = generate(llm, prompts, params)  # single-step, a cache with room for every row
    assert preempted > 0
    for i in (1, 3):
        doc = json.loads(outs[i][0].text)
        assert set(doc) == {"name", "age"} and len(doc["name"]) <= 8 and 0 <= doc["age"] <= 99
        assert outs[i][0].text == want[i][0].text  # seeded: same tokens whatever the step mix
    assert [outs[0][0].token_ids, outs[2][0].token_ids] == [want[0][0].token_ids, want[2][0].token_ids]


def test_prompt_logprobs_steps_apply_the_mask_too():
    """With prompt logprobs the step is the scoring variant; its sampler sees the mask as well."""
    with LLM(str(resources.small_checkpoint()), **SETTINGS, enable_prompt_logprobs=True, warm_up=False) as scoring:
        params = [
            SamplingParams(
                max_tokens=20, temperature=1.0, seed=s, prompt_logprobs=1, structured=StructuredSpec.choice(CHOICES)
            )
            for s in range(4)
        ]
        outs = scoring.generate(PROMPTS, params, use_tqdm=False)
    for o in outs:
        assert o.outputs[0].text in CHOICES and o.prompt_logprobs is not None


def test_two_replicas(llm):
    """Data parallel (mesh (2, 1)): each replica's rows get their own masks; free greedy rows match one replica's."""
    free = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    params = [
        free,
        SamplingParams(max_tokens=20, temperature=1.0, seed=1, structured=StructuredSpec.regex(REGEX)),
        free,
        SamplingParams(max_tokens=20, temperature=1.0, seed=2, structured=StructuredSpec.choice(CHOICES)),
    ]
    want = generate(llm, PROMPTS, params)
    with LLM(str(resources.small_checkpoint()), **SETTINGS, mesh_shape=(2, 1), warm_up=False) as dp:
        assert dp.engine.num_replicas == 2
        got = generate(dp, PROMPTS, params)
    assert re.fullmatch(REGEX, got[1][0].text) and got[3][0].text in CHOICES
    assert [got[0][0].token_ids, got[2][0].token_ids] == [want[0][0].token_ids, want[2][0].token_ids]
    assert [got[1][0].text, got[3][0].text] == [want[1][0].text, want[3][0].text]  # seeded: the same draws


def test_async_scheduling_steps_constrained_rows_every_step(llm):
    """With async scheduling (the default) the next step's masks wait for the grammars to take the
    tokens of the step in flight: the constrained request advances one token per step beside free
    ones, and its outputs equal those with the overlap off."""
    overlap = llm.overlap  # LLM.generate's step loop
    assert overlap.async_scheduling
    spec = StructuredSpec.json_schema(SCHEMA)
    params = [
        SamplingParams(max_tokens=40, temperature=0.8, seed=3, structured=spec),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
    ]
    calls, step = [], overlap.step
    overlap.step = lambda: calls.append(1) or step()  # LLM.generate's loop: one call per engine step
    try:
        on = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    finally:
        del overlap.step
    steps = len(calls)
    overlap.flush()
    overlap.async_scheduling = False
    try:
        off = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    finally:
        overlap.async_scheduling = True
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    check_schema(json.loads(on[0].outputs[0].text))
    # a token per step (plus the prefill's and the pipeline's last): not one every other step
    assert steps <= len(on[0].outputs[0].token_ids) + 3, steps


def _allowed_next(text: str, token: str, choices) -> bool:
    return any(c.startswith(text + token) for c in choices)


def test_logprobs_under_a_grammar_hold_only_allowed_tokens(llm):
    """A grammar that allows fewer tokens than the top-N asked for: the masked ones (logprob -inf) are
    left out of each entry, never given as -inf; every number is finite; the sampled token is in its
    entry; the alternatives are tokens the grammar allowed there."""
    tok = llm.engine.tokenizer
    params = [
        SamplingParams(max_tokens=20, temperature=1.0, seed=s, logprobs=20, structured=StructuredSpec.choice(CHOICES))
        for s in range(4)
    ]
    outs = generate(llm, PROMPTS, params)
    short = 0
    for (c,) in outs:
        assert c.text in CHOICES and len(c.logprobs) == len(c.token_ids)
        text = ""
        for tid, entry in zip(c.token_ids, c.logprobs):
            assert all(math.isfinite(lp) and lp <= 0 for lp in entry.values()), entry
            assert tid in entry and len(entry) <= 21
            short += len(entry) < 20
            for t in entry:
                assert _allowed_next(text, tok.decode([t]), CHOICES), (text, tok.decode([t]), entry)
            text += tok.decode([tid])
        assert math.isfinite(c.cumulative_logprob)
    assert short  # the grammar allowed fewer than 20 tokens somewhere: some were left out


def test_logprob_entries_leave_out_values_that_are_not_finite():
    """The host side of the top-N (no model): -inf (masked) and NaN alternatives are dropped, the
    sampled token's own value is kept; prompt entries likewise keep the prompt token's own."""
    import numpy as np

    from jaxserve.engine.output_processor import OutputProcessor, top_entry
    from jaxserve.model.sampler import SampleOutput

    assert top_entry(np.array([5, 7, 0, 9]), np.array([-0.1, -2.0, -np.inf, np.nan], np.float32)) == {
        5: pytest.approx(-0.1),
        7: -2.0,
    }
    seq = SimpleNamespace(params=SamplingParams(logprobs=4), logprobs=[], cumulative_logprob=0.0)
    sampled = SampleOutput(
        tokens=np.array([7]),
        logprobs=np.array([-2.0], np.float32),
        top_ids=np.array([[5, 7, 0, 1]]),
        top_logprobs=np.array([[-0.1, -2.0, -np.inf, -np.inf]], np.float32),
    )
    OutputProcessor.record_logprobs(seq, sampled, 0)
    assert seq.logprobs == [{5: pytest.approx(-0.1), 7: -2.0}] and seq.cumulative_logprob == -2.0

    seq.params = SamplingParams(prompt_logprobs=2)
    seq.prompt_token_ids, seq.prompt_logprobs = [3, 4, 6], [None, None, None]
    scores = SimpleNamespace(
        target_logprobs=np.array([[-1.0, -3.0]], np.float32),
        top_ids=np.array([[[4, 0], [2, 0]]]),
        top_logprobs=np.array([[[-1.0, -np.inf], [-0.5, np.nan]]], np.float32),
    )
    OutputProcessor.record_prompt_logprobs(seq, 0, [4, 6], scores, 0)
    assert seq.prompt_logprobs == [None, {4: -1.0}, {2: -0.5, 6: -3.0}]
