"""At load: a draft with the target's tokenizer shares it; one with another tokenizer drafts across
vocabularies (`handler.vocab_map`); a pair whose vocabularies cannot work together is refused, naming both."""

from __future__ import annotations

import types

import pytest

from handler.runtime.loading import check_vocabularies


def model(vocab_size: int):
    config = types.SimpleNamespace(vocab_size=vocab_size)
    return types.SimpleNamespace(config=types.SimpleNamespace(get_text_config=lambda: config))


def test_a_draft_with_another_tokenizer_gets_the_map_between_the_vocabularies(tiny_tokenizer, tmp_path, caplog):
    other = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    other.add_tokens(["<draft-only>"])
    other.save_pretrained(tmp_path / "draft")
    size = len(tiny_tokenizer) + 8
    with caplog.at_level("INFO", logger="handler.runtime.loading"):
        mapping = check_vocabularies(tiny_tokenizer, model(size), model(size), str(tmp_path / "draft"), "models/target")
    assert mapping.num_shared == len(tiny_tokenizer) and mapping.draft_id(5) == 5
    assert mapping.target_id(len(tiny_tokenizer)) == -1  # <draft-only>
    assert (
        f"{len(tiny_tokenizer)} tokens ({100 * len(tiny_tokenizer) / len(other):.1f}% of the draft's) are shared"
        in (caplog.text)
    )


def test_a_draft_tokenizer_that_shares_no_token_is_refused_naming_both(tiny_tokenizer, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"\u4e16": 0, "\u754c": 1, "<unk>": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(tmp_path / "draft")
    size = len(tiny_tokenizer) + 8
    with pytest.raises(ValueError, match=r"draft's tokenizer \(.*draft\) and the target's \(models/target\) share no"):
        check_vocabularies(tiny_tokenizer, model(size), model(size), str(tmp_path / "draft"), "models/target")


def test_a_draft_tokenizer_named_in_the_config_must_load(tiny_tokenizer, tmp_path):
    size = len(tiny_tokenizer)
    with pytest.raises(ValueError, match="handler.draft_tokenizer: cannot load a tokenizer from"):
        check_vocabularies(tiny_tokenizer, model(size), model(size), "d", "t", str(tmp_path / "missing"))


def test_a_draft_vocabulary_smaller_than_the_target_tokenizer_is_refused_naming_both(tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"draft's vocab_size \(8, .*d\).*target tokenizer's .*t\).*draft_tokenizer"):
        check_vocabularies(tiny_tokenizer, model(len(tiny_tokenizer)), model(8), str(tmp_path / "d"), "t")


def test_a_draft_folder_without_a_tokenizer_shares_the_targets(tiny_tokenizer, tmp_path):
    size = len(tiny_tokenizer)
    check_vocabularies(tiny_tokenizer, model(size), model(size), str(tmp_path / "empty"), "t")


def test_check_pair_runs_the_load_time_checks_on_configs_alone_without_a_weight(tmp_path):
    import transformers

    from handler.config import HandlerConfig
    from handler.runtime.loading import check_pair
    from scripts.model_tools import make_tiny_models

    for name in ("target", "draft"):
        make_tiny_models.save_tokenizer(tmp_path / name)  # config.json and the tokenizer: no weights
    assert not list(tmp_path.rglob("*.safetensors"))
    check_pair(HandlerConfig(target_model=str(tmp_path / "target"), draft_model=str(tmp_path / "draft")), None)
    transformers.MambaConfig(vocab_size=384, hidden_size=64, state_size=8).save_pretrained(tmp_path / "draft")
    with pytest.raises(ValueError, match=r"MambaForCausalLM uses cache layers .*cannot be rolled back by a length"):
        check_pair(HandlerConfig(target_model="target", draft_model="draft"), str(tmp_path))
