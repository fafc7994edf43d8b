"""Draft trees: several candidate continuations checked in one target pass.

Vocabulary (draft, target, accepted, bonus: `handler.sampler`). A draft tree
is a set of nodes, each one draft token, flattened so that parents come
before their children. `parents[i]` is node i's parent, -1 for the root: the
row's pending token, which the verify pass feeds first. A chain is the tree
in which node i's parent is i - 1, so every look-up proposal is a tree.

In the verify pass the chunk is [root, node 0, node 1, ...]: each node sits
at position `length + depth` and attends to the row's cached tokens, the root
and its own ancestors only (`chunk_attention`). Logits at chunk column c are
the target's distribution after the path to column c.

Acceptance (`verify_tree`): walk down from the root. At each node, draw the
target's own token there: its argmax for a greedy row, its inverse-CDF sample
with the depth's uniform otherwise (a fresh uniform per depth for an unseeded
row; the position's seeded uniform for a coupled row, as in
`handler.sampler.coupled_targets`). If a child holds that token, it is
accepted and the walk descends; otherwise the token is emitted and the step
ends. Every emitted token is a sample of the target's distribution given the
path so far, so the output is exactly the target's, for any tree chosen
without looking at the target's draws; a coupled row emits the same tokens
whatever the tree. For one-hot drafts (look-ups) this accepts a chain's token
x with probability target_probs[x], as rejection sampling does.

This module imports only torch.
"""

from __future__ import annotations

import heapq
import operator
from typing import Sequence

import torch

from handler.sampler import sample_from_probs

ROOT = -1


def is_chain(parents: Sequence[int]) -> bool:
    """Whether every node's parent is the node before it (the root for the first)."""
    return all(map(operator.eq, parents, range(ROOT, len(parents) - 1)))


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth: 1 for a child of the root."""
    result: list[int] = []
    for index, parent in enumerate(parents):
        assert ROOT <= parent < index, (index, parent)  # parents come before their children
        result.append(1 if parent == ROOT else result[parent] + 1)
    return result


def order_best_first(
    token_ids: Sequence[int], parents: Sequence[int], scores: Sequence[float]
) -> tuple[list[int], list[int], list[float]]:
    """Reorders a tree's nodes by decreasing score, parents always before their children.

    A node is placed once its parent is; among the nodes available, the highest
    score goes first (ties: the earlier node). With scores that never grow from
    parent to child (reach probabilities), this is the plain sort, and every
    prefix of the result is the best tree of its size.

    Returns:
        token_ids, parents (new indices) and scores, in the new order.
    """
    num_nodes = len(token_ids)
    assert len(parents) == num_nodes == len(scores), (len(token_ids), len(parents), len(scores))
    if all(map(operator.ge, scores, scores[1:])):
        # Already best first (a chain of equal shares, a suffix tree's path probabilities): parents come first.
        return list(token_ids), list(parents), list(scores)
    if all(parent == ROOT or scores[parent] >= scores[index] for index, parent in enumerate(parents)):
        # Scores that never grow from parent to child (a look-up's shares and path probabilities, always):
        # the stable sort by score places every parent first and is the walk's order, without the walk.
        order = sorted(range(num_nodes), key=lambda node: -scores[node])
    else:
        order = _placed_best_first(parents, scores)
    new_index = {node: position for position, node in enumerate(order)}
    return (
        [token_ids[node] for node in order],
        [ROOT if parents[node] == ROOT else new_index[parents[node]] for node in order],
        [scores[node] for node in order],
    )


def _placed_best_first(parents: Sequence[int], scores: Sequence[float]) -> list[int]:
    """`order_best_first`'s order for any scores: each node once its parent is placed, the best available first."""
    num_nodes = len(parents)
    children: list[list[int]] = [[] for _ in range(num_nodes)]
    # The nodes whose parent is placed, keyed (-score, node): the highest score first, ties to the earlier node.
    heap = []
    for index, parent in enumerate(parents):
        if parent == ROOT:
            heap.append((-scores[index], index))
        else:
            children[parent].append(index)
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        _, best = heapq.heappop(heap)
        order.append(best)
        for child in children[best]:
            heapq.heappush(heap, (-scores[child], child))
    return order


