"""Host-side pieces of speculative decoding (no model): n-gram lookup, the adaptive policy, settings, metrics."""

import pytest

from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.spec_decode.ngram import propose_ngram
from jaxserve.spec_decode.policy import AcceptanceEstimate, SpecPolicy, SpecState, expected_tokens, probe_interval


def test_ngram_copies_what_followed_the_longest_latest_match():
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 6, 7]
    # "6 7" occurs at 1 and 6; the latest (6) is followed by 3 4 6 7
    assert propose_ngram(tokens, 3, 1, 2) == [3, 4, 6]
    # with a 3-gram "4 6 7": no earlier occurrence, so the 2-gram decides
    assert propose_ngram(tokens, 3, 2, 3) == [3, 4, 6]
    # a longer match wins over a later shorter one: "5 6 7" ... "5 6 7" -> what followed the first
    tokens2 = [5, 6, 7, 8, 9, 6, 7, 2, 5, 6, 7]
    assert propose_ngram(tokens2, 2, 1, 3) == [8, 9]
    assert propose_ngram(tokens2, 2, 1, 2) == [2, 5]  # limited to 2-grams: the latest "6 7"
    assert propose_ngram(tokens2, 6, 1, 2) == [2, 5, 6, 7, 2, 5]  # ... whose copy then repeats itself


def test_ngram_edge_cases():
    assert propose_ngram([1, 2, 3], 4, 1, 4) == []  # nothing repeats
    assert propose_ngram([7], 4, 1, 4) == []
    assert propose_ngram([1, 2, 1], 4, 1, 4) == [2, 1, 2, 1]  # the copy runs into the suffix: a loop continues
    assert propose_ngram([1, 2, 1, 2, 1, 2], 5, 2, 2) == [1, 2, 1, 2, 1]
    assert propose_ngram([7, 7, 7], 3, 1, 4) == [7, 7, 7]
    assert propose_ngram([1, 2, 1], 0, 1, 4) == []
    assert propose_ngram([1, 2, 3, 1, 2], 2, 3, 4) == []  # only 2-grams match, below the minimum


def test_policy_adapts_k_to_the_measured_acceptance():
    policy = SpecPolicy(max_tokens=6)
    costs = [1.0] + [1.2 + 0.25 * k for k in range(1, 7)]
    state = SpecState()
    assert policy.choose(state, 1, costs) > 0  # the prior (a = 0.75) is worth a few drafts
    for _ in range(20):
        state.record(proposed=4, accepted=4)
    assert policy.choose(state, 1, costs) == 6  # everything accepted: propose the most
    assert policy.choose(state, 1, [1.0] + [3.0] * 6) == 6  # still worth a 3x verify step
    assert policy.choose(state, 1, [1.0, 1.5, 2.5, 3.0, 3.0, 7.5, 7.5]) == 4  # the best tokens per cost
    low = SpecState()
    for _ in range(20):
        low.record(proposed=2, accepted=0)
    assert low.acceptance < 0.2
    assert policy.choose(low, 1, costs) == 0  # not worth a draft step: decode plainly
    assert policy.choose(low, probe_interval(costs), costs) == 1  # ... but probe now and then, on a shared schedule
    assert probe_interval([1.0, 3.0]) == 100  # expensive probes are rarer
    assert SpecPolicy(6, adaptive=False).choose(low, 1, costs) == 6
    assert expected_tokens(0.5, 2) == pytest.approx(1.75) and expected_tokens(1.0, 3) == 4
    assert low.proposed == 40 and low.verify_steps == 20


def test_speculative_settings_are_checked():
    ok = EngineConfig(model="m", speculative_model="d", num_speculative_tokens=4)
    assert ok.speculation == "draft"
    assert EngineConfig(model="m", speculative_method="ngram", num_speculative_tokens=3).speculation == "ngram"
    assert EngineConfig(model="m").speculation is None
    # n-gram speculation and prompt logprobs: a scoring step verifies nothing, and there is no draft cache.
    EngineConfig(model="m", speculative_method="ngram", num_speculative_tokens=3, enable_prompt_logprobs=True)
    cli = EngineConfig.from_cli(
        ["--model", "m", "--speculative-model", "d", "--num-speculative-tokens", "4", "--speculative-adaptive", "false"]
    )
    assert cli == ok.replace(speculative_adaptive=False)
    for bad, match in [
        (dict(num_speculative_tokens=4), "needs speculative_model"),
        (dict(speculative_model="d"), "num_speculative_tokens is 0"),
        (
            dict(speculative_method="ngram", speculative_model="d", num_speculative_tokens=2),
            "needs no speculative_model",
        ),
        (
            dict(speculative_method="ngram", num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2),
            "prompt_lookup_min",
        ),
        (dict(num_speculative_tokens=-1), ">= 0"),
        (
            dict(speculative_model="d", num_speculative_tokens=2, enable_prompt_logprobs=True),
            "enable_prompt_logprobs is not supported with speculative_method='draft'",
        ),
    ]:
        with pytest.raises(ConfigError, match=match):
            EngineConfig(model="m", **bad)


