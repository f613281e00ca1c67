"""Step composition for /metrics: steps by kind (decode, prefill, mixed) and real tokens per step."""

from jaxserve.engine.scheduler_output import ScheduledRow
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.step_stats import StepComposition
from jaxserve.sampling.params import SamplingParams
from jaxserve.server.metrics import ServerMetrics


def seq(prompt_len: int, computed: int, outputs: int = 0) -> Sequence:
    s = Sequence(
        seq_id=f"s{prompt_len}-{computed}",
        request_id="r",
        index=0,
        prompt_token_ids=list(range(prompt_len)),
        params=SamplingParams(),
        seed=0,
    )
    s.output_token_ids.extend([1] * outputs)
    s.num_computed = computed
    return s


def test_kinds_and_token_histogram():
    c = StepComposition((1, 2, 4, 8, 16, 32, 64))
    decoding = seq(10, 10, outputs=1)  # computes only its newest token
    prompt = seq(40, 0)
    assert c.record([ScheduledRow(decoding, 10, 1)]) == "decode"
    assert c.record([ScheduledRow(prompt, 0, 32)]) == "prefill"
    assert c.record([ScheduledRow(decoding, 10, 1), ScheduledRow(prompt, 32, 8)]) == "mixed"
    assert c.record([ScheduledRow(decoding, 10, 1, num_lookahead=4)]) == "decode"  # a verification: 5 tokens
    stats = c.as_stats()
    assert stats["steps_by_kind"] == {"decode": 2, "prefill": 1, "mixed": 1}
    assert stats["iteration_tokens"]["sum"] == 1 + 32 + 9 + 5
    counts = dict(zip([*c.bounds, "inf"], stats["iteration_tokens"]["counts"]))
    assert counts[1] == 1 and counts[8] == 1 and counts[16] == 1 and counts[32] == 1


def test_rendered_as_prometheus_families():
    c = StepComposition((1, 4, 8, 16))
    c.record([ScheduledRow(seq(4, 4, outputs=1), 4, 1)])
    c.record([ScheduledRow(seq(4, 4, outputs=1), 4, 1), ScheduledRow(seq(20, 0), 0, 12)])
    text = ServerMetrics(lambda: c.as_stats()).render().decode()
    assert 'jaxserve:steps_total{kind="mixed"} 1.0' in text and 'jaxserve:steps_total{kind="decode"} 1.0' in text
    assert 'jaxserve:iteration_tokens_bucket{le="1"} 1.0' in text
    assert 'jaxserve:iteration_tokens_bucket{le="16"} 2.0' in text and "jaxserve:iteration_tokens_sum 14.0" in text
