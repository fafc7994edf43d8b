"""The OpenAI routes' request side: url_path routing, translation into engine rows, errors, the model list."""

from __future__ import annotations

import pytest

from handler.api.native import RequestError, parse_request
from handler.api.openai.requests import (
    MAX_CHOICES,
    OPENAI_SAMPLING_DEFAULTS,
    choice_seed,
    decode_openai_body,
    parse_openai_request,
    sampling_defaults,
)
from handler.api.openai.routes import (
    ROUTE_CHAT,
    ROUTE_COMPLETIONS,
    ROUTE_MODEL,
    ROUTE_MODELS,
    ROUTE_NATIVE,
    ROUTE_UNKNOWN,
    error_answer,
    models_answer,
    route_from_url_path,
    unknown_route_error,
)
from handler.config import HandlerConfig, SamplingParams

CONFIG = HandlerConfig(
    num_speculative_tokens=4, max_num_speculative_tokens=8, max_new_tokens=32, max_new_tokens_limit=64
)
MAX_CONTEXT = 512
MODEL = "tiny-spec"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_models_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models_dir / "target")


def parse(kind, body, tokenizer):
    return parse_openai_request(kind, body, CONFIG, tokenizer, MAX_CONTEXT, MODEL)


def native(body, tokenizer):
    return parse_request(body, CONFIG, tokenizer, MAX_CONTEXT).generation


def refused(kind, body, tokenizer) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(kind, body, tokenizer)
    return info.value


@pytest.mark.parametrize(
    "url_path, kind, path",
    [
        (None, ROUTE_NATIVE, ""),
        ("", ROUTE_NATIVE, ""),
        ("v1/completions", ROUTE_COMPLETIONS, "v1/completions"),
        ("v1/chat/completions/", ROUTE_CHAT, "v1/chat/completions"),
        ("/v1//models", ROUTE_MODELS, "v1/models"),
        ("v1/models/tiny-spec", ROUTE_MODEL, "v1/models/tiny-spec"),
        ("v1/embeddings", ROUTE_UNKNOWN, "v1/embeddings"),
        ("completions", ROUTE_UNKNOWN, "completions"),
    ],
)
def test_routes_from_url_path(url_path, kind, path):
    route = route_from_url_path(url_path)
    assert (route.kind, route.path) == (kind, path)
    assert route.is_openai == (kind != ROUTE_NATIVE)


def test_completion_is_the_native_request_with_openai_names(tokenizer):
    request = parse(
        ROUTE_COMPLETIONS,
        {
            "model": MODEL,
            "prompt": "hello",
            "max_tokens": 10,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 7,
            "seed": 3,
            "stop": "END",
            "num_speculative_tokens": 2,
        },
        tokenizer,
    )
    expected = native(
        {
            "prompt": "hello",
            "max_new_tokens": 10,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 7,
            "seed": 3,
            "stop": ["END"],
            "num_speculative_tokens": 2,
        },
        tokenizer,
    )
    assert request.generations == (expected,)
    assert request.kind == ROUTE_COMPLETIONS and request.model == MODEL and request.n == 1
    assert request.id.startswith("cmpl-") and request.created > 0
    assert not request.stream and not request.include_usage and request.num_top_logprobs is None


def test_left_out_fields_take_openai_sampling_and_the_config_s_limits_and_nulls_are_left_out(tokenizer):
    request = parse(ROUTE_COMPLETIONS, {"prompt": "hello", "temperature": None, "stop": None, "n": None}, tokenizer)
    (generation,) = request.generations
    assert generation == native({"prompt": "hello", **OPENAI_SAMPLING_DEFAULTS}, tokenizer)
    # OpenAI's temperature 1 (sampling), not the config's greedy default; max tokens from the config.
    assert generation.max_new_tokens == 32 and generation.sampling == SamplingParams(temperature=1.0)


# A generation_config.json as instruct models ship it (Qwen2.5's), with fields the routes do not read.
GENERATION_CONFIG = {
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
    "max_new_tokens": 512,
    "bos_token_id": 1,
    "transformers_version": "4.44.0",
}


