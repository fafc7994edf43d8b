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

Guessed drafting and the draft's runners-up (trees) are not offered: both are
in the draft's ids.
"""

from __future__ import annotations

from typing import Callable, Hashable, Mapping, Sequence

import torch

from handler.caches.kv_cache import left_pad
from handler.caches.prefix_cache import PrefixCache
from handler.drafters import CROSS_VOCAB_GREEDY, SLEM, TLI
from handler.drafters.model import DraftSample, ModelDrafter, agree_on_drafts, draft_confidences, sampling_tensors
from handler.sampler import sample_from_probs, warp_logits_to_probs
from handler.vocab_map import CONTEXT_TOKENS, VocabMap

# The committed target tokens a row keeps to re-tokenize the draft's text after (SLEM).
NUM_CONTEXT = CONTEXT_TOKENS[-1]


class CrossVocabDrafter(ModelDrafter):
    """Proposes target tokens from a draft model with another vocabulary."""

    def __init__(
        self,
        model,
        vocab_map: VocabMap,
        draft_pad_token_id: int,
        prefix_cache: PrefixCache | None = None,
        runner=None,
        greedy: str = TLI,
    ) -> None:
        """`greedy`: how unconstrained greedy rows draft, `slem` (the draft's whole vocabulary, its text
        re-tokenized) or `tli` (the shared tokens only, as sampled rows)."""
        assert greedy in CROSS_VOCAB_GREEDY, greedy
        super().__init__(model, vocab_map.target_vocab_size, draft_pad_token_id, prefix_cache, runner)
        self.vocab_map = vocab_map
        self.greedy = greedy
        self.sequence: dict[Hashable, list[int]] = {}  # the translation of the committed tokens
        self.cached: dict[Hashable, list[int]] = {}  # the draft ids the row's cache holds
        self.synced: dict[Hashable, int] = {}  # how much of `cached` is known to equal `sequence`
        self.context: dict[Hashable, list[int]] = {}  # the row's last committed target tokens (SLEM)

    def fill(self, request_ids: Sequence[Hashable]) -> None:
        """Prefills the requests' translated sequences so far, all but the last draft id."""
        ids = [request_id for request_id in request_ids if request_id in self.unfilled]
        if not ids:
            return
        for request_id in ids:
            target_ids = self.unfilled.pop(request_id)
            # A prompt that translates to nothing (a special token the draft cannot spell) feeds the pad.
            sequence = self.vocab_map.translate(target_ids) or [self.pad_token_id]
            self.context[request_id] = target_ids[-NUM_CONTEXT:]
            self.sequence[request_id] = sequence
            self.cached[request_id] = sequence[:-1]
            self.synced[request_id] = len(sequence) - 1
        self._join({request_id: list(self.cached[request_id]) for request_id in ids})

    @property
    def max_pending(self) -> int:
        """The most tokens a row feeds the next (or the current) proposal's first pass."""
        return max((len(self.sequence[r]) - self.synced[r] for r in self.order), default=1) or 1

    def _pending(self, request_id: Hashable) -> list[int]:
        return self.sequence[request_id][len(self.cached[request_id]) :]

    def propose(
        self,
        sampling: Mapping[Hashable, tuple[float, int, float, torch.Tensor]],
        shapers: Mapping[Hashable, Callable[[torch.Tensor, int | None], torch.Tensor]] | None = None,
        keep_drafting: Callable[[int, dict[Hashable, float]], bool] | None = None,
        with_confidence: bool = True,
        guesses=None,
    ) -> dict[Hashable, DraftSample]:
        """As `ModelDrafter.propose`, in target ids; `guesses` are not taken. A row may end with fewer
        drafts than the others (a SLEM row whose text the passes did not finish, a stalled row)."""
        assert sampling and self.cache is not None
        assert with_confidence or keep_drafting is None
        k = max(len(setting[3]) for setting in sampling.values())
        num_rows = len(self.order)
        temperature, top_k, top_p, uniforms = sampling_tensors(self.order, sampling, k, self.device)
        shaped = {slot: shapers[r] for slot, r in enumerate(self.order) if shapers and r in shapers}
        asking = [slot for slot, request_id in enumerate(self.order) if request_id in sampling]
        texts: dict[int, _TextDrafts] = {}
        if self.greedy == SLEM:
            texts = {
                slot: _TextDrafts(self.vocab_map, self.context[self.order[slot]])
                for slot in asking
                if float(temperature[slot]) == 0 and slot not in shaped
            }
        drafts: list[list[int]] = [[] for _ in range(num_rows)]  # target ids
        probs_of: list[list[torch.Tensor]] = [[] for _ in range(num_rows)]
        confidences: list[list[float]] = [[] for _ in range(num_rows)]
        runners_up: list[list[tuple[int, float]]] = [[] for _ in range(num_rows)]
        # Rows that draft no more: a TLI draw with no draft id (a grammar left no shared token), a SLEM
        # row whose draft drew a special token.
        stalled: set[int] = set()
        feeds = [self._pending(request_id) for request_id in self.order]
        counts = {slot: [] for slot in asking}
        num_drafts, num_passes = 0, 0
        # A SLEM row's last target token may be unfinished: one pass more finishes its k-th.
        max_passes = k + 1 if texts else k
        while True:
            input_ids, chunk_mask = left_pad(feeds, self.pad_token_id)
            draft_logits = self.cache.forward(input_ids, chunk_mask, logits_to_keep=1)  # [rows, 1, draft_vocab]
            num_passes += 1
            for slot, request_id in enumerate(self.order):
                self.cached[request_id].extend(feeds[slot])
            own_ids = draft_logits[:, -1].argmax(dim=-1)  # [rows]: the draft's greedy choice, whole vocabulary
            logits = self.vocab_map.to_target_logits(draft_logits)  # [rows, 1, vocab]
            for slot, shape in shaped.items():
                logits[slot, -1] = shape(logits[slot, -1], drafts[slot][-1] if drafts[slot] else None)
            probs = warp_logits_to_probs(logits, temperature, top_k, top_p)  # [rows, 1, vocab]
            # Draft j of a row takes the row's uniform j.
            column = torch.tensor([[min(len(drafts[slot]), k - 1)] for slot in range(num_rows)])
            sampled = self._draw(probs[:, 0], uniforms.gather(1, column)[:, 0])  # [rows]
            if with_confidence:
                confidence, other_ids, other_probs = draft_confidences(logits, sampled[:, None])
                own_confidence = draft_confidences(draft_logits, own_ids[:, None])[0]
            sampled_ids, own_list = sampled.tolist(), own_ids.tolist()
            # Rows that draft nothing more feed the draft's own choice: the batch stays rectangular.
            feeds = [[own_list[slot]] for slot in range(num_rows)]
            for slot in asking:
                if slot in stalled:
                    continue
                if slot in texts:
                    text = texts[slot]
                    if not text.take(own_list[slot], own_confidence[slot][0] if with_confidence else 0.0):
                        stalled.add(slot)
                    drafts[slot], confidences[slot] = text.target_ids, text.confidences
                    continue
                draft_id = self.vocab_map.draft_id(sampled_ids[slot])
                if len(drafts[slot]) >= k or draft_id < 0:
                    stalled.add(slot)
                    continue
                feeds[slot] = [draft_id]
                drafts[slot].append(sampled_ids[slot])
                probs_of[slot].append(probs[slot, 0])
                if with_confidence:
                    confidences[slot].append(confidence[slot][0])
                    runners_up[slot].append((other_ids[slot][0], other_probs[slot][0]))
            out_of_passes = num_passes >= max_passes or all(slot in stalled for slot in asking)
            num_drafts, stop = agree_on_drafts(
                self.order, asking, drafts, confidences, counts, num_drafts, k, keep_drafting, stop=out_of_passes
            )
            if stop:
                break
        if num_drafts < k and out_of_passes:
            # Out of passes, or every row stalled, before each row had k: each keeps what it has.
            num_drafts = min(k, max(len(drafts[slot]) for slot in asking))
        self.last_draft_counts = {self.order[slot]: counts[slot] for slot in asking}
        self.last_num_drafts = num_drafts
        proposals = {}
        for slot in asking:
            token_ids = drafts[slot][:num_drafts]
            if slot in texts or not token_ids:
                # A re-tokenized draft is the draft's greedy choice: its distribution is one-hot.
                probs = torch.zeros((len(token_ids), self.vocab_size), device=self.device)  # [n, vocab]
                probs[torch.arange(len(token_ids)), torch.tensor(token_ids, dtype=torch.long)] = 1.0
            else:
                probs = torch.stack(probs_of[slot][: len(token_ids)])  # [n, vocab]
            proposals[self.order[slot]] = DraftSample(
                torch.tensor(token_ids, dtype=torch.long, device=self.device),
                probs,
                confidences[slot][: len(token_ids)],
                runners_up[slot][: len(token_ids)],
            )
        return proposals

    def _draw(
        self,
        probs: torch.Tensor,  # [rows, vocab]: the warped distribution on the shared tokens
        uniforms: torch.Tensor,  # [rows] float64
    ) -> torch.Tensor:  # [rows]
        """Each row's draw from `probs`, the distribution its proposal reports (TLI): a draw from any
        other, the draft's unrestricted one say, would break losslessness."""
        return sample_from_probs(probs, uniforms.to(self.device))

    def observe(self, committed: Mapping[Hashable, Sequence[int]]) -> None:
        """Translates each row's committed tokens and rolls its cache back to what it shares with them."""
        for request_id, tokens in self.unfilled.items():
            tokens.extend(committed.get(request_id, ()))
        if self.cache is None:
            return
        lengths = self.cache.lengths.clone()
        for slot, request_id in enumerate(self.order):
            tokens = committed.get(request_id, ())
            sequence, cached = self.sequence[request_id], self.cached[request_id]
            sequence.extend(self.vocab_map.translate(tokens))
            self.context[request_id] = (self.context[request_id] + list(tokens))[-NUM_CONTEXT:]
            synced = self.synced[request_id]
            limit = min(len(cached), len(sequence) - 1)
            while synced < limit and cached[synced] == sequence[synced]:
                synced += 1
            lengths[slot] -= len(cached) - synced
            del cached[synced:]
            self.synced[request_id] = synced
        self.cache.rollback(lengths)

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
