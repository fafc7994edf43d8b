"""The draft-model drafter for a draft from another family, whose tokenizer differs from the target's.

The draft reads and writes its own ids; the engine sees target ids only
(`handler.vocab_map` has the methods and their sources):

- A row's draft sequence is the translation of its committed target tokens,
  token by token, so it grows as tokens are committed. The draft's cache holds
  a prefix of it plus whatever the draft fed itself; after each step the cache
  rolls back to the longest prefix it shares with the sequence (never the
  sequence's last token, whose logits the next proposal needs), and the rest
  of the sequence is pending.
- Sampled rows, and greedy rows with a grammar, draft from the draft's
  distribution restricted to the shared tokens (TLI). The draws are target ids
  with draft distributions on the target's vocabulary, so the rejection
  sampler, the coupled draws of seeded rows and the grammar masks work
  unchanged.
- Other greedy rows draft with the draft's whole vocabulary, and its text is
  cut into target tokens (SLEM). The last target token of that text may be the
  prefix of a longer one and is not proposed; it takes one draft pass beyond
  the row's k to finish the k-th. Their drafts' distributions are one-hot.

The draft loop is `ModelDrafter.propose`'s; this drafter supplies its vocabulary's part. Guessed
drafting and the draft's runners-up (trees) are not offered: both are in the draft's ids.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from handler.caches.prefix_cache import PrefixCache
from handler.drafters import CROSS_VOCAB_GREEDY, SLEM, TLI
from handler.drafters.model import ModelDrafter, draft_confidences
from handler.sampler import SamplingBatch, argmax_vocab
from handler.vocab_map import CONTEXT_TOKENS, VocabMap

# The committed target tokens a row keeps to re-tokenize the draft's text after (SLEM).
NUM_CONTEXT = CONTEXT_TOKENS[-1]


class CrossVocabDrafter(ModelDrafter):
    """Proposes target tokens from a draft model with another vocabulary."""

    def __init__(
        self,
        model,
        vocab_map: VocabMap,
        prefix_cache: PrefixCache | None = None,
        runner=None,
        greedy=TLI,
        prefill_model=None,
        prefill_speedup: float = 1.0,
    ):
        """`greedy`: how unconstrained greedy rows draft, `slem` (the draft's whole vocabulary, its text
        re-tokenized) or `tli` (the shared tokens only, as sampled rows). The draft pads with its own pad id.
        `prefill_model`, `prefill_speedup`: as `ModelDrafter`'s."""
        assert greedy in CROSS_VOCAB_GREEDY, greedy
        super().__init__(
            model,
            vocab_map.target_vocab_size,
            vocab_map.draft_pad_token_id,
            prefix_cache,
            runner,
            prefill_model=prefill_model,
            prefill_speedup=prefill_speedup,
        )
        self.vocab_map = vocab_map
        self.greedy = greedy
        self.sequence: dict[Hashable, list[int]] = {}  # the translation of the committed tokens
        self.cached: dict[Hashable, list[int]] = {}  # the draft ids the row's cache holds
        self.synced: dict[Hashable, int] = {}  # how much of `cached` is known to equal `sequence`
        self.context: dict[Hashable, list[int]] = {}  # the row's last committed target tokens (SLEM)

    def _start_row(self, request_id: Hashable, target_ids: list[int]) -> list[int]:
        """A joining row's translated sequence so far; its prefill is all but the last draft id."""
        # A prompt that translates to nothing (a special token the draft cannot spell) feeds the pad.
        sequence = self.vocab_map.translate(target_ids) or [self.pad_token_id]
        self.context[request_id] = target_ids[-NUM_CONTEXT:]
        self.sequence[request_id] = sequence
        self.cached[request_id] = sequence[:-1]
        self.synced[request_id] = len(sequence) - 1
        return list(self.cached[request_id])

    @property
    def max_pending(self) -> int:
        """The most tokens a row feeds the next (or the current) proposal's first pass."""
        return max((len(self.sequence[r]) - self.synced[r] for r in self.order), default=1) or 1

    def _pending(self, request_id: Hashable) -> list[int]:
        return self.sequence[request_id][len(self.cached[request_id]) :]

    # The vocabulary's part of `ModelDrafter.propose`'s draft loop: feeds are draft ids, drafts target ids.

    def _first_feeds(self) -> list[list[int]]:
        return [self._pending(request_id) for request_id in self.order]

    def _pass_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [rows, width]: draft ids already
        return input_ids

    def _fed(self, feeds: list[list[int]]) -> None:
        for slot, request_id in enumerate(self.order):
            self.cached[request_id].extend(feeds[slot])

    def _target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:  # [rows, 1, draft_vocab]
        """The draft's distribution restricted to the shared tokens, on the target's ids (TLI): a row
        draws from the distribution its proposal reports, as losslessness needs."""
        return self.vocab_map.to_target_logits(draft_logits)  # [rows, 1, vocab]

    def _own_choices(self, draft_logits: torch.Tensor, with_confidence: bool):
        """The draft's greedy choice over its whole vocabulary, and its confidence: what a text row
        drafts (SLEM) and what a row that drafts no more feeds."""
        own_ids = argmax_vocab(draft_logits[:, -1])  # [rows]
        own_confidence = None
        if with_confidence:
            own_confidence = [row[0] for row in draft_confidences(draft_logits, own_ids[:, None])[0]]
        return own_ids.tolist(), own_confidence

    def _feed_of(self, token: int) -> int | None:
        draft_id = self.vocab_map.draft_id(token)
        return None if draft_id < 0 else draft_id

    def _texts(self, asking: list[int], settings: SamplingBatch, shaped: dict) -> dict:
        """The greedy rows without a grammar that draft with the draft's whole vocabulary (SLEM)."""
        if self.greedy != SLEM:
            return {}
        return {
            slot: _TextDrafts(self.vocab_map, self.context[self.order[slot]])
            for slot in asking
            if float(settings.temperature[slot]) == 0 and slot not in shaped
        }

    def _end_proposal(self, drafts: list[list[int]], num_drafts: int) -> None:
        """Nothing to cut: `observe` rolls the cache back to what it shares with the committed tokens."""

    def _sync(self, request_id: Hashable, tokens: Sequence[int]) -> int:
        """Translates a row's committed tokens; its cache keeps what it shares with them (returns the ids
        it drops)."""
        sequence, cached = self.sequence[request_id], self.cached[request_id]
        sequence.extend(self.vocab_map.translate(tokens))
        self.context[request_id] = (self.context[request_id] + list(tokens))[-NUM_CONTEXT:]
        synced = self.synced[request_id]
        limit = min(len(cached), len(sequence) - 1)
        while synced < limit and cached[synced] == sequence[synced]:
            synced += 1
        num_dropped = len(cached) - synced
        del cached[synced:]
        self.synced[request_id] = synced
        return num_dropped

    def _forget(self, request_id: Hashable) -> None:
        for state in (self.sequence, self.cached, self.synced, self.context):
            del state[request_id]

    def _draft_ids(self, token_ids):
        """Committed target tokens in the draft's ids (the prefix cache keys the draft's KV by them)."""
        assert not isinstance(token_ids, torch.Tensor)
        return self.vocab_map.translate(token_ids)


