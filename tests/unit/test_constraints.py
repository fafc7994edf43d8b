"""Constraints without a model: compiling, the cache and its time bound, row matchers, request fields."""

from __future__ import annotations

import json

import pytest
import torch

from handler import constraints, schema
from handler.api.native import parse_request
from handler.config import HandlerConfig
from handler.constraints import Constraint, GrammarCompiler, RowGrammar
from handler.schema import RequestError

CONFIG = HandlerConfig()
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer):
    return GrammarCompiler(tiny_tokenizer)


def row_for(compiler, constraint, tokenizer, vocab_size=384) -> RowGrammar:
    return compiler.row(constraint, vocab_size, [tokenizer.eos_token_id])


def test_a_schema_compiles_once_and_is_cached(compiler):
    before = compiler.num_compiled
    first = compiler.compile(Constraint.json_schema(PERSON))
    assert compiler.compile(Constraint.json_schema(PERSON)) is first
    assert compiler.num_compiled == before + 1


def test_the_cache_keeps_the_most_recently_used(tiny_tokenizer):
    small = GrammarCompiler(tiny_tokenizer, cache_size=2)
    a, b, c = (Constraint.regex(pattern) for pattern in ("a+", "b+", "c+"))
    small.compile(a)
    small.compile(b)
    small.compile(a)  # a is now the most recent
    small.compile(c)  # evicts b
    assert list(small.cache) == [a, c]


@pytest.mark.parametrize(
    "constraint, message",
    [
        (Constraint.regex("a(b"), "regex: cannot be enforced"),
        (Constraint.grammar("start: missing_rule"), "grammar: cannot be enforced"),
        (Constraint.json_schema({"type": "string", "format": "no-such-format"}), "Unknown format"),
        (Constraint.json_schema({"type": "object", "dependentSchemas": {"a": {}}}), "dependentSchemas"),
    ],
)
def test_what_cannot_be_enforced_is_a_400_naming_the_field(compiler, constraint, message):
    with pytest.raises(RequestError, match=message) as raised:
        compiler.compile(constraint)
    assert raised.value.status == 400


def test_compiling_past_the_time_bound_is_a_400(tiny_tokenizer, monkeypatch):
    import threading

    # A compile that outlasts the bound whatever the machine's speed (a tiny grammar on a fast
    # thread could otherwise finish within even a nanosecond's join).
    release = threading.Event()
    real_grammar_text = constraints._grammar_text

    def slow_grammar_text(constraint):
        release.wait(5.0)
        return real_grammar_text(constraint)

    monkeypatch.setattr(constraints, "_grammar_text", slow_grammar_text)
    slow = GrammarCompiler(tiny_tokenizer, timeout_s=0.05)
    try:
        with pytest.raises(RequestError, match="took longer than"):
            slow.compile(Constraint.json_schema(PERSON))
    finally:
        release.set()


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"type": "strin"}, "not a valid JSON Schema"),
        ({"properties": {"a": {"minimum": "zero"}}}, r"at /properties/a/minimum"),
        ([1, 2], "must be a JSON Schema object"),
    ],
)
def test_an_invalid_json_schema_is_refused_before_compiling(bad, message):
    with pytest.raises(RequestError, match=message):
        constraints.check_json_schema(bad, "json_schema")


def test_forced_tokens_masks_and_rollback(compiler, tiny_tokenizer):
    row = row_for(compiler, Constraint.json_schema(PERSON), tiny_tokenizer)
    forced = row.forced_tokens(32)
    assert tiny_tokenizer.decode(forced).startswith('{"name":')
    assert row.forced_tokens(0) == []
    masks = row.masks(forced)  # [len + 1, vocab]
    assert masks.shape == (len(forced) + 1, 384)
    for j, token_id in enumerate(forced):
        assert masks[j, token_id]
    # The masks left the matcher where it was: the same forced tokens again.
    assert row.forced_tokens(32) == forced
    # Ids past the tokenizer (a padded model vocabulary) are never allowed.
    assert not masks[:, len(tiny_tokenizer) :].any()


