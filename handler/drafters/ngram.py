"""The n-gram drafter (prompt lookup): drafts by copying what followed the same n-gram earlier.

For each row it takes the longest suffix of prompt + completion, from
`max_n` down to `min_n` tokens, that occurred earlier in the row, and
proposes up to k tokens that followed its earliest occurrence. An edit copies
its source from the prompt, where the earliest occurrence lies; a later one is
more often a repeat inside the completion (6 code edits, hybrid: 169 target
passes against 173 with the most recent occurrence). Rows without a match
draft nothing that step.

A look-up is deterministic: its draft distribution is one-hot on the proposed
token, so the rejection sampler accepts it with probability target_probs[x]
and recovers from target_probs with x removed. No model runs: a proposal
costs a dictionary look-up, and each committed token updates the index in
O(max_n), never a scan of the context.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

from handler.drafters import NGRAM, NO_DRAFTS, DraftRow, Proposal
from handler.tree import ROOT, order_best_first

# The most occurrences of one n-gram a tree look-up follows: the earliest ones.
MAX_OCCURRENCES = 8
# Tokens from which `NgramIndex.extend` enters n by n rather than one by one: a step's commit (k + 1
# tokens at most) goes one by one, a prompt n by n.
BULK_EXTEND = 16


class NgramIndex:
    """One row's tokens and, per n-gram, the end of its earliest occurrence."""

    def __init__(self, token_ids: Sequence[int], min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n, (min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        # n-gram -> end index (exclusive) of its earliest occurrence; the current suffix enters
        # only once a token follows it.
        self.first_end: dict[tuple[int, ...], int] = {}
        # n-gram -> ends of its next occurrences, up to MAX_OCCURRENCES in all (tree look-ups).
        self.more_ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(token_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Appends tokens; each suffix that a new token follows becomes an earlier occurrence.

        Every committed token of a hybrid row passes here, a step's few at a time and a prompt's at
        admission, and at n = 2..8 a token is 7 n-grams. A few tokens enter one by one; from
        BULK_EXTEND on, n by n over the new ends (`zip` over shifted slices, `map` of `setdefault`): its
        fixed cost a call, 7 rounds of slices and maps, is the cost of about 20 tokens one by one,
        and a 2000-token prompt enters in half the time. For one n the ends come in order, so each
        n-gram's first end and its next ones are the same either way.
        """
        tokens = self.tokens
        start = len(tokens)
        tokens.extend(token_ids)
        stop = len(tokens)  # the n-grams ending at start .. stop - 1 enter: a token followed each
        first_end = self.first_end
        if stop - start < BULK_EXTEND:
            min_n, max_n = self.min_n, self.max_n
            for end in range(max(start, min_n), stop):
                # The longest n-gram ending here, once; the shorter ones are its tails (a tuple's
                # slice: one copy each, where a list's slice and its tuple made two; 20 % faster).
                top = min(max_n, end)
                window = tuple(tokens[end - top : end])
                for cut in range(top - min_n + 1):
                    ngram = window[cut:]
                    if first_end.setdefault(ngram, end) != end:
                        self._repeated(ngram, end)
            return
        for n in range(self.min_n, self.max_n + 1):
            begin = max(start, n)  # an n-gram needs n tokens before its end
            if begin >= stop:
                continue
            ngrams = list(zip(*[tokens[begin - n + i : stop - n + i] for i in range(n)]))
            ends = range(begin, stop)
            earliest = list(map(first_end.setdefault, ngrams, ends))
            for ngram, end in [(g, e) for g, e, first in zip(ngrams, ends, earliest) if first != e]:
                self._repeated(ngram, end)

    def _repeated(self, ngram: tuple[int, ...], end: int) -> None:
        """Enters a later occurrence of `ngram`, up to MAX_OCCURRENCES in all."""
        more = self.more_ends.get(ngram)
        if more is None:
            self.more_ends[ngram] = [end]
        elif len(more) < MAX_OCCURRENCES - 1:
            more.append(end)

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest matching suffix's earliest occurrence."""
        end = len(self.tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            start = self.first_end.get(tuple(self.tokens[end - n : end]))
            if start is not None:
                return self.tokens[start : start + k]
        return []

    def lookup_tree(self, max_nodes: int) -> Proposal:
        """The continuations of the longest matching suffix's occurrences, merged into a tree.

        Each node's share is the fraction of the occurrences whose continuation runs
        through it; nodes come by decreasing share (ties: the shallower, then the
        earlier occurrence's), and the first `max_nodes` are kept. With one occurrence this is the
        chain `lookup` proposes.
        """
        tokens = self.tokens
        end = len(tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            ngram = tuple(tokens[end - n : end])
            first = self.first_end.get(ngram)
            if first is None:
                continue
            more = self.more_ends.get(ngram)
            if not more:
                # One occurrence: its continuation is the chain, every node on it (share 1).
                token_ids = tokens[first : min(first + max_nodes, end)]
                return Proposal(token_ids, None, list(range(ROOT, len(token_ids) - 1)), [1.0] * len(token_ids))
            starts = [first, *more]
            token_ids, parents, counts = [], [], []
            children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
            heads = [ROOT] * len(starts)  # each occurrence's node at the current depth
            # Depth by depth, so that nodes are numbered shallow first (the tie-break below).
            for depth in range(max_nodes):
                if depth and heads.count(None) == len(heads):
                    break  # every occurrence ran into the row's end
                for occurrence, start in enumerate(starts):
                    if start + depth >= end or heads[occurrence] is None:
                        heads[occurrence] = None
                        continue
                    key = (heads[occurrence], tokens[start + depth])
                    node = children.get(key)
                    if node is None:
                        node = children[key] = len(token_ids)
                        token_ids.append(key[1])
                        parents.append(key[0])
                        counts.append(0)
                    counts[node] += 1
                    heads[occurrence] = node
            shares = [count / len(starts) for count in counts]
            token_ids, parents, shares = order_best_first(token_ids, parents, shares)
            return Proposal(token_ids[:max_nodes], None, parents[:max_nodes], shares[:max_nodes])
        return NO_DRAFTS


class NgramDrafter:
    """Prompt-lookup proposals for every row it indexes."""

    name = NGRAM

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.rows: dict[Hashable, NgramIndex] = {}

    def add(self, prompts: Mapping[Hashable, Sequence[int]], private: Sequence[Hashable] = ()) -> None:
        """Indexes each new request's prompt (a row's look-ups read its own text only: none is shared)."""
        for request_id, prompt_ids in prompts.items():
            self.rows[request_id] = NgramIndex(prompt_ids, self.min_n, self.max_n)

    def remove(
        self, request_ids: Sequence[Hashable], sequences: Mapping[Hashable, Sequence[int]] | None = None
    ) -> None:
        for request_id in request_ids:
            self.rows.pop(request_id, None)

    def propose(self, rows: Sequence[DraftRow], sampling=None, keep_drafting=None) -> list[Proposal]:
        """Each row's look-up (`lookup`); a look-up is one-hot, whatever the sampling settings."""
        return [self.lookup(row.request_id, row.max_tokens, tree=row.tree) for row in rows]

    def lookup(self, request_id: Hashable, max_tokens: int, tree: bool = False) -> Proposal:
        """One row's continuation of its longest matching suffix, up to `max_tokens` drafts (`tree`: of
        every occurrence's, as a tree)."""
        if max_tokens <= 0:
            return NO_DRAFTS
        if tree:
            return self.rows[request_id].lookup_tree(max_tokens)
        return Proposal(self.rows[request_id].lookup(max_tokens))

    def observe(self, committed: Mapping[Hashable, Sequence[int]]) -> None:
        for request_id, new_tokens in committed.items():
            if request_id in self.rows:
                self.rows[request_id].extend(new_tokens)
