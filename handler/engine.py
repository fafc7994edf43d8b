"""The speculative decoding loop: draft -> verify -> accept -> roll back the caches.

Vocabulary (draft, target, accepted, recovered, bonus) is defined in
`handler.sampler`. One call to `SpeculativeEngine.generate` runs a batch of
requests together:

- Each row keeps its own k, sampling settings, seed and acceptance (ragged).
- Pending tokens are committed tokens a model has not processed yet. At the
  start the whole prompt is pending, so the first draft pass is the draft's
  prefill and the first verification is the target's prefill: no separate
  prefill pass. Afterwards the target has one pending token (the last
  emitted), and the draft one or two: when all k drafts are accepted, the
  draft never saw the last one, so it is fed in the next step.
- The target verifies all drafts in one forward pass over just the new tokens.
- After verification both caches roll back to the committed length.
- A finished row leaves the batch; the others carry on undisturbed.

Nothing here imports TorchServe.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import torch

from handler.adaptive import AcceptanceTracker, AdaptiveK
from handler.config import SamplingParams
from handler.kv_cache import RaggedCache, left_pad
from handler.sampler import draw_step_uniforms, rejection_sample, sample_from_probs, warp_logits_to_probs
from handler.schema import FINISH_EOS, FINISH_LENGTH, FINISH_STOP
from handler.stopping import StopChecker

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    num_speculative_tokens: int = 4
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclasses.dataclass
class SpeculativeStats:
    """Per-request counters. One verification of a batch counts once for each row in it."""

    num_speculative_tokens: int
    draft_tokens: int = 0
    accepted_tokens: int = 0
    target_forward_passes: int = 0
    completion_tokens: int = 0
    # Steps that ended on a rejected draft; accepted / (accepted + rejections) estimates
    # the per-token acceptance probability of Leviathan et al.'s model.
    rejections: int = 0
    # Adaptive k found speculation slower than plain decoding and stopped drafting.
    fell_back: bool = False

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target forward pass."""
        return self.completion_tokens / self.target_forward_passes if self.target_forward_passes else 0.0

    def as_dict(self) -> dict:
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "target_forward_passes": self.target_forward_passes,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "fell_back_to_target_only": self.fell_back,
        }


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    stats: SpeculativeStats


class _Row:
    """One request's progress: emitted tokens, stop conditions, counters."""

    def __init__(
        self,
        request: GenerationRequest,
        tokenizer,
        eos_token_ids: frozenset[int],
        adaptive: AdaptiveK | None,
    ) -> None:
        self.request = request
        self.adaptive = adaptive
        self.tracker = AcceptanceTracker()
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.token_ids: list[int] = []
        self.text = ""
        self.stop_checker = StopChecker(tokenizer, request.stop) if request.stop else None
        self.finish_reason: str | None = None
        self.stats = SpeculativeStats(num_speculative_tokens=request.num_speculative_tokens)
        self.generator = None
        if not request.sampling.is_greedy:
            self.generator = torch.Generator()
            if request.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(request.seed)

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.token_ids)

    def plan_k(self) -> int:
        """This step's number of drafts."""
        # Never draft past max_new_tokens: the verify pass must stay inside the context.
        max_k = max(0, min(self.request.num_speculative_tokens, self.remaining - 1))
        if self.stats.fell_back:
            return 0
        if self.adaptive is None or max_k == 0:
            return max_k
        k = self.adaptive.choose(self.tracker, max_k)
        if k == 0:
            self.stats.fell_back = True
        return k

    def extend(self, new_token_ids: Sequence[int]) -> list[int]:
        """Appends tokens one by one until a stop condition; returns those kept."""
        kept = []
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            kept.append(token_id)
            if token_id in self.eos_token_ids:
                self.finish_reason = FINISH_EOS
            elif self.request.stop and self._hit_stop_string():
                self.finish_reason = FINISH_STOP
            elif self.remaining == 0:
                self.finish_reason = FINISH_LENGTH
            if self.finish_reason is not None:
                break
        self.stats.completion_tokens = len(self.token_ids)
        return kept

    def _hit_stop_string(self) -> bool:
        match = self.stop_checker.add_token(self.token_ids[-1])
        if match is None:
            return False
        self.text = match.text
        return True

    def result(self) -> GenerationResult:
        assert self.finish_reason is not None
        if self.finish_reason != FINISH_STOP:
            self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        return GenerationResult(
            token_ids=list(self.token_ids),
            text=self.text,
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.request.prompt_ids),
            stats=self.stats,
        )


