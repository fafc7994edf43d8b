"""The drafters: who proposes the tokens that the target verifies.

- `model` (`handler.drafters.model`): a small causal LM samples k drafts, one
  forward pass each, with their draft distributions.
- `ngram` (`handler.drafters.ngram`): prompt look-up; copies what followed the
  longest matching n-gram earlier in the request's own prompt and output.
- `suffix` (`handler.drafters.suffix`): suffix trees over the request's own
  text and over recent completions of other requests, with counts; proposes the
  most frequent continuation while its estimated probability stays high.
- `hybrid` (`handler.drafters.hybrid`): per row and step, the proposal that
  promises the most tokens per second: a look-up (suffix or n-gram) or the
  draft model.

Guessed drafting: where a hybrid row drafts with the model, the suffix trees
guess the draft model's next drafts (`SuffixDrafter.continuation`) and one draft
pass runs over the guesses too; while the draft model's draws equal them, the
pass yields several drafts. The drafts are the draft model's own either way.

Look-up drafts are one-hot (a deterministic proposal), so the rejection
sampler accepts each with the target's own probability of it and the output
stays the target's distribution whoever proposed it.

Every drafter follows the rows of the engine's batch through the same calls:
`add(prompts)` when requests join, `observe(committed)` after every step, and
`remove(request_ids, sequences)` when they leave. Look-up drafters answer
`lookup(request_id, max_tokens, tree=False) -> Proposal`, a chain or, with
`tree`, a tree of up to `max_tokens` drafts (`handler.tree`); the model drafter samples a whole
batch in `propose`.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Mapping, Protocol, Sequence

# The names live below the drafters, where the config and the requests can read them; re-exported.
from handler.config import CROSS_VOCAB_GREEDY, SLEM, TLI  # noqa: F401 - re-exported
from handler.tree import is_chain
from handler.types import DRAFTERS, HYBRID, MODEL, MODEL_FREE, NGRAM, SUFFIX  # noqa: F401 - re-exported


@dataclasses.dataclass(frozen=True)
class Proposal:
    """One row's drafts for one step, a chain or a tree: a look-up's, the tokens a grammar forces,
    or the draft model's chain with its runners-up as siblings (`handler.engine.propose`)."""

    token_ids: list[int]
    # probs[j]: the estimated probability that drafts 0..j are all accepted (a suffix tree's
    # counts along the path); None when the drafter has no estimate (the n-gram look-up).
    probs: list[float] | None = None
    # parents[j]: the index of draft j's parent, -1 for the row's pending token (`handler.tree`);
    # None: a chain, each draft following the one before.
    parents: list[int] | None = None
    # shares[j]: the fraction of the matched occurrences whose continuation runs through draft j
    # (an n-gram tree); None: all of them.
    shares: list[float] | None = None

    @property
    def is_tree(self) -> bool:
        """Whether some draft does not follow the one before it."""
        return self.parents is not None and not is_chain(self.parents)

    def prefix(self, num: int) -> Proposal:
        """The first `num` drafts, a proposal again: parents come before their children."""
        return Proposal(
            self.token_ids[:num],
            None if self.probs is None else self.probs[:num],
            None if self.parents is None else self.parents[:num],
            None if self.shares is None else self.shares[:num],
        )


NO_DRAFTS = Proposal([])  # no drafts: plain decoding for the row


class Drafter(Protocol):
    """What the engine calls on every drafter."""

    name: str

    def add(self, prompts: Mapping[Hashable, Sequence[int]]) -> None:
        """Starts following the rows of new requests, by request id."""

    def observe(self, committed: Mapping[Hashable, Sequence[int]]) -> None:
        """Takes the tokens each row committed in the last step (absent: none)."""

    def remove(
        self, request_ids: Sequence[Hashable], sequences: Mapping[Hashable, Sequence[int]] | None = None
    ) -> None:
        """Stops following rows; `sequences` (prompt + completion) when their state is consistent."""
