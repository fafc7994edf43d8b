"""A draft from another family: its vocabulary against the target's.

Speculative decoding verifies target tokens, so a draft whose tokenizer differs
from the target's must hand over target ids and must read the target's
committed tokens in its own ids. Following Timor et al., "Accelerating LLM
inference with lossless speculative decoding algorithms for heterogeneous
vocabularies" (ICML 2025):

- shared tokens: a draft token and a target token with the same bytes (special
  tokens by their text, apart from ordinary ones). The map between them is
  built once, at load.
- TLI (token-level intersection): the draft's distribution restricted to the
  shared tokens, renormalized, is a distribution over target ids
  (`to_target_logits`). Its draws are verified by the standard rejection
  sampler, so the output follows the target's distribution exactly; a seeded
  request's coupled draws work unchanged.
- SLEM (string-level exact match), for greedy rows: the draft drafts with its
  whole vocabulary; its text is cut into target tokens by the target's own
  tokenizer (`retokenize`), and those are verified as usual. At temperature 0
  any proposal leaves the output the target's argmax, so a draft text whose
  target tokenization the target would never produce costs acceptance, never
  exactness.
- translation: each committed target token becomes the draft ids with the same
  bytes (`translate`): its shared id, else its bytes cut by longest match over
  the draft's vocabulary. Token by token, so a sequence's translation only
  grows as tokens are committed, and the draft's cache rolls back by length.
"""

from __future__ import annotations

from typing import Sequence

import torch

from handler.token_bytes import token_bytes

# Committed target tokens re-tokenized before the draft's text (SLEM): enough for a merge across the
# boundary to show, and for the text to start on a character.
CONTEXT_TOKENS = (2, 4, 8)