def test_sampling_defaults_are_the_generation_config_s_then_openai_s():
    assert sampling_defaults(None) == sampling_defaults({}) == OPENAI_SAMPLING_DEFAULTS
    assert OPENAI_SAMPLING_DEFAULTS["temperature"] == 1.0 and OPENAI_SAMPLING_DEFAULTS["top_p"] == 1.0
    defaults = sampling_defaults(GENERATION_CONFIG)
    assert defaults == {**OPENAI_SAMPLING_DEFAULTS, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                        "repetition_penalty": 1.05}  # fmt: skip
    assert sampling_defaults({"min_p": 0.05, "temperature": 0})["min_p"] == 0.05
    assert sampling_defaults({"temperature": 0})["temperature"] == 0.0, "a greedy generation config stays greedy"


@pytest.mark.parametrize(
    "generation_config",
    [{"top_p": 0}, {"temperature": -1}, {"temperature": "hot"}, {"top_k": 2.5}, {"top_k": True}, {"min_p": 2}],
)
def test_a_generation_config_value_the_rules_refuse_is_skipped_with_a_warning(generation_config, caplog):
    defaults = sampling_defaults({**generation_config, "repetition_penalty": 1.1})
    (key,) = generation_config
    assert defaults[key] == OPENAI_SAMPLING_DEFAULTS[key] and defaults["repetition_penalty"] == 1.1
    assert f"generation_config.json: {key}" in caplog.text


def test_left_out_sampling_fields_take_the_given_defaults_and_the_request_s_own_win(tokenizer):
    defaults = sampling_defaults(GENERATION_CONFIG)
    for kind, body in ((ROUTE_CHAT, {"messages": MESSAGES}), (ROUTE_COMPLETIONS, {"prompt": "hello"})):
        (generation,) = parse_openai_request(kind, body, CONFIG, tokenizer, MAX_CONTEXT, MODEL, defaults).generations
        assert generation.sampling == SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
        own = {**body, "temperature": 0, "top_k": 0, "presence_penalty": 0.5}
        (generation,) = parse_openai_request(kind, own, CONFIG, tokenizer, MAX_CONTEXT, MODEL, defaults).generations
        assert generation.sampling == SamplingParams(
            temperature=0.0, top_p=0.8, top_k=0, presence_penalty=0.5, repetition_penalty=1.05
        )
    # max_new_tokens is not a sampling field: the config's, not the generation config's 512.
    assert generation.max_new_tokens == CONFIG.max_new_tokens


def test_the_native_route_keeps_the_config_s_greedy_default_whatever_the_openai_defaults(tokenizer):
    from handler.api.entry import parse_entry

    defaults = sampling_defaults(GENERATION_CONFIG)
    native_entry = parse_entry({"body": {"prompt": "hello"}}, "application/json", CONFIG, tokenizer, MAX_CONTEXT,
                               route_from_url_path(""), MODEL, openai_defaults=defaults)  # fmt: skip
    assert native_entry.generation.sampling == SamplingParams() == CONFIG.sampling
    chat_entry = parse_entry({"body": {"messages": MESSAGES}}, "application/json", CONFIG, tokenizer, MAX_CONTEXT,
                             route_from_url_path("v1/chat/completions"), MODEL, openai_defaults=defaults)  # fmt: skip
    assert chat_entry.generations[0].sampling.temperature == 0.7


def test_chat_renders_the_template_like_the_native_route(tokenizer):
    request = parse(ROUTE_CHAT, {"messages": MESSAGES, "max_completion_tokens": 5}, tokenizer)
    expected = native({"messages": MESSAGES, "max_new_tokens": 5, **OPENAI_SAMPLING_DEFAULTS}, tokenizer)
    assert request.generations == (expected,)
    assert request.id.startswith("chatcmpl-")


def test_chat_content_parts_developer_role_and_null_extras(tokenizer):
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "Hi", "name": "ann", "tool_calls": None},
    ]
    request = parse(ROUTE_CHAT, {"messages": messages}, tokenizer)
    expected = [{"role": "system", "content": "Be\nbrief."}, {"role": "user", "content": "Hi"}]
    assert request.generations == (native({"messages": expected, **OPENAI_SAMPLING_DEFAULTS}, tokenizer),)


def test_max_completion_tokens_wins_over_max_tokens(tokenizer):
    request = parse(ROUTE_CHAT, {"messages": MESSAGES, "max_tokens": 9, "max_completion_tokens": 4}, tokenizer)
    assert request.generations[0].max_new_tokens == 4


