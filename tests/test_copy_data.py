"""The copy-stage data of the small model's training (scripts/train_small_model.py) and the function
extraction it and the speculation benchmark's copy workload share (scripts/corpus.py, functions_in)."""

import numpy as np
import train_small_model as train
from corpus import functions_in

SOURCE = '''import os


def short(a):
    return a


def longer(a, b):
    """Doc."""
    if a:

        return b
    return a
x = 1
class C:
    def method(self):
        return 1
def last(z):
    y = z
    return y

'''


def test_functions_end_at_the_next_unindented_line_and_drop_trailing_blanks():
    assert functions_in(SOURCE, 1, 99) == [
        "def short(a):\n    return a",
        'def longer(a, b):\n    """Doc."""\n    if a:\n\n        return b\n    return a',
        "def last(z):\n    y = z\n    return y",
    ]
    assert functions_in(SOURCE, 3, 3) == ["def last(z):\n    y = z\n    return y"]  # methods are not top level


def test_copy_batches_end_with_an_example_after_plain_text_and_are_a_function_of_the_step():
    examples = [np.arange(100, 110, dtype=np.int32), np.arange(200, 230, dtype=np.int32)]
    stream = np.arange(5000, 6000, dtype=np.uint16)
    batch = train.copy_batch_at(examples, stream, step=7, batch=6, seq=63, seed=0)
    assert batch.shape == (6, 64) and batch.dtype == np.int32
    for row in batch:
        ex = next(e for e in examples if np.array_equal(row[-len(e) :], e))
        plain = row[: -len(ex)]
        assert np.all(plain >= 5000) and np.all(np.diff(plain) == 1)  # one contiguous window of the stream
    np.testing.assert_array_equal(batch, train.copy_batch_at(examples, stream, 7, 6, 63, 0))
    assert not np.array_equal(batch, train.copy_batch_at(examples, stream, 8, 6, 63, 0))


def test_repeat_rows_are_plain_text_then_one_random_segment_repeated_to_the_end():
    examples = [np.arange(100, 110, dtype=np.int32)]
    stream = np.arange(9000, 10000, dtype=np.uint16)  # above the vocabulary: tells plain text from the segment
    plain_batch = train.copy_batch_at(examples, stream, step=3, batch=4, seq=511, seed=0)
    batch = train.copy_batch_at(examples, stream, step=3, batch=4, seq=511, seed=0, repeats=2)
    np.testing.assert_array_equal(batch[:2], plain_batch[:2])  # the function rows do not move
    for row in batch[2:]:
        fill = int(np.sum(row >= 9000))
        assert np.all(row[:fill] >= 9000) and np.all(np.diff(row[:fill]) == 1)
        body = row[fill:]
        period = next(p for p in range(16, 129) if np.array_equal(body[p:], body[:-p]))
        assert len(body) >= 3 * period and np.all((body >= 4) & (body < train.VOCAB_SIZE))
