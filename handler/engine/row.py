"""One request in flight, a row of the batch: its tokens, stop conditions, rules and counters.

A row's rules (a grammar, a logit bias, penalties) shape the draft model's logits as the target's
will be shaped (`Row.shape_draft_logits`), and move past the tokens a step emitted (`Row.commit`).
"""

from __future__ import annotations

import time
from typing import Hashable, Sequence

import torch

from handler.constraints import RowGrammar, compiler_for
from handler.drafters import PROPOSERS
from handler.logits_processors import emitted_ids, process_row_logits, token_counts, token_mask
from handler.planning.trackers import AcceptanceTracker, GuessRate
from handler.schema import FINISH_EOS, FINISH_LENGTH, FINISH_STOP
from handler.stopping import StopChecker
from handler.types import GenerationRequest, GenerationResult, SpeculativeStats, StepOutput, TokenLogprob


def unseeded_generator() -> torch.Generator:
    """The generator of an unseeded sampled request: seeded from the operating system's entropy."""
    generator = torch.Generator()
    generator.seed()
    return generator


class Row:
    """One request in flight: emitted tokens, stop conditions, counters, its random stream."""

    def __init__(self, request_id: Hashable, request: GenerationRequest, drafter: str, tokenizer, eos_token_ids):
        self.request_id = request_id
        self.request = request
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.token_ids: list[int] = []
        self.remaining = request.max_new_tokens  # tokens it may still emit (`extend` counts them down)
        self.text = ""
        self.stop_checker = StopChecker(tokenizer, request.stop) if request.stop else None
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprob] | None = [] if request.logprobs is not None else None
        self.trackers = {name: AcceptanceTracker() for name in PROPOSERS}
        self.grammar: RowGrammar | None = None  # the constraint's, set by `start`
        # Whether a rule changes this row's logits: a grammar, a logit bias or a penalty. Read for every
        # row several times a step, and fixed by the request.
        self.shapes_logits = request.constraint is not None or request.sampling.processes_logits
        # Penalties' history (set by the engine when the request has penalties): counts of the
        # generated tokens, and which tokens the prompt or the output holds.
        self.output_counts: torch.Tensor | None = None  # [vocab] float
        self.seen: torch.Tensor | None = None  # [vocab] bool
        self.drafted: list[int] = []  # the draft model's drafts so far in this step (penalties)
        self.cached_tokens = 0  # prompt tokens found in the target's prefix cache
        self.prefix_handle = None  # the target prefix-cache node this row keeps locked
        self.steps_without_drafts = 0
        self.guess_rate = GuessRate()  # its model drafts that came free (guessed drafting)
        self.stats = SpeculativeStats(
            num_speculative_tokens=request.num_speculative_tokens, drafter=drafter, constrained=bool(request.constraint)
        )
        # A seeded sampled row is coupled: each output position has its own uniform, keyed by the
        # seed (`position_uniforms`). An unseeded one draws a step's uniforms from its generator.
        self.coupled = not request.sampling.is_greedy and request.seed is not None
        self.generator = None
        if not request.sampling.is_greedy and request.seed is None:
            self.generator = unseeded_generator()

    @classmethod
    def start(
        cls,
        request_id: Hashable,
        request: GenerationRequest,
        drafter: str,
        tokenizer,
        eos_token_ids,
        vocab_size: int,
        device: torch.device,
    ) -> Row:
        """A new request's row, with its grammar's start state and its penalties' history."""
        row = cls(request_id, request, drafter, tokenizer, eos_token_ids)
        if request.constraint is not None:
            assert eos_token_ids, "a constrained request needs an end-of-sequence token to end on"
            # Compiled (and cached) when the request was parsed: this is a copy of the start state.
            row.grammar = compiler_for(tokenizer).row(request.constraint, vocab_size, eos_token_ids)
        if request.sampling.needs_output_counts:
            row.output_counts = token_counts([], vocab_size, device)
        if request.sampling.needs_seen_tokens:
            row.seen = token_mask(request.prompt_ids, vocab_size, device)
        return row

    def cap(self) -> int:
        """The most drafts this row may verify now: its k, and never past max_new_tokens."""
        return self._within_max_new_tokens(self.request.num_speculative_tokens)

    def lookup_cap(self, lookup_num_tokens: int) -> int:
        """The most look-up drafts this row may verify now: `lookup_num_tokens` (0: its k), none when its k is 0."""
        k = self.request.num_speculative_tokens
        return self._within_max_new_tokens(lookup_num_tokens if k and lookup_num_tokens else k)

    def _within_max_new_tokens(self, num_drafts: int) -> int:
        # The verify pass emits up to num_drafts + 1 tokens and must stay inside max_new_tokens.
        return max(0, min(num_drafts, self.remaining - 1))

    def extend(self, new_token_ids: Sequence[int]) -> list[int]:
        """Appends tokens one by one until a stop condition; returns those kept."""
        kept = []
        remaining = self.remaining
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            kept.append(token_id)
            remaining -= 1
            if token_id in self.eos_token_ids:
                self.finish_reason = FINISH_EOS
            elif self.request.stop and self._hit_stop_string():
                self.finish_reason = FINISH_STOP
            elif remaining == 0:
                self.finish_reason = FINISH_LENGTH
            if self.finish_reason is not None:
                break
        self.remaining = remaining
        self.stats.completion_tokens = len(self.token_ids)
        return kept

    def shape_draft_logits(self, logits: torch.Tensor, previous_draft: int | None) -> torch.Tensor:  # [vocab]
        """The draft model's logits for this row's next draft, shaped as the target's will be."""
        if previous_draft is not None:
            self.drafted.append(previous_draft)
        if self.request.sampling.processes_logits:
            counts, seen = self.output_counts, self.seen
            if self.drafted and counts is not None:
                counts = counts + token_counts(self.drafted, counts.shape[0], counts.device)
            if self.drafted and seen is not None:
                seen = seen | token_mask(self.drafted, seen.shape[0], seen.device)
            logits = process_row_logits(logits[None], self.request.sampling, counts, seen, [])[0]
        if self.grammar is not None:
            mask = self.grammar_call("draft_mask", previous_draft)  # [vocab]
            logits = logits.masked_fill(~mask.to(logits.device), float("-inf"))
        return logits

    def draft_penalties(self) -> tuple | None:
        """Where the row's only rules on the draft's logits are its logit bias and penalties: their
        settings and history for a chain of draft passes on the device (`DraftRow.penalties`), else None."""
        if self.grammar is not None or not self.request.sampling.processes_logits:
            return None
        return self.request.sampling, self.output_counts, self.seen

    def end_drafting(self) -> None:
        self.drafted = []
        if self.grammar is not None:
            self.grammar_call("end_drafting")

    def commit(self, kept: list[int]) -> None:
        """Moves the rules' state past the tokens this step emitted."""
        if self.grammar is not None and self.finish_reason is None:
            self.grammar_call("commit", kept)
        if not kept or (self.output_counts is None and self.seen is None):
            return
        # In place at the tokens' ids: 4 calls for both, where a count and a mask of them, each added, took 9.
        history = self.output_counts if self.output_counts is not None else self.seen
        ids = emitted_ids(kept, history.shape[0], history.device)
        if self.output_counts is not None:
            self.output_counts.index_put_((ids,), torch.ones(len(ids), device=history.device), accumulate=True)
        if self.seen is not None:
            self.seen[ids] = True

    def emit(self, new_tokens: list[int], logits: torch.Tensor | None, path: list[int]) -> StepOutput:
        """Appends the step's tokens up to the first stop, moves the rules past them, and reports them
        (`logits`: the row's raw target logits at the step's columns, [columns, vocab], read where it
        reports log-probabilities; `path`: the columns of the emitted tokens)."""
        kept = self.extend(new_tokens)
        self.commit(kept)
        if self.logprobs is not None and kept:
            self.logprobs.extend(token_logprobs(logits[path[: len(kept)]], kept, self.request.logprobs))
        result = self.result() if self.finish_reason is not None else None
        return StepOutput(self.request_id, kept, self.token_ids, self.finish_reason, result)

    def grammar_call(self, method: str, *args):
        """Calls the row's grammar, counting the time in its masks."""
        started = time.perf_counter()
        try:
            return getattr(self.grammar, method)(*args)
        finally:
            self.stats.mask_seconds += time.perf_counter() - started

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
            logprobs=self.logprobs,
            cached_tokens=self.cached_tokens,
        )


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprob]:  # [n, vocab]
    """The emitted tokens' log-probabilities under the target's raw logits, and the top `num_top`."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    chosen = logprobs.gather(-1, torch.tensor(token_ids, device=logits.device)[:, None])[:, 0].tolist()
    if num_top == 0:
        return [TokenLogprob(t, lp) for t, lp in zip(token_ids, chosen)]
    top = logprobs.topk(num_top, dim=-1)
    top_ids, top_values = top.indices.tolist(), top.values.tolist()
    return [
        TokenLogprob(t, lp, tuple(zip(ids, values)))
        for t, lp, ids, values in zip(token_ids, chosen, top_ids, top_values)
    ]
