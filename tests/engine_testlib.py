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
