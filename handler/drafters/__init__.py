"""The drafters: who proposes the tokens that the target verifies.

- `model` (`handler.drafters.model`): a small causal LM samples k drafts, one
  forward pass each, with their draft distributions.
- `ngram` (`handler.drafters.ngram`): prompt look-up; copies what followed the
  longest matching n-gram earlier in the request's own prompt and output.
- `suffix` (`handler.drafters.suffix`): suffix trees over the request's own
  text and over recent completions of other requests, with counts; proposes the
  most frequent continuation while its estimated probability stays high.
- `hybrid` (the rule is `handler.planning.planner.choose`): per row and step, the proposal that
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
`remove(request_ids, sequences)` when they leave; and every drafter proposes
through one call, `propose(rows, sampling)`: the rows asking (`DraftRow`, each
with its most drafts), the step's `handler.sampler.SamplingBatch`, and back one
`Proposal` per row. A look-up answers with a chain or, where the row may take
one, a tree (`handler.tree`); the draft model with its chain and the
distributions it drew it from; the grammar (`handler.drafters.grammar`) with the
tokens it forces.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
from typing import TYPE_CHECKING, Callable, Hashable, Mapping, Protocol, Sequence

# The names live below the drafters, where the config and the requests can read them; re-exported.
from handler.config import CROSS_VOCAB_GREEDY, SLEM, TLI  # noqa: F401 - re-exported
from handler.tree import is_chain
from handler.types import DRAFTERS, HYBRID, MODEL, MODEL_FREE, NGRAM, SUFFIX, DrafterName  # noqa: F401 - re-exported

if TYPE_CHECKING:
    import torch

    from handler.sampler import SamplingBatch

# Not a drafter a request picks: the tokens a constraint's grammar forces, proposed as drafts.
PROPOSER_GRAMMAR = DrafterName.GRAMMAR
# Whoever proposes a row's drafts in a step: a drafter, or the grammar.
PROPOSERS = (MODEL, NGRAM, SUFFIX, PROPOSER_GRAMMAR)
# The look-ups, in the order the hybrid drafter offers their candidates.
LOOKUPS = (SUFFIX, NGRAM)
# The drafters that propose for a request of each drafter.
_PROPOSING = {MODEL: (MODEL,), NGRAM: (NGRAM,), SUFFIX: (SUFFIX,), HYBRID: (*LOOKUPS, MODEL)}


def drafters_of(drafter: DrafterName) -> tuple[DrafterName, ...]:
    """The drafters that propose for a request of `drafter` (a hybrid's: every one)."""
    return _PROPOSING[drafter]


@dataclasses.dataclass  # not frozen, as the planner's per-step records (`handler.planning.planner`)
class Proposal:
    """One row's drafts for one step, a chain or a tree: a look-up's, the tokens a grammar forces,
    or the draft model's chain (with its runners-up as siblings, `handler.engine.propose`)."""

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
    # The draft model's chain: the distributions its drafts were drawn from [n, vocab] (None: one-hot, a
    # look-up's), its own probability of each draft before warping, and its likeliest other token at
    # each with that token's probability (both None where not measured).
    draft_probs: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    confidences: list[float] | None = None
    runners_up: list[tuple[int, float]] | None = None

    @functools.cached_property
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
            None if self.draft_probs is None else self.draft_probs[:num],
            None if self.confidences is None else self.confidences[:num],
            None if self.runners_up is None else self.runners_up[:num],
        )


NO_DRAFTS = Proposal([])  # no drafts: plain decoding for the row


class DeviceDrafts:
    """A draft loop's drafts left where they were drawn [rows, k] until the step reads them with its
    verdict (`resolve`), so that a drafting step waits for the device once: the verify pass takes
    them as they are (`handler.engine.verify`), and the host's bookkeeping of them (the draft's
    feeds, the verdict's comparisons) follows that one read. Each row's drafts are a `DeviceChain`."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor  # [rows, k] long, on the draft model's device
        self._host: list[list[int]] | None = None

    @property
    def resolved(self) -> bool:
        return self._host is not None

    def resolve(self, host_rows: list[list[int]]) -> None:
        """Takes the drafts as the step's read brought them ([rows][k])."""
        self._host = host_rows

    def rows(self) -> list[list[int]]:
        if self._host is None:
            # Nothing read them with a verdict (a drafter driven without the engine's verify): a read of
            # their own, so that the tokens are right whoever asks.
            self._host = self.tensor.tolist()
        return self._host

    def chain(self, row: int, num: int) -> DeviceChain:
        return DeviceChain(self, row, num)


