"""The OpenAI routes' answers: bodies, usage, logprobs and SSE chunks, checked against the openai package's types.

Engine results are hand-made (token ids, text, logprobs), with a tokenizer
that spells each id as one fixed string, so every field's value is known.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from handler.api.native import RequestError
from handler.api.openai.answers import (
    MIN_LOGPROB,
    OpenAIStream,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    response_body,
    speculative_totals,
    usage,
)
from handler.api.openai.requests import OpenAIRequest
from handler.api.openai.routes import ROUTE_CHAT, ROUTE_COMPLETIONS
from handler.engine import GenerationRequest, SpeculativeStats
from handler.token_bytes import is_byte_level

PIECES = {0: "<eos>", 1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: " END", 7: "\ufffd"}
SPECIAL = {0}


class PieceTokenizer:
    """Decodes each id to its piece; skip_special_tokens drops <eos>."""

    def decode(self, token_ids, skip_special_tokens=False):
        return "".join(PIECES[i] for i in token_ids if not (skip_special_tokens and i in SPECIAL))


@dataclasses.dataclass(frozen=True)
class FakeLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass
class FakeResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    stats: SpeculativeStats
    logprobs: list[FakeLogprob] | None = None
    cached_tokens: int = 0


def stats(draft: int, accepted: int, passes: int, completion: int, fell_back: bool = False) -> SpeculativeStats:
    return SpeculativeStats(
        num_speculative_tokens=4,
        draft_tokens=draft,
        accepted_tokens=accepted,
        target_forward_passes=passes,
        completion_tokens=completion,
        fell_back=fell_back,
    )


def logprobs_of(token_ids: list[int]) -> list[FakeLogprob]:
    # The emitted token is not always the likeliest: top lists it where it ranks.
    return [
        FakeLogprob(t, -0.25 * (i + 1), ((t, -0.25 * (i + 1)), (5, -1.5), (3, float("-inf"))))
        for i, t in enumerate(token_ids)
    ]


def make_request(kind: str, num_choices: int = 1, n: int | None = None, **fields) -> OpenAIRequest:
    generation = GenerationRequest(prompt_ids=(1, 2, 3), max_new_tokens=8, stop=fields.pop("stop", ()))
    return OpenAIRequest(
        kind=kind,
        model="tiny-spec",
        generations=(generation,) * num_choices,
        n=n or num_choices,
        id="cmpl-x",
        created=1700000000,
        **fields,
    )


HELLO = FakeResult([1, 2, 3, 4, 0], "Hello world", "eos", 3, stats(8, 4, 2, 5), cached_tokens=2)
BANG = FakeResult([5, 5, 5], "!!!", "length", 3, stats(4, 1, 2, 3, fell_back=True))


@pytest.mark.parametrize("ours, theirs", [("eos", "stop"), ("stop", "stop"), ("length", "length"), ("abort", "abort")])
def test_finish_reasons(ours, theirs):
    assert finish_reason(ours) == theirs


def test_completion_body_validates_as_the_openai_type():
    body = response_body(make_request(ROUTE_COMPLETIONS), [HELLO], PieceTokenizer())
    parsed = Completion.model_validate(json.loads(json.dumps(body)))
    assert parsed.object == "text_completion" and parsed.id == "cmpl-x" and parsed.model == "tiny-spec"
    assert parsed.choices[0].text == "Hello world" and parsed.choices[0].finish_reason == "stop"
    assert parsed.choices[0].logprobs is None
    assert parsed.usage.model_dump(exclude_none=True) == {
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert body["speculative"] == HELLO.stats.as_dict()


def test_chat_body_validates_as_the_openai_type():
    body = response_body(make_request(ROUTE_CHAT, 2), [HELLO, BANG], PieceTokenizer())
    parsed = ChatCompletion.model_validate(json.loads(json.dumps(body)))
    assert parsed.object == "chat.completion"
    assert [(c.index, c.message.role, c.message.content, c.finish_reason) for c in parsed.choices] == [
        (0, "assistant", "Hello world", "stop"),
        (1, "assistant", "!!!", "length"),
    ]


def test_usage_counts_each_prompt_once_and_every_choice():
    request = make_request(ROUTE_COMPLETIONS, 4, n=2)  # 2 prompts x n=2
    results = [
        HELLO,
        BANG,
        dataclasses.replace(BANG, prompt_tokens=7, cached_tokens=6),
        dataclasses.replace(HELLO, prompt_tokens=7, cached_tokens=6),
    ]
    assert usage(request, results) == {
        "prompt_tokens": 3 + 7,
        "completion_tokens": 5 + 3 + 3 + 5,
        "total_tokens": 26,
        # Cached prompt tokens count once per prompt too: the first choice's of each.
        "prompt_tokens_details": {"cached_tokens": 2 + 6},
    }


def test_speculative_totals_add_up_the_choices():
    assert speculative_totals([HELLO]) == HELLO.stats.as_dict()
    totals = speculative_totals([HELLO, BANG])
    assert totals["draft_tokens"] == 12 and totals["accepted_tokens"] == 5 and totals["target_forward_passes"] == 4
    assert totals["acceptance_rate"] == round(5 / 12, 4)
    assert totals["mean_accepted_length"] == round(8 / 4, 4)
    assert totals["fell_back_to_target_only"] is True and totals["num_speculative_tokens"] == 4


def test_chat_logprobs_format():
    entries = logprobs_of([1, 7])
    formatted = chat_logprobs(entries, TokenTexts(PieceTokenizer()), num_top=2)
    first, second = formatted["content"]
    assert first == {
        "token": "Hel",
        "logprob": -0.25,
        "bytes": list(b"Hel"),
        "top_logprobs": [
            {"token": "Hel", "logprob": -0.25, "bytes": list(b"Hel")},
            {"token": "!", "logprob": -1.5, "bytes": list(b"!")},
        ],
    }
    assert second["token"] == "\ufffd" and second["bytes"] is None, "half a character has no bytes of its own"
    assert formatted["refusal"] is None
    assert chat_logprobs(entries, TokenTexts(PieceTokenizer()), num_top=0)["content"][0]["top_logprobs"] == []
    # An impossible alternative is clamped: JSON has no -Infinity.
    third = chat_logprobs(entries, TokenTexts(PieceTokenizer()), num_top=3)["content"][0]["top_logprobs"][2]
    assert third["logprob"] == MIN_LOGPROB


def test_completion_logprobs_format():
    formatted = completion_logprobs(logprobs_of([1, 2, 3]), TokenTexts(PieceTokenizer()), num_top=1)
    assert formatted["tokens"] == ["Hel", "lo", " wor"]
    assert formatted["token_logprobs"] == [-0.25, -0.5, -0.75]
    assert formatted["text_offset"] == [0, 3, 5]
    # The top entry, plus the emitted token when it is not among them (legacy API).
    assert formatted["top_logprobs"] == [{"Hel": -0.25}, {"lo": -0.5}, {" wor": -0.75}]
    zero = completion_logprobs(logprobs_of([1]), TokenTexts(PieceTokenizer()), num_top=0)
    assert zero["top_logprobs"] == [{"Hel": -0.25}]
    two = completion_logprobs(logprobs_of([1]), TokenTexts(PieceTokenizer()), num_top=2)
    assert two["top_logprobs"] == [{"Hel": -0.25, "!": -1.5}]


def test_tokens_sharing_a_text_keep_the_likeliest_logprob():
    # Ids 5 and 6 both read "!" here; the likelier one's logprob stands for the text.
    pieces = {**PIECES, 6: "!"}

    class SharedTexts(PieceTokenizer):
        def decode(self, token_ids, skip_special_tokens=False):
            return "".join(pieces[i] for i in token_ids)

    entry = FakeLogprob(1, -0.5, ((5, -1.0), (6, -2.0), (1, -0.5)))
    formatted = completion_logprobs([entry], TokenTexts(SharedTexts()), num_top=3)
    assert formatted["top_logprobs"] == [{"!": -1.0, "Hel": -0.5}]


def test_split_characters_have_exact_bytes_with_a_byte_level_tokenizer(tiny_models_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models_dir / "target")
    text = "naïve 世界 ok"
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    texts = TokenTexts(tokenizer)
    assert is_byte_level(tokenizer)
    assert bytes(sum((texts.bytes(t) for t in token_ids), [])).decode("utf-8") == text
    split = [t for t in token_ids if "\ufffd" in tokenizer.decode([t])]
    assert split, "the tiny vocabulary has no token for these characters: they split into bytes"
    assert all(texts(t).startswith("bytes:\\x") for t in split)
    assert texts(tokenizer.eos_token_id) == tokenizer.eos_token and texts.bytes(tokenizer.eos_token_id) is not None
    entries = [FakeLogprob(t, -1.0, ()) for t in token_ids]
    offsets = completion_logprobs(entries, texts, num_top=0)["text_offset"]
    # Each token starts where the text decoded from the tokens before it ends.
    for index, offset in enumerate(offsets):
        prefix = tokenizer.decode(token_ids[:index])
        assert offset == len(prefix.rstrip("\ufffd")), (index, prefix)


def test_bodies_carry_logprobs_when_asked():
    result = dataclasses.replace(HELLO, logprobs=logprobs_of(HELLO.token_ids))
    chat = response_body(make_request(ROUTE_CHAT, num_top_logprobs=1), [result], PieceTokenizer())
    parsed = ChatCompletion.model_validate(json.loads(json.dumps(chat)))
    assert [entry.token for entry in parsed.choices[0].logprobs.content] == ["Hel", "lo", " wor", "ld", "<eos>"]
    completion = response_body(make_request(ROUTE_COMPLETIONS, num_top_logprobs=0), [result], PieceTokenizer())
    parsed = Completion.model_validate(json.loads(json.dumps(completion)))
    assert parsed.choices[0].logprobs.token_logprobs == [-0.25, -0.5, -0.75, -1.0, -1.25]


def completion_chunk(event: dict) -> Completion:
    """A streamed completions chunk as the openai client reads it: `Completion`, built without
    validation, since the type says finish_reason is never null and every chunk but the last has null."""
    assert all(choice["finish_reason"] in (None, "stop", "length") for choice in event["choices"])
    return Completion.construct(**event)


def events_of(text: str) -> list:
    """The data of each SSE event; [DONE] as a string."""
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def run_stream(request: OpenAIRequest, results: list[FakeResult], finish_early: bool = False) -> list:
    """Feeds each choice its tokens one at a time, as engine steps would, and returns the events."""
    stream = OpenAIStream(request, PieceTokenizer())
    text = ""
    for step in range(max(len(r.token_ids) for r in results)):
        for choice, result in enumerate(results):
            if step < len(result.token_ids) - 1:
                text += stream.on_tokens(choice, result.token_ids[: step + 1])
            elif step == len(result.token_ids) - 1 and finish_early:
                text += stream.on_finished(choice, result)
    text += stream.close(results)
    assert stream.started
    return events_of(text)


@pytest.mark.parametrize("finish_early", [False, True], ids=["finish-at-close", "finish-when-done"])
def test_chat_stream_joins_to_the_plain_answer(finish_early):
    request = make_request(ROUTE_CHAT, 2, stream=True, include_usage=True)
    events = run_stream(request, [HELLO, BANG], finish_early)
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(event) for event in events[:-1]]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.total_tokens == 3 + 5 + 3
    for index, result in enumerate([HELLO, BANG]):
        own = [c for c in chunks[:-1] if c.choices[0].index == index]
        assert own[0].choices[0].delta.role == "assistant"
        assert all(c.choices[0].delta.role is None for c in own[1:])
        assert "".join(c.choices[0].delta.content for c in own) == result.text
        assert [c.choices[0].finish_reason for c in own][-1] == finish_reason(result.finish_reason)
        assert all(c.choices[0].finish_reason is None for c in own[:-1])
        assert own[-1].model_extra["speculative"] == result.stats.as_dict()
        assert all(c.usage is None for c in own)
    assert {c.id for c in chunks} == {"cmpl-x"} and {c.object for c in chunks} == {"chat.completion.chunk"}


def test_completion_stream_without_usage_and_with_a_held_back_stop_prefix():
    # " wor" could start the stop string " world!" and is held back until it cannot.
    result = FakeResult([1, 2, 3, 4, 5], "Hello world!", "length", 3, stats(4, 2, 2, 5))
    request = make_request(ROUTE_COMPLETIONS, stream=True, stop=(" world?",))
    events = run_stream(request, [result])
    assert events[-1] == "[DONE]"
    chunks = [completion_chunk(event) for event in events[:-1]]
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == "Hello world!"
    assert texts[:2] == ["Hel", "lo"], "the first chunks flow before the possible stop prefix"
    assert all("usage" not in event for event in events[:-1])


def test_streamed_logprobs_come_once_per_token():
    result = dataclasses.replace(HELLO, logprobs=logprobs_of(HELLO.token_ids))
    request = make_request(ROUTE_COMPLETIONS, stream=True, num_top_logprobs=1)
    stream = OpenAIStream(request, PieceTokenizer())
    # Per-step logprobs for the first two tokens, the rest with the finishing chunk.
    text = stream.on_tokens(0, [1], result.logprobs[:1]) + stream.on_tokens(0, [1, 2], result.logprobs[1:2])
    text += stream.close([result])
    chunks = [completion_chunk(e) for e in events_of(text)[:-1]]
    tokens = sum((c.choices[0].logprobs.tokens for c in chunks), [])
    offsets = sum((c.choices[0].logprobs.text_offset for c in chunks), [])
    assert tokens == ["Hel", "lo", " wor", "ld", "<eos>"]
    assert offsets == [0, 3, 5, 9, 11]


def test_error_after_the_stream_began_is_an_error_event():
    stream = OpenAIStream(make_request(ROUTE_CHAT, stream=True), PieceTokenizer())
    events = events_of(stream.error(RequestError("server: generation failed mid-stream", 500)))
    assert events == [
        {
            "error": {
                "message": "server: generation failed mid-stream",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        },
        "[DONE]",
    ]
