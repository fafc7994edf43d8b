"""The suffix drafter: its own tree and the shared one, counts, bounds, eviction, who sees what."""

from __future__ import annotations

import pytest

from handler.drafters import NO_DRAFTS
from handler.drafters.suffix import SuffixDrafter, SuffixOptions, SuffixTreeStats

ANSWER = [20, 21, 22, 23, 24, 25, 26, 27]  # an earlier request's output
PROMPT = [1, 2, 3]


def answered(drafter: SuffixDrafter, request_id, prompt, output, step: int = 3) -> None:
    """A whole request: joins, commits its output a few tokens per step, leaves."""
    drafter.add({request_id: prompt})
    for start in range(0, len(output), step):
        drafter.observe({request_id: output[start : start + step]})
    drafter.remove([request_id])


def test_proposes_the_continuation_of_the_request_own_text():
    drafter = SuffixDrafter(SuffixOptions(share_across_requests=False))
    drafter.add({"a": [5, 6, 7, 8, 9, 1, 5, 6]})
    lookup = drafter.lookup("a", 8)
    # "5 6" matched; a proposal is at most as long as the match that supports it. "5 6" was
    # followed by 7 once and ended the text once: each step down the path is an even bet.
    assert lookup.token_ids == [7, 8]
    assert lookup.probs == pytest.approx([0.5, 0.5])
    drafter.observe({"a": [7, 8]})
    assert drafter.lookup("a", 8).token_ids == [9, 1, 5, 6]
    assert drafter.lookup("a", 2).token_ids == [9, 1]
    assert drafter.lookup("a", 0) is NO_DRAFTS


def test_learns_across_requests_and_weighs_continuations_by_count():
    drafter = SuffixDrafter(SuffixOptions())
    answered(drafter, "a", PROMPT, ANSWER)
    assert drafter.stats == SuffixTreeStats(num_requests=1, num_tokens=len(ANSWER))
    # A new request that has just written the answer's first tokens gets the rest from the shared tree.
    drafter.add({"b": [9, 20, 21, 22, 23]})  # 4 tokens matched: up to 4 proposed
    assert drafter.lookup("b", 4).token_ids == [24, 25, 26, 27]
    # Two outputs went one way after 22 and one the other: the estimate follows the counts.
    answered(drafter, "c", PROMPT, [20, 21, 22, 23, 24, 25, 26, 27])
    answered(drafter, "d", PROMPT, [20, 21, 22, 90, 91, 92, 93, 94])
    drafter.add({"e": [9, 20, 21, 22]})
    lookup = drafter.lookup("e", 3)
    assert lookup.token_ids == [23, 24, 25]
    assert lookup.probs == pytest.approx([2 / 3, 2 / 3, 2 / 3])


def test_stops_where_the_path_probability_falls_below_min_token_prob():
    outputs = [[30, 31, 32, 40 + i, 50, 51] for i in range(4)]  # after 30 31 32: four endings, once each
    for min_token_prob, expected in ((0.1, [1.0, 0.25]), (0.3, [1.0])):
        drafter = SuffixDrafter(SuffixOptions(min_token_prob=min_token_prob))
        for i, output in enumerate(outputs):
            answered(drafter, i, PROMPT, output)
        drafter.add({"new": [7, 8, 30, 31]})
        lookup = drafter.lookup("new", 4)
        assert lookup.token_ids[:1] == [32] and lookup.token_ids[1:] in ([], [40], [41], [42], [43])
        assert lookup.probs == pytest.approx(expected)


def test_max_depth_bounds_the_match_and_the_proposal_together():
    # Depth 4: a 2-token match and 2 drafts. Depth 24: 9 of the 10 tokens matched, 9 drafts.
    for max_depth, expected in ((4, [110, 111]), (24, list(range(110, 119)))):
        drafter = SuffixDrafter(SuffixOptions(max_depth=max_depth))
        answered(drafter, "a", PROMPT, list(range(100, 120)))
        drafter.add({"b": list(range(100, 110))})
        assert drafter.lookup("b", 16).token_ids == expected


