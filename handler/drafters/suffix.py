"""The suffix drafter (SuffixDecoding, Oliaro et al. 2025): drafts learned from every request answered.

Two kinds of suffix tree, both depth-bounded (`max_depth` tokens) and with a
count on every node of how often its path occurred:

- one per request, over its prompt and its output so far;
- one global tree over the outputs of recent requests (the running ones
  included), bounded in requests and in tokens: the oldest output is evicted
  first.

A proposal matches the row's last tokens in both trees, then follows the most
frequent child from the match while the product of the empirical
probabilities (child count / node count) stays at or above `min_token_prob`,
for at most `max_depth` tokens and at most as many tokens as matched. Of the
two trees' proposals it keeps the one with the larger score, the sum of those
probabilities: the expected number of accepted drafts if the counts are
right. The probabilities go with the proposal so that the planner can use
them as each position's acceptance estimate.

Every committed token updates the trees incrementally (O(max_depth) per token),
never a rebuild. The trees are arctic-inference's C++ `SuffixTree` (a
measured choice: docs/suffix-decoding.md); this module owns which text goes
into which tree, the bounds and the eviction.

Who sees whose text: with `share_across_requests`, one request's output may be
*proposed* for another request. A draft is only ever emitted when the target
generates it itself, but acceptance rates and timing reveal similarity. A
request added as private neither feeds the global tree nor drafts from it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Hashable, Mapping, Sequence

from handler.config import SuffixOptions  # noqa: F401 - re-exported: the settings are the config's
from handler.drafters import NO_DRAFTS, SUFFIX, DraftRow, Proposal
from handler.tree import ROOT, order_best_first

# A proposal is at most as long as the context it matched (times 1, plus 0): a 1-token match
# proposes 1 token. vLLM's defaults again (max_spec_factor, max_spec_offset).
SPEC_FACTOR = 1.0
SPEC_OFFSET = 0.0
DEFAULT_OPTIONS = SuffixOptions()


def _suffix_tree_class():
    """arctic-inference's `SuffixTree`, imported on first use."""
    try:
        from arctic_inference.suffix_decoding._C import SuffixTree
    except ImportError as error:  # pragma: no cover - the install builds it
        raise RuntimeError(
            "the suffix drafter needs arctic-inference (its C++ suffix tree); `make install` builds it, "
            "which needs a C++20 compiler (g++ 10 or newer)"
        ) from error
    return SuffixTree


@dataclasses.dataclass(frozen=True)
class SuffixTreeStats:
    """The global tree's size: outputs held, and their tokens."""

    num_requests: int
    num_tokens: int


class _RowState:
    __slots__ = ("tree", "context", "seq_id", "shared")

    def __init__(self, tree, context: list[int], shared: bool) -> None:
        self.tree = tree  # the request's own suffix tree (prompt + output)
        self.context = context  # its last max_depth tokens
        self.seq_id: int | None = None  # its output's sequence in the global tree, while held there
        self.shared = shared


