"""The prefix cache's radix tree: matches to the token, LRU eviction, locks, the byte bound.

The KV here is fake: each token's slice holds its token id and position, so a
wrong copy, split or concatenation shows in the values.
"""

from __future__ import annotations

import random

import pytest
import torch

from handler.caches.prefix_cache import MIN_SHARED_TOKENS, PrefixCache, _shared_new_prefixes

NUM_LAYERS, NUM_HEADS, HEAD_DIM = 2, 1, 2
# float32 KV: bytes per token over every layer, keys and values.
BYTES_PER_TOKEN = NUM_LAYERS * 2 * NUM_HEADS * HEAD_DIM * 4


def fake_kv(tokens, start: int, end: int) -> torch.Tensor:
    """[layers, 2, heads, end - start, head_dim]: token id and position in every slot."""
    kv = torch.zeros((NUM_LAYERS, 2, NUM_HEADS, end - start, HEAD_DIM))
    for offset, position in enumerate(range(start, end)):
        kv[:, :, :, offset, 0] = tokens[position]
        kv[:, :, :, offset, 1] = position
    return kv


def insert(cache: PrefixCache, tokens):
    return cache.insert(tokens, lambda start, end: fake_kv(tokens, start, end))


def assert_kv_of(cache: PrefixCache, tokens, num_expected: int) -> None:
    match = cache.match(tokens)
    assert match.num_tokens == num_expected
    if num_expected:
        assert torch.equal(match.kv, fake_kv(tokens, 0, num_expected))
    else:
        assert match.kv is None


def node_count(cache: PrefixCache) -> int:
    stack, count = [cache.root], -1
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(node.children.values())
    return count


def test_a_match_is_the_longest_common_prefix_to_the_token():
    cache = PrefixCache(10**6)
    insert(cache, [1, 2, 3, 4, 5, 6])
    assert_kv_of(cache, [1, 2, 3, 4, 5, 6, 7, 8], 6)
    assert_kv_of(cache, [1, 2, 3, 9], 3)  # ends inside an edge
    assert_kv_of(cache, [1, 2, 3], 3)
    assert_kv_of(cache, [9, 1, 2], 0)
    assert_kv_of(cache, [], 0)


def test_diverging_inserts_split_an_edge_and_both_branches_keep_their_kv():
    cache = PrefixCache(10**6)
    first, second = [1, 2, 3, 4, 5], [1, 2, 3, 7, 8, 9]
    insert(cache, first)
    handle, num_cached = insert(cache, second)
    assert num_cached == len(second) and handle.tokens == (7, 8, 9)
    assert node_count(cache) == 3  # [1 2 3] -> [4 5], [7 8 9]
    assert_kv_of(cache, first, 5)
    assert_kv_of(cache, second, 6)
    assert len(cache) == 8 and cache.stats.num_bytes == 8 * BYTES_PER_TOKEN


def test_inserting_a_cached_prefix_adds_nothing_and_returns_its_end():
    cache = PrefixCache(10**6)
    insert(cache, [1, 2, 3, 4])
    calls = []
    handle, num_cached = cache.insert([1, 2], lambda start, end: calls.append((start, end)))
    assert calls == [] and num_cached == 2 and handle.tokens == (1, 2)
    assert len(cache) == 4


def test_query_counts_prompt_tokens_and_hits():
    cache = PrefixCache(10**6)
    insert(cache, [1, 2, 3])
    assert cache.query([1, 2, 3, 4, 5]) == 3
    assert cache.query([2, 3]) == 0
    assert (cache.stats.queries, cache.stats.hits) == (7, 3)


def test_the_least_recently_used_prefix_goes_first():
    cache = PrefixCache(6 * BYTES_PER_TOKEN)
    insert(cache, [1, 1, 1])
    insert(cache, [2, 2, 2])
    cache.match([1, 1, 1])  # [1 1 1] is now the more recently used
    insert(cache, [3, 3, 3])
    assert_kv_of(cache, [1, 1, 1], 3)
    assert_kv_of(cache, [2, 2, 2], 0)
    assert_kv_of(cache, [3, 3, 3], 3)
    assert cache.stats.evictions == 1 and cache.stats.evicted_tokens == 3


