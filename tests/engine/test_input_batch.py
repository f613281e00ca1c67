"""The InputBatch (jaxserve/runner/input_batch.py) keeps each plain bucket's packed inputs from step to
step and rewrites only what changed. Every step it writes must equal the from-scratch pack of the
same rows (`row_packing.pack_rows`) word for word, through adds, finishes, preemptions, aborts,
n > 1 forks, prefix-cache hits, chunked prompts, penalties and logit_bias, on one replica and on
two; and the outputs must be those of packing every step from scratch."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.runner.step_row import StepRow
from jaxserve.model.transfer import SPARSE_FIELDS
from jaxserve.runner.step_io import split_sparse
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.row_packing import pack_rows
from jaxserve.model.kv_cache import RaggedBatch
from jaxserve.model.sampler import RowSampling, SamplingTensors
from jaxserve.structured.apply import TokenMask
from jaxserve.model.transfer import Layout

SETTINGS = dict(
    dtype="float32", page_size=8, max_model_len=192, max_num_seqs=8, max_num_batched_tokens=32, warm_up=False
)


def workload(seed=0, n=24):
    """Prompts sharing prefixes (prefix hits), n = 2 forks, penalties, logit_bias, seeds, logprobs."""
    rng = np.random.RandomState(seed)
    shared = rng.randint(4, 500, size=20).tolist()
    prompts, params = [], []
    for i in range(n):
        prompt = rng.randint(4, 500, size=int(rng.randint(2, 40))).tolist()
        prompts.append(shared + prompt[:6] if i % 3 == 0 else prompt)
        p = dict(max_tokens=int(rng.randint(2, 30)), temperature=0.0, ignore_eos=True)
        kind = i % 6
        if kind == 1:
            p.update(temperature=0.8, top_k=-1, top_p=0.9, seed=i)
        elif kind == 2:
            p.update(n=2, temperature=1.0, seed=i, logprobs=2)
        elif kind == 3:
            p.update(repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.2)
        elif kind == 4:
            p.update(logit_bias={7: 3.0, 11: -2.0}, min_p=0.1, temperature=0.5, seed=i)
        params.append(SamplingParams(**p))
    return prompts, params


def check_against_anew(runner, counts):
    """Wrap the runner's written packing: each step's written inputs are compared with the
    from-scratch pack of the same rows."""
    real = runner.plain.pack

    def pack_written(rows, shape, layout):
        packed = real(rows, shape, layout)
        ref = pack_rows(runner.ctx, rows, shape)
        np.testing.assert_array_equal(packed.logit_at, ref.logit_at)
        assert packed.token_at == ref.token_at
        ours, theirs = (packed.batch, packed.sampling, packed.mask), (ref.batch, ref.sampling, ref.mask)
        (ours_packed, ours_sparse), ref_sparse = split_sparse(ours), split_sparse(theirs)[1]
        for a, b in zip(ours_sparse, ref_sparse):
            np.testing.assert_array_equal(a, b)
        # The mask words of free rows are never read (their flag is off): compared where constrained.
        constrained = ref.mask.constrained
        np.testing.assert_array_equal(packed.mask.bitmask[constrained], ref.mask.bitmask[constrained])
        ref_words = layout.pack(split_sparse((ref.batch, ref.sampling, TokenMask(packed.mask.bitmask, constrained)))[0])
        np.testing.assert_array_equal(packed.buffer, ref_words)
        np.testing.assert_array_equal(layout.pack(ours_packed), ref_words)  # what a follower would pack
        counts["steps"] += 1
        counts["rows"] += len(rows)
        return packed

    runner.plain.pack = pack_written


def run(llm, prompts, params, abort_every=0):
    """Step the engine by hand (aborting every `abort_every`-th request once it has a token);
    returns each request's token ids and finish reasons."""
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), None, sp, p)
    tokens: dict[str, list] = {}
    step = 0
    while llm.overlap.has_unfinished_requests():
        for out in llm.overlap.step():
            for c in out.outputs:
                tokens.setdefault((out.request_id, c.index), []).extend(list(c.token_ids) + [c.finish_reason])
        step += 1
        if abort_every and step % 5 == 0:
            for rid in [r for r in list(engine.requests) if int(r) % abort_every == 0]:
                engine.abort_request(rid)
    return tokens


