"""Incremental detokenization and stop strings: exactly the full decode's answers, at a bounded cost per token.

Three kinds of tokenizer: the tiny pair's byte-level BPE (characters split
across tokens), a SentencePiece-style one (decoding a suffix drops its leading
space, so the suffix's decode differs from the decode's suffix), and one whose
decode rewrites text across token boundaries (" ." becomes ".").
"""

from __future__ import annotations

import random

import pytest

from handler.detokenizer import MAX_LIVE_TOKENS, NUM_CONTEXT_TOKENS, IncrementalDecoder
from handler.stopping import StopChecker
from handler.streaming import DeltaTracker

NUM_LONG_TOKENS = 2000
NUM_STOP_STRINGS = 16
# Per token: one decode of the window, one of the next context; each at most this long.
MAX_TOKENS_PER_DECODE = NUM_CONTEXT_TOKENS + MAX_LIVE_TOKENS


class ByteTokenizer:
    """Each token is one byte; incomplete or invalid UTF-8 decodes to U+FFFD, as in byte-level BPE."""

    def decode(self, token_ids, skip_special_tokens=True):
        return bytes(token_ids).decode("utf-8", errors="replace")


class CleanupTokenizer:
    """Word tokens whose decode drops the space before punctuation, so a later token changes earlier text."""

    WORDS = ["a", "b", "cd", ".", ",", "!", " ", " e"]

    def decode(self, token_ids, skip_special_tokens=True):
        text = "".join(self.WORDS[i] for i in token_ids)
        for mark in ".,!":
            text = text.replace(" " + mark, mark)
        return text


class CountingTokenizer:
    """Wraps a tokenizer and counts the token ids it decodes, and the characters it returns."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.num_calls = 0
        self.num_tokens_decoded = 0
        self.num_chars_decoded = 0

    def decode(self, token_ids, skip_special_tokens=True):
        text = self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        self.num_calls += 1
        self.num_tokens_decoded += len(token_ids)
        self.num_chars_decoded += len(text)
        return text


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """A Metaspace BPE, trained on the fly, in the way of Llama's and Mistral's tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    corpus = ["the quick brown fox jumps over the lazy dog", "def add(a, b): return a + b", "hello world"] * 20
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>")
    ids = fast("hello world")["input_ids"]
    # The point of this tokenizer: the suffix's decode is not what the full decode adds for it.
    assert fast.decode(ids) == "hello world" and fast.decode(ids[1:]) == "world" != fast.decode(ids)[5:]
    return fast


