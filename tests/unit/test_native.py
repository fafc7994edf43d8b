"""Request parsing and validation: every bad request is a RequestError naming the field."""

from __future__ import annotations

import dataclasses
import json

import pytest

from handler.api.native import RequestError, decode_body, parse_request
from handler.config import HandlerConfig, SamplingParams

CONFIG = HandlerConfig(
    num_speculative_tokens=4, max_num_speculative_tokens=8, max_new_tokens=32, max_new_tokens_limit=64
)
MAX_CONTEXT = 512


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


def parse(body, tokenizer, config=CONFIG):
    return parse_request(body, config, tokenizer, MAX_CONTEXT)


def test_defaults_come_from_the_config(tokenizer):
    parsed = parse({"prompt": "hello"}, tokenizer)
    request = parsed.generation
    assert request.prompt_ids == tuple(tokenizer("hello")["input_ids"])
    assert request.max_new_tokens == 32 and request.num_speculative_tokens == 4
    assert request.sampling == SamplingParams() and request.seed is None and request.stop == ()
    assert parsed.stream is False


def test_all_fields(tokenizer):
    parsed = parse(
        {
            "prompt": "hello",
            "max_new_tokens": 10,
            "temperature": 0.5,
            "top_k": 7,
            "top_p": 0.9,
            "seed": 3,
            "num_speculative_tokens": 0,
            "stop": ["\n\n", "END"],
            "stream": True,
        },
        tokenizer,
    )
    request = parsed.generation
    assert (request.max_new_tokens, request.seed, request.num_speculative_tokens) == (10, 3, 0)
    assert request.sampling == SamplingParams(0.5, 7, 0.9)
    assert request.stop == ("\n\n", "END") and parsed.stream


def test_messages_use_the_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    request = parse({"messages": messages}, tokenizer).generation
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(request.prompt_ids) == rendered
    assert rendered.rstrip().endswith("<|im_start|>assistant")


