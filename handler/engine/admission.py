"""Admission: the batch's rows, who joins it (prefilled through the target's prefix cache) and who leaves.

The prefix cache's budget is shared by both models in proportion to their KV bytes per token
(`split_prefix_cache`). A joining row's prompt is looked up in the target's cache, the rest
prefilled, and its KV joins the running batch's cache (`Batch.admit`); the drafters start
following it. A leaving row's prompt and completion go into the prefix cache, its prompt's node
is unlocked, and the drafters forget it (`Batch.drop`).
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Mapping

import torch

from handler import runners
from handler.caches.kv_cache import kv_bytes_per_token
from handler.caches.prefix_cache import PrefixCache, PrefixCacheStats, prefill_with_cache
from handler.caches.rollback import target_lengths_after_verify
from handler.drafters import MODEL, Drafter, drafters_of
from handler.engine.row import Row


def split_prefix_cache(target, draft, max_bytes: int | None) -> tuple[PrefixCache | None, PrefixCache | None]:
    """The target's and the draft's prefix caches within `max_bytes` together (None: no prefix cache)."""
    if max_bytes is None:
        return None, None
    # Split in proportion to each model's KV bytes per token: both then hold about as many tokens.
    target_share = kv_bytes_per_token(target)
    draft_share = kv_bytes_per_token(draft) if draft is not None else 0
    target_bytes = max_bytes * target_share // (target_share + draft_share)
    return PrefixCache(target_bytes), None if draft is None else PrefixCache(max_bytes - target_bytes)


class Batch:
    """The rows in flight, in the target cache's row order, with the requests waiting to join."""

    def __init__(
        self,
        target,
        runner,
        prefix_cache: PrefixCache | None,
        pad_token_id: int,
        drafters: Mapping[str, Drafter],
        first_token_from_prefill: bool = True,
    ) -> None:
        self.first_token_from_prefill = first_token_from_prefill
        self.target = target
        self.runner = runner
        self.prefix_cache = prefix_cache
        self.pad_token_id = pad_token_id
        self.drafters = drafters
        self.rows: list[Row] = []
        self.waiting: list[Row] = []
        self.aborted: set[Hashable] = set()
        self.cache: runners.BatchCache | None = None  # the target's KV of the rows
        # Prompt tokens admitted, and those of them whose target KV came from the prefix cache.
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        # Moves on whenever rows join or leave: the same number, the same rows (request ids may be reused).
        self.version = 0
        # Tokens committed by steps that drafted nothing, by request id, that the drafters have not seen
        # yet (`observe`).
        self.unobserved: dict[Hashable, list[int]] = {}

    def holds(self, request_id: Hashable) -> bool:
        """Whether the request is in flight or waiting to join."""
        return any(row.request_id == request_id for row in (*self.rows, *self.waiting))

    def queue(self, row: Row) -> None:
        """Adds a new request's row to the waiting ones (the caller checked it is not `holds`)."""
        self.aborted.discard(row.request_id)
        self.waiting.append(row)

    def abort(self, request_id: Hashable) -> None:
        """The request's row leaves at the next step (`drop_aborted`)."""
        self.aborted.add(request_id)

    def clear(self) -> None:
        """Drops every row and waiting request; the caches' contents are not kept (after a failed step)."""
        self.waiting = []
        self.aborted.clear()
        self.drop(list(self.rows), consistent=False)

    def drop_aborted(self) -> None:
        self.drop([row for row in self.rows if row.request_id in self.aborted])
        self.waiting = [row for row in self.waiting if row.request_id not in self.aborted]
        self.aborted.clear()

    def admit(self) -> tuple[list[Row], torch.Tensor | None]:
        """Prefills the waiting rows over their whole prompts, together, and appends them to the batch.

        The logits after each prompt give the row its first token (`SpeculativeEngine._admit`), as
        plain decoding takes it: a drafting row then drafts from its second token on, its first step
        verifying drafts after that token, and pays no target pass more than plain decoding does.
        Without `first_token_from_prefill` (a test's knob) a drafting row is prefilled up to its
        prompt's last token, which its first step verifies with the drafts that follow it.

        Returns:
            the rows that take their first token now, and the logits after their prompts [rows, 1, vocab]
            (None for none).
        """
        new_rows, self.waiting = self.waiting, []
        plain = [row for row in new_rows if row.request.num_speculative_tokens == 0]
        drafting = [row for row in new_rows if row.request.num_speculative_tokens > 0]
        first, rest = (new_rows, []) if self.first_token_from_prefill else (plain, drafting)
        # The cache's rows in the order of `rows`: those that take their first token now first.
        first_logits = self._prefill(first, whole=True) if first else None
        if rest:
            self._prefill(rest, whole=False)
        self.rows.extend([*first, *rest])
        self.version += 1
        # A row whose k is 0 never drafts: no drafter needs to read its prompt.
        private = [r.request_id for r in drafting if r.request.suffix_share_across_requests is False]
        for name, drafter in self.drafters.items():
            prompts = {r.request_id: r.request.prompt_ids for r in drafting if name in drafters_of(r.drafter)}
            drafter.add(prompts, private=private)
        return first, first_logits

    def rollback(self, ks: list[int], num_accepted: list[int], paths: list[list[int]]) -> None:
        """Keeps each row's pending token and accepted drafts in the target cache (a tree's accepted
        path first moves to the front of the chunk)."""
        # A path is increasing from 0 (`handler.tree.verify_tree`): it is 0, 1, .. n - 1 (a chain's)
        # where its last column is n - 1.
        if any([path and path[-1] != len(path) - 1 for path in paths]):
            self.cache.keep_chunk_paths(max(ks) + 1, paths)
        kept_lengths = target_lengths_after_verify(self.cache.lengths.tolist(), ks, num_accepted)
        self.cache.rollback(torch.tensor(kept_lengths, dtype=torch.long))

    def observe(self, committed: Mapping[Hashable, list[int]], drafted: bool) -> None:
        """The drafters take the rows' newly committed tokens.

        After a step that drafted for no row (`drafted` False) the tokens wait, joined to those of the
        steps before, until a drafter is next asked or a row leaves (`flush_observed`): a drafter that
        did not propose only appends what it is given, so that one call a plan gives it the same state
        as one call a step, and a plain step's bookkeeping stays a plain engine's (16 rows' suffix and
        n-gram updates and the draft's pending tokens were a quarter of such a step's own time). A step
        that drafted was planned, and the plan took every waiting token first (`flush_observed`), so
        that a drafter that proposed gets its step's tokens in one call, as its roll-back needs."""
        if not drafted:
            for request_id, tokens in committed.items():
                if tokens:
                    self.unobserved.setdefault(request_id, []).extend(tokens)
            return
        assert not self.unobserved, "a step drafted before its drafters saw the tokens before it"
        for drafter in self.drafters.values():
            drafter.observe(committed)

    def flush_observed(self) -> None:
        """Hands the drafters the tokens of the steps that drafted nothing since they last saw any."""
        if self.unobserved:
            committed, self.unobserved = self.unobserved, {}
            for drafter in self.drafters.values():
                drafter.observe(committed)

    def drop(self, rows: list[Row], consistent: bool = True) -> None:
        """Removes rows from the batch and from every drafter.

        `consistent`: the caches hold what the rows committed (between steps), so their
        prompts and completions go into the prefix caches; False after a failed step.
        """
        if not rows:
            return
        gone = {row.request_id for row in rows}
        if consistent:
            self.flush_observed()  # a leaving row's outputs join the suffix tree shared across requests
        else:
            self.unobserved = {r: tokens for r, tokens in self.unobserved.items() if r not in gone}
        sequences = {row.request_id: (*row.request.prompt_ids, *row.token_ids) for row in rows} if consistent else None
        self._release(rows, sequences)
        keep = [slot for slot, row in enumerate(self.rows) if row.request_id not in gone]
        self.rows = [self.rows[slot] for slot in keep]
        self.version += 1
        if not self.rows:
            self.cache = None  # an empty batch restarts from a fresh cache
        elif len(keep) < self.cache.lengths.shape[0]:
            self.cache.select_rows(keep)
        for drafter in self.drafters.values():
            drafter.remove(list(gone), sequences)

    def _prefill(self, rows: list[Row], whole: bool) -> torch.Tensor | None:
        """Prefills the rows' prompts (`whole`: all of each, else all but its last token) into the
        batch's cache; with `whole`, returns the logits after each prompt [rows, 1, vocab]."""
        filled = prefill_with_cache(
            self.target,
            self.prefix_cache,
            [row.request.prompt_ids if whole else row.request.prompt_ids[:-1] for row in rows],
            self.pad_token_id,
            last_logits=whole,
        )
        for row, num_cached, handle in zip(rows, filled.num_cached, filled.handles):
            row.cached_tokens, row.prefix_handle = num_cached, handle
            self.num_prompt_tokens += len(row.request.prompt_ids)
            self.num_cached_tokens += num_cached
        if self.cache is None:
            self.cache = self.runner.adopt(filled.cache)
        else:
            self.cache.extend(filled.cache)
        return filled.logits[:, None] if whole else None

    def _release(self, leaving: list[Row], sequences: dict | None) -> None:
        """Caches what the batch's cache holds of the leaving rows' sequences (`sequences`, prompt and
        completion by request id; None after a failed step), and unlocks their prompts."""
        if self.prefix_cache is None:
            return
        cache = self.cache
        slot_of = {row.request_id: slot for slot, row in enumerate(self.rows)}
        for row in leaving:
            slot = slot_of.get(row.request_id)
            if sequences is not None and slot is not None:
                # The target cache holds the sequence but for the pending last token (and, after an
                # early stop, perhaps accepted drafts beyond it).
                tokens = sequences[row.request_id]
                num_cached = min(int(cache.lengths[slot]), len(tokens) - 1)
                if num_cached > 0:
                    self.prefix_cache.insert(
                        tokens[:num_cached], lambda start, end, slot=slot: cache.row_kv(slot, start, end)
                    )
            if row.prefix_handle is not None:
                self.prefix_cache.unlock(row.prefix_handle)
                row.prefix_handle = None

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Since start-up: prompt tokens queried and found in the target's cache (vLLM's
        prefix_cache_queries and prefix_cache_hits); bytes, tokens and evictions of both models' caches."""
        if self.prefix_cache is None:
            return None
        draft_prefix_cache = self.drafters[MODEL].prefix_cache if MODEL in self.drafters else None
        total = dataclasses.replace(
            self.prefix_cache.stats, queries=self.num_prompt_tokens, hits=self.num_cached_tokens
        )
        if draft_prefix_cache is not None:
            draft = draft_prefix_cache.stats
            total.num_bytes += draft.num_bytes
            total.evictions += draft.evictions
            total.evicted_tokens += draft.evicted_tokens
        return total
