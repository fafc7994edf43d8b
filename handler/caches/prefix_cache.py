"""A prefix cache: the KV of token prefixes already computed, kept in a radix tree.

Chat clients and agents send the whole conversation with every turn. The
engine looks each new prompt up here and prefills only what is not cached;
when a request leaves, its prompt and completion go in, so that the next turn
of the conversation finds them.

Why a radix tree (as SGLang's RadixAttention) rather than hashed fixed-size
blocks (as vLLM's automatic prefix caching): blocks exist to serve a paged KV
allocator, which this engine does not have; its rows are contiguous
`DynamicCache` tensors, so a hit is copied into the row's cache either way.
A tree then matches to the token, where blocks lose up to a block's worth of
tokens at every boundary, including the place where a re-rendered chat turn
stops matching the ids the model generated.

- A node holds the KV of the tokens on the edge into it:
  [layers, 2 (keys, values), kv heads, tokens, head dim].
- A match may end inside an edge: its first tokens' KV is used.
- Every node on the path of a prefix that a running row uses is locked; an
  eviction takes the least recently used unlocked leaf, never a locked node.
- The tree's bytes never exceed `max_bytes`: an insertion first evicts, and
  keeps only the part that fits when locked nodes leave too little room.
- Splitting an edge copies both halves, so that evicting one half frees its memory.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Sequence

import torch

from handler.caches.kv_cache import RaggedCache, prefill, prefill_with_logits

# The least new prefix two joining rows must share to be computed once before their rows.
MIN_SHARED_TOKENS = 16


def common_length(left: Sequence[int], right: Sequence[int]) -> int:
    """The number of leading tokens the two sequences share."""
    length = min(len(left), len(right))
    for index in range(length):
        if left[index] != right[index]:
            return index
    return length


class _Node:
    __slots__ = ("tokens", "kv", "children", "parent", "last_used", "num_locks")

    def __init__(self, tokens: tuple[int, ...], kv: torch.Tensor | None, parent: _Node | None) -> None:
        self.tokens = tokens
        self.kv = kv  # [layers, 2, heads, len(tokens), head_dim]; None at the root
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_used = 0
        self.num_locks = 0  # rows whose prefix runs through this node

    @property
    def num_bytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()


@dataclasses.dataclass
class PrefixMatch:
    """The longest cached prefix of some tokens."""

    num_tokens: int
    kv: torch.Tensor | None  # [layers, 2, heads, num_tokens, head_dim]; None when nothing matched


@dataclasses.dataclass
class PrefixCacheStats:
    """Counters since start-up; queries and hits count tokens, as vLLM's do."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found cached
    evictions: int = 0  # nodes (cached token runs) evicted
    evicted_tokens: int = 0
    num_bytes: int = 0  # KV bytes held now
    num_tokens: int = 0  # tokens held now