def random_ids(tokenizer, num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    if isinstance(tokenizer, ByteTokenizer):
        # Mostly ASCII, some multi-byte characters, some stray continuation or lead bytes.
        pieces = [b"a", b" ", b"\n", "é".encode(), "🚀".encode(), "€".encode(), b"\x80", b"\xe2\x82", b"\xff"]
        data = b"".join(rng.choice(pieces) for _ in range(num_tokens))
        return list(data[:num_tokens])
    if isinstance(tokenizer, CleanupTokenizer):
        return [rng.randrange(len(CleanupTokenizer.WORDS)) for _ in range(num_tokens)]
    return [rng.randrange(len(tokenizer)) for _ in range(num_tokens)]


TOKENIZERS = ["byte", "cleanup", "tiny", "sentencepiece"]


@pytest.fixture
def tokenizer(request):
    if request.param == "byte":
        return ByteTokenizer()
    if request.param == "cleanup":
        return CleanupTokenizer()
    return request.getfixturevalue(f"{request.param}_tokenizer")


def full_decode(tokenizer, token_ids) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("tokenizer", TOKENIZERS, indirect=True)
@pytest.mark.parametrize("seed", range(4))
def test_incremental_text_equals_the_full_decode_after_every_token(tokenizer, seed):
    token_ids = random_ids(tokenizer, 120, seed)
    decoder = IncrementalDecoder(tokenizer)
    for n, token_id in enumerate(token_ids, start=1):
        decoder.add(token_id)
        expected = full_decode(tokenizer, token_ids[:n])
        assert decoder.num_chars == len(expected)
        assert decoder.text == expected, f"after {n} tokens"
        for start in {0, len(expected) // 2, max(0, len(expected) - 3), len(expected)}:
            assert decoder.text_from(start) == expected[start:]


def test_a_decoder_that_rewrites_earlier_text_falls_back_to_a_full_decode():
    tokenizer = CleanupTokenizer()
    decoder = IncrementalDecoder(tokenizer)
    for token_id in [0, 1, 6, 3]:  # "a", "b", " ", ".": the "." removes the space before it
        decoder.add(token_id)
    assert decoder.text == full_decode(tokenizer, [0, 1, 6, 3]) == "ab."
    assert decoder.num_full_decodes == 1


def reference_stop(tokenizer, token_ids, stop) -> tuple[int, str] | None:
    """The former per-token check: decode everything, search the tail. (tokens kept, text) or None."""
    text = ""
    max_chars = max(len(s) for s in stop)
    for n in range(1, len(token_ids) + 1):
        search_from = max(0, len(text) - max_chars)
        text = full_decode(tokenizer, token_ids[:n])
        hits = [i for i in (text.find(s, search_from) for s in stop) if i >= 0]
        if hits:
            return n, text[: min(hits)]
    return None


def run_checker(tokenizer, token_ids, stop) -> tuple[int, str] | None:
    checker = StopChecker(tokenizer, stop)
    for n, token_id in enumerate(token_ids, start=1):
        match = checker.add_token(token_id)
        if match is not None:
            assert match.stop in stop and match.text == checker.decoder.text[: match.index]
            return n, match.text
    return None


@pytest.mark.parametrize("tokenizer", TOKENIZERS, indirect=True)
@pytest.mark.parametrize("seed", range(6))
def test_stop_checker_stops_where_the_full_decode_search_stops(tokenizer, seed):
    token_ids = random_ids(tokenizer, 150, seed)
    text = full_decode(tokenizer, token_ids)
    rng = random.Random(seed)
    # Stop strings cut from the text itself (so they occur), plus some that never do.
    stop = []
    for length in (1, 2, 3, 5):
        start = rng.randrange(max(1, len(text) - length))
        if text[start : start + length]:
            stop.append(text[start : start + length])
    stop += ["\x00never", "zzzzzzzzzz"]
    expected = reference_stop(tokenizer, token_ids, stop)
    assert expected is not None
    assert run_checker(tokenizer, token_ids, stop) == expected


def test_stop_string_split_across_multibyte_tokens():
    tokenizer = ByteTokenizer()
    token_ids = list("prix: 5€ net".encode())
    assert run_checker(tokenizer, token_ids, ["5€"]) == reference_stop(tokenizer, token_ids, ["5€"])
    kept, text = run_checker(tokenizer, token_ids, ["5€"])
    assert text == "prix: " and kept == len("prix: 5€".encode())


def long_completion(tokenizer) -> tuple[list[int], list[str]]:
    """NUM_LONG_TOKENS tokens whose text ends with the one stop string (of 16) that occurs."""
    words = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    token_ids: list[int] = []
    while len(token_ids) < NUM_LONG_TOKENS:
        token_ids += tokenizer(words, add_special_tokens=False)["input_ids"]
    ending = tokenizer("\n# END", add_special_tokens=False)["input_ids"]
    token_ids = token_ids[: NUM_LONG_TOKENS - len(ending)] + ending
    stop = [f"<stop {i}>" for i in range(NUM_STOP_STRINGS - 1)] + ["# END"]
    return token_ids, stop


def cost_per_token(counting: CountingTokenizer, feed, token_ids) -> list[tuple[int, int]]:
    """(token ids decoded, characters decoded) for each token fed."""
    costs = []
    for n, token_id in enumerate(token_ids, start=1):
        tokens_before, chars_before = counting.num_tokens_decoded, counting.num_chars_decoded
        feed(n, token_id)
        costs.append((counting.num_tokens_decoded - tokens_before, counting.num_chars_decoded - chars_before))
    return costs


def test_stop_check_cost_per_token_does_not_grow_with_the_length(tiny_tokenizer):
    token_ids, stop = long_completion(tiny_tokenizer)
    counting = CountingTokenizer(tiny_tokenizer)
    checker = StopChecker(counting, stop)
    matches = []

    costs = cost_per_token(counting, lambda n, token_id: matches.append(checker.add_token(token_id)), token_ids)

    # Found exactly at the last token, with the text the full decode gives.
    assert all(match is None for match in matches[:-1])
    full_text = full_decode(tiny_tokenizer, token_ids)
    assert matches[-1].text == full_text[: full_text.rindex("# END")]
    # Every token decodes a bounded window, the same at token 2,000 as at token 10;
    # the former full decode per token read 2,000 ids at the end, 2 million in all.
    max_tokens = max(tokens for tokens, _ in costs[:-1])
    assert max_tokens <= 2 * MAX_TOKENS_PER_DECODE
    # Tokens 100-599 against the last 500 (the first few tokens have less context to decode).
    early, late = costs[100:600], costs[-501:-1]
    assert sum(t for t, _ in late) <= 1.1 * sum(t for t, _ in early)
    assert sum(c for _, c in late) <= 1.1 * sum(c for _, c in early)
    assert sum(t for t, _ in costs) < 25 * NUM_LONG_TOKENS
    print(
        f"\n{NUM_LONG_TOKENS} tokens, {len(stop)} stop strings: {counting.num_calls} decode calls, "
        f"{counting.num_tokens_decoded} token ids and {counting.num_chars_decoded} characters decoded "
        f"(a full decode per token: {NUM_LONG_TOKENS * (NUM_LONG_TOKENS + 1) // 2} token ids)"
    )


def test_streamed_deltas_cost_per_step_does_not_grow_with_the_length(tiny_tokenizer):
    token_ids, stop = long_completion(tiny_tokenizer)
    counting = CountingTokenizer(tiny_tokenizer)
    tracker = DeltaTracker(counting, stop)
    deltas = []

    costs = cost_per_token(counting, lambda n, _: deltas.append(tracker.next_delta(token_ids[:n])), token_ids)

    full_text = full_decode(tiny_tokenizer, token_ids)
    final_text = full_text[: full_text.rindex("# END")]
    assert "".join(deltas) + tracker.final_delta(final_text) == final_text
    assert max(tokens for tokens, _ in costs) <= 2 * MAX_TOKENS_PER_DECODE
    assert sum(t for t, _ in costs[-500:]) <= 1.1 * sum(t for t, _ in costs[100:600])