def test_a_new_request_starts_from_the_engine_wide_acceptance():
    """A fixed optimistic prior (a = 0.75) had every new request verify drafts until two rejections
    outweighed it, with a head accepting a third of its drafts; the engine's own estimate does not."""
    costs = [1.0, 1.5, 1.8, 2.2, 2.5]
    engine = AcceptanceEstimate()
    assert engine.new_state().acceptance == pytest.approx(0.75)  # nothing measured yet: the old prior
    for _ in range(40):
        engine.record(proposed=3, accepted=0)
    fresh = engine.new_state()
    assert fresh.acceptance == pytest.approx(engine.value) and fresh.acceptance < 0.2
    assert SpecPolicy(4).choose(fresh, 1, costs) == 0
    assert SpecPolicy(4).choose(SpecState(), 1, costs) > 0  # what the fixed prior did
    fresh.record(proposed=1, accepted=1)  # its own verifies still move it (the prior weighs two)
    assert fresh.acceptance > 0.3


def test_a_losing_batch_turns_speculation_off():
    """At batch 16 on a CPU one draft per row moves the step from the 16- to the 32-token bucket
    (about twice the time): at a head's acceptance of ~0.5 no k pays, so no row drafts but at the
    shared probe steps; where verifying is cheap (an accelerator) the same acceptance pays."""
    policy = SpecPolicy(max_tokens=4)
    batch16 = [1.0, 1.95, 3.4, 3.4, 5.9]  # the 32-, 64-, 64- and 128-token buckets against 16
    engine = AcceptanceEstimate()
    for _ in range(40):
        engine.record(proposed=2, accepted=1)
    assert engine.value == pytest.approx(0.5, abs=0.05)
    assert not policy.batch_drafts(engine, 1, batch16)
    assert policy.batch_drafts(engine, probe_interval(batch16), batch16)  # re-measured together
    assert policy.batch_drafts(engine, 1, [1.0, 1.1, 1.2, 1.3, 1.4])
    assert SpecPolicy(4, adaptive=False).batch_drafts(engine, 1, batch16)


def test_spec_metrics_in_prometheus():
    from jaxserve.server.metrics import ServerMetrics

    stats = dict(
        num_running=1,
        spec_decode_num_draft_tokens=40,
        spec_decode_num_accepted_tokens=30,
        spec_decode_num_verify_steps=10,
        spec_decode_num_steps=8,
        spec_decode_acceptance_rate=0.75,
        spec_decode_mean_accepted_length=4.0,
        spec_decode_num_drafts_per_pos=[10, 9],
        spec_decode_num_accepted_tokens_per_pos=[8, 5],
    )
    text = ServerMetrics(lambda: stats).render().decode()
    for line in [
        "jaxserve:spec_decode_num_draft_tokens_total 40.0",
        "jaxserve:spec_decode_num_accepted_tokens_total 30.0",
        "jaxserve:spec_decode_num_verify_steps_total 10.0",
        "jaxserve:spec_decode_acceptance_rate 0.75",
        "jaxserve:spec_decode_mean_accepted_length 4.0",
        'jaxserve:spec_decode_num_drafts_per_pos_total{position="1"} 9.0',
        'jaxserve:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 8.0',
    ]:
        assert line in text, line
    assert "spec_decode" not in ServerMetrics(lambda: dict(num_running=1)).render().decode()


def test_acceptance_is_counted_by_draft_position():
    from jaxserve.spec_decode.decoder import SpecCounters

    c = SpecCounters()
    for k, n in [(3, 3), (3, 1), (2, 0), (4, 2)]:
        c.record(k, n)
    assert c.proposed_per_pos == [4, 4, 3, 1]
    assert c.accepted_per_pos == [3, 2, 1, 0]


def test_token_buffer_appends_only_what_is_new():
    from jaxserve.spec_decode.ngram import TokenBuffer

    buf, prompt, output = TokenBuffer(), [1, 2, 3], []
    assert buf.view(prompt, output).tolist() == [1, 2, 3]
    for t in range(100):
        output.append(t)
        assert buf.view(prompt, output).tolist() == prompt + output


def test_a_memory_budget_buys_pages_for_both_caches():
    import jax.numpy as jnp

    from jaxserve.config import ModelConfig
    from jaxserve.planning.memory import plan_memory

    cfg = ModelConfig.from_dir("configs/models/smollm2-135m")
    per_token = cfg.kv_bytes_per_token(4)
    settings = EngineConfig(kv_cache_memory="1GiB")
    alone = plan_memory(cfg, settings, jnp.float32)
    shared = plan_memory(cfg, settings, jnp.float32, draft_kv_bytes_per_token=per_token // 4)
    assert shared.num_pages == 2**30 // (per_token * 5 // 4 * 16)
    assert shared.num_pages < alone.num_pages and "speculation's KV" in shared.describe()