def test_n_gives_one_row_per_choice_with_derived_seeds(tokenizer):
    request = parse(ROUTE_COMPLETIONS, {"prompt": "hello", "n": 3, "seed": 7, "temperature": 1.0}, tokenizer)
    seeds = [g.seed for g in request.generations]
    assert request.n == 3 and request.num_prompts == 1
    assert seeds[0] == 7, "choice 0 keeps the seed: n=1 answers as the native route"
    assert len(set(seeds)) == 3 and seeds == [choice_seed(7, c) for c in range(3)]
    assert all(0 <= s < 2**63 for s in seeds)
    assert {g.prompt_ids for g in request.generations} == {request.generations[0].prompt_ids}
    # Deterministic, and no overlap with the neighbouring seed's choices.
    assert parse(ROUTE_COMPLETIONS, {"prompt": "hello", "n": 3, "seed": 7}, tokenizer).generations[2].seed == seeds[2]
    assert choice_seed(7, 1) != choice_seed(8, 0)
    assert [g.seed for g in parse(ROUTE_COMPLETIONS, {"prompt": "x", "n": 2}, tokenizer).generations] == [None, None]


def test_prompt_lists_are_prompt_major(tokenizer):
    request = parse(ROUTE_COMPLETIONS, {"prompt": ["a b", "hello there"], "n": 2, "seed": 1}, tokenizer)
    prompts = [g.prompt_ids for g in request.generations]
    assert request.num_prompts == 2 and len(prompts) == 4
    assert prompts[0] == prompts[1] != prompts[2] == prompts[3]
    assert [g.seed for g in request.generations] == [1, choice_seed(1, 1), 1, choice_seed(1, 1)]


def test_stream_options_and_logprobs_fields(tokenizer):
    request = parse(
        ROUTE_CHAT,
        {
            "messages": MESSAGES,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 3,
        },
        tokenizer,
    )
    assert request.stream and request.include_usage and request.num_top_logprobs == 3
    assert parse(ROUTE_CHAT, {"messages": MESSAGES, "logprobs": True}, tokenizer).num_top_logprobs == 0
    assert parse(ROUTE_CHAT, {"messages": MESSAGES, "logprobs": False}, tokenizer).num_top_logprobs is None
    assert parse(ROUTE_COMPLETIONS, {"prompt": "x", "logprobs": 0}, tokenizer).num_top_logprobs == 0
    assert parse(ROUTE_COMPLETIONS, {"prompt": "x", "logprobs": 5}, tokenizer).num_top_logprobs == 5


def test_logprobs_and_drafter_reach_every_row(tokenizer):
    request = parse(ROUTE_COMPLETIONS, {"prompt": "x", "logprobs": 3, "n": 2, "drafter": "ngram"}, tokenizer)
    assert [(g.logprobs, g.drafter) for g in request.generations] == [(3, "ngram"), (3, "ngram")]
    chat = parse(ROUTE_CHAT, {"messages": MESSAGES, "logprobs": True}, tokenizer)
    assert chat.generations[0].logprobs == 0 and chat.generations[0].drafter == CONFIG.drafter
    assert parse(ROUTE_CHAT, {"messages": MESSAGES}, tokenizer).generations[0].logprobs is None


NEUTRAL_ACCEPTED = [
    (
        ROUTE_COMPLETIONS,
        {
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "logit_bias": {},
            "echo": False,
            "best_of": 1,
            "suffix": "",
            "user": "u1",
        },
    ),
    (
        ROUTE_CHAT,
        {
            "presence_penalty": 0,
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "store": False,
            "service_tier": "auto",
            "modalities": ["text"],
            "parallel_tool_calls": True,
            "metadata": {"a": "b"},
            "audio": None,
            "user": "u1",
            "stream": True,
            "stream_options": {"include_usage": False, "include_obfuscation": True},
        },
    ),
]


@pytest.mark.parametrize("kind, extra", NEUTRAL_ACCEPTED, ids=["completions", "chat"])
def test_unsupported_standard_fields_pass_at_their_neutral_value(kind, extra, tokenizer):
    prompt = {"messages": MESSAGES} if kind == ROUTE_CHAT else {"prompt": "x"}
    assert len(parse(kind, {**prompt, **extra}, tokenizer).generations) == 1


