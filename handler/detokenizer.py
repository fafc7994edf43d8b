"""Incremental detokenization: the text of a growing completion at a bounded cost per token.

`tokenizer.decode(all_ids)` after every token costs O(length) per token, so
O(length^2) per completion. `IncrementalDecoder` decodes only a short window:
a few *context* tokens whose text is already committed, then the *live*
tokens whose text is not. Vocabulary:

- committed text: the text of the first `num_committed_tokens` tokens, kept
  in pieces and never decoded again;
- live text: the text of the tokens after them, as the full decode shows it
  now; it may end in U+FFFD while a character's UTF-8 bytes are still
  arriving (byte-level BPE splits characters across tokens).

The context matters for decoders that treat the start of their input
specially: SentencePiece's drops the leading space of the first token, so
decoding the live tokens alone would lose it. Decoding context + live and
cutting off the context's own decode gives the live text as the full decode
shows it.

That holds when a token's text depends only on its near neighbours, which is
true of byte-level BPE and SentencePiece. When it is not (a decoder that
rewrites text across the commit point, such as transformers' optional
`clean_up_tokenization_spaces`), the window's decode no longer starts with
the context's decode; the decoder notices and falls back to one full decode,
so the text is always exactly `tokenizer.decode(ids, skip_special_tokens=True)`.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT_CHARACTER = "\ufffd"
# Tokens decoded before the live ones; SentencePiece needs one, a few cost nothing.
NUM_CONTEXT_TOKENS = 4
# A UTF-8 character has at most 4 bytes, so live text still ending in U+FFFD after
# this many tokens holds invalid bytes, which stay U+FFFD: commit it anyway.
MAX_LIVE_TOKENS = 8


class IncrementalDecoder:
    """The decoded text of token ids fed one at a time, decoding O(1) tokens per token.

    `text` always equals `tokenizer.decode(token_ids, skip_special_tokens=True)`.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.num_full_decodes = 0  # fallbacks to a full decode (see the module docstring)
        self._pieces: list[str] = []  # the committed text, one piece per commit
        self._num_committed_chars = 0
        self._num_committed_tokens = 0
        self._context_start = 0  # first token of the decode window
        self._context_text = ""  # decode(token_ids[_context_start:_num_committed_tokens])
        self._live_text = ""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_chars(self) -> int:
        """Length of the full decoded text."""
        return self._num_committed_chars + len(self._live_text)

    @property
    def text(self) -> str:
        """The full decoded text; O(length), for the end of a request."""
        return "".join(self._pieces) + self._live_text

    def add(self, token_id: int) -> None:
        """Appends one token; decodes at most NUM_CONTEXT_TOKENS + MAX_LIVE_TOKENS tokens."""
        self.token_ids.append(token_id)
        window = self._decode(self.token_ids[self._context_start :])
        if not window.startswith(self._context_text):
            # The new token changed the text before the commit point: start over from a full decode.
            self._pieces, self._num_committed_chars = [], 0
            self._commit_all(self._decode(self.token_ids))
            self.num_full_decodes += 1
            return
        self._live_text = window[len(self._context_text) :]
        num_live_tokens = self.num_tokens - self._num_committed_tokens
        if not self._live_text.endswith(REPLACEMENT_CHARACTER) or num_live_tokens >= MAX_LIVE_TOKENS:
            self._commit_all(self._live_text)

    def text_from(self, start: int) -> str:
        """`text[start:]`, at a cost of O(num_chars - start) rather than O(num_chars)."""
        assert 0 <= start <= self.num_chars, (start, self.num_chars)
        num_needed = self._num_committed_chars - start
        if num_needed <= 0:
            return self._live_text[-num_needed:]
        parts = []
        for piece in reversed(self._pieces):
            if len(piece) >= num_needed:
                parts.append(piece[len(piece) - num_needed :])
                break
            parts.append(piece)
            num_needed -= len(piece)
        return "".join(reversed(parts)) + self._live_text

    def _commit_all(self, new_text: str) -> None:
        """Commits `new_text` as the text of every token so far; the next window starts from here."""
        if new_text:
            self._pieces.append(new_text)
            self._num_committed_chars += len(new_text)
        self._live_text = ""
        self._num_committed_tokens = self.num_tokens
        self._context_start = max(0, self.num_tokens - NUM_CONTEXT_TOKENS)
        self._context_text = self._decode(self.token_ids[self._context_start :])

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
