"""The rollback arithmetic of both caches, by hand-worked cases and against a replay of the tokens.

The replays keep each cache as the list of token ids it holds and check the
invariant of `handler.caches.rollback`: cached tokens + pending tokens == committed
tokens, with at least one pending token, and the draft cache keeping every fed
draft that agrees with the committed tokens. `hypothesis` is not in the
environment, so the property checks draw thousands of random steps from a
seeded `random.Random` instead.
"""

from __future__ import annotations

import random

import pytest

from handler.caches.rollback import draft_rollback, target_lengths_after_verify

PAD = -1  # the padding of a verify chunk beyond a row's own k; never a real token

# ------------------------------------------------------------------ the target


@pytest.mark.parametrize(
    ("num_accepted", "kept"),
    [
        (4, 10 + 1 + 4),  # all accepted: the bonus token is the new pending one
        (0, 10 + 1),  # none accepted: only the old pending token stays
        (2, 10 + 1 + 2),  # partial
    ],
)
def test_target_keeps_its_pending_token_and_the_accepted_drafts(num_accepted, kept):
    # 10 cached tokens, then a verify pass of the pending token and 4 drafts.
    assert target_lengths_after_verify([10 + 1 + 4], [4], [num_accepted]) == [kept]


def test_target_rows_of_different_k_drop_their_padding():
    # Three rows padded to width 4: cached 7, 3 and 5 tokens before the pass.
    lengths = [7 + 1 + 4, 3 + 1 + 4, 5 + 1 + 4]
    assert target_lengths_after_verify(lengths, [4, 2, 1], [3, 2, 0]) == [7 + 1 + 3, 3 + 1 + 2, 5 + 1]


def test_target_row_with_k_zero_keeps_only_its_pending_token():
    assert target_lengths_after_verify([9 + 1 + 3, 2 + 1 + 3], [3, 0], [1, 0]) == [9 + 1 + 1, 2 + 1]
    # Every row decoding plainly: a pass of width 0 is kept whole.
    assert target_lengths_after_verify([6, 1], [0, 0], [0, 0]) == [6, 1]


def test_target_refuses_more_accepted_than_drafted():
    with pytest.raises(AssertionError):
        target_lengths_after_verify([12], [2], [3])
    with pytest.raises(AssertionError):
        target_lengths_after_verify([12, 12], [2, 1], [0])


def test_target_replay_matches_the_committed_tokens():
    rng = random.Random(20261122)
    num_rows = 4
    committed = [[rng.randrange(3) for _ in range(rng.randint(1, 5))] for _ in range(num_rows)]
    # After its prefill a row holds all its prompt but the last token, which is pending.
    cached = [tokens[:-1] for tokens in committed]
    for _ in range(2000):
        step_ks = [rng.choice([0, 0, 1, 2, 3, 5]) for _ in range(num_rows)]
        width = max(step_ks)
        fed_cache, num_accepted = [], []
        for row in range(num_rows):
            k = step_ks[row]
            drafts = [rng.randrange(3) for _ in range(k)]
            # The verify chunk: the pending token, the row's drafts, padding up to the width.
            fed_cache.append(cached[row] + [committed[row][-1]] + drafts + [PAD] * (width - k))
            accepted = rng.randint(0, k)
            num_accepted.append(accepted)
            committed[row] += drafts[:accepted] + [rng.randrange(3)]  # then the recovered or bonus token
        kept = target_lengths_after_verify([len(tokens) for tokens in fed_cache], step_ks, num_accepted)
        for row in range(num_rows):
            cached[row] = fed_cache[row][: kept[row]]
            assert cached[row] + committed[row][-1:] == committed[row]


# ------------------------------------------------------------- the draft model