def test_eos_is_allowed_exactly_where_the_grammar_accepts(compiler, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    row = row_for(compiler, Constraint.regex("ab?"), tiny_tokenizer)
    a = tiny_tokenizer.convert_tokens_to_ids("a")
    b = tiny_tokenizer.convert_tokens_to_ids("b")
    masks = row.masks([a, b])
    assert not masks[0, eos] and masks[0, a]
    assert masks[1, eos] and masks[1, b]  # "a" is complete, "ab" too
    assert masks[2, eos] and masks[2].sum() == 1


def test_num_valid_cuts_at_the_first_refused_token_and_before_eos(compiler, tiny_tokenizer):
    row = row_for(compiler, Constraint.regex("[ab]+"), tiny_tokenizer)
    a, b, c = (tiny_tokenizer.convert_tokens_to_ids(ch) for ch in "abc")
    assert row.num_valid([a, b, c, a]) == 2
    assert row.num_valid([a, tiny_tokenizer.eos_token_id]) == 1
    assert row.num_valid([]) == 0


def test_commit_moves_the_committed_state_and_refuses_what_the_grammar_refuses(compiler, tiny_tokenizer):
    row = row_for(compiler, Constraint.regex("abc"), tiny_tokenizer)
    a, b, c = (tiny_tokenizer.convert_tokens_to_ids(ch) for ch in "abc")
    row.commit([a])
    assert row.num_valid([b, c]) == 2
    with pytest.raises(RuntimeError, match="grammar refused"):
        row.commit([c])


def test_drafting_follows_the_drafts_and_rolls_back(compiler, tiny_tokenizer):
    row = row_for(compiler, Constraint.regex("ab"), tiny_tokenizer)
    a, b = (tiny_tokenizer.convert_tokens_to_ids(ch) for ch in "ab")
    first = row.draft_mask(None)
    assert first[a] and not first[b]
    second = row.draft_mask(a)
    assert second[b] and not second[a]
    after_eos = row.draft_mask(tiny_tokenizer.eos_token_id)
    assert after_eos.all()  # nothing after an end of sequence is ever emitted
    row.end_drafting()
    assert row.draft_mask(None)[a]
    row.end_drafting()


def test_one_compiler_per_tokenizer_and_only_the_config_sets_its_bound(tiny_tokenizer):
    compiler = constraints.compiler_for(tiny_tokenizer)
    assert constraints.compiler_for(tiny_tokenizer) is compiler
    before = compiler.timeout_s
    try:
        constraints.compiler_for(tiny_tokenizer, 5.0)  # the config's bound, at start-up and parse
        constraints.compiler_for(tiny_tokenizer)  # the engine's look-up must not reset it
        assert compiler.timeout_s == 5.0
    finally:
        compiler.timeout_s = before


# --- Request fields ------------------------------------------------------------------------------


def parse(tokenizer, **fields):
    return parse_request({"prompt": "hello", **fields}, CONFIG, tokenizer, max_context=512).generation


def test_each_field_becomes_its_constraint(tiny_tokenizer):
    assert parse(tiny_tokenizer).constraint is None
    generation = parse(tiny_tokenizer, json_schema=PERSON)
    assert generation.constraint == Constraint.json_schema(PERSON)
    assert json.loads(generation.constraint.source) == PERSON
    assert parse(tiny_tokenizer, regex="[0-9]+").constraint == Constraint.regex("[0-9]+")
    assert parse(tiny_tokenizer, grammar='start: "yes" | "no"').constraint.kind == constraints.KIND_GRAMMAR
    assert parse(tiny_tokenizer, json_schema=True).constraint.kind == constraints.KIND_JSON_SCHEMA


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"json_schema": PERSON, "regex": "a"}, "regex: give at most one of"),
        ({"json_schema": "{}"}, "json_schema: must be a JSON Schema object"),
        ({"json_schema": False}, "json_schema: must be a JSON Schema object"),
        ({"json_schema": {"type": 3}}, "json_schema: not a valid JSON Schema"),
        ({"regex": ""}, "regex: must be a non-empty string"),
        ({"regex": "(("}, "regex: cannot be enforced"),
        ({"grammar": 5}, "grammar: must be a non-empty string"),
        ({"grammar": "start: ("}, "grammar: cannot be enforced"),
        ({"regex": "a" * (schema.MAX_CONSTRAINT_CHARS + 1)}, "at most"),
    ],
)
def test_a_bad_constraint_field_is_a_400_naming_it(tiny_tokenizer, fields, message):
    with pytest.raises(RequestError, match=message) as raised:
        parse(tiny_tokenizer, **fields)
    assert raised.value.status == 400