class VocabMap:
    """The draft's and the target's vocabularies: the shared tokens, and text both ways."""

    def __init__(
        self,
        target_tokens: Sequence[bytes],
        target_special: Sequence[int],
        draft_tokens: Sequence[bytes],
        draft_special: Sequence[int],
        target_vocab_size: int,
        target_encode=None,
        draft_pad_token_id: int = 0,
    ) -> None:
        """Args:
        target_tokens, draft_tokens: each token id's bytes (`handler.token_bytes`).
        target_special, draft_special: the ids of special tokens, matched by text among themselves.
        target_vocab_size: the width of the target's logits (may exceed its tokenizer).
        target_encode: text -> target ids, the target tokenizer's own (SLEM); None: longest match.
        draft_pad_token_id: the draft id that pads its batch.
        """
        self.draft_pad_token_id = draft_pad_token_id
        self.draft_tokenizer = None
        self.target_tokens = list(target_tokens)
        self.draft_tokens = list(draft_tokens)
        self.target_special = frozenset(target_special)
        self.draft_special = frozenset(draft_special)
        self.target_vocab_size = target_vocab_size
        self.target_encode = target_encode
        target_by_key: dict[tuple[bool, bytes], int] = {}
        for token_id, spelled in enumerate(self.target_tokens):
            target_by_key.setdefault((token_id in self.target_special, spelled), token_id)
        pairs: dict[int, int] = {}  # target id -> draft id
        for token_id, spelled in enumerate(self.draft_tokens):
            target_id = target_by_key.get((token_id in self.draft_special, spelled))
            if target_id is not None and target_id not in pairs and target_id < target_vocab_size:
                pairs[target_id] = token_id
        self.target_to_draft = [-1] * len(self.target_tokens)
        self.draft_to_target = [-1] * len(self.draft_tokens)
        for target_id, draft_id in pairs.items():
            self.target_to_draft[target_id] = draft_id
            self.draft_to_target[draft_id] = target_id
        self.shared_target_ids = torch.tensor(sorted(pairs), dtype=torch.long)  # [shared]
        self.shared_draft_ids = torch.tensor([pairs[t] for t in sorted(pairs)], dtype=torch.long)  # [shared]
        self._draft_by_bytes = self._ordinary(self.draft_tokens, draft=True)
        self._target_by_bytes = self._ordinary(self.target_tokens, draft=False)
        self._longest_draft = max(map(len, self._draft_by_bytes), default=1)
        self._longest_target = max(map(len, self._target_by_bytes), default=1)
        self._translations: dict[int, list[int]] = {}
        self._devices: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _ordinary(self, tokens: Sequence[bytes], draft: bool) -> dict[bytes, int]:
        """Bytes -> the lowest id of an ordinary (not special) token that spells them."""
        special = self.draft_special if draft else self.target_special
        by_bytes: dict[bytes, int] = {}
        for token_id, spelled in enumerate(tokens):
            if spelled and token_id not in special:
                by_bytes.setdefault(spelled, token_id)
        return by_bytes

    @classmethod
    def from_tokenizers(cls, target_tokenizer, draft_tokenizer, target_vocab_size: int) -> VocabMap:
        """Reads both tokenizers' tokens as bytes; raises ValueError, naming the tokenizer, where one has none."""
        spelled = {}
        for name, tokenizer in (("target", target_tokenizer), ("draft", draft_tokenizer)):
            vocabulary = token_bytes(tokenizer)
            if isinstance(vocabulary, str):
                raise ValueError(
                    f"the {name}'s tokenizer cannot be read as bytes ({vocabulary}): a draft from another family "
                    "needs both vocabularies spelled as bytes"
                )
            spelled[name] = vocabulary

        def encode(text: str) -> list[int]:
            return list(target_tokenizer.encode(text, add_special_tokens=False))

        pad = draft_tokenizer.pad_token_id
        if pad is None:
            pad = draft_tokenizer.eos_token_id if draft_tokenizer.eos_token_id is not None else 0
        vocab_map = cls(*spelled["target"], *spelled["draft"], target_vocab_size, encode, pad)
        vocab_map.draft_tokenizer = draft_tokenizer  # for Hugging Face's universal assisted generation
        return vocab_map

    @property
    def num_shared(self) -> int:
        return len(self.shared_target_ids)

    @property
    def shared_share(self) -> float:
        """The share of the draft's ordinary and special tokens that the target also has."""
        return self.num_shared / max(1, len(self.draft_tokens))

    def draft_id(self, target_id: int) -> int:
        """The draft id of a shared target token; -1 for one that is not shared."""
        return self.target_to_draft[target_id] if 0 <= target_id < len(self.target_to_draft) else -1

    def target_id(self, draft_id: int) -> int:
        """The target id of a shared draft token; -1 for one that is not shared."""
        return self.draft_to_target[draft_id] if 0 <= draft_id < len(self.draft_to_target) else -1

    def to_target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:  # [..., draft_vocab]
        """The draft's logits on the target's vocabulary: shared tokens carry theirs, all others -inf (TLI).

        Returns: [..., target_vocab_size].
        """
        device = draft_logits.device
        if device not in self._devices:
            self._devices[device] = (self.shared_target_ids.to(device), self.shared_draft_ids.to(device))
        target_ids, draft_ids = self._devices[device]
        logits = draft_logits.new_full((*draft_logits.shape[:-1], self.target_vocab_size), float("-inf"))
        logits[..., target_ids] = draft_logits[..., draft_ids]
        return logits

    def translate(self, target_ids: Sequence[int]) -> list[int]:
        """The draft ids for committed target tokens, token by token (prefix-stable)."""
        draft_ids: list[int] = []
        for target_id in target_ids:
            translation = self._translations.get(target_id)
            if translation is None:
                translation = self._translate_one(target_id)
                self._translations[target_id] = translation
            draft_ids.extend(translation)
        return draft_ids

    def _translate_one(self, target_id: int) -> list[int]:
        draft_id = self.draft_id(target_id)
        if draft_id >= 0:
            return [draft_id]
        if not 0 <= target_id < len(self.target_tokens):
            return []  # a padded row of the target's logits: never a real token
        return longest_match(self.target_tokens[target_id], self._draft_by_bytes, self._longest_draft)

    def retokenize(self, context: Sequence[int], draft_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """The target tokens of the draft's text after the committed `context` (SLEM).

        The text is cut by the target's tokenizer together with the context's last
        tokens, so that it is cut as the target would cut it there; the tokens from
        the context's end on are the drafts. Where the tokenizer's cut does not
        reproduce the text, or merges across the context's end, or where the bytes are
        no UTF-8 text, they are cut by longest match over the target's vocabulary
        instead. A text that stops inside a character is cut before that character.

        Returns:
            target_ids: the target tokens, the last possibly a prefix of a longer one;
            ends: per target token, the index of the draft token its last byte came from.
        """
        pieces = [self.draft_tokens[d] if 0 <= d < len(self.draft_tokens) else b"" for d in draft_ids]
        body = b"".join(pieces)
        target_ids = None
        text_length = utf8_text_length(body)
        if text_length:
            # Text, maybe with an unfinished character at the end: the target's tokenizer cuts the text.
            target_ids = self._cut_after(context, body[:text_length])
        if target_ids is None:
            # Bytes that are no text (a character's bytes out of order), or a cut that failed.
            target_ids = longest_match(body, self._target_by_bytes, self._longest_target)
        # Per target token, the draft token its last byte came from.
        ends, draft_end, slot = [], 0, -1
        position = 0
        for target_id in target_ids:
            position += len(self.target_tokens[target_id])
            while draft_end < position and slot + 1 < len(pieces):
                slot += 1
                draft_end += len(pieces[slot])
            ends.append(max(slot, 0))
        return target_ids, ends

    def _cut_after(self, context: Sequence[int], body: bytes) -> list[int] | None:
        """The target tokenizer's cut of `body` after the context's last tokens; None where it fails."""
        if self.target_encode is None:
            return None
        # The context since its last special token: a special token's text would read as text.
        start = len(context)
        while start > 0 and context[start - 1] not in self.target_special and len(context) - start < CONTEXT_TOKENS[-1]:
            start -= 1
        tail = [t for t in context[start:] if 0 <= t < len(self.target_tokens)]
        for num in CONTEXT_TOKENS:
            prefix = b"".join(self.target_tokens[t] for t in tail[-num:])
            try:
                text = (prefix + body).decode("utf-8")
            except UnicodeDecodeError:
                continue  # the context starts inside a character: take more of it
            target_ids = self.target_encode(text)
            position, cut = 0, None
            for index, target_id in enumerate(target_ids):
                if position == len(prefix):
                    cut = index
                if not 0 <= target_id < len(self.target_tokens):
                    return None
                position += len(self.target_tokens[target_id])
            if position != len(prefix) + len(body) or cut is None:
                return None  # the cut adds or drops text (a SentencePiece leading space), or merges across
            return target_ids[cut:]
        return None


def longest_match(text: bytes, by_bytes: dict[bytes, int], longest: int) -> list[int]:
    """`text` cut greedily into the longest tokens of `by_bytes`; a byte no token spells is skipped."""
    token_ids: list[int] = []
    position = 0
    while position < len(text):
        for end in range(min(len(text), position + longest), position, -1):
            token_id = by_bytes.get(text[position:end])
            if token_id is not None:
                token_ids.append(token_id)
                position = end
                break
        else:
            position += 1
    return token_ids


def utf8_text_length(data: bytes) -> int:
    """The length of `data` but for an unfinished character at its end; 0 where it holds bytes
    that are no UTF-8 text (or is empty)."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            data[:cut].decode("utf-8")
            return cut
        except UnicodeDecodeError as error:
            if error.reason != "unexpected end of data":
                return 0
    return 0
