"""The n-gram look-up: longest suffix first, earliest occurrence, incremental index."""

from __future__ import annotations

from handler.drafters.ngram import BULK_EXTEND, NgramDrafter, NgramIndex


def test_proposes_what_followed_the_longest_matching_suffix():
    # Suffix (1, 2) occurred at 0..2 and was followed by 3, 4, 1.
    assert NgramIndex([1, 2, 3, 4, 1, 2], 1, 3).lookup(3) == [3, 4, 1]
    # The 3-gram (9, 1, 2) beats the shorter (1, 2), which occurs later.
    index = NgramIndex([9, 1, 2, 7, 5, 1, 2, 8, 9, 1, 2], 1, 3)
    assert index.lookup(2) == [7, 5]


def test_takes_the_earliest_occurrence():
    index = NgramIndex([1, 2, 3, 1, 2, 4, 1, 2], 2, 2)
    assert index.lookup(1) == [3]
    # The suffix itself never counts, even as the first occurrence.
    assert NgramIndex([5, 1, 2], 2, 2).lookup(1) == []


def test_never_matches_the_suffix_itself_and_stops_at_the_end_of_the_row():
    assert NgramIndex([5, 6, 7], 1, 2).lookup(4) == []
    # The earlier (7,) is followed by only one token before the row ends.
    assert NgramIndex([7, 8, 7], 1, 1).lookup(5) == [8, 7]


def test_min_n_bounds_the_shortest_match():
    assert NgramIndex([1, 2, 3, 9, 3], 2, 3).lookup(2) == []
    assert NgramIndex([1, 2, 3, 9, 3], 1, 3).lookup(2) == [9, 3]


def test_incremental_extension_equals_building_from_scratch():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    grown = NgramIndex(tokens[:5], 1, 4)
    for start in range(5, len(tokens), 3):
        grown.extend(tokens[start : start + 3])
        scratch = NgramIndex(tokens[: start + 3], 1, 4)
        assert grown.first_end == scratch.first_end
        assert grown.lookup(5) == scratch.lookup(5)


def test_index_work_per_token_is_bounded_by_max_n():
    index = NgramIndex(list(range(10_000)), 1, 4)
    # One entry per n-gram end and length: linear in the tokens, never quadratic.
    assert len(index.first_end) <= 4 * 10_000


def test_drafter_tracks_rows_by_request_id():
    drafter = NgramDrafter(1, 3)
    drafter.add({"a": [1, 2, 3, 1], "b": [4, 5]})
    assert drafter.lookup("a", 2).token_ids == [2, 3]
    assert drafter.lookup("b", 2).token_ids == []
    drafter.observe({"b": [4]})
    assert drafter.lookup("b", 2).token_ids == [5, 4]
    assert drafter.lookup("a", 0).token_ids == []
    drafter.remove(["a"])
    assert "a" not in drafter.rows


def _indexed_token_by_token(tokens: list[int], min_n: int, max_n: int) -> tuple[dict, dict]:
    """The index as one token at a time enters it: each suffix a token follows becomes an occurrence."""
    from handler.drafters.ngram import MAX_OCCURRENCES

    first_end, more_ends = {}, {}
    for end in range(len(tokens)):
        for n in range(min_n, min(max_n, end) + 1):
            ngram = tuple(tokens[end - n : end])
            if first_end.setdefault(ngram, end) != end:
                more = more_ends.setdefault(ngram, [])
                if len(more) < MAX_OCCURRENCES - 1:
                    more.append(end)
    return first_end, more_ends


def test_an_index_grown_in_chunks_holds_each_ngrams_occurrences_as_one_token_at_a_time_does():
    import random

    generator = random.Random(0)
    for trial in range(60):
        min_n = generator.randint(1, 3)
        max_n = generator.randint(min_n, 8)
        # A small vocabulary repeats n-grams often: past MAX_OCCURRENCES, and inside one chunk.
        tokens = [generator.randrange(2 + trial % 6) for _ in range(generator.randint(0, 120))]
        cut = generator.randint(0, len(tokens))
        index = NgramIndex(tokens[:cut], min_n, max_n)
        while cut < len(tokens):
            step = generator.randint(0, 2 * BULK_EXTEND)  # one by one, and n by n
            index.extend(tokens[cut : cut + step])
            cut += step
        assert index.tokens == tokens
        assert (index.first_end, index.more_ends) == _indexed_token_by_token(tokens, min_n, max_n), trial
