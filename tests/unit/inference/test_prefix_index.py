"""The prefix store's index: which block-aligned prompt prefixes have K/V stored (no torch)."""

from __future__ import annotations

from services.inference.prefix_index import PrefixIndex


def stored(index: PrefixIndex, *prompts: list[int]) -> None:
    """Insert and commit each prompt's full blocks, as a step that prefilled them would."""
    for prompt in prompts:
        index.insert(prompt)
        index.commit()


def test_match_returns_the_longest_stored_prefix_in_whole_blocks() -> None:
    index = PrefixIndex(num_blocks=8, block_size=2)
    stored(index, [1, 2, 3, 4, 5, 6])
    assert index.match([1, 2, 3, 4, 5, 6, 7], 7) == (0, 1, 2)
    assert index.match([1, 2, 3, 4, 9, 9], 6) == (0, 1)  # the third block differs
    assert index.match([1, 2, 3], 3) == (0,)  # a partial block is never matched
    assert index.match([2, 1, 3, 4], 4) == ()  # the same second block after another first one


def test_match_stays_within_max_tokens() -> None:
    index = PrefixIndex(num_blocks=8, block_size=4)
    stored(index, list(range(12)))
    assert index.match(list(range(12)), 12) == (0, 1, 2)
    assert index.match(list(range(12)), 11) == (0, 1)  # 11 tokens hold two whole blocks
    assert index.match(list(range(12)), 3) == ()


def test_inserted_blocks_are_pending_until_commit() -> None:
    index = PrefixIndex(num_blocks=4, block_size=2)
    assert index.insert([1, 2, 3, 4, 5]) == ((0, 0), (1, 1))  # (block of the sequence, store block)
    assert index.match([1, 2, 3, 4], 4) == ()  # the step that writes their K/V has not run
    assert index.insert([1, 2, 3, 4]) == ()  # already reserved: nothing to save twice
    index.commit()
    assert index.match([1, 2, 3, 4], 4) == (0, 1)


def test_rollback_frees_the_pending_blocks_only() -> None:
    index = PrefixIndex(num_blocks=3, block_size=2)
    stored(index, [1, 2])
    assert index.insert([5, 6, 7, 8]) == ((0, 1), (1, 2))
    index.rollback()
    assert index.num_used_blocks == 1
    assert index.match([5, 6, 7, 8], 4) == () and index.match([1, 2], 2) == (0,)
    ((_, reused),) = index.insert([5, 6])
    assert reused in (1, 2) and index.match([1, 2], 2) == (0,)  # a freed block, not an eviction


def test_a_full_store_evicts_the_least_recently_used_block() -> None:
    index = PrefixIndex(num_blocks=2, block_size=2)
    stored(index, [1, 2], [3, 4])  # store blocks 0 and 1
    assert index.match([1, 2], 2) == (0,)  # [1, 2] is now the most recently used
    assert index.insert([5, 6]) == ((0, 1),)  # so [3, 4]'s block 1 is taken
    index.commit()
    assert index.match([3, 4], 2) == ()
    assert index.match([1, 2], 2) == (0,) and index.match([5, 6], 2) == (1,)


def test_pending_blocks_are_never_evicted() -> None:
    index = PrefixIndex(num_blocks=2, block_size=2)
    assert index.insert([1, 2, 3, 4, 5, 6]) == ((0, 0), (1, 1))  # no room for the third block
    assert index.num_used_blocks == 2
    index.commit()
    assert index.match([1, 2, 3, 4], 4) == (0, 1)


def test_a_hash_collision_is_a_miss_not_wrong_kv() -> None:
    # In CPython hash(-1) == hash(-2), so these one-token blocks get the same key.
    assert hash((None, (-1,))) == hash((None, (-2,)))
    index = PrefixIndex(num_blocks=4, block_size=1)
    stored(index, [-1])
    assert index.match([-2], 1) == ()  # same key, other tokens: compared, so a miss
    assert index.match([-1], 1) == (0,)


def test_counters_count_lookups_hits_and_reused_tokens() -> None:
    index = PrefixIndex(num_blocks=4, block_size=2)
    stored(index, [1, 2, 3, 4])
    index.match([1, 2, 3, 4, 5], 5)
    index.match([9, 9], 2)
    index.match([1, 2, 7, 7], 4)
    assert (index.num_lookups, index.num_hits, index.num_hit_tokens) == (3, 2, 6)


def test_clear_forgets_everything() -> None:
    index = PrefixIndex(num_blocks=3, block_size=2)
    stored(index, [1, 2, 3, 4])
    index.insert([7, 8])
    index.clear()
    assert index.num_used_blocks == 0 and index.match([1, 2], 2) == ()
    assert index.insert([1, 2, 3, 4, 5, 6]) == ((0, 0), (1, 1), (2, 2))
