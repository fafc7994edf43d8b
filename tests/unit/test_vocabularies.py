"""A draft whose vocabulary differs from the target's is refused at load, with a message naming both."""

from __future__ import annotations

import types

import pytest

from handler.loading import check_vocabularies


def model(vocab_size: int):
    config = types.SimpleNamespace(vocab_size=vocab_size)
    return types.SimpleNamespace(config=types.SimpleNamespace(get_text_config=lambda: config))


def test_a_draft_with_another_tokenizer_is_refused_naming_both(tiny_tokenizer, tmp_path):
    other = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    other.add_tokens(["<draft-only>"])
    other.save_pretrained(tmp_path / "draft")
    size = len(tiny_tokenizer) + 8
    with pytest.raises(ValueError) as refused:
        check_vocabularies(tiny_tokenizer, model(size), model(size), str(tmp_path / "draft"), "models/target")
    message = str(refused.value)
    assert "draft" in message and str(tmp_path / "draft") in message and "models/target" in message
    assert f"{len(other)} tokens" in message and f"{len(tiny_tokenizer)} tokens" in message
    assert "<draft-only>" in message


def test_a_draft_vocabulary_smaller_than_the_target_tokenizer_is_refused_naming_both(tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"draft's vocab_size \(8, d\).*target tokenizer's .*t\)"):
        check_vocabularies(tiny_tokenizer, model(len(tiny_tokenizer)), model(8), "d", "t")


def test_a_draft_folder_without_a_tokenizer_shares_the_targets(tiny_tokenizer, tmp_path):
    size = len(tiny_tokenizer)
    check_vocabularies(tiny_tokenizer, model(size), model(size), str(tmp_path / "empty"), "t")