@pytest.mark.parametrize(
    ("committed", "expected"),
    [
        # k = 3, drafts 7 8 9, of which 7 and 8 were fed after the pending 5.
        ([7, 8, 9, 10], (0, [9, 10])),  # all accepted: the last draft was never fed
        ([3], (2, [3])),  # none accepted
        ([7, 4], (1, [4])),  # partial
        # The last committed token equals a fed draft, but stays pending: the
        # next proposal needs the logits after it.
        ([7, 8], (1, [8])),
        ([7], (2, [7])),
    ],
)
def test_draft_keeps_the_fed_drafts_that_match_but_never_the_last_committed_token(committed, expected):
    assert draft_rollback([5], [7, 8], [], committed) == expected


def test_draft_fed_drafts_longer_than_the_committed_tokens():
    # A row that stopped early (or a row with a smaller k in the batch) commits fewer tokens than were fed.
    assert draft_rollback([5], [7, 8, 9], [], [7, 2]) == (2, [2])
    assert draft_rollback([5], [7, 8, 9], [], [7, 8, 9]) == (1, [9])


def test_draft_row_that_committed_nothing_goes_back_to_before_the_proposal():
    assert draft_rollback([4, 5], [7, 8], [], []) == (4, [4, 5])
    assert draft_rollback([5], [], [], []) == (1, [5])


def test_draft_without_a_proposal_queues_the_committed_tokens():
    assert draft_rollback([], [], [4], [6, 2]) == (0, [4, 6, 2])
    assert draft_rollback([], [], [4], []) == (0, [4])


def test_draft_with_k_one_feeds_no_draft():
    assert draft_rollback([5], [], [], [9]) == (0, [9])
    assert draft_rollback([5], [], [], [7, 9]) == (0, [7, 9])


def test_draft_after_several_pending_tokens():
    # Hybrid mode: accepted look-up drafts were pending, then fed with the first model draft.
    assert draft_rollback([3, 4, 5], [6], [], [6, 1]) == (0, [1])
    assert draft_rollback([3, 4, 5], [6], [], [2]) == (1, [2])


def test_draft_refuses_pending_tokens_beside_fed_ones():
    with pytest.raises(AssertionError):
        draft_rollback([5], [7], [3], [7, 1])


def reference_draft_cache(cached: list[int], committed: list[int], before_proposal: list[int], new: list[int]):
    """The slow rule on token lists: the longest cached prefix that agrees with the committed tokens,
    short of the last one; or, when nothing was committed, the cache from before the proposal."""
    if not new:
        return list(before_proposal)
    num_agreeing = 0
    while num_agreeing < min(len(cached), len(committed) - 1) and cached[num_agreeing] == committed[num_agreeing]:
        num_agreeing += 1
    return cached[:num_agreeing]


def test_draft_replay_matches_the_committed_tokens():
    rng = random.Random(11)
    for _ in range(20):
        committed = [rng.randrange(3) for _ in range(rng.randint(1, 6))]
        cached, pending = committed[:-1], committed[-1:]  # after the drafter's prefill
        for _ in range(200):
            before_proposal = list(cached)
            fed_pending, fed = [], []
            proposed = rng.random() < 0.8
            if proposed:
                k = rng.randint(1, 5)
                drafts = [rng.randrange(3) for _ in range(k)]
                fed_pending, fed = pending, drafts[: k - 1]
                cached = cached + fed_pending + fed
                pending = []
                accepted = rng.randint(0, k)
                new = drafts[:accepted] + [rng.randrange(3)]
            else:  # the row was verified with look-up drafts: any tokens
                new = [rng.randrange(3) for _ in range(rng.randint(1, 4))]
            if rng.random() < 0.2:
                new = new[: rng.randint(0, len(new))]  # a stop string, or a row that committed nothing
            committed += new

            expected_cache = reference_draft_cache(cached, committed, before_proposal, new)
            num_dropped, pending = draft_rollback(fed_pending, fed, pending, new)
            assert num_dropped == len(cached) - len(expected_cache)
            cached = cached[: len(cached) - num_dropped]
            assert cached == expected_cache
            assert pending and cached + pending == committed
