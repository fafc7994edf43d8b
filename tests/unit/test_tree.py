"""Draft trees on small hand-made trees: depths, ordering, the attention mask, the walk, n-gram trees."""

from __future__ import annotations

import pytest
import torch

from handler.drafters import Proposal
from handler.drafters.ngram import MAX_OCCURRENCES, NgramIndex
from handler.tree import (
    ROOT,
    chunk_attention,
    depths,
    first_choice_path,
    is_chain,
    off_first_choice,
    order_best_first,
    verify_tree,
)

# root ─┬─ 0:a ─┬─ 2:c ── 4:e
#       │       └─ 3:d
#       └─ 1:b
TOKENS = [10, 11, 12, 13, 14]
PARENTS = [ROOT, ROOT, 0, 0, 2]


def one_hot(token_ids: list[int], vocab: int = 16) -> torch.Tensor:  # [len, vocab]
    probs = torch.zeros(len(token_ids), vocab)
    probs[torch.arange(len(token_ids)), torch.tensor(token_ids)] = 1.0
    return probs


def test_depths_and_chains():
    assert depths(PARENTS) == [1, 1, 2, 2, 3]
    assert is_chain([ROOT, 0, 1]) and is_chain([])
    assert not is_chain(PARENTS)
    with pytest.raises(AssertionError):
        depths([ROOT, 2, 0])  # a parent after its child


def test_lookup_prefix_keeps_a_tree_and_knows_a_chain():
    lookup = Proposal(TOKENS, [0.9, 0.5, 0.4, 0.3, 0.2], PARENTS)
    assert lookup.is_tree
    assert lookup.prefix(1) == Proposal([10], [0.9], [ROOT])
    assert not lookup.prefix(1).is_tree
    assert not Proposal([1, 2, 3]).is_tree


def test_chunk_attention_sees_the_root_and_its_ancestors_only():
    allowed, depth = chunk_attention([PARENTS], width=6)
    # Column 1 + i is node i; column 0 the root; column 6 padding.
    expected = {
        0: {0},
        1: {0, 1},
        2: {0, 2},
        3: {0, 1, 3},
        4: {0, 1, 4},
        5: {0, 1, 3, 5},
        6: {0, 6},
    }
    for column, seen in expected.items():
        assert set(allowed[0, column].nonzero().flatten().tolist()) == seen, column
    assert depth[0].tolist() == [0, 1, 1, 2, 2, 3, 1]


def test_a_chain_mask_is_causal():
    allowed, depth = chunk_attention([[ROOT, 0, 1], [ROOT]], width=3)
    assert torch.equal(allowed[0], torch.ones(4, 4, dtype=torch.bool).tril())
    assert depth.tolist() == [[0, 1, 2, 3], [0, 1, 1, 1]]


def test_order_best_first_puts_parents_first_and_the_likeliest_next():
    token_ids, parents, scores = order_best_first(TOKENS, PARENTS, [0.3, 0.6, 0.2, 0.25, 0.1])
    assert token_ids == [11, 10, 13, 12, 14]
    assert parents == [ROOT, ROOT, 1, 1, 3]
    assert scores == [0.6, 0.3, 0.25, 0.2, 0.1]
    # A child scored above its parent still waits for it.
    token_ids, parents, _ = order_best_first([1, 2], [ROOT, 0], [0.1, 0.9])
    assert (token_ids, parents) == ([1, 2], [ROOT, 0])


@pytest.mark.parametrize("scored", ["any", "never-above-the-parent", "best-first-already"])
def test_order_best_first_is_the_greedy_pick_among_the_nodes_whose_parent_is_placed(scored):
    """Over random trees with tied scores, rising ones, ones that never rise from parent to child (a
    look-up's, which take the sort) or already in order (kept as they are): at each place, of the nodes
    whose parent is placed, the highest score, ties to the earlier node (the definition, picked by a scan)."""
    import random

    rng = random.Random(5)
    for _ in range(300):
        num = rng.randint(1, 24)
        parents = [rng.randint(ROOT, index - 1) for index in range(num)]
        scores = [rng.choice((0.1, 0.2, 0.5, rng.random())) for _ in range(num)]
        if scored == "never-above-the-parent":
            for index, parent in enumerate(parents):
                if parent != ROOT:
                    scores[index] = min(scores[index], scores[parent])
        elif scored == "best-first-already":
            scores.sort(reverse=True)
        order, placed = [], set()
        while len(order) < num:
            available = [n for n in range(num) if n not in placed and (parents[n] == ROOT or parents[n] in placed)]
            best = max(available, key=lambda node: (scores[node], -node))
            order.append(best)
            placed.add(best)
        token_ids, new_parents, new_scores = order_best_first(list(range(num)), parents, scores)
        assert token_ids == order
        assert new_scores == [scores[node] for node in order]
        assert [ROOT if p == ROOT else token_ids[p] for p in new_parents] == [parents[n] for n in order]


def test_greedy_walk_descends_while_the_target_agrees():
    # The target wants a, then d, then 7: accepts a and d, emits 7 (d has no children).
    target_probs = one_hot([10, 13, 9, 9, 7, 9])  # columns: root, a, b, c, d, e
    path, emitted = verify_tree(target_probs, TOKENS, PARENTS, [0.0] * 4)
    assert path == [0, 1, 4]
    assert emitted == [10, 13, 7]


def test_greedy_walk_takes_the_second_branch_and_stops_on_a_miss():
    target_probs = one_hot([11, 9, 5, 9, 9, 9])
    path, emitted = verify_tree(target_probs, TOKENS, PARENTS, [0.0] * 4)
    assert (path, emitted) == ([0, 2], [11, 5])
    path, emitted = verify_tree(one_hot([3, 9, 9, 9, 9, 9]), TOKENS, PARENTS, [0.0] * 4)
    assert (path, emitted) == ([0], [3])


