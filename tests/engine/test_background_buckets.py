"""The bucket rules of serving while the rest compile (host only): which token buckets open, in what
order the others compile, and which ready bucket a step takes meanwhile."""

import pytest

from jaxserve.engine.buckets import (
    MULTI_STEP,
    BucketTable,
    background_order,
    opening_buckets,
    pick_step_shape,
    step_shapes,
)


def test_opening_buckets_hold_a_lone_decode_and_every_rows_decodes():
    assert opening_buckets(BucketTable.build(16, 512, 64)) == (1, 16)
    assert opening_buckets(BucketTable.build(2, 16, 8)) == (1, 4)
    assert opening_buckets(BucketTable.build(12, 512, 64)) == (1, 16)  # the bucket holding 12 rows
    assert opening_buckets(BucketTable.build(1, 1, 8)) == (1,)


def test_background_order_is_largest_first_then_the_widest_gap():
    table = BucketTable.build(16, 512, 64)
    order = background_order(table.token_counts, (1, 16))
    assert sorted(order) == [4, 8, 32, 64, 128, 256, 512]
    assert order[0] == 512  # the full budget: a long prompt in few steps
    assert order[1] in (64, 128)  # the middle of 16..512, the widest gap left
    assert order.index(4) < order.index(8)  # 1..16 is wider than 64..128 once 64 is in
    assert background_order((1, 4), (1, 4)) == []


def test_a_step_takes_the_smallest_ready_bucket_that_holds_it():
    table = BucketTable.build(16, 512, 64)
    assert pick_step_shape(table, 3, 5) == (4, 64)
    assert pick_step_shape(table, 3, 5, ready=(1, 16)) == (16, 64)
    assert pick_step_shape(table, 1, 5, ready=(1, 16)) == (1, 64)
    assert pick_step_shape(table, 100, 5, ready=(1, 16, 512)) == (512, 64)
    # Above every ready bucket (the capped budget makes none): the table's, compiled then.
    assert pick_step_shape(table, 100, 5, ready=(1, 16)) == (128, 64)
    with pytest.raises(ValueError):
        pick_step_shape(table, 3, 65, ready=(1, 16))


def test_multi_step_is_planned_for_the_bucket_every_rows_decode_takes():
    """Two rows' decodes take the 4-token bucket: its multi-step variant is planned (it used to be
    compiled unplanned at the first two-row decode), and it opens with it."""
    table = BucketTable.build(2, 16, 8)
    multi = [s[0] for s in step_shapes(table, 4) if s[2:] == (MULTI_STEP,)]
    assert multi == [1, 4] and opening_buckets(table) == (1, 4)
    assert [s[0] for s in step_shapes(BucketTable.build(16, 256, 8), 4) if s[2:]] == [1, 4, 8, 16]
