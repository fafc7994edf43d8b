"""The REST contract: answer and stream builders, and the validators clients run on what they receive."""

from __future__ import annotations

import pytest

from handler import schema

SPECULATIVE = {
    "num_speculative_tokens": 4,
    "draft_tokens": 8,
    "accepted_tokens": 6,
    "acceptance_rate": 0.75,
    "target_forward_passes": 3,
    "mean_accepted_length": 2.6667,
    "fell_back_to_target_only": False,
    "draft_passes": 3,
    "drafter": "model",
    "by_drafter": {"model": {"draft_tokens": 4, "accepted_tokens": 3}},
    "accepted_per_position": [2, 1],
    "tree": {"steps": 1, "nodes": 5, "accepted_depth": 2, "other_branch": 1},
}
ANSWER = {
    "text": "ab",
    "token_ids": [1, 2],
    "finish_reason": "length",
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 2},
    "speculative": SPECULATIVE,
}
STREAM_LINES = [
    {"text_delta": "a", "token_ids": [1]},
    {"text_delta": "b", "token_ids": [2], **{k: v for k, v in ANSWER.items() if k not in ("text", "token_ids")}},
]


def test_validate_answer_accepts_the_contract_and_names_each_problem():
    assert schema.validate_answer(ANSWER) == []
    broken = dict(ANSWER, finish_reason="done", token_ids=[1, "2"], usage={"prompt_tokens": 3})
    del broken["speculative"]
    problems = " | ".join(schema.validate_answer(broken))
    for expected in ("finish_reason", "token_ids", "usage.completion_tokens", "usage.cached_tokens", "speculative"):
        assert expected in problems
    assert schema.validate_answer([ANSWER]) != []


def test_validate_stream_needs_a_final_line_with_finish_reason():
    assert schema.validate_stream(STREAM_LINES) == []
    assert any("last line" in p for p in schema.validate_stream(STREAM_LINES[:1]))
    assert schema.validate_stream([]) == ["stream: no lines"]
    early_finish = [dict(STREAM_LINES[0], finish_reason="eos"), STREAM_LINES[1]]
    assert any("before the last line" in p for p in schema.validate_stream(early_finish))
    no_delta = [{"token_ids": [1]}, STREAM_LINES[1]]
    assert any("text_delta" in p for p in schema.validate_stream(no_delta))


def test_builders_make_what_the_validators_accept():
    answer = schema.answer("ab", [1, 2], schema.FINISH_LENGTH, 3, SPECULATIVE, cached_tokens=2)
    assert answer == ANSWER and tuple(answer) == schema.ANSWER_KEYS
    assert set(answer["speculative"]) == schema.SPECULATIVE_KEYS
    lines = [schema.stream_chunk("a", [1]), schema.final_stream_chunk(answer, "b", [2])]
    assert lines == STREAM_LINES and tuple(lines[0]) == schema.STREAM_CHUNK_KEYS
    assert schema.validate_stream(lines) == []
    assert schema.join_stream(lines) == answer
    assert schema.error_answer("top_p: must be in (0, 1]") == {"error": "top_p: must be in (0, 1]"}


@pytest.mark.parametrize("reason", schema.FINISH_REASONS)
def test_every_finish_reason_is_valid_and_no_other(reason):
    assert schema.validate_answer(dict(ANSWER, finish_reason=reason)) == []
    assert "abort" in schema.FINISH_REASONS
    with pytest.raises(AssertionError):
        schema.answer("", [], "done", 1, SPECULATIVE)


def test_field_rules_without_a_tokenizer():
    assert schema.stop_field({"stop": ["a", "b"]}) == ("a", "b")
    with pytest.raises(schema.RequestError, match="^stop: at most 16"):
        schema.stop_field({"stop": ["x"] * (schema.MAX_STOP_STRINGS + 1)})
    with pytest.raises(schema.RequestError, match="^stop: each stop string"):
        schema.stop_field({"stop": ["x" * (schema.MAX_STOP_STRING_CHARS + 1)]})
    assert schema.seed_field({}) is None and schema.seed_field({"seed": 3.0}) == 3
    assert schema.integer_field({"k": 2.0}, "k", 0, 0, 4) == 2
    with pytest.raises(schema.RequestError, match="^k: must be an integer"):
        schema.integer_field({"k": True}, "k", 0, 0, 4)
    with pytest.raises(schema.RequestError, match="^nope: unknown field; known fields are prompt, messages"):
        schema.check_known_fields({"prompt": "x", "nope": 1})


def test_schema_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, handler.schema, scripts.serving.torchserve; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
