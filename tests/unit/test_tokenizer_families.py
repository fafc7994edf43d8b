"""Tokenizer families: byte-level BPE, SentencePiece-style BPE with byte fallback, Unigram, and WordLevel
with a `Fuse` decoder, each with added special tokens, with and without a BOS token.

Each tokenizer is trained here on a small corpus with the `tokenizers` library (nothing is
downloaded). For each family:

- streamed deltas join to the final text, where a character's bytes are split across tokens
  and where SentencePiece's `▁` stands for a leading space;
- a stop string ends the text before it, however the tokens split it;
- a grammar's mask allows exactly the tokens whose bytes continue the grammar's language.
  llguidance's own reader takes the byte-level and the byte-fallback tokenizers; the Unigram
  (a `Metaspace` decoder) and WordLevel (`Fuse`) ones go through `handler.token_bytes`.
"""

from __future__ import annotations

import pytest

from handler.constraints import Constraint, compiler_for
from handler.streaming import DeltaTracker
from handler.token_bytes import token_bytes

CORPUS = [
    "def add(a, b): return a + b",
    "the café serves crème brûlée and naïve coffee",
    "世界 你好 世界 hello world",
    "hello world, hello there, the world is wide",
    "print('ok') # ok ok",
] * 20
SPECIAL = ["<unk>", "<s>", "</s>", "<|tool|>"]
# Characters split across tokens (é, 世), a leading space, and a stop string the tokens may split.
TEXTS = ["hello world", " café crème", "世界 hello", "naïve: ok ok", "the world is wide"]
FAMILIES = ["byte_level_bpe", "sentencepiece_bpe", "unigram", "word_level_fuse"]


def _wrap(tokenizer, with_bos: bool):
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    if with_bos:
        if tokenizer.token_to_id("<s>") is None:
            tokenizer.add_special_tokens(["<s>"])
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
        )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    wrapped.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    wrapped.adds_bos = with_bos  # what the tests expect of it
    return wrapped


def build(family: str, with_bos: bool = False):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if family == "byte_level_bpe":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
    elif family == "sentencepiece_bpe":
        # Llama 2 / Mistral style: `▁` for spaces, unknown characters spelled as <0xNN> byte tokens.
        tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        byte_tokens = [f"<0x{byte:02X}>" for byte in range(256)]
        # Byte tokens enter the vocabulary as ordinary tokens; the characters outside the corpus have
        # no piece of their own and fall back to them.
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL + byte_tokens, limit_alphabet=40)
    elif family == "unigram":
        tokenizer = Tokenizer(models.Unigram())
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=SPECIAL, unk_token="<unk>")
    else:
        from tests.unit.test_constraints import fuse_word_level_tokenizer

        wrapped = fuse_word_level_tokenizer(extra=tuple("éèûïü世界你好'#"))
        return _wrap(wrapped.backend_tokenizer, with_bos)
    tokenizer.train_from_iterator(CORPUS, trainer)
    return _wrap(tokenizer, with_bos)


@pytest.fixture(scope="module", params=[(family, bos) for family in FAMILIES for bos in (False, True)],
                ids=lambda p: f"{p[0]}{'-bos' if p[1] else ''}")  # fmt: skip
def tokenizer(request):
    return build(*request.param)


def completion_ids(tokenizer, text: str) -> list[int]:
    """The ids a model would emit for `text` (no BOS: it follows a prompt)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_families_split_characters_and_spell_spaces_as_they_do(tokenizer):
    """What the other tests rely on: each tokenizer round-trips the texts, and some split a character."""
    for text in TEXTS:
        ids = completion_ids(tokenizer, text)
        assert tokenizer.decode(ids, skip_special_tokens=True).strip() == text.strip()
    with_bos = tokenizer("hello")["input_ids"]
    assert (with_bos[0] == tokenizer.bos_token_id) == tokenizer.adds_bos


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_join_to_the_final_text(tokenizer, text):
    ids = completion_ids(tokenizer, text) + [tokenizer.convert_tokens_to_ids("<|tool|>")]
    final = tokenizer.decode(ids, skip_special_tokens=True)
    tracker = DeltaTracker(tokenizer)
    deltas = [tracker.next_delta(ids[: end + 1]) for end in range(len(ids))]
    assert all("\ufffd" not in delta for delta in deltas), deltas  # never half a character
    assert "".join(deltas) + tracker.final_delta(final) == final


@pytest.mark.parametrize("stop", ["world", "lo w", "é", "界 h"])
def test_a_stop_string_ends_the_text_before_it(tokenizer, stop):
    text = next(t for t in TEXTS if stop in tokenizer.decode(completion_ids(tokenizer, t), skip_special_tokens=True))
    ids = completion_ids(tokenizer, text)
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    tracker = DeltaTracker(tokenizer, [stop])
    sent = "".join(tracker.next_delta(ids[: end + 1]) for end in range(len(ids)))
    assert stop not in sent
    assert decoded.startswith(sent) and len(sent) <= decoded.index(stop)


LANGUAGE = ["café ok", "cafe ok", "世界 ok"]


@pytest.mark.parametrize("position", [0, 3, 4])
def test_a_grammar_allows_exactly_the_tokens_whose_bytes_continue_it(tokenizer, position):
    """Masks after a prefix of the language's strings: a token is allowed where its bytes continue one.

    Where one string is left (position 4: " ok" is forced), llguidance allows only the tokens that
    begin the forced bytes' own tokenization, a subset: every one of them still continues it."""
    language = [s for s in LANGUAGE if all(tokenizer.convert_tokens_to_ids(c) != tokenizer.unk_token_id
                                           for c in s if not c.isascii())] or ["cafe ok"]  # fmt: skip
    pattern = "|".join(language).replace(" ", "\\ ")
    compiler = compiler_for(tokenizer)
    row = compiler.row(Constraint.regex(f"({pattern})"), len(tokenizer), [tokenizer.eos_token_id])
    spelled = token_bytes(tokenizer)
    assert not isinstance(spelled, str), spelled
    vocabulary, special = spelled
    done = language[0][:position].encode("utf-8")
    row.commit(spell(done, vocabulary, set(special)))
    strings = [s.encode("utf-8") for s in language if s.encode("utf-8").startswith(done)]
    expected = {
        token_id
        for token_id, piece in enumerate(vocabulary)
        if token_id not in special and piece and any(s[len(done) :].startswith(piece) for s in strings)
    }
    mask = row.mask()
    allowed = {t for t in range(len(vocabulary)) if mask[t] and t not in special}
    assert expected, "the language continues after the prefix"
    if len({s[len(done) :] for s in strings}) > 1:
        assert allowed == expected
    else:
        assert allowed and allowed <= expected


def spell(text: bytes, vocabulary: list[bytes], special: set[int]) -> list[int]:
    """Tokens whose bytes join to `text` exactly, longest first (the prefix a model wrote)."""
    ids, index = [], 0
    while index < len(text):
        token_id = max(
            (t for t, piece in enumerate(vocabulary) if t not in special and piece and text.startswith(piece, index)),
            key=lambda t: len(vocabulary[t]),
        )
        ids.append(token_id)
        index += len(vocabulary[token_id])
    return ids
