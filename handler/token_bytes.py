"""Each token's bytes, from any tokenizer `transformers` loads: the grammar engine's vocabulary where its
own reader of Hugging Face tokenizers cannot read one (a `Fuse` decoder, a WordPiece vocabulary, ...).

A token's bytes are what it adds to a text after another token: the decoded
text of (anchor, token) past the anchor's, so that a SentencePiece token's
leading space and a WordPiece continuation are spelled as they appear inside a
text. A token that ends inside a UTF-8 character (byte-level BPE, SentencePiece
byte fallback) decodes to U+FFFD; its bytes come from its piece: `<0xE2>`, or
the byte-level alphabet. A vocabulary is kept only where it is checked: the
bytes of random sequences of tokens, joined, must be what `decode` gives for
those sequences. Where a token has no byte spelling, or the check fails, there
is no vocabulary, and the reason says which token.
"""

from __future__ import annotations

import random
import re
from typing import Any

from handler.detokenizer import REPLACEMENT_CHARACTER

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
NUM_CHECKED_SEQUENCES = 512
MAX_CHECKED_LENGTH = 8


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's spelling of bytes as characters (GPT-2, Llama 3, Qwen): character -> byte.

    Printable Latin-1 bytes stand for themselves; the other 68 are shifted to
    code points 256 and up, in byte order, so that no token holds a space or a
    control character.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    alphabet = {chr(byte): byte for byte in printable}
    shifted = (byte for byte in range(256) if byte not in alphabet.values())
    alphabet.update((chr(256 + n), byte) for n, byte in enumerate(shifted))
    return alphabet


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


def is_byte_level(tokenizer) -> bool:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


def piece_bytes(tokenizer, token_id: int) -> bytes | None:
    """The bytes of a token that is a piece of a character: `<0xNN>`, or a byte-level piece; else None."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    piece = convert(token_id) if convert is not None else None
    if not isinstance(piece, str):
        return None
    match = BYTE_PIECE.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    if is_byte_level(tokenizer) and piece and all(char in BYTE_LEVEL_ALPHABET for char in piece):
        return bytes(BYTE_LEVEL_ALPHABET[char] for char in piece)
    return None


def _anchor(tokenizer) -> int | None:
    """A token that decodes to plain text on its own (`a`, or the first such in the vocabulary)."""
    for text in ("a", "x", "0"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1:
            return ids[0]
    return None


def token_bytes(tokenizer) -> tuple[list[bytes], list[int]] | str:
    """Per token id, its bytes, and the ids of the special tokens; or why there is no such vocabulary.

    A special token's bytes are its text (the grammar engine names it apart, as a token).
    """
    anchor = _anchor(tokenizer)
    if anchor is None:
        return "no token spells a single letter, to read the others after"
    special = set(tokenizer.all_special_ids)
    special.update(
        token_id for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special
    )
    base = tokenizer.decode([anchor], skip_special_tokens=False)
    vocabulary: list[bytes] = []
    for token_id in range(len(tokenizer)):
        if token_id in special:
            vocabulary.append(tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8"))
            continue
        text = tokenizer.decode([anchor, token_id], skip_special_tokens=False)
        added = text[len(base) :] if text.startswith(base) else None
        if added is not None and REPLACEMENT_CHARACTER not in added:
            vocabulary.append(added.encode("utf-8"))
            continue
        spelled = piece_bytes(tokenizer, token_id)
        if spelled is None:
            piece = tokenizer.convert_ids_to_tokens(token_id)
            return f"token {token_id} ({piece!r}) decodes to {added!r}, and has no byte spelling"
        vocabulary.append(spelled)
    problem = check_token_bytes(tokenizer, vocabulary, special, anchor)
    return problem if problem is not None else (vocabulary, sorted(special))


def check_token_bytes(tokenizer, vocabulary: list[bytes], special: set[int], anchor: int) -> str | None:
    """None where random sequences of tokens decode to their tokens' bytes joined; else the first that does not."""
    rng = random.Random(0)
    ordinary = [token_id for token_id in range(len(vocabulary)) if token_id not in special]
    base = tokenizer.decode([anchor], skip_special_tokens=False)
    for _ in range(NUM_CHECKED_SEQUENCES):
        sequence = [rng.choice(ordinary) for _ in range(rng.randint(2, MAX_CHECKED_LENGTH))]
        joined = b"".join(vocabulary[token_id] for token_id in sequence)
        try:
            expected = joined.decode("utf-8")
        except UnicodeDecodeError:
            continue  # ends or breaks inside a character: decode would only say U+FFFD
        decoded = tokenizer.decode([anchor, *sequence], skip_special_tokens=False)
        if decoded != base + expected:
            return f"tokens {sequence} decode to {decoded[len(base) :]!r}, not their bytes joined ({expected!r})"
    return None


class ByteVocabulary:
    """What llguidance's `TokenizerWrapper` reads: the tokens' bytes, the special ids, EOS and BOS, and
    a text -> ids function."""

    def __init__(self, tokenizer, tokens: list[bytes], special_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.special_token_ids = special_token_ids
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id

    def __call__(self, text: Any) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self.tokenizer.encode(text, add_special_tokens=False))
