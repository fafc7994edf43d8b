"""How far each KV cache rolls back after a speculative step: plain integer arithmetic.

Rolling back is cropping a row's cache to a length (`handler.caches.kv_cache`); these
functions say which length, from token counts and token ids alone, so that the
arithmetic can be tested without a model. The engine and the draft-model
drafter call them and apply the result to their `RaggedCache`.

Vocabulary: a row's *committed* tokens are its prompt and every token emitted
so far. A cache never holds the last committed token: the next forward pass
needs the logits that follow it, so it is *pending*, fed at the start of the
next pass. Each cache therefore keeps this invariant between steps:

    cached tokens + pending tokens == committed tokens, with pending non-empty.

The target has exactly one pending token; the draft model may have several
(committed tokens it has not seen: a recovered or bonus token, or look-up
drafts accepted in hybrid mode).
"""

from __future__ import annotations

from typing import Sequence


def target_lengths_after_verify(
    lengths: Sequence[int], step_ks: Sequence[int], num_accepted: Sequence[int]
) -> list[int]:
    """Each row's target cache length once the verify pass is rolled back.

    The verify pass fed every row 1 + width tokens, width = max(step_ks): its
    pending token, then its step_ks[row] drafts, padded to the width. A row
    keeps its pending token and its accepted drafts; the padding, the rejected
    drafts and the drafts after them go. The token the step emits last (the
    recovered or bonus token) was never fed and becomes the new pending token,
    so the invariant holds again.

    Args:
        lengths: each row's cached tokens after the verify pass.
        step_ks: each row's number of drafts in the pass (0 for plain decoding).
        num_accepted: each row's accepted drafts, 0 <= num_accepted[row] <= step_ks[row].

    Returns:
        each row's length to roll back to: its length before the pass + 1 + num_accepted[row].
    """
    assert len(lengths) == len(step_ks) == len(num_accepted), (len(lengths), len(step_ks), len(num_accepted))
    width = max(step_ks, default=0)
    kept = []
    for length, k, accepted in zip(lengths, step_ks, num_accepted):
        assert 0 <= accepted <= k <= width, (accepted, k, width)
        assert length >= 1 + width, (length, width)  # the pass itself appended 1 + width tokens
        kept.append(length - (width - accepted))
    return kept


def draft_rollback(
    fed_pending: Sequence[int], fed: Sequence[int], pending: Sequence[int], committed: Sequence[int]
) -> tuple[int, list[int]]:
    """Rolls one row of the draft cache back to what the step committed.

    A proposal of k drafts feeds the row's pending tokens, then its first k - 1
    drafts (the last draft's logits are never needed), and leaves nothing
    pending. Afterwards:

    - The fed drafts stay cached as far as they equal the committed tokens,
      position by position, but never the last committed token, even when it
      equals a fed draft: it must stay pending. The committed tokens after the
      kept drafts become pending.
    - A row that committed nothing goes back to before the proposal: the
      proposal's pending tokens are pending again.
    - Without a proposal this step (nothing fed), the committed tokens join the
      pending ones.

    The invariant (cached + pending == committed, pending non-empty) holds
    afterwards if it held before the proposal.

    Args:
        fed_pending: the pending tokens the last proposal fed; [] if none ran.
        fed: the drafts it fed after them; [] if none ran (or k was 1).
        pending: the row's pending tokens now; [] after a proposal.
        committed: the tokens the row committed this step; [] for none.

    Returns:
        the number of cached tokens to drop, and the row's new pending tokens (a plain pair: every
        row makes one every step).
    """
    # A proposal feeds every pending token, so pending tokens and fed ones never coexist.
    assert not (pending and (fed or fed_pending)), (pending, fed, fed_pending)
    if not committed:
        return len(fed) + len(fed_pending), [*fed_pending, *pending]
    num_matching, most = 0, min(len(fed), len(committed) - 1)  # every row, every step: the bound once
    while num_matching < most and fed[num_matching] == committed[num_matching]:
        num_matching += 1
    return len(fed) - num_matching, [*pending, *committed[num_matching:]]