class DeviceChain(collections.abc.Sequence):
    """Row `row`'s first `num` drafts of a `DeviceDrafts`: its length is known at once, its tokens once
    the step has read them (asked before, they are read then). A slice from the start stays one."""

    __slots__ = ("drafts", "row", "num")

    def __init__(self, drafts: DeviceDrafts, row: int, num: int) -> None:
        assert 0 <= num <= drafts.tensor.shape[1], (num, drafts.tensor.shape)
        self.drafts, self.row, self.num = drafts, row, num

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, index):
        if isinstance(index, int):
            position = range(self.num)[index]  # IndexError past the chain
            return self.drafts.rows()[self.row][position]
        if index.start in (None, 0) and index.step in (None, 1):
            return DeviceChain(self.drafts, self.row, len(range(self.num)[index]))
        return self.drafts.rows()[self.row][: self.num][index]

    def __iter__(self):
        return iter(self.drafts.rows()[self.row][: self.num])

    def __eq__(self, other) -> bool:
        return isinstance(other, collections.abc.Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        state = list(self) if self.drafts.resolved else f"{self.num} on the device"
        return f"DeviceChain({state})"

    @property
    def device_tokens(self) -> torch.Tensor:  # [num]
        return self.drafts.tensor[self.row, : self.num]


@dataclasses.dataclass  # not frozen, as `Proposal`
class DraftRow:
    """One row asking a drafter for its drafts this step."""

    request_id: Hashable
    max_tokens: int  # the most drafts (a tree's nodes) it may verify
    slot: int = 0  # its row in the step's `SamplingBatch`
    tree: bool = False  # a look-up may answer with a tree
    # The draft model's: its rules on the draft's logits, f(logits [vocab], previous draft or None) -> logits,
    # called once per draft in order (a grammar mask, penalties); how many of its next drafts a look-up
    # may guess into each pass (guessed drafting; 0: none); whether to measure its drafts' confidences
    # and runners-up.
    shape: Callable | None = None
    # Where `shape` is the row's logit bias and penalties alone (no grammar): their settings and history,
    # (SamplingParams, output counts [vocab] | None, seen tokens [vocab] | None), which a chain of draft
    # passes applies on the device (`handler.logits_processors.ChainPenalties`) instead of calling `shape`.
    penalties: tuple | None = None
    guesses: int = 0
    measure_confidence: bool = False
    # The grammar's: n -> the tokens its grammar forces next, up to n.
    forced: Callable[[int], list[int]] | None = None


class Drafter(Protocol):
    """What the engine calls on every drafter."""

    name: DrafterName

    def propose(
        self,
        rows: Sequence[DraftRow],
        sampling: SamplingBatch,
        keep_drafting: Callable[[int, dict], bool] | None = None,
    ) -> list[Proposal]:
        """Each row's drafts, in order. `keep_drafting`: a drafter that drafts token by token asks it,
        after each, whether one more pays (f(drafts so far, request id -> confidence of its latest))."""

    def add(self, prompts: Mapping[Hashable, Sequence[int]], private: Sequence[Hashable] = ()) -> None:
        """Starts following the rows of new requests, by request id (`private`: those whose text must
        serve no other request)."""

    def observe(self, committed: Mapping[Hashable, Sequence[int]]) -> None:
        """Takes the tokens each row committed in the last step (absent: none)."""

    def remove(
        self, request_ids: Sequence[Hashable], sequences: Mapping[Hashable, Sequence[int]] | None = None
    ) -> None:
        """Stops following rows; `sequences` (prompt + completion) when their state is consistent."""
