"""Text deltas for streaming: never half a UTF-8 character, never part of a stop string.

Each call decodes the tokens so far and returns only the new text that can no
longer change: a trailing U+FFFD (bytes of a character still to come) and any
tail that could be the start of a stop string are held back. The deltas joined
equal the final `text` of the non-streamed answer.
"""

from __future__ import annotations

from typing import Sequence

REPLACEMENT_CHARACTER = "\ufffd"


def held_back_stop_prefix(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop_string in stop:
        for length in range(min(len(stop_string) - 1, len(text)), longest, -1):
            if text.endswith(stop_string[:length]):
                longest = length
                break
    return longest


class DeltaTracker:
    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.num_sent_chars = 0

    def next_delta(self, token_ids: Sequence[int]) -> str:
        """The new stable text after `token_ids` (all tokens so far)."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        end = len(text)
        while end > self.num_sent_chars and text[end - 1] == REPLACEMENT_CHARACTER:
            end -= 1
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            end = min(end, min(hits))
        end -= held_back_stop_prefix(text[:end], self.stop)
        return self._take(text, end)

    def final_delta(self, final_text: str) -> str:
        """Whatever of the final text has not been sent yet."""
        return self._take(final_text, len(final_text))

    def _take(self, text: str, end: int) -> str:
        if end <= self.num_sent_chars:
            return ""
        delta = text[self.num_sent_chars : end]
        self.num_sent_chars = end
        return delta


class RequestProgress:
    """One request's bookkeeping during a batch: timing and, when streamed, what was sent."""

    def __init__(self, stream: bool, tokenizer, stop: Sequence[str] = ()) -> None:
        self.deltas = DeltaTracker(tokenizer, stop) if stream else None
        self.num_sent_tokens = 0
        self.first_chunk_at: float | None = None
        self.finished_at: float | None = None