class SuffixDrafter:
    """Suffix-tree proposals for every row it follows, from its own text and recent outputs."""

    name = SUFFIX

    def __init__(self, options: SuffixOptions = DEFAULT_OPTIONS) -> None:
        assert options.max_depth >= 1 and 0.0 <= options.min_token_prob <= 1.0, options
        self.options = options
        # The C++ trees are made on first use: a deployment that never drafts from suffix trees
        # serves without arctic-inference built.
        self._global_tree = None
        # Outputs in the global tree, oldest first: sequence id -> tokens held.
        self.held: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.num_held_tokens = 0
        self.next_seq_id = 0
        self.rows: dict[Hashable, _RowState] = {}
        self.owner: dict[int, Hashable] = {}  # sequence id -> request id, while the request runs

    @functools.cached_property
    def _tree_class(self):
        return _suffix_tree_class()

    @property
    def global_tree(self):
        """The tree of recent outputs shared across requests."""
        if self._global_tree is None:
            self._global_tree = self._tree_class(self.options.max_depth)
        return self._global_tree

    @property
    def stats(self) -> SuffixTreeStats:
        return SuffixTreeStats(len(self.held), self.num_held_tokens)

    def add(self, prompts: Mapping[Hashable, Sequence[int]], private: Sequence[Hashable] = ()) -> None:
        """Builds each new request's own tree over its prompt.

        Args:
            private: request ids that neither feed the global tree nor draft from it.
        """
        depth = self.options.max_depth
        for request_id, prompt_ids in prompts.items():
            tree = self._tree_class(depth)
            tree.extend(0, list(prompt_ids))
            shared = self.options.share_across_requests and request_id not in private
            self.rows[request_id] = _RowState(tree, list(prompt_ids[-depth:]), shared)

    def observe(self, committed: Mapping[Hashable, Sequence[int]]) -> None:
        for request_id, new_tokens in committed.items():
            row = self.rows.get(request_id)
            if row is None or not new_tokens:
                continue
            tokens = list(new_tokens)
            row.tree.extend(0, tokens)
            row.context = (row.context + tokens)[-self.options.max_depth :]
            if row.shared:
                self._hold(request_id, row, tokens)

    def remove(
        self, request_ids: Sequence[Hashable], sequences: Mapping[Hashable, Sequence[int]] | None = None
    ) -> None:
        """Drops the rows' own trees; their outputs stay in the global tree until evicted."""
        for request_id in request_ids:
            row = self.rows.pop(request_id, None)
            if row is not None and row.seq_id is not None:
                del self.owner[row.seq_id]

    def propose(self, rows: Sequence[DraftRow], sampling=None, keep_drafting=None) -> list[Proposal]:
        """Each row's look-up (`lookup`); a look-up is one-hot, whatever the sampling settings."""
        return [self.lookup(row.request_id, row.max_tokens, tree=row.tree) for row in rows]

    def lookup(self, request_id: Hashable, max_tokens: int, tree: bool = False) -> Proposal:
        """The most likely continuation of the row's last tokens, up to `max_tokens` tokens.

        With `tree`: the most likely continuations, a tree of up to `max_tokens` nodes,
        best first (each node's probability is its path's).
        """
        if max_tokens <= 0:
            return NO_DRAFTS
        row = self.rows[request_id]
        if not row.context:
            return NO_DRAFTS
        max_tokens = min(max_tokens, self.options.max_depth)
        best, other = self._speculate(row, row.context, max_tokens, tree)
        if tree and other is not None and other.token_ids:
            # A tree can hold both trees' candidates: merged path by path, best first.
            return _merge_drafts([best, other], max_tokens)
        if other is not None and other.score > best.score:
            best = other
        if not best.token_ids:
            return NO_DRAFTS
        parents = list(best.parents) if tree else None
        return Proposal(list(best.token_ids), list(best.probs), parents)

    def continuation(self, request_id: Hashable, drafts: Sequence[int], max_tokens: int) -> list[int]:
        """The likeliest continuation of the row's tokens followed by `drafts` (not committed), as a chain.

        The draft model's passes take it as guesses of its next drafts (`handler.drafters`, guessed drafting).
        """
        row = self.rows.get(request_id)
        if row is None or max_tokens <= 0:
            return []
        depth = self.options.max_depth
        context = (row.context + list(drafts))[-depth:] if drafts else row.context
        if not context:
            return []
        best, other = self._speculate(row, context, min(max_tokens, depth), tree=False)
        if other is not None and other.score > best.score:
            best = other
        return list(best.token_ids)

    def _speculate(self, row: _RowState, context: list[int], max_tokens: int, tree: bool):
        """Both trees' proposals after `context`: the row's own, and the shared tree's (None where
        the row does not share or the shared tree holds nothing)."""
        args = (context, max_tokens, SPEC_FACTOR, SPEC_OFFSET, self.options.min_token_prob, tree)
        own = row.tree.speculate(*args)
        return own, self.global_tree.speculate(*args) if row.shared and self.held else None

    def _hold(self, request_id: Hashable, row: _RowState, tokens: list[int]) -> None:
        """Appends a row's new output tokens to the global tree, evicting the oldest outputs beyond the bounds."""
        if row.seq_id is None:
            if self.next_seq_id in self.held:  # pragma: no cover - 2**31 requests later
                self._evict(self.next_seq_id)
            row.seq_id = self.next_seq_id
            self.next_seq_id = (self.next_seq_id + 1) % 2**31
            self.held[row.seq_id] = 0
            self.owner[row.seq_id] = request_id
        self.global_tree.extend(row.seq_id, tokens)
        self.held[row.seq_id] += len(tokens)
        self.num_held_tokens += len(tokens)
        options = self.options
        while self.held and (
            len(self.held) > options.max_cached_requests or self.num_held_tokens > options.max_cached_tokens
        ):
            self._evict(next(iter(self.held)))

    def _evict(self, seq_id: int) -> None:
        self.global_tree.remove(seq_id)
        self.num_held_tokens -= self.held.pop(seq_id)
        request_id = self.owner.pop(seq_id, None)
        if request_id is not None:
            # A running request whose output was evicted starts a new sequence with its next tokens.
            self.rows[request_id].seq_id = None


def _merge_drafts(drafts, max_tokens: int) -> Proposal:
    """Speculated trees merged into one: a path proposed twice keeps its higher probability.

    Returns:
        the merged tree's first `max_tokens` nodes, by decreasing probability (parents first).
    """
    token_ids, parents, probs = [], [], []
    node_of: dict[tuple[int, int], int] = {}  # (parent in the merged tree, token) -> node
    for draft in drafts:
        mapped: list[int] = []
        for token_id, parent, prob in zip(draft.token_ids, draft.parents, draft.probs):
            key = (ROOT if parent == ROOT else mapped[parent], token_id)
            node = node_of.get(key)
            if node is None:
                node = node_of[key] = len(token_ids)
                token_ids.append(token_id)
                parents.append(key[0])
                probs.append(prob)
            else:
                probs[node] = max(probs[node], prob)
            mapped.append(node)
    if not token_ids:
        return NO_DRAFTS
    token_ids, parents, probs = order_best_first(token_ids, parents, probs)
    return Proposal(token_ids[:max_tokens], probs[:max_tokens], parents[:max_tokens])