REFUSED = [
    (ROUTE_COMPLETIONS, {"presence_penalty": 2.5}, "presence_penalty", 400),
    (ROUTE_CHAT, {"frequency_penalty": -3}, "frequency_penalty", 400),
    (ROUTE_COMPLETIONS, {"repetition_penalty": 0}, "repetition_penalty", 400),
    (ROUTE_CHAT, {"min_p": 1.5}, "min_p", 400),
    (ROUTE_COMPLETIONS, {"logit_bias": {"5": 101}}, "logit_bias", 400),
    (ROUTE_CHAT, {"logit_bias": {"99999999": 1}}, "logit_bias", 400),
    (ROUTE_CHAT, {"logit_bias": {"five": 1}}, "logit_bias", 400),
    (ROUTE_COMPLETIONS, {"echo": True}, "echo", 400),
    (ROUTE_COMPLETIONS, {"best_of": 3}, "best_of", 400),
    (ROUTE_COMPLETIONS, {"suffix": "end"}, "suffix", 400),
    (ROUTE_COMPLETIONS, {"messages": MESSAGES}, "messages", 400),
    (ROUTE_COMPLETIONS, {"max_new_tokens": 5}, "max_new_tokens", 400),
    (ROUTE_COMPLETIONS, {"no_such_field": 1}, "no_such_field", 400),
    (ROUTE_COMPLETIONS, {"n": 0}, "n", 400),
    (ROUTE_COMPLETIONS, {"n": MAX_CHOICES + 1}, "n", 400),
    (ROUTE_COMPLETIONS, {"max_tokens": 0}, "max_tokens", 400),
    (ROUTE_COMPLETIONS, {"max_tokens": 65}, "max_tokens", 400),
    (ROUTE_COMPLETIONS, {"temperature": -1}, "temperature", 400),
    (ROUTE_COMPLETIONS, {"top_p": 0}, "top_p", 400),
    (ROUTE_COMPLETIONS, {"seed": "7"}, "seed", 400),
    (ROUTE_COMPLETIONS, {"stop": [1]}, "stop", 400),
    (ROUTE_COMPLETIONS, {"stream": "yes"}, "stream", 400),
    (ROUTE_COMPLETIONS, {"stream_options": {"include_usage": True}}, "stream_options", 400),
    (ROUTE_COMPLETIONS, {"logprobs": True}, "logprobs", 400),
    (ROUTE_COMPLETIONS, {"logprobs": 21}, "logprobs", 400),
    (ROUTE_COMPLETIONS, {"model": "gpt-4o"}, "model", 404),
    (ROUTE_COMPLETIONS, {"num_speculative_tokens": 9}, "num_speculative_tokens", 400),
    (ROUTE_COMPLETIONS, {"drafter": "eagle"}, "drafter", 400),
    (ROUTE_CHAT, {"tools": [{"type": "function"}]}, "tools[0].function", 400),
    (ROUTE_CHAT, {"tool_choice": "always"}, "tool_choice", 400),
    (ROUTE_CHAT, {"response_format": {"type": "xml"}}, "response_format", 400),
    (ROUTE_COMPLETIONS, {"response_format": {"type": "json_schema"}}, "response_format.json_schema", 400),
    (ROUTE_CHAT, {"top_logprobs": 2}, "top_logprobs", 400),
    (ROUTE_CHAT, {"logprobs": 2}, "logprobs", 400),
    (ROUTE_CHAT, {"prompt": "x"}, "prompt", 400),
    (ROUTE_CHAT, {"stream": True, "stream_options": {"continuous": True}}, "stream_options.continuous", 400),
]


@pytest.mark.parametrize("kind, extra, field, status", REFUSED, ids=[f"{r[2]}-{i}" for i, r in enumerate(REFUSED)])
def test_refusals_name_the_field(kind, extra, field, status, tokenizer):
    prompt = {"messages": MESSAGES} if kind == ROUTE_CHAT else {"prompt": "x"}
    error = refused(kind, {**prompt, **extra}, tokenizer)
    assert str(error).startswith(f"{field}:"), str(error)
    assert error.status == status
    assert error_answer(error)[1]["error"]["param"] == field


def test_penalties_min_p_and_logit_bias_reach_the_native_request(tokenizer):
    """Standard (presence, frequency, logit_bias) and extension (repetition_penalty, min_p) alike, on both routes."""
    fields = {
        "temperature": 0.9,
        "presence_penalty": 0.5,
        "frequency_penalty": 1.5,
        "repetition_penalty": 1.2,
        "min_p": 0.05,
        "logit_bias": {"3": -100, "10": 4},
    }
    request = parse(ROUTE_COMPLETIONS, {"prompt": "hello", "n": 2, **fields}, tokenizer)
    expected = native({"prompt": "hello", **fields}, tokenizer).sampling
    assert expected.logit_bias == ((3, -100.0), (10, 4.0)) and expected.presence_penalty == 0.5
    assert [g.sampling for g in request.generations] == [expected, expected]
    chat = parse(ROUTE_CHAT, {"messages": MESSAGES, **fields}, tokenizer)
    assert chat.generations[0].sampling == expected


