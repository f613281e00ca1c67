"""Driving an engine step by step in tests: each step's scheduler plan recorded, its deltas summed."""

from jaxserve.engine.output_processor import OutputAccumulator


class StepRecorder:
    """`with StepRecorder(engine) as rec:` wraps the scheduler's `schedule` so that `rec.plans` holds
    every step's SchedulerOutput; `rec.step()` runs one engine step (through `steps`, the LLM's
    `Overlap`, when given: async scheduling's steps in flight) and adds its deltas to `rec.totals`
    (the engine emits deltas); `rec.token_ids()` gives each request's output ids."""

    def __init__(self, engine, steps=None):
        self.engine, self.plans, self.totals = engine, [], OutputAccumulator()
        self.steps = steps if steps is not None else engine
        self._schedule = engine.scheduler.schedule

    def __enter__(self):
        def recording_schedule():
            self.plans.append(self._schedule())
            return self.plans[-1]

        self.engine.scheduler.schedule = recording_schedule
        return self

    def __exit__(self, *exc):
        self.engine.scheduler.schedule = self._schedule

    def step(self) -> None:
        for delta in self.steps.step():
            self.totals.add(delta)

    def mixed_step(self, running: list) -> tuple[dict, list[int]]:
        """One step that must be mixed with every `running` sequence decoding in it (one token, plus
        any drafts): its rows by sequence (id), and the tokens each running sequence gained."""
        before = [len(s.output_token_ids) for s in running]
        self.step()
        plan = self.plans[-1]
        assert plan.kind == "mixed"
        by_seq = {id(r.seq): r for r in plan.rows}
        assert all(by_seq[id(s)].num_tokens == 1 for s in running)  # every stream decodes this step
        return by_seq, [len(s.output_token_ids) - b for s, b in zip(running, before)]

    def token_ids(self) -> dict:
        return {rid: out.outputs[0].token_ids for rid, out in self.totals.outputs.items()}


def random_traffic(llm, rng, rounds, *, penalties=False, after_each=lambda: None) -> None:
    """Random adds (n = 1 or 2, greedy or seeded sampling, 1-39 prompt ids; with `penalties` a
    repetition penalty on every third), aborts (of a request in the step in flight when there is one)
    and overlap steps, `rounds` times, then every request to its end; `after_each()` runs after each
    action. No delta, nor an aborted request's last one, may show a placeholder."""
    from jaxserve import SamplingParams

    engine, live, next_id = llm.engine, set(), 0
    for _ in range(rounds):
        action = rng.randint(4)
        if action == 0 or not live:
            params = SamplingParams(
                max_tokens=int(rng.randint(1, 30)),
                temperature=float(rng.rand() < 0.5),
                n=int(rng.choice([1, 1, 2])),
                seed=next_id,
                repetition_penalty=1.2 if penalties and next_id % 3 == 0 else 1.0,
            )
            engine.add_request(f"q{next_id}", None, params, rng.randint(3, 500, size=rng.randint(1, 40)).tolist())
            live.add(f"q{next_id}")
            next_id += 1
        elif action == 1:
            in_flight = llm.overlap.in_flight[-1] if llm.overlap.in_flight else None
            ids = sorted({r.seq.request_id for r in in_flight.batch.rows} & live) if in_flight else []
            victim = ids[rng.randint(len(ids))] if ids else sorted(live)[rng.randint(len(live))]
            out = engine.abort_request(victim)
            live.discard(victim)
            assert out is None or all(t >= 0 for c in out.outputs for t in c.token_ids)
        else:
            for out in llm.overlap.step():
                assert all(t >= 0 for c in out.outputs for t in c.token_ids)
                if out.finished:
                    live.discard(out.request_id)
        after_each()
    while llm.overlap.has_unfinished_requests():
        llm.overlap.step()
