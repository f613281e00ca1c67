"""The benchmarks' timing of a captured compiled step (`jaxserve.runner.step_timing`): it calls the
runner's executable as the runner does, so scripts/bench_decode.py and scripts/roofline.py measure
the step the engine runs."""

import numpy as np


def test_time_step_calls_the_captured_step_and_leaves_the_runner_usable(hf_model_dir):
    from jaxserve import LLM
    from jaxserve.runner.step_row import StepRow
    from jaxserve.runner.step_timing import capture_step, time_step

    path, _ = hf_model_dir("llama")
    with LLM(
        path, dtype="float32", page_size=8, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, warm_up=False
    ) as llm:
        runner = llm.runner
        rows = [StepRow([5], 9, [1, 2]), StepRow([6], 3, [3])]
        want = np.asarray(runner.execute_rows(rows).tokens)
        step = capture_step(runner, rows)
        assert step.shape == (4, runner.buckets.page_counts[-1])
        synced, pipelined = time_step(runner, step, 3, sync=True), time_step(runner, step, 3, sync=False)
        assert len(synced) == len(pipelined) == 3 and min(synced + pipelined) > 0
        # The same rows again give the same greedy tokens: the cache and carried samples the timing
        # handed back are the runner's own, still valid (no donated buffer reused).
        np.testing.assert_array_equal(np.asarray(runner.execute_rows(rows).tokens), want)