@pytest.mark.parametrize("pages", [None, 24])
def test_written_steps_equal_the_from_scratch_pack(pages):
    prompts, params = workload()
    with LLM("checkpoints/small", **SETTINGS, num_pages=pages) as llm:
        counts = {"steps": 0, "rows": 0}
        check_against_anew(llm.runner, counts)
        written = run(llm, prompts, params, abort_every=5)
        if pages:
            assert llm.engine.scheduler.num_preemptions > 0  # the table of a re-admitted sequence is new
        assert llm.blocks.num_free_pages(0) == llm.blocks.num_usable_pages
    assert counts["steps"] > 20
    with LLM("checkpoints/small", **SETTINGS, num_pages=pages) as llm:
        runner = llm.runner
        # Every step packed from scratch: the outputs the written steps must reproduce exactly.
        runner.plain.pack = lambda rows, shape, layout: pack_rows(runner.ctx, rows, shape)
        anew = run(llm, prompts, params, abort_every=5)
    assert written == anew


def test_written_steps_on_two_replicas():
    prompts, params = workload(seed=1, n=16)
    with LLM("checkpoints/small", **SETTINGS, mesh_shape=(2, 1), num_pages=40) as llm:
        counts = {"steps": 0, "rows": 0}
        check_against_anew(llm.runner, counts)
        run(llm, prompts, params, abort_every=4)
        assert all(llm.blocks.num_free_pages(r) == llm.blocks.num_usable_pages for r in range(2))
    assert counts["steps"] > 10