class PrefixCache:
    """One model's prefix cache, bounded to `max_bytes` of KV."""

    def __init__(self, max_bytes: int) -> None:
        assert max_bytes >= 0
        self.max_bytes = max_bytes
        self.root = _Node((), None, None)
        self.stats = PrefixCacheStats()
        self._clock = itertools.count(1)

    # ------------------------------------------------------------------ reads

    def query(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of a prompt's `tokens` are cached; counted in the queries and hits."""
        num_tokens = sum(used for _, used in self._walk(tokens))
        self.stats.queries += len(tokens)
        self.stats.hits += num_tokens
        return num_tokens

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of `tokens`, with its KV (a copy), and marks it recently used."""
        path = self._walk(tokens)
        num_tokens = sum(used for _, used in path)
        if not num_tokens:
            return PrefixMatch(0, None)
        now = next(self._clock)
        for node, _ in path:
            node.last_used = now
        kv = torch.cat([node.kv[:, :, :, :used] for node, used in path], dim=3)
        return PrefixMatch(num_tokens, kv)

    def __len__(self) -> int:
        """Tokens held."""
        return self.stats.num_tokens

    # ----------------------------------------------------------------- writes

    def insert(self, tokens: Sequence[int], kv_of: Callable[[int, int], torch.Tensor]) -> tuple[_Node, int]:
        """Caches `tokens`, taking the KV of the uncached ones from `kv_of(start, end)`.

        Args:
            tokens: the prefix, from the first token.
            kv_of: (start, end) -> [layers, 2, heads, end - start, head_dim], the KV of
                tokens[start:end] (a tensor of its own: the tree keeps it).
        Returns:
            the node where the cached part of `tokens` ends (the handle to `lock`), and the
            number of tokens of `tokens` now cached: fewer than all only when the budget is
            held by locked prefixes.
        """
        tokens = tuple(tokens)
        path = self._walk(tokens)
        num_matched = sum(used for _, used in path)
        node = self.root
        if path:
            node, used = path[-1]
            if used < len(node.tokens):
                node = self._split(node, used)
        now = next(self._clock)
        for walked, _ in path:
            walked.last_used = now
        node.last_used = now
        num_new = len(tokens) - num_matched
        if num_new == 0:
            return node, num_matched
        self._lock_path(node, +1)  # the path the new leaf hangs from must survive the evictions
        try:
            kv = kv_of(num_matched, len(tokens))
            bytes_per_token = kv.element_size() * kv.numel() // max(1, kv.shape[3])
            room = self._make_room(num_new * bytes_per_token)
            num_kept = min(num_new, room // bytes_per_token) if bytes_per_token else num_new
        finally:
            self._lock_path(node, -1)
        if num_kept == 0:
            return node, num_matched
        if num_kept < num_new:
            kv = kv[:, :, :, :num_kept].clone()
        leaf = _Node(tokens[num_matched : num_matched + num_kept], kv.contiguous(), node)
        leaf.last_used = now
        node.children[leaf.tokens[0]] = leaf
        self._account(leaf, +1)
        return leaf, num_matched + num_kept

    def lock(self, node: _Node) -> None:
        """Keeps the prefix ending at `node` from eviction until `unlock`."""
        self._lock_path(node, +1)

    def unlock(self, node: _Node) -> None:
        self._lock_path(node, -1)

    def clear(self) -> None:
        """Evicts everything unlocked."""
        while self._evict_one():
            pass

    # -------------------------------------------------------------- internals

    def _walk(self, tokens: Sequence[int]) -> list[tuple[_Node, int]]:
        """The nodes along `tokens`, each with how many of its tokens match (all but maybe the last)."""
        path = []
        node, index = self.root, 0
        while index < len(tokens):
            child = node.children.get(tokens[index])
            if child is None:
                break
            used = common_length(child.tokens, tokens[index : index + len(child.tokens)])
            path.append((child, used))
            index += used
            if used < len(child.tokens):
                break
            node = child
        return path

    def _split(self, node: _Node, at: int) -> _Node:
        """Cuts `node`'s edge after `at` tokens; returns the new upper node. Both halves are copies."""
        assert 0 < at < len(node.tokens)
        upper = _Node(node.tokens[:at], node.kv[:, :, :, :at].clone(), node.parent)
        upper.last_used, upper.num_locks = node.last_used, node.num_locks
        node.parent.children[upper.tokens[0]] = upper
        node.tokens, node.kv, node.parent = node.tokens[at:], node.kv[:, :, :, at:].clone(), upper
        upper.children[node.tokens[0]] = node
        return upper

    def _lock_path(self, node: _Node, delta: int) -> None:
        while node is not None and node is not self.root:
            node.num_locks += delta
            assert node.num_locks >= 0
            node = node.parent

    def _account(self, node: _Node, sign: int) -> None:
        self.stats.num_bytes += sign * node.num_bytes
        self.stats.num_tokens += sign * len(node.tokens)

    def _make_room(self, num_bytes: int) -> int:
        """Evicts least recently used prefixes until `num_bytes` fit, or nothing more can go; returns the room."""
        while self.max_bytes - self.stats.num_bytes < num_bytes and self._evict_one():
            pass
        return max(0, self.max_bytes - self.stats.num_bytes)

    def _evict_one(self) -> bool:
        victim = None
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root and node.num_locks == 0:
                if victim is None or node.last_used < victim.last_used:
                    victim = node
        if victim is None:
            return False
        del victim.parent.children[victim.tokens[0]]
        self._account(victim, -1)
        self.stats.evictions += 1
        self.stats.evicted_tokens += len(victim.tokens)
        victim.kv = None
        return True


@dataclasses.dataclass
class CachedPrefill:
    """What `prefill_with_cache` computed for rows joining the batch."""

    cache: RaggedCache
    num_cached: list[int]  # per row: tokens found in the prefix cache before this prefill
    handles: list[_Node | None]  # per row: the locked node where its cached prefix ends, or None
    # [rows, vocab]: the logits after each prefix, with `last_logits`; else None.
    logits: torch.Tensor | None = None


def prefill_with_cache(
    model: torch.nn.Module,
    prefix_cache: PrefixCache | None,
    prefixes: Sequence[Sequence[int]],
    pad_id: int,
    last_logits: bool = False,
) -> CachedPrefill:
    """Prefills the joining rows' prefixes, computing only what `prefix_cache` lacks.

    A new prefix that several joining rows share (a system prompt that nobody has
    sent yet; the n choices of one request) is computed once, in a first pass, and
    found in the cache by the rows' own pass. Each row's whole prefix is then
    cached and locked: release it with `PrefixCache.unlock(handle)`.

    `last_logits`: every row computes at least its prefix's last token, whatever the cache
    holds, and the result carries the logits after each prefix (prefixes must not be empty).
    """
    assert not last_logits or all(prefixes), "logits after an empty prefix"
    if prefix_cache is None:
        cache, logits = prefill_with_logits(model, prefixes, pad_id)
        return CachedPrefill(cache, [0] * len(prefixes), [None] * len(prefixes), logits if last_logits else None)
    # What may come from the cache: all but the last token where the logits after it are needed.
    reusable = [prefix[:-1] for prefix in prefixes] if last_logits else prefixes
    num_cached = [prefix_cache.query(prefix) for prefix in reusable]
    shared_handles = []
    shared = _shared_new_prefixes(prefixes, num_cached)
    if shared:
        first = prefill(model, shared, pad_id, [prefix_cache.match(prefix).kv for prefix in shared])
        for slot, prefix in enumerate(shared):
            handle, _ = prefix_cache.insert(prefix, lambda start, end, slot=slot: first.row_kv(slot, start, end))
            prefix_cache.lock(handle)
            shared_handles.append(handle)
        del first
    cache, logits = prefill_with_logits(model, prefixes, pad_id, [prefix_cache.match(prefix).kv for prefix in reusable])
    handles: list[_Node | None] = []
    for slot, prefix in enumerate(prefixes):
        handle = None
        if prefix:
            handle, _ = prefix_cache.insert(prefix, lambda start, end, slot=slot: cache.row_kv(slot, start, end))
            prefix_cache.lock(handle)
        handles.append(handle)
    for handle in shared_handles:
        prefix_cache.unlock(handle)
    return CachedPrefill(cache, num_cached, handles, logits if last_logits else None)


def _shared_new_prefixes(prefixes: Sequence[Sequence[int]], num_cached: Sequence[int]) -> list[tuple[int, ...]]:
    """The uncached prefixes that two or more of `prefixes` share, at least MIN_SHARED_TOKENS beyond their cached part.

    The longest prefix a sequence shares with any other is the longer of those it
    shares with its neighbours in sorted order. Of shared prefixes that nest, the
    shortest is kept: computing it once serves all their rows.
    """
    order = sorted(range(len(prefixes)), key=lambda row: tuple(prefixes[row]))
    longest = [0] * len(prefixes)
    for left, right in zip(order, order[1:]):
        length = common_length(prefixes[left], prefixes[right])
        longest[left] = max(longest[left], length)
        longest[right] = max(longest[right], length)
    candidates = sorted(
        {
            tuple(prefixes[row][: longest[row]])
            for row in range(len(prefixes))
            if longest[row] - num_cached[row] >= MIN_SHARED_TOKENS
        },
        key=len,
    )
    kept: list[tuple[int, ...]] = []
    for candidate in candidates:
        if not any(candidate[: len(shorter)] == shorter for shorter in kept):
            kept.append(candidate)
    return kept