def test_the_walk_uses_each_depth_own_uniform():
    uniform_probs = torch.full((6, 16), 1 / 16)
    # Depth 0 draws token 10 (uniform in [10/16, 11/16)), depth 1 draws 12, depth 2 draws 14.
    uniforms = [10.5 / 16, 12.5 / 16, 14.5 / 16, 0.0]
    path, emitted = verify_tree(uniform_probs, TOKENS, PARENTS, uniforms)
    assert (path, emitted) == ([0, 1, 3, 5], [10, 12, 14, 0])


def test_first_choice_path_follows_first_children():
    assert first_choice_path(PARENTS, 3) == [0, 1, 3, 5]
    assert first_choice_path(PARENTS, 1) == [0, 1]
    assert first_choice_path([ROOT, 0], 5) == [0, 1, 2]


def test_off_first_choice_marks_all_but_the_best_scored_path():
    # Node 2 (c) outscores its sibling 3 (d), and 0 (a) outscores 1 (b): the path is a, c, e.
    assert off_first_choice(PARENTS, [0.9, 0.5, 0.6, 0.3, 0.4]) == [False, True, False, True, False]
    # A better-scored sibling takes the path, with its subtree; ties go to the earlier node.
    assert off_first_choice(PARENTS, [0.9, 0.5, 0.3, 0.6, 0.4]) == [False, True, True, False, True]
    assert off_first_choice([ROOT, ROOT], [0.5, 0.5]) == [False, True]
    ordered = order_best_first(list("abcde"), PARENTS, [0.9, 0.5, 0.3, 0.6, 0.4])
    off = off_first_choice(ordered[1], ordered[2])
    assert [column for column in range(1, 6) if not off[column - 1]] == first_choice_path(ordered[1], 9)[1:]


def test_ngram_tree_merges_the_occurrences_continuations():
    # (1, 2) occurs three times, followed by 3 4 5 / 3 7 8 / 3 4 9.
    index = NgramIndex([1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 1, 2, 3, 4, 9, 1, 2], 1, 4)
    lookup = index.lookup_tree(8)
    assert lookup.token_ids[0] == 3 and lookup.shares[0] == 1.0
    paths = set()
    for node in range(len(lookup.token_ids)):
        tokens, parent = [], node
        while parent != ROOT:
            tokens.insert(0, lookup.token_ids[parent])
            parent = lookup.parents[parent]
        paths.add(tuple(tokens))
    assert {(3, 4), (3, 7), (3, 4, 5), (3, 4, 9)} <= paths
    shares = dict(zip(lookup.token_ids[:2], lookup.shares[:2]))
    assert shares == {3: 1.0, 4: pytest.approx(2 / 3)}
    assert lookup.shares == sorted(lookup.shares, reverse=True)
    # Shallow nodes before deep ones of the same share: the alternatives fit a small budget.
    assert index.lookup_tree(3).token_ids == [3, 4, 7]
    # Parents come first, and the budget holds.
    assert all(parent < node for node, parent in enumerate(lookup.parents))
    assert len(index.lookup_tree(3).token_ids) == 3


def test_ngram_tree_of_one_occurrence_is_the_chain():
    index = NgramIndex([5, 6, 7, 8, 9, 5, 6], 1, 4)
    assert index.lookup_tree(3) == Proposal([7, 8, 9], None, [ROOT, 0, 1], [1.0, 1.0, 1.0])
    assert index.lookup(3) == [7, 8, 9]
    assert index.lookup_tree(3).is_tree is False


def test_ngram_tree_follows_at_most_max_occurrences():
    index = NgramIndex([1, 2] * 20 + [1], 1, 1)
    assert len(index.more_ends[(1,)]) == MAX_OCCURRENCES - 1


def test_suffix_tree_look_up_merges_the_request_tree_and_the_shared_tree():
    from handler.drafters.suffix import SuffixDrafter

    drafter = SuffixDrafter()
    # An earlier answer continued (1, 2, 3) with 7 8; this request's own text with 4 5.
    drafter.add({"earlier": [9]})
    drafter.observe({"earlier": [1, 2, 3, 7, 8, 1, 2, 3, 7, 8]})
    drafter.remove(["earlier"])
    drafter.add({"now": [1, 2, 3, 4, 5, 6, 1, 2, 3]})
    chain = drafter.lookup("now", 4)
    merged = drafter.lookup("now", 4, tree=True)
    assert chain.parents is None and len(chain.token_ids) >= 1
    assert merged.is_tree
    roots = {token for token, parent in zip(merged.token_ids, merged.parents) if parent == ROOT}
    assert roots == {4, 7}
    assert merged.probs == sorted(merged.probs, reverse=True)
    private = SuffixDrafter()
    private.add({"now": [1, 2, 3, 4, 5, 6, 1, 2, 3]}, private=["now"])
    assert not private.lookup("now", 4, tree=True).is_tree


def test_chain_with_siblings_puts_each_sibling_beside_its_chain_node():
    from handler.tree import chain_with_siblings

    token_ids, parents = chain_with_siblings([10, 11, 12], [0, 2], [20, 22])
    assert token_ids == [10, 11, 12, 20, 22]
    assert parents == [ROOT, 0, 1, ROOT, 1]
    assert depths(parents) == [1, 2, 3, 1, 3]
    assert chain_with_siblings([10, 11], [], []) == ([10, 11], [ROOT, 0])