# ---------------------------------------------------------------- the writer alone (no engine)
def layout_of(R=1, N=8, S=4, P=3, V=64):
    L = min(N, S)
    i32 = lambda *d: np.zeros((R,) + d, np.int32)  # noqa: E731
    batch = RaggedBatch(
        tokens=i32(N),
        positions=i32(N),
        slots=i32(N),
        token_row=i32(N),
        query_start=i32(S + 1),
        context_lens=i32(S),
        page_table=i32(S, P),
        logit_index=i32(L),
    )
    inputs = (
        batch,
        SamplingTensors.pack([], (R, L), 8),
        TokenMask(np.zeros((R, L, (V + 31) // 32), np.int32), np.zeros((R, L), bool)),
    )
    return Layout.of(split_sparse(inputs)[0]), L


def test_rows_are_rewritten_only_when_they_change():
    layout, L = layout_of()
    idle = SamplingTensors.pack([], (1, L), 8)
    writer = InputBatch(layout, page_size=4, idle_sparse={k: getattr(idle, k) for k in SPARSE_FIELDS})
    from array import array

    table = array("i", [5, 6])
    rs = RowSampling(temperature=0.5, top_k=-1, seed=9)
    row = StepRow([3], 6, table, rs, step=2, pages_version=0)
    writer.write([row])
    assert writer.batch.page_table[0, 0].tolist() == [5, 6, 0]
    assert writer.batch.slots[0, 0] == 6 * 4 + 2
    assert writer.idle_sampling.top_k[0, 0] == 0 and writer.idle_sampling.step[0, 0] == 2
    table[0] = 9  # not told (same version): the entries written are kept, as a table never changes so
    writer.write([StepRow([4], 7, table, rs, step=3, pages_version=0)])
    assert writer.batch.page_table[0, 0, 0] == 5
    writer.write([StepRow([4], 7, table, rs, step=3, pages_version=1)])  # a released page: rewritten
    assert writer.batch.page_table[0, 0].tolist() == [9, 6, 0]
    grammar = object()
    writer.write([StepRow([4], 7, table, rs, step=3, pages_version=1, grammar=grammar), row])
    assert writer.mask().constrained[0].tolist() == [True, False, False, False]
    writer.write([])  # every row and slot back to padding
    assert not writer.mask().constrained.any()
    assert writer.batch.page_table.sum() == 0 and writer.batch.context_lens.sum() == 0
    assert writer.idle_sampling.temperature[0, 0] == 0 and writer.idle_sampling.seed[0, 0] == 0
    with pytest.raises(ValueError):
        writer.write([StepRow([1] * 9, 0, array("i", [1, 2, 3]), rs)])


def test_written_steps_with_pages_released_outside_the_window(hf_model_dir):
    """The tiny Mistral (every layer windowed): release_outside_window replaces a table's leading
    entries in place and bumps its version, so the writer must rewrite those rows."""
    path, _ = hf_model_dir("mistral")
    with LLM(
        path,
        dtype="float32",
        page_size=8,
        max_model_len=128,
        max_num_seqs=4,
        num_pages=16,
        max_num_batched_tokens=32,
        warm_up=False,
    ) as llm:
        assert llm.blocks.sliding_window is not None
        counts = {"steps": 0, "rows": 0}
        check_against_anew(llm.runner, counts)
        rng = np.random.RandomState(2)
        prompts = [rng.randint(0, 500, size=n).tolist() for n in (20, 9, 30)]
        params = [SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True, n=1 + (i == 1)) for i in range(3)]
        run(llm, prompts, params)
        assert llm.blocks.num_window_released_pages > 0
    assert counts["steps"] > 50


def test_a_writer_with_history_writes_what_a_fresh_writer_writes():
    """The writer rewrites only what changed since its last step (a steady decode step writes five
    slices); after any sequence of steps (rows coming and going, decode rows and chunks, fewer or more
    tokens, samples and logit slots) its buffer equals that of a writer writing the same rows first."""
    from array import array

    layout, L = layout_of(R=1, N=16, S=6, P=4)
    idle = SamplingTensors.pack([], (1, L), 8)
    make = lambda: InputBatch(layout, page_size=4, idle_sparse={k: getattr(idle, k) for k in SPARSE_FIELDS})  # noqa: E731
    kept = make()
    rng = np.random.RandomState(0)
    samplings = [RowSampling(temperature=0.1 * i, top_k=i, seed=i) for i in range(4)] + [None]
    tables = [array("i", rng.randint(1, 30, size=4).tolist()) for _ in range(8)]
    decodes = 0
    for step in range(300):
        if step % 3:  # mostly steady decode steps of the last rows, one position further
            kind = "decode"
        else:
            kind = rng.choice(["decode", "new", "mixed", "empty"])
        if kind == "empty":
            rows = []
        elif kind == "decode" and step % 3 and step > 0 and rows:
            rows = [
                StepRow(
                    [int(rng.randint(-5, 50))],
                    min(r.start_pos + len(r.tokens), 15),
                    r.page_ids,
                    r.sampling,
                    step=(r.step or 0) + 1,
                    pages_version=r.pages_version,
                )
                for r in rows
            ]
            decodes += 1
        else:
            rows = []
            t = 0
            for _ in range(int(rng.randint(1, 7))):
                n = 1 if kind != "mixed" or rng.rand() < 0.5 else int(rng.randint(2, 5))
                if t + n > 16:
                    break
                start = int(rng.randint(0, 16 - n + 1))
                samples = bool(rng.rand() < 0.8)
                rows.append(
                    StepRow(
                        rng.randint(-3, 50, size=n).tolist(),
                        start,
                        tables[rng.randint(len(tables))],
                        samplings[rng.randint(len(samplings))],
                        samples=samples,
                        step=int(rng.randint(0, 9)),
                        pages_version=int(rng.randint(0, 2)),
                    )
                )
                t += n
            rows = rows[:6]
            if sum(r.samples for r in rows) > L:
                rows = rows[:L]
        ours = kept.write(rows)
        fresh = make()
        theirs = fresh.write(rows)
        np.testing.assert_array_equal(ours[0], theirs[0])
        assert ours[1] == theirs[1]
        np.testing.assert_array_equal(kept.buffer, fresh.buffer, err_msg=f"step {step} ({kind})")
    assert decodes > 100
