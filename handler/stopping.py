"""Stop strings, checked token by token at a cost that does not grow with the completion.

A request's stop strings end its generation as soon as one appears in the
decoded completion. The answer's `text` then ends just before the stop string,
while its `token_ids` run to the token that completed it.

Only the tail can hold a stop string that the newest token completed: the
search starts `max(len(stop))` characters before where the previous text
ended (the end itself can move back, when the last character was an
incomplete UTF-8 sequence). The text comes from `IncrementalDecoder`, which
decodes a bounded window per token, so one token costs O(longest stop string
+ the token's own text), whatever the length so far.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from handler.detokenizer import IncrementalDecoder


@dataclasses.dataclass(frozen=True)
class StopMatch:
    """A stop string completed by the newest token."""

    stop: str  # the stop string found (the earliest one, when several are)
    index: int  # where it starts in the completion's text
    text: str  # the text to keep: the completion's text before the stop string


class StopChecker:
    """Fed each newly emitted token id; says when and where a stop string completes.

    Args:
        tokenizer: anything with `decode(ids, skip_special_tokens=True)`.
        stop: the request's stop strings, at least one, none empty.
    """

    def __init__(self, tokenizer, stop: Sequence[str]) -> None:
        assert stop and all(stop), "a StopChecker needs non-empty stop strings"
        self.stop = tuple(stop)
        self.decoder = IncrementalDecoder(tokenizer)
        self._max_stop_chars = max(len(s) for s in self.stop)
        self._num_chars_before = 0  # length of the text before the newest token

    def add_token(self, token_id: int) -> StopMatch | None:
        """Appends one emitted token; returns the match if a stop string now appears, else None."""
        search_from = max(0, self._num_chars_before - self._max_stop_chars)
        self.decoder.add(token_id)
        self._num_chars_before = self.decoder.num_chars
        tail = self.decoder.text_from(min(search_from, self.decoder.num_chars))
        hits = [(index, s) for s in self.stop if (index := tail.find(s)) >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        index += search_from
        # The one O(length) step, taken once per request.
        return StopMatch(stop=stop, index=index, text=self.decoder.text[:index])