@pytest.mark.parametrize(
    "body, field",
    [
        ({}, "prompt/messages"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt/messages"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}]}, r"messages\[0\]\.content"),
        ({"messages": [{"role": "user", "content": 5}]}, r"messages\[0\]\.content"),
        ({"messages": ["hi"]}, r"messages\[0\]"),
        ({"prompt": "a", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "a", "max_new_tokens": 65}, "max_new_tokens"),
        ({"prompt": "a", "max_new_tokens": 2.5}, "max_new_tokens"),
        ({"prompt": "a", "max_new_tokens": "10"}, "max_new_tokens"),
        ({"prompt": "a", "temperature": -1}, "temperature"),
        ({"prompt": "a", "temperature": float("nan")}, "temperature"),
        ({"prompt": "a", "temperature": float("inf")}, "temperature"),
        ({"prompt": "a", "temperature": "hot"}, "temperature"),
        ({"prompt": "a", "top_p": 0}, "top_p"),
        ({"prompt": "a", "top_p": 1.01}, "top_p"),
        ({"prompt": "a", "top_k": -1}, "top_k"),
        ({"prompt": "a", "min_p": -0.5}, "min_p"),
        ({"prompt": "a", "min_p": 1.01}, "min_p"),
        ({"prompt": "a", "min_p": "0.1"}, "min_p"),
        ({"prompt": "a", "presence_penalty": 2.01}, "presence_penalty"),
        ({"prompt": "a", "presence_penalty": None}, "presence_penalty"),
        ({"prompt": "a", "frequency_penalty": -2.5}, "frequency_penalty"),
        ({"prompt": "a", "frequency_penalty": float("inf")}, "frequency_penalty"),
        ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "a", "repetition_penalty": 11}, "repetition_penalty"),
        ({"prompt": "a", "repetition_penalty": True}, "repetition_penalty"),
        ({"prompt": "a", "logit_bias": [[5, 1.0]]}, "logit_bias"),
        ({"prompt": "a", "logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"prompt": "a", "logit_bias": {"5": -101}}, "logit_bias"),
        ({"prompt": "a", "logit_bias": {"5": "up"}}, "logit_bias"),
        ({"prompt": "a", "logit_bias": {"5": float("nan")}}, "logit_bias"),
        ({"prompt": "a", "logit_bias": {"-1": 1}}, "logit_bias"),
        ({"prompt": "a", "logit_bias": {"05": 1}}, "logit_bias"),
        ({"prompt": "a", "logit_bias": {"hello": 1}}, "logit_bias"),
        ({"prompt": "a", "logit_bias": {"5": 1, 5: 2}}, "logit_bias"),
        ({"prompt": "a", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"prompt": "a", "logit_bias": {"12345678901": 1}}, "logit_bias"),
        ({"prompt": "a", "num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"prompt": "a", "num_speculative_tokens": 9}, "num_speculative_tokens"),
        ({"prompt": "a", "seed": 1.5}, "seed"),
        ({"prompt": "a", "seed": "7"}, "seed"),
        ({"prompt": "a", "seed": -1}, "seed"),
        ({"prompt": "a", "stop": "END"}, "stop"),
        ({"prompt": "a", "stop": [1]}, "stop"),
        ({"prompt": "a", "stop": [""]}, "stop"),
        ({"prompt": "a", "stream": "yes"}, "stream"),
        ({"prompt": "a", "temprature": 1}, "temprature"),
    ],
)
def test_bad_requests_name_the_field(tokenizer, body, field):
    with pytest.raises(RequestError, match=f"^{field}") as error:
        parse(body, tokenizer)
    assert error.value.status == 400


def test_penalties_min_p_and_logit_bias(tokenizer):
    body = {
        "prompt": "hello",
        "temperature": 0.8,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.3,
        "logit_bias": {"7": -100, "3": 2.5, 0: 1},
    }
    sampling = parse(body, tokenizer).generation.sampling
    assert sampling == SamplingParams(
        temperature=0.8,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.3,
        logit_bias=((0, 1.0), (3, 2.5), (7, -100.0)),
    )
    # Left out: the config's defaults; the config has no logit_bias.
    config = dataclasses.replace(CONFIG, sampling=SamplingParams(repetition_penalty=1.1, min_p=0.2))
    assert parse({"prompt": "hello"}, tokenizer, config).generation.sampling == config.sampling
    both = parse({"prompt": "hello", "repetition_penalty": 1.0, "logit_bias": {"1": 1}}, tokenizer, config)
    assert both.generation.sampling == SamplingParams(min_p=0.2, logit_bias={1: 1.0})


def test_logit_bias_ids_must_be_in_the_vocabulary(tokenizer):
    last = len(tokenizer) - 1  # the added tokens count
    assert parse({"prompt": "a", "logit_bias": {str(last): 5}}, tokenizer).generation.sampling.logit_bias == (
        (last, 5.0),
    )
    with pytest.raises(RequestError, match=f"^logit_bias: token {last + 1} is not in") as error:
        parse({"prompt": "a", "logit_bias": {"1": 5, str(last + 1): 5}}, tokenizer)
    assert error.value.status == 400


def test_prompt_too_long_for_the_context_is_413(tokenizer):
    long_prompt = "word " * 600
    with pytest.raises(RequestError, match="context") as error:
        parse({"prompt": long_prompt}, tokenizer)
    assert error.value.status == 413


@pytest.mark.parametrize(
    "value, content_type, expected",
    [
        ({"prompt": "hi"}, "application/json", {"prompt": "hi"}),
        (b'{"prompt": "hi"}', None, {"prompt": "hi"}),
        (bytearray(b'{"prompt": "hi"}'), "application/octet-stream", {"prompt": "hi"}),
        (b"write a haiku", "text/plain", {"prompt": "write a haiku"}),
        ("write a haiku", "text/plain", {"prompt": "write a haiku"}),
        (b"42", "text/plain", {"prompt": "42"}),
        ("caf\u00e9".encode(), None, {"prompt": "caf\u00e9"}),
    ],
)
def test_decode_body_accepts_json_objects_and_plain_text(value, content_type, expected):
    assert decode_body(value, content_type) == expected


@pytest.mark.parametrize(
    "value, content_type, message",
    [
        (b"\xff\xfe not utf-8", None, "not valid UTF-8"),
        (b'{"prompt": ', "application/json", "not valid JSON"),
        (b"[1, 2]", None, "must be an object"),
        ([1, 2], "application/json", "must be an object"),
        (7, "application/json", "must be an object"),
        (b'"just a string"', "application/json", "must be an object"),
        ("already parsed by TorchServe", "application/json", "must be an object"),
    ],
)
def test_decode_body_rejects_what_is_not_a_request(value, content_type, message):
    with pytest.raises(RequestError, match=message) as error:
        decode_body(value, content_type)
    assert error.value.status == 400
    json.dumps({"error": str(error.value)})  # the message must be JSON-serialisable


def test_a_request_may_opt_out_of_the_shared_suffix_tree_but_not_into_one_the_server_closed(tokenizer):
    assert parse({"prompt": "a"}, tokenizer).generation.suffix_share_across_requests is None
    for value in (False, True):
        request = parse({"prompt": "a", "suffix_share_across_requests": value}, tokenizer).generation
        assert request.suffix_share_across_requests is value
    with pytest.raises(RequestError, match="suffix_share_across_requests"):
        parse({"prompt": "a", "suffix_share_across_requests": "no"}, tokenizer)
    closed = dataclasses.replace(CONFIG, suffix_share_across_requests=False)
    assert parse({"prompt": "a", "suffix_share_across_requests": False}, tokenizer, closed).generation
    with pytest.raises(RequestError, match="suffix_share_across_requests") as error:
        parse({"prompt": "a", "suffix_share_across_requests": True}, tokenizer, closed)
    assert error.value.status == 400 and "opt out" in str(error.value)
    assert parse({"prompt": "a", "drafter": "suffix"}, tokenizer).generation.drafter == "suffix"


def test_speculative_tree_is_auto_or_off_and_off_only_narrows(tokenizer):
    assert parse({"prompt": "a"}, tokenizer).generation.speculative_tree is None
    assert parse({"prompt": "a", "speculative_tree": "auto"}, tokenizer).generation.speculative_tree is None
    assert parse({"prompt": "a", "speculative_tree": "off"}, tokenizer).generation.speculative_tree is False
    for bad in ("on", True, 1):
        with pytest.raises(RequestError, match="speculative_tree") as error:
            parse({"prompt": "a", "speculative_tree": bad}, tokenizer)
        assert error.value.status == 400
    # A server with trees off keeps them off: the request defaults to the config's setting.
    chains = dataclasses.replace(CONFIG, speculative_tree="off")
    assert parse({"prompt": "a"}, tokenizer, chains).generation.speculative_tree is False