def chunk_attention(parents: Sequence[Sequence[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which chunk columns each chunk column attends to, and each column's depth.

    Column 0 of a row is its root (the pending token), column 1 + i its node i.
    Columns past a row's nodes are padding: each attends to the root and itself.

    Args:
        parents: per row, its tree's parents (at most `width` nodes).
        width: the drafts' width of the chunk; the chunk has width + 1 columns.

    Returns:
        allowed: [batch, width + 1, width + 1] bool, allowed[b, q, c]: column q sees column c.
        depth: [batch, width + 1] long, 0 for the root.
    """
    batch_size = len(parents)
    allowed = torch.zeros((batch_size, width + 1, width + 1), dtype=torch.bool)
    depth = torch.zeros((batch_size, width + 1), dtype=torch.long)
    allowed[:, :, 0] = True
    for row, row_parents in enumerate(parents):
        assert len(row_parents) <= width, (len(row_parents), width)
        for index in range(width):
            column = index + 1
            parent = row_parents[index] if index < len(row_parents) else ROOT
            parent_column = parent + 1
            allowed[row, column] = allowed[row, parent_column]
            allowed[row, column, column] = True
            depth[row, column] = depth[row, parent_column] + 1
    return allowed, depth


def verify_tree(
    target_probs: torch.Tensor,  # [columns, vocab]: the root's column, then each node's
    token_ids: Sequence[int],
    parents: Sequence[int],
    uniforms: Sequence[float],  # one per depth, >= the tree's depth + 1
) -> tuple[list[int], list[int]]:
    """Walks a row's tree down the target's own draws.

    Args:
        target_probs: the target's warped probabilities at the row's chunk columns;
            a greedy row's are one-hot, so any uniform draws its argmax.
        uniforms: uniforms[d] draws the target's token after d accepted drafts.

    Returns:
        path: the chunk columns whose tokens the cache keeps: 0 (the root), then the
            accepted nodes' columns, in depth order.
        emitted: the accepted drafts, then the target's token after the last one.
    """
    num_columns = len(token_ids) + 1
    column_depths = [0, *depths(parents)]
    assert max(column_depths) < len(uniforms), (max(column_depths), len(uniforms))
    # Every column's draw at once: the walk only reads the columns it reaches.
    column_uniforms = torch.tensor([uniforms[d] for d in column_depths], dtype=torch.float64)
    drawn = sample_from_probs(target_probs[:num_columns], column_uniforms.to(target_probs.device)).tolist()
    children: dict[int, dict[int, int]] = {}
    for index, (token_id, parent) in enumerate(zip(token_ids, parents)):
        children.setdefault(parent + 1, {}).setdefault(token_id, index + 1)
    path = [0]
    while True:
        token_id = drawn[path[-1]]
        child = children.get(path[-1], {}).get(token_id)
        if child is None:
            return path, [*(token_ids[column - 1] for column in path[1:]), token_id]
        path.append(child)


def first_choice_path(parents: Sequence[int], depth: int) -> list[int]:
    """The chunk columns of the tree's first-choice path down to `depth`: each node's first child."""
    first_child: dict[int, int] = {}
    for index, parent in enumerate(parents):
        first_child.setdefault(parent + 1, index + 1)
    path = [0]
    while len(path) <= depth and path[-1] in first_child:
        path.append(first_child[path[-1]])
    return path


def off_first_choice(parents: Sequence[int], scores: Sequence[float]) -> list[bool]:
    """Whether each node is off the tree's first-choice path: from the root down, the best-scored
    child of each node on the path (ties: the earlier node), as `order_best_first` places it."""
    best_child: dict[int, int] = {}
    for index, parent in enumerate(parents):
        best = best_child.get(parent)
        if best is None or scores[index] > scores[best]:
            best_child[parent] = index
    on_path = [False] * len(parents)
    node = best_child.get(ROOT)
    while node is not None:
        on_path[node] = True
        node = best_child.get(node)
    return [not on for on in on_path]


def chain_with_siblings(
    token_ids: Sequence[int], positions: Sequence[int], sibling_ids: Sequence[int]
) -> tuple[list[int], list[int]]:
    """A chain of drafts with a sibling leaf beside some of its nodes.

    Args:
        token_ids: the chain's drafts.
        positions: chain positions that get a sibling: the sibling shares that draft's parent.
        sibling_ids: the sibling's token at each of those positions.

    Returns:
        token_ids and parents: the chain's nodes first (as a chain), then the siblings.
    """
    num = len(token_ids)
    assert all(0 <= position < num for position in positions), (positions, num)
    return [*token_ids, *sibling_ids], [*range(ROOT, num - 1), *(position - 1 for position in positions)]
