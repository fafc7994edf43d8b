"""Text deltas for streaming: never half a UTF-8 character, never part of a stop string.

Each call returns only the new text that can no longer change: a trailing
U+FFFD (bytes of a character still to come) and any tail that could be the
start of a stop string are held back. The deltas joined equal the final
`text` of the non-streamed answer. The text comes from an
`IncrementalDecoder`, and only its unsent tail is searched, so a step costs
the same at the 10th token as at the 2,000th.
"""

from __future__ import annotations

from collections.abc import Sequence

from handler.detokenizer import REPLACEMENT_CHARACTER, IncrementalDecoder


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
        self.decoder = IncrementalDecoder(tokenizer)
        self.num_sent_chars = 0
        self._max_stop_chars = max((len(s) for s in self.stop), default=0)

    def next_delta(self, token_ids: Sequence[int]) -> str:
        """The new stable text after `token_ids` (all tokens so far)."""
        for token_id in token_ids[self.decoder.num_tokens :]:
            self.decoder.add(token_id)
        # Sent text never holds the start of a stop string (that is held back), so a
        # stop string, and a held-back prefix of one, can only begin in this tail.
        start = max(0, min(self.num_sent_chars - self._max_stop_chars, self.decoder.num_chars))
        tail = self.decoder.text_from(start)
        end = len(tail)
        while end > self.num_sent_chars - start and tail[end - 1] == REPLACEMENT_CHARACTER:
            end -= 1
        hits = [i for i in (tail.find(s) for s in self.stop) if i >= 0]
        if hits:
            end = min(end, min(hits))
        end -= held_back_stop_prefix(tail[:end], self.stop)
        return self._take(tail, start, start + end)

    def final_delta(self, final_text: str) -> str:
        """Whatever of the final text has not been sent yet."""
        return self._take(final_text, 0, len(final_text))

    def _take(self, text: str, text_start: int, end: int) -> str:
        """Sends the characters from num_sent_chars to `end`; `text` starts at character `text_start`."""
        if end <= self.num_sent_chars:
            return ""
        delta = text[self.num_sent_chars - text_start : end - text_start]
        self.num_sent_chars = end
        return delta