def test_a_locked_prefix_is_never_evicted_and_an_insert_keeps_what_fits():
    cache = PrefixCache(5 * BYTES_PER_TOKEN)
    handle, _ = insert(cache, [1, 2, 3, 4])
    cache.lock(handle)
    _, num_cached = insert(cache, [7, 8, 9])
    assert num_cached == 1  # one token's room left beside the locked four
    assert_kv_of(cache, [1, 2, 3, 4], 4)
    assert_kv_of(cache, [7, 8, 9], 1)
    cache.unlock(handle)
    insert(cache, [5, 5, 5, 5])
    assert_kv_of(cache, [1, 2, 3, 4], 0)
    assert cache.stats.num_bytes <= cache.max_bytes


def test_a_lock_below_a_split_still_protects_the_whole_path():
    cache = PrefixCache(8 * BYTES_PER_TOKEN)
    handle, _ = insert(cache, [1, 2, 3, 4, 5, 6])
    cache.lock(handle)
    insert(cache, [1, 2, 9])  # splits the locked edge after [1 2]
    cache.clear()
    assert_kv_of(cache, [1, 2, 3, 4, 5, 6], 6)
    assert_kv_of(cache, [1, 2, 9], 2)
    cache.unlock(handle)
    cache.clear()
    assert len(cache) == 0 and cache.stats.num_bytes == 0


def test_an_insert_never_evicts_the_path_it_extends():
    cache = PrefixCache(6 * BYTES_PER_TOKEN)
    insert(cache, [1, 2, 3])
    insert(cache, [5, 5])
    cache.match([5, 5])  # [1 2 3] is the least recently used
    _, num_cached = insert(cache, [1, 2, 3, 4, 4])
    assert num_cached == 5
    assert_kv_of(cache, [1, 2, 3, 4, 4], 5)
    assert_kv_of(cache, [5, 5], 0)


def test_a_flood_of_unique_prompts_stays_within_the_budget():
    rng = random.Random(0)
    cache = PrefixCache(100 * BYTES_PER_TOKEN)
    locked = []
    for index in range(300):
        tokens = [rng.randrange(50) for _ in range(rng.randrange(1, 60))]
        handle, _ = insert(cache, tokens)
        assert cache.stats.num_bytes <= cache.max_bytes
        assert cache.stats.num_bytes == len(cache) * BYTES_PER_TOKEN
        if index % 7 == 0:
            cache.lock(handle)
            locked.append((handle, tokens))
        if len(locked) > 2:
            cache.unlock(locked.pop(0)[0])
        for held, held_tokens in locked:
            depth = sum(len(node.tokens) for node in _path(held))
            assert cache.match(held_tokens).num_tokens >= depth  # still there
    assert cache.stats.evictions > 0


def _path(node):
    while node.parent is not None:
        yield node
        node = node.parent


def test_a_zero_budget_caches_nothing():
    cache = PrefixCache(0)
    handle, num_cached = insert(cache, [1, 2, 3])
    assert num_cached == 0 and handle is cache.root and len(cache) == 0


@pytest.mark.parametrize(
    ("prefixes", "num_cached", "expected"),
    [
        # Two rows with one new system prompt: it is computed once.
        ([[1] * 20 + [2], [1] * 20 + [3], [4] * 30], [0, 0, 0], [(1,) * 20]),
        # Identical prompts (n choices): the whole prompt.
        ([[5] * 20, [5] * 20], [0, 0], [(5,) * 20]),
        # Already cached: nothing new to share.
        ([[1] * 20 + [2], [1] * 20 + [3]], [20, 20], []),
        # Too short a shared part to pay for a pass of its own.
        ([[1] * (MIN_SHARED_TOKENS - 1) + [2], [1] * (MIN_SHARED_TOKENS - 1) + [3]], [0, 0], []),
        # Nested shared prefixes: the shortest serves them all.
        ([[1] * 20 + [2] * 5 + [3], [1] * 20 + [2] * 5 + [4], [1] * 20 + [9]], [0, 0, 0], [(1,) * 20]),
    ],
)
def test_shared_new_prefixes(prefixes, num_cached, expected):
    assert _shared_new_prefixes(prefixes, num_cached) == expected
