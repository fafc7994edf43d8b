"""A stand-in for the engine's step API: deterministic tokens, no model.

Each running request emits `tokens_per_step` tokens a step (fewer at its
max_new_tokens), as if it drafted `num_draft_tokens` and the target accepted
`tokens_per_step - 1` of them. Token t of a request is `first_token + t`, so a
request's output never depends on what runs beside it, as with the real engine.
Decoded text is one character per token.
"""

from __future__ import annotations

from typing import Hashable

from handler.types import GenerationRequest, GenerationResult, SpeculativeStats, StepOutput

FIRST_CHARACTER = ord("a")


class CharTokenizer:
    """One token per character; token id = code point."""

    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in token_ids)


# The fake steps with the engine's own output type.
FakeStepOutput = StepOutput


class FakeEngine:
    def __init__(self, tokens_per_step: int = 2, num_draft_tokens: int = 3) -> None:
        assert 1 <= tokens_per_step <= num_draft_tokens + 1
        self.tokens_per_step = tokens_per_step
        self.num_draft_tokens = num_draft_tokens
        self.requests: dict[Hashable, GenerationRequest] = {}
        self.tokens: dict[Hashable, list[int]] = {}
        self.steps_run = 0
        self.rows_per_step: list[int] = []
        self.aborted: list[Hashable] = []
        self.fail_next_step = False
        self.resets = 0

    def add_request(self, request_id: Hashable, request: GenerationRequest) -> None:
        assert request_id not in self.requests, "a request id is added once"
        self.requests[request_id] = request
        self.tokens[request_id] = []

    def abort_request(self, request_id: Hashable) -> None:
        self.aborted.append(request_id)
        self.requests.pop(request_id, None)
        self.tokens.pop(request_id, None)

    def reset(self) -> None:
        """Drops every request in flight, as the engine does after a failed step."""
        self.resets += 1
        self.requests.clear()
        self.tokens.clear()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_active_requests(self) -> int:
        return len(self.requests)

    def step(self) -> list[FakeStepOutput]:
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("simulated kernel failure")
        self.steps_run += 1
        self.rows_per_step.append(len(self.requests))
        outputs = []
        for request_id, request in list(self.requests.items()):
            tokens = self.tokens[request_id]
            first = FIRST_CHARACTER + request.prompt_ids[0] % 20
            length = self.length_of(request_id, request)
            num_new = min(self.tokens_per_step, length - len(tokens))
            new = [first + len(tokens) + i for i in range(num_new)]
            tokens.extend(new)
            finished = len(tokens) == length
            result = None
            if finished:
                del self.requests[request_id]
                result = GenerationResult(
                    token_ids=list(tokens),
                    text="".join(chr(t) for t in tokens),
                    finish_reason="length",
                    prompt_tokens=len(request.prompt_ids),
                    stats=SpeculativeStats(num_speculative_tokens=self.num_draft_tokens),
                )
            outputs.append(
                FakeStepOutput(
                    request_id=request_id,
                    new_token_ids=new,
                    token_ids=list(tokens),
                    finish_reason="length" if finished else None,
                    result=result,
                    num_draft_tokens=self.num_draft_tokens,
                    num_accepted_tokens=self.tokens_per_step - 1,
                )
            )
        return outputs

    def generate(self, requests, on_tokens=None):
        """The batch loop over the step API, as the engine's generate is."""
        ids = list(range(len(requests)))
        for i, request in zip(ids, requests):
            self.add_request(i, request)
        results = {}
        while self.has_unfinished_requests():
            for output in self.step():
                if on_tokens is not None and output.new_token_ids:
                    on_tokens(output.request_id, output.new_token_ids, output)
                if output.result is not None:
                    results[output.request_id] = output.result
        return [results[i] for i in ids]

    def length_of(self, request_id: Hashable, request: GenerationRequest) -> int:
        """How many tokens the request generates; a test may make some rows finish early."""
        return request.max_new_tokens

    def solo_text(self, request: GenerationRequest, length: int | None = None) -> str:
        first = FIRST_CHARACTER + request.prompt_ids[0] % 20
        return "".join(chr(first + i) for i in range(length or request.max_new_tokens))
