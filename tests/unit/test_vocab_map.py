"""The map between a draft's vocabulary and the target's (`handler.vocab_map`), on hand-made vocabularies
and on the tiny pair's tokenizer against a copy with shuffled ids and other merges."""

from __future__ import annotations

import pytest
import torch

from handler.vocab_map import VocabMap, longest_match, utf8_text_length

# Target: ids 0..6, special 0; draft: other ids, special 0 and 1, one token the target lacks ("cd").
TARGET = [b"<eos>", b"a", b"b", b"c", b"ab", b" a", b"abc"]
DRAFT = [b"<eos>", b"<pad>", b"c", b"b", b"a", b"cd", b" a", b"d", b"ab"]


def vocab_map(encode=None) -> VocabMap:
    return VocabMap(TARGET, [0], DRAFT, [0, 1], target_vocab_size=8, target_encode=encode)


def test_tokens_are_shared_by_their_bytes_and_special_tokens_by_their_text_apart():
    mapping = vocab_map()
    pairs = dict(zip(mapping.shared_target_ids.tolist(), mapping.shared_draft_ids.tolist()))
    assert pairs == {0: 0, 1: 4, 2: 3, 3: 2, 4: 8, 5: 6}
    assert mapping.draft_id(6) == -1 and mapping.target_id(5) == -1 and mapping.target_id(1) == -1
    assert mapping.shared_share == pytest.approx(6 / 9)
    # An ordinary token spelled as a special token's text is not that special token.
    other = VocabMap([b"<eos>", b"x"], [], [b"<eos>", b"x"], [0], target_vocab_size=2)
    assert other.draft_id(0) == -1 and other.draft_id(1) == 1


def test_translation_is_token_by_token_and_spells_a_missing_token_by_longest_match():
    mapping = vocab_map()
    assert mapping.translate([6]) == [8, 2]  # "abc" -> "ab" "c"
    assert mapping.translate([1, 6, 7]) == [4, 8, 2]  # 7: a padded row of the target's logits
    sequence = [5, 6, 2, 0, 4]
    assert mapping.translate(sequence) == mapping.translate(sequence[:2]) + mapping.translate(sequence[2:])
    assert longest_match(b"abzc", {b"a": 1, b"ab": 2, b"c": 3}, 2) == [2, 3]  # "z" has no token: skipped


def test_draft_logits_on_the_target_vocabulary_keep_the_shared_tokens_only():
    mapping = vocab_map()
    draft_logits = torch.arange(9, dtype=torch.float32).view(1, 1, 9)  # [1, 1, draft_vocab]
    logits = mapping.to_target_logits(draft_logits)  # [1, 1, 8]
    assert logits.shape == (1, 1, 8)
    assert logits[0, 0].tolist() == [0.0, 4.0, 3.0, 2.0, 8.0, 6.0, float("-inf"), float("-inf")]
    # The softmax over the shared tokens is the draft's distribution restricted to them, renormalized.
    draft_probs = torch.softmax(draft_logits[0, 0], -1)
    shared = mapping.shared_draft_ids
    expected = draft_probs[shared] / draft_probs[shared].sum()
    assert torch.allclose(torch.softmax(logits[0, 0], -1)[mapping.shared_target_ids], expected)


def test_retokenizing_cuts_the_draft_text_as_the_targets_tokenizer_does_after_the_context():
    calls = []

    def encode(text: str) -> list[int]:
        calls.append(text)
        return longest_match(text.encode(), {spelled: i for i, spelled in enumerate(TARGET) if i}, 3)

    mapping = vocab_map(encode)
    # Context "b", draft text "a" "b" "c" -> the target's cut of "babc" is "b" "abc": the drafts are "abc".
    target_ids, ends = mapping.retokenize([2], [4, 3, 2])
    assert calls == ["babc"] and target_ids == [6] and ends == [2]
    # A cut that merges across the context's end gives way to longest match of the draft text alone.
    target_ids, ends = mapping.retokenize([1], [3, 2])  # "a" + "bc" cuts as "abc": no boundary after "a"
    assert target_ids == [2, 3] and ends == [0, 1]


def test_text_stops_before_an_unfinished_character_and_bytes_that_are_no_text_are_not_text():
    word = "é".encode()
    assert utf8_text_length(b"ab" + word[:1]) == 2
    assert utf8_text_length(b"ab" + word) == 4
    assert utf8_text_length(b"\xcb\x0f") == 0  # a lead byte followed by no continuation
    assert utf8_text_length(b"") == 0


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    from scripts.model_tools import make_tiny_models

    out = tmp_path_factory.mktemp("cross")
    target_tokenizer = make_tiny_models.build_tokenizer()
    make_tiny_models.build_cross_vocab_draft(
        target_tokenizer, make_tiny_models.Qwen2ForCausalLM(make_tiny_models.build_config(360, 0)), out, 0, 20
    )
    return target_tokenizer, AutoTokenizer.from_pretrained(out)


def test_the_tiny_pairs_cross_draft_shares_most_tokens_and_its_translations_spell_the_same_text(tokenizers):
    target_tokenizer, draft_tokenizer = tokenizers
    mapping = VocabMap.from_tokenizers(target_tokenizer, draft_tokenizer, 384)
    assert 0.85 < mapping.shared_share < 1.0
    eos = target_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert mapping.draft_id(eos) == draft_tokenizer.convert_tokens_to_ids("<|im_end|>") != eos
    text = "def add(a, b):\n    return a + b  # café"
    target_ids = target_tokenizer.encode(text, add_special_tokens=False)
    assert draft_tokenizer.decode(mapping.translate(target_ids)) == text
    # The draft's own tokenization of a continuation, re-cut for the target: the target's own tokens.
    context = target_tokenizer.encode("def add(a, b):\n", add_special_tokens=False)
    continuation = "    return a + b"
    draft_ids = draft_tokenizer.encode(continuation, add_special_tokens=False)
    target_ids, ends = mapping.retokenize(context, draft_ids)
    expected = target_tokenizer.encode("def add(a, b):\n" + continuation, add_special_tokens=False)
    assert expected[: len(context)] == context and target_ids == expected[len(context) :]
    assert ends[-1] == len(draft_ids) - 1 and ends == sorted(ends)