def _fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [batch, positions, draft_vocab]
    """Puts draft logits on the target's vocabulary: extra ids cut, missing ids impossible."""
    draft_vocab = logits.shape[-1]
    if draft_vocab > vocab_size:
        return logits[..., :vocab_size]
    if draft_vocab < vocab_size:
        padding = logits.new_full((*logits.shape[:-1], vocab_size - draft_vocab), float("-inf"))
        return torch.cat([logits, padding], dim=-1)
    return logits


class SpeculativeEngine:
    """Lossless speculative decoding with a draft and a target Hugging Face causal LM."""

    def __init__(
        self,
        target,
        draft,
        tokenizer,
        eos_token_ids: Sequence[int],
        pad_token_id: int = 0,
        adaptive: AdaptiveK | None = None,
    ) -> None:
        """`adaptive`, when given, picks each step's k per request, up to the request's k."""
        self.target = target
        self.adaptive = adaptive
        self.draft = draft
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.device = next(target.parameters()).device
        self.vocab_size = target.config.get_text_config().vocab_size
        self.draft_vocab_size = draft.config.get_text_config().vocab_size

    @torch.inference_mode()
    def generate(
        self,
        requests: Sequence[GenerationRequest],
        on_tokens: Callable[[int, list[int], _Row], None] | None = None,
    ) -> list[GenerationResult]:
        """Runs all requests in one batched loop and returns their results in order.

        Args:
            requests: the batch; each has its own k, sampling settings and seed.
            on_tokens: optional callback (request index, new token ids, row) after
                every verification step that emitted tokens for that request.
        """
        rows = [_Row(request, self.tokenizer, self.eos_token_ids, self.adaptive) for request in requests]
        active = list(range(len(rows)))
        target_cache = RaggedCache(self.target, len(rows))
        draft_cache = RaggedCache(self.draft, len(rows))
        target_pending = [list(request.prompt_ids) for request in requests]
        draft_pending = [list(request.prompt_ids) for request in requests]

        while active:
            batch = [rows[i] for i in active]
            step_ks = [row.plan_k() for row in batch]
            num_accepted, emitted = self._step(batch, step_ks, target_cache, draft_cache, target_pending, draft_pending)
            k = max(step_ks)

            target_lengths = target_cache.lengths.clone()
            draft_lengths = draft_cache.lengths.clone()
            still_active = []
            for slot, row_index in enumerate(active):
                row = rows[row_index]
                accepted = num_accepted[slot]
                new_tokens = emitted[slot][: accepted + 1]
                row.stats.draft_tokens += step_ks[slot]
                row.stats.accepted_tokens += accepted
                row.stats.rejections += int(accepted < step_ks[slot])
                row.stats.target_forward_passes += 1
                row.tracker.update(accepted, step_ks[slot])
                kept = row.extend(new_tokens)
                if on_tokens is not None and kept:
                    on_tokens(row_index, kept, row)
                if row.finish_reason is not None:
                    continue
                still_active.append(slot)
                # Roll back: the target keeps its pending tokens and the accepted drafts,
                # the draft keeps what it has seen of them.
                target_lengths[slot] -= k - accepted
                num_drafts_fed = max(k - 1, 0)
                draft_lengths[slot] -= num_drafts_fed - min(accepted, num_drafts_fed)
                target_pending[slot] = [new_tokens[-1]]
                if k == 0:
                    draft_pending[slot].append(new_tokens[-1])
                elif accepted == k:
                    draft_pending[slot] = [new_tokens[-2], new_tokens[-1]]
                else:
                    draft_pending[slot] = [new_tokens[-1]]

            target_cache.rollback(target_lengths)
            if k > 0:
                draft_cache.rollback(draft_lengths)
            if len(still_active) < len(active):
                target_cache.select_rows(still_active)
                draft_cache.select_rows(still_active)
                target_pending[:] = [target_pending[slot] for slot in still_active]
                draft_pending[:] = [draft_pending[slot] for slot in still_active]
                active = [active[slot] for slot in still_active]
        return [row.result() for row in rows]

    def _step(
        self,
        batch: list[_Row],
        step_ks: list[int],
        target_cache: RaggedCache,
        draft_cache: RaggedCache,
        target_pending: list[list[int]],
        draft_pending: list[list[int]],
    ) -> tuple[list[int], list[list[int]]]:
        """One draft + verify step over the active rows, with k = max(step_ks).

        Returns:
            num_accepted per row, and emitted tokens per row ([k + 1], -1 padded).
        """
        k = max(step_ks)
        # Rows whose k is below the batch's k have their extra drafts ignored;
        # `draw_step_uniforms` draws only for each row's own k.
        draft_uniforms, verify_uniforms = draw_step_uniforms([row.generator for row in batch], step_ks, k)
        temperature = torch.tensor([row.request.sampling.temperature for row in batch], device=self.device)
        top_k = torch.tensor([row.request.sampling.top_k for row in batch], device=self.device)
        top_p = torch.tensor([row.request.sampling.top_p for row in batch], device=self.device)

        draft_token_ids = torch.empty((len(batch), 0), dtype=torch.long, device=self.device)  # [batch, k]
        draft_probs = torch.empty((len(batch), 0, self.vocab_size), device=self.device)  # [batch, k, vocab]
        if k > 0:
            input_ids, chunk_mask = left_pad(draft_pending, self.pad_token_id)
            # A padded target vocabulary can emit ids the draft has no embedding for (never
            # real tokens); the draft sees the pad id instead, which only costs acceptance.
            input_ids = input_ids.masked_fill(input_ids >= self.draft_vocab_size, self.pad_token_id)
            logits = draft_cache.forward(input_ids, chunk_mask, logits_to_keep=1)  # [batch, 1, draft_vocab]
            draft_uniforms = draft_uniforms.to(self.device)
            sampled, probs_per_step = [], []
            for j in range(k):
                probs = warp_logits_to_probs(_fit_vocab(logits, self.vocab_size), temperature, top_k, top_p)[:, 0]
                token_ids = sample_from_probs(probs, draft_uniforms[:, j])  # [batch]
                sampled.append(token_ids)
                probs_per_step.append(probs)
                if j < k - 1:
                    ones = torch.ones((len(batch), 1), dtype=torch.long)
                    logits = draft_cache.forward(token_ids[:, None], ones, logits_to_keep=1)
            draft_token_ids = torch.stack(sampled, dim=1)
            draft_probs = torch.stack(probs_per_step, dim=1)

        input_ids, chunk_mask = left_pad(target_pending, self.pad_token_id)
        input_ids = torch.cat([input_ids.to(self.device), draft_token_ids], dim=1)  # [batch, width + k]
        chunk_mask = torch.cat([chunk_mask, torch.ones((len(batch), k), dtype=torch.long)], dim=1)
        logits = target_cache.forward(input_ids, chunk_mask, logits_to_keep=k + 1)  # [batch, k + 1, vocab]
        target_probs = warp_logits_to_probs(logits[..., : self.vocab_size], temperature, top_k, top_p)

        num_accepted, output_token_ids = rejection_sample(
            target_probs,
            draft_probs,
            draft_token_ids,
            torch.tensor(step_ks, device=self.device),
            verify_uniforms.to(self.device),
        )
        # The step's one synchronisation point: the bookkeeping below is plain Python.
        return num_accepted.tolist(), output_token_ids.tolist()