BAD_PROMPTS = [
    (ROUTE_COMPLETIONS, {}, "prompt"),
    (ROUTE_COMPLETIONS, {"prompt": []}, "prompt"),
    (ROUTE_COMPLETIONS, {"prompt": [1, 2, 3]}, "prompt"),
    (ROUTE_COMPLETIONS, {"prompt": ["ok", ""]}, "prompt[1]"),
    (ROUTE_COMPLETIONS, {"prompt": ["a"] * 3, "n": 3}, "n"),
    (ROUTE_CHAT, {}, "messages"),
    (ROUTE_CHAT, {"messages": []}, "messages"),
    (ROUTE_CHAT, {"messages": [{"role": "user"}]}, "messages[0].content"),
    (ROUTE_CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    (
        ROUTE_CHAT,
        {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{}]}]},
        "messages[0].tool_calls[0].id",
    ),
    (ROUTE_CHAT, {"messages": [{"role": "user", "content": "x", "weight": 1}]}, "messages[0].weight"),
]


@pytest.mark.parametrize("kind, body, field", BAD_PROMPTS, ids=[f"{r[2]}-{i}" for i, r in enumerate(BAD_PROMPTS)])
def test_bad_prompts_and_messages(kind, body, field, tokenizer):
    assert str(refused(kind, body, tokenizer)).startswith(f"{field}:")


def test_prompt_too_long_is_a_400_with_openai_code(tokenizer):
    error = refused(ROUTE_COMPLETIONS, {"prompt": "word " * 600, "max_tokens": 8}, tokenizer)
    assert error.status == 413  # what the native route answers
    status, body = error_answer(error)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["type"] == "invalid_request_error"


def test_error_answer_shapes():
    assert error_answer(RequestError("server: generation failed (X)", 500)) == (
        500,
        {"error": {"message": "server: generation failed (X)", "type": "server_error", "param": None, "code": None}},
    )
    status, body = error_answer(unknown_route_error(route_from_url_path("v1/embeddings")))
    assert status == 404 and body["error"]["code"] == "unknown_url" and body["error"]["param"] is None
    assert "/v1/embeddings" in body["error"]["message"]
    status, body = error_answer(RequestError('model: the model "x" does not exist', 404))
    assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert error_answer(RequestError("body: empty"))[1]["error"]["param"] is None


def test_model_list_and_card():
    listing = models_answer(route_from_url_path("v1/models"), MODEL, 123)
    assert listing == {
        "object": "list",
        "data": [{"id": MODEL, "object": "model", "created": 123, "owned_by": "torchserve"}],
    }
    assert models_answer(route_from_url_path(f"v1/models/{MODEL}"), MODEL, 123) == listing["data"][0]
    with pytest.raises(RequestError) as info:
        models_answer(route_from_url_path("v1/models/gpt-4o"), MODEL, 123)
    assert info.value.status == 404


@pytest.mark.parametrize(
    "value, content_type, expected",
    [
        (b'{"prompt": "x"}', None, {"prompt": "x"}),
        ('{"prompt": "x"}', "text/plain", {"prompt": "x"}),
        ({"prompt": "x"}, "application/json", {"prompt": "x"}),
    ],
)
def test_bodies_are_json_whatever_the_content_type(value, content_type, expected):
    assert decode_openai_body(value, content_type) == expected


@pytest.mark.parametrize(
    "value, content_type, message",
    [
        (b"", None, "body: empty"),
        (b"{broken", "application/json", "body: not valid JSON"),
        ("just text", "text/plain", "body: not valid JSON"),
        (b"\xff", None, "body: not valid UTF-8"),
        ("a string", "application/json", "body: must be a JSON object"),
        ([1, 2], "application/json", "body: must be a JSON object"),
    ],
)
def test_bad_bodies(value, content_type, message):
    with pytest.raises(RequestError, match=message):
        decode_openai_body(value, content_type)
