"""BackgroundCompile's bookkeeping without a model (issue 52, part 3): a token bucket is ready only
once every variant's executable of that size is built, in the planned order; the budget cap and the
steps' ready tuple follow; a bucket that fails to compile stays unready while the others go on; a
stop ends the thread between executables. The executable table is a stand-in that records what it
was asked to build."""

from __future__ import annotations

import threading
import types

from jaxserve.engine.buckets import MULTI_STEP, BucketTable, step_shapes
from jaxserve.runner.background_compile import BackgroundCompile


class Table:
    def __init__(self, fail: int | None = None, hold: threading.Event | None = None):
        self.built: list[tuple] = []
        self.fail, self.hold = fail, hold

    def get(self, key: tuple):
        if self.hold is not None:
            self.hold.wait()
        if key[0] == self.fail:
            raise RuntimeError("no memory left for this one")
        self.built.append(key)


def runner(table: Table, buckets: BucketTable):
    opened = []

    def warm_up(keys):
        opened.extend(keys)
        for key in keys:
            table.built.append(key)

    return types.SimpleNamespace(
        buckets=buckets, table=table, ctx=types.SimpleNamespace(ready_tokens=None), warm_up=warm_up, opened=opened
    )


def test_buckets_open_then_become_ready_whole_with_every_variant():
    buckets = BucketTable.build(4, 32, 8)  # token buckets 1, 4, 8, 16, 32; multi-step for 1 and 4
    keys = step_shapes(buckets, num_scheduler_steps=2)
    caps = []
    r = runner(Table(), buckets)
    background = BackgroundCompile(r, keys, caps.append)
    assert background.opening == (1, 4) and background.order[0] == 32
    background.open()
    assert sorted(r.opened) == sorted(k for k in keys if k[0] in (1, 4))
    assert (1, 8, MULTI_STEP) in r.opened and (4, 8, MULTI_STEP) in r.opened  # every variant of the opening
    assert r.ctx.ready_tokens == (1, 4) and caps[-1] == 4
    background.start()
    assert background.wait(30)
    assert background.ready == (1, 4, 8, 16, 32) and r.ctx.ready_tokens is None and caps[-1] == 32
    assert sorted(r.table.built) == sorted(keys) and len(set(r.table.built)) == len(keys)  # each once
    assert caps == sorted(caps)  # the cap only grows
    assert background.stats()["buckets_ready"] == background.stats()["buckets_total"] == 5


def test_a_failed_bucket_stays_unready_and_the_others_go_on():
    buckets = BucketTable.build(4, 32, 8)
    r = runner(Table(fail=32), buckets)
    background = BackgroundCompile(r, step_shapes(buckets), lambda cap: None)
    background.open()
    background.start()
    assert background.wait(30)
    assert background.ready == (1, 4, 8, 16) and [t for t, _ in background.failed] == [32]
    assert r.ctx.ready_tokens == (1, 4, 8, 16)  # steps never pick the failed bucket


def test_stop_ends_the_thread_without_building_more():
    buckets = BucketTable.build(4, 32, 8)
    hold = threading.Event()
    table = Table(hold=hold)
    r = runner(table, buckets)
    background = BackgroundCompile(r, step_shapes(buckets), lambda cap: None)
    background.open()
    background.start()
    threading.Timer(0.2, hold.set).start()  # the build under way ends; none after it
    background.stop(timeout=30)
    assert not background.running
    assert len([k for k in table.built if k[0] not in (1, 4)]) <= 1
    assert background.ready == (1, 4)  # a build finished after stop is not published