class _TextDrafts:
    """A SLEM row's drafts in one proposal: the draft's own tokens, and their text in target tokens."""

    def __init__(self, vocab_map: VocabMap, context: Sequence[int]) -> None:
        self.vocab_map = vocab_map
        self.context = context
        self.own: list[int] = []
        self.own_confidences: list[float] = []
        self.target_ids: list[int] = []
        self.confidences: list[float] = []

    def take(self, draft_id: int, confidence: float) -> bool:
        """Takes the draft's next token; False once the text is over (a special token drawn)."""
        if draft_id in self.vocab_map.draft_special:
            # The text before it is finished; a special token both have (an end of turn) is a draft too.
            self._cut(finished=True)
            target_id = self.vocab_map.target_id(draft_id)
            if target_id >= 0:
                self.target_ids.append(target_id)
                self.confidences.append(confidence)
            return False
        self.own.append(draft_id)
        self.own_confidences.append(confidence)
        self._cut(finished=False)
        return True

    def _cut(self, finished: bool) -> None:
        target_ids, ends = self.vocab_map.retokenize(self.context, self.own)
        if not finished:
            # The last may be the prefix of a longer token that the draft's next tokens finish.
            target_ids, ends = target_ids[:-1], ends[:-1]
        self.target_ids = target_ids
        self.confidences = [self.own_confidences[end] for end in ends]
