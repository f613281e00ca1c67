"""The router's prefix index alone (no Ray): keys name whole prefixes, the longest holder wins."""

from jaxserve.serving.prefix_index import PrefixIndex, block_keys


def test_block_keys_name_whole_prefixes_and_skip_a_partial_block():
    a = block_keys(list(range(40)), 16)
    assert len(a) == 2  # 8 trailing tokens make no block
    b = block_keys([99] + list(range(1, 40)), 16)
    assert a[0] != b[0] and a[1] != b[1]  # a different first block changes every later key
    assert block_keys(list(range(32)) + [5] * 16, 16)[:2] == a


def test_match_finds_the_longest_holder_among_live_replicas():
    index = PrefixIndex(block_size=4)
    shared = list(range(12))
    index.insert(shared[:4] + [50, 51, 52, 53], "a")
    index.insert(shared + [60], "b")
    assert index.match(shared + [70, 71], ["a", "b"]) == (["b"], 3)
    assert index.match(shared[:4] + [50, 51, 52, 53, 9], ["a", "b"]) == (["a"], 2)
    assert index.match(shared, ["a"]) == (["a"], 1)  # b is not a candidate: a's one block is the best
    assert index.match(shared[:4], ["b", "a"]) == (["b", "a"], 1)  # both hold it, in the candidates' order
    assert index.match([7] * 12, ["a", "b"]) == ([], 0)
    assert index.match([1, 2], ["a", "b"]) == ([], 0)  # shorter than a block


def test_every_holder_of_the_longest_prefix_is_returned_and_removal_forgets_a_replica():
    index = PrefixIndex(block_size=4)
    ids = list(range(8))
    index.insert(ids, "a")
    index.insert(ids, "b")
    assert index.match(ids, ["b", "a"]) == (["b", "a"], 2)
    index.remove("b")
    assert index.match(ids, ["b", "a"]) == (["a"], 2)
    index.remove("a")
    assert len(index) == 0


def test_least_recently_used_blocks_go_past_the_bound():
    index = PrefixIndex(block_size=2, max_blocks=4)
    index.insert([1, 2, 3, 4], "a")
    index.insert([5, 6, 7, 8], "b")
    index.insert([1, 2, 3, 4], "a")  # touched again: b's blocks are now the oldest
    index.insert([9, 9], "c")
    assert len(index) == 4
    assert index.match([5, 6], ["b"]) == ([], 0)
    assert index.match([1, 2, 3, 4], ["a"]) == (["a"], 2)