def test_the_shared_tree_evicts_the_oldest_output_beyond_its_bounds():
    drafter = SuffixDrafter(SuffixOptions(max_cached_requests=2))
    answered(drafter, "a", PROMPT, [60, 61, 62, 63])
    answered(drafter, "b", PROMPT, [70, 71, 72, 73])
    answered(drafter, "c", PROMPT, [80, 81, 82, 83])
    assert drafter.stats == SuffixTreeStats(2, 8)
    drafter.add({"x": [60, 61]})
    drafter.add({"y": [9, 80, 81]})
    assert drafter.lookup("x", 2) is NO_DRAFTS  # a's output went first
    assert drafter.lookup("y", 2).token_ids == [82, 83]

    by_tokens = SuffixDrafter(SuffixOptions(max_cached_tokens=10))
    answered(by_tokens, "a", PROMPT, [60, 61, 62, 63, 64, 65])
    answered(by_tokens, "b", PROMPT, [70, 71, 72, 73, 74, 75])
    assert by_tokens.stats == SuffixTreeStats(1, 6)


def test_a_running_request_evicted_from_the_shared_tree_goes_on_feeding_it():
    drafter = SuffixDrafter(SuffixOptions(max_cached_tokens=6))
    drafter.add({"long": PROMPT})
    drafter.observe({"long": [60, 61, 62, 63]})
    drafter.observe({"long": [64, 65, 66]})  # 7 tokens: its own first part is evicted
    assert drafter.stats == SuffixTreeStats(0, 0)
    drafter.observe({"long": [67, 68, 69]})
    assert drafter.stats == SuffixTreeStats(1, 3)
    drafter.remove(["long"])
    drafter.add({"next": [67, 68]})
    assert drafter.lookup("next", 1).token_ids == [69]


def test_updates_token_by_token_equal_updates_in_chunks():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    one, chunks = SuffixDrafter(), SuffixDrafter()
    one.add({0: tokens[:4]})
    chunks.add({0: tokens[:4]})
    for start in range(4, len(tokens), 5):
        for token in tokens[start : start + 5]:
            one.observe({0: [token]})
        chunks.observe({0: tokens[start : start + 5]})
        assert one.lookup(0, 8) == chunks.lookup(0, 8)
    assert one.stats == chunks.stats == SuffixTreeStats(1, len(tokens) - 4)


def test_nothing_is_shared_when_the_server_or_the_request_says_so():
    closed = SuffixDrafter(SuffixOptions(share_across_requests=False))
    answered(closed, "a", PROMPT, ANSWER)
    closed.add({"b": [20, 21, 22]})
    assert closed.stats == SuffixTreeStats(0, 0) and closed.lookup("b", 4) is NO_DRAFTS

    drafter = SuffixDrafter()
    # A private request's output never enters the shared tree...
    drafter.add({"private": PROMPT}, private=["private"])
    drafter.observe({"private": ANSWER})
    drafter.remove(["private"])
    assert drafter.stats == SuffixTreeStats(0, 0)
    # ...and a private request never drafts from what others wrote, only from its own text.
    answered(drafter, "a", PROMPT, ANSWER)
    drafter.add({"reader": [20, 21, 22]}, private=["reader"])
    drafter.add({"sharer": [20, 21, 22]})
    assert drafter.lookup("reader", 4) is NO_DRAFTS
    assert drafter.lookup("sharer", 4).token_ids == [23, 24]


def test_remove_forgets_the_request_but_keeps_its_output():
    drafter = SuffixDrafter()
    drafter.add({"a": PROMPT})
    drafter.observe({"a": ANSWER})
    drafter.remove(["a", "never-added"])
    assert "a" not in drafter.rows and drafter.stats == SuffixTreeStats(1, len(ANSWER))
    drafter.observe({"a": [1, 2]})  # a late observation of a gone row is ignored
    assert drafter.stats == SuffixTreeStats(1, len(ANSWER))


def test_a_continuation_guesses_past_uncommitted_drafts_from_both_trees():
    drafter = SuffixDrafter(SuffixOptions())
    answered(drafter, "a", PROMPT, ANSWER)
    drafter.add({"b": [9, 8, 20]})
    # Committed "... 20", drafted "21 22": the shared tree knows what followed, as far as the match.
    assert drafter.continuation("b", [21, 22], 8) == [23, 24, 25]
    assert drafter.continuation("b", [21, 22], 2) == [23, 24]
    assert drafter.continuation("b", [21, 99], 8) == []  # nothing ever followed "21 99"
    assert drafter.continuation("b", [21, 22], 0) == []
    assert drafter.continuation("gone", [21], 4) == []
    # The drafts are guesses' context only: nothing was committed, the look-up is unchanged.
    assert drafter.lookup("b", 8).token_ids == [21]
    # A private request neither reads the shared tree nor guesses from it.
    drafter.add({"c": [9, 8, 20]}, private=["c"])
    assert drafter.continuation("c", [21, 22], 8) == []