def test_unpack_bitmask_reads_bits_in_order():
    bitmask = torch.tensor([0b101, -(2**31)], dtype=torch.int32)  # tokens 0, 2 and 63
    allowed = constraints._unpack_bitmask(bitmask, 64)
    assert allowed.nonzero().flatten().tolist() == [0, 2, 63]


def test_a_special_token_spelled_literally_is_taken_as_its_text(compiler, tiny_tokenizer):
    # llguidance matches special tokens only through <token> references, yet its mask for the
    # literal text can allow the special token itself, which its matcher then refuses. The row
    # allows it where its text fits, and moves the matcher by that text.
    im_start = tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
    a = tiny_tokenizer.convert_tokens_to_ids("a")
    row = row_for(compiler, Constraint.grammar('start: "<|im_start|>" "a"'), tiny_tokenizer)
    forced = row.forced_tokens(16)
    assert row.num_valid(forced) == len(forced)
    masks = row.masks([im_start])
    assert masks[0, im_start] and masks[1, a] and not masks[1, im_start]
    row.commit([im_start])
    assert row.mask()[a]
    row.commit([a])
    assert row.mask()[tiny_tokenizer.eos_token_id]


def test_a_special_token_whose_text_does_not_fit_is_refused(compiler, tiny_tokenizer):
    im_start = tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
    row = row_for(compiler, Constraint.regex("[a-z]+"), tiny_tokenizer)
    assert not row.mask()[im_start]
    with pytest.raises(RuntimeError, match="grammar refused"):
        row.commit([im_start])


def fuse_word_level_tokenizer(extra: tuple[str, ...] = ()):
    """A character-level tokenizer that `transformers` loads and decodes but llguidance's reader of
    Hugging Face tokenizers cannot read: a WordLevel model with a `Fuse` decoder. `extra`: more tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    characters = list('abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ{}[]":,.()=+-_0123456789\n') + list(extra)
    vocab = {"<unk>": 0, "</s>": 1, **{character: i + 2 for i, character in enumerate(characters)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>", pad_token="</s>")


def unspellable_tokenizer():
    """The same, with a token that decodes to U+FFFD and has no byte piece: no vocabulary of bytes exists."""
    return fuse_word_level_tokenizer(extra=("\ufffd",))


def test_a_tokenizer_llguidance_cannot_read_is_read_from_its_tokens_bytes():
    tokenizer = fuse_word_level_tokenizer()
    from handler.token_bytes import token_bytes

    compiler = constraints.compiler_for(tokenizer)
    request = parse_request({"prompt": "ab", "regex": "[a-c]+x"}, CONFIG, tokenizer, max_context=512).generation
    row = row_for(compiler, request.constraint, tokenizer, vocab_size=len(tokenizer))
    allowed = row.mask()  # the first position: a, b or c only
    assert {tokenizer.decode([t]) for t in range(len(tokenizer)) if allowed[t]} == {"a", "b", "c"}
    vocabulary, _ = token_bytes(tokenizer)
    assert vocabulary[tokenizer.convert_tokens_to_ids(" ")] == b" "


def test_a_tokenizer_without_a_byte_spelling_is_a_400_for_structured_requests_only(monkeypatch):
    tokenizer = unspellable_tokenizer()
    assert tokenizer.decode(tokenizer("ab c")["input_ids"]) == "ab c"  # transformers serves it
    built = []
    monkeypatch.setattr(constraints, "GrammarCompiler", lambda t: built.append(t) or GrammarCompiler(t))
    for _ in range(2):
        with pytest.raises(RequestError, match="grammar engine cannot read its tokenizer.*Fuse.*no byte") as caught:
            constraints.compiler_for(tokenizer)
        assert caught.value.status == 400
    assert len(built) == 1  # asked once, the answer kept
    assert parse_request({"prompt": "ab"}, CONFIG, tokenizer, max_context=512).generation.prompt_ids  # plain: parses
    with pytest.raises(RequestError, match="structured output"):
        parse_request({"prompt": "ab", "regex": "[a-z]+"}, CONFIG, tokenizer, max_context=512)
