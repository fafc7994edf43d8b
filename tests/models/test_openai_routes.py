"""The OpenAI routes through the TorchServe handler with TorchServe's own Context, no server.

Requests carry the `url_path` header the way TorchServe 0.12's frontend sets
it; native and OpenAI requests share batches.
"""

from __future__ import annotations

import json

import pytest
from ts.context import Context, RequestProcessor

import handler.spec_handler as spec_handler_module
from handler.api.openai.requests import choice_seed
from handler.spec_handler import SpeculativeHandler
from tests.models.conftest import fail_batches_holding
from tests.models.test_spec_handler import HANDLER_SECTION

MODEL = "tiny"
COMPLETIONS, CHAT, MODELS, NATIVE = "v1/completions", "v1/chat/completions", "v1/models", ""


def make_context(model_dir, url_paths) -> Context:
    context = Context(
        MODEL,
        str(model_dir),
        {"model": {"modelName": MODEL}},
        4,
        None,
        "0.12.0",
        model_yaml_config={"batchSize": 4, "handler": dict(HANDLER_SECTION)},
    )
    context.request_processor = [
        RequestProcessor({"body": {"content-type": "application/json"}, "url_path": path}) for path in url_paths
    ]
    context.request_ids = {i: f"r{i}" for i in range(len(url_paths))}
    return context


@pytest.fixture(scope="module")
def handler(tiny_models_dir):
    handler = SpeculativeHandler()
    handler.initialize(make_context(tiny_models_dir, []))
    return handler


def call(handler, tiny_models_dir, requests):
    """requests: (url_path, body) pairs sent as one batch; returns answers, statuses and the context."""
    context = make_context(tiny_models_dir, [path for path, _ in requests])
    answers = handler.handle([{"body": body} for _, body in requests], context)
    return answers, [context.get_response_status(i)[0] for i in range(len(requests))], context


def native_answer(handler, tiny_models_dir, body):
    answers, statuses, _ = call(handler, tiny_models_dir, [(NATIVE, body)])
    assert statuses == [200], answers
    return answers[0]


def test_a_mixed_batch_answers_each_request_in_its_own_shape(handler, tiny_models_dir):
    sampled = {"prompt": "import os", "max_tokens": 10, "temperature": 0.9, "seed": 5, "n": 2}
    answers, statuses, context = call(
        handler,
        tiny_models_dir,
        [
            (NATIVE, {"prompt": "def add(a, b):", "max_new_tokens": 12}),
            # temperature 0: greedy, as the native route is by default (the OpenAI routes' default is 1).
            (COMPLETIONS, {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0}),
            (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 8, "temperature": 0}),
            (COMPLETIONS, sampled),
            (MODELS, b""),
            (COMPLETIONS, {"prompt": "x", "presence_penalty": 3}),
            ("v1/embeddings", {"input": "x"}),
        ],
    )
    assert statuses == [200, 200, 200, 200, 200, 400, 404]
    plain, completion, chat, two, models, bad, unknown = answers

    assert completion["object"] == "text_completion" and completion["model"] == MODEL
    assert completion["choices"][0]["text"] == plain["text"], "greedy: the same answer as the native route"
    assert completion["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    assert completion["usage"]["total_tokens"] == plain["usage"]["prompt_tokens"] + plain["usage"]["completion_tokens"]
    assert completion["speculative"]["num_speculative_tokens"] == 4
    assert context.get_response_content_type(1) == "application/json"

    native_chat = native_answer(
        handler, tiny_models_dir, {"messages": [{"role": "user", "content": "Hi"}], "max_new_tokens": 8}
    )
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": native_chat["text"]}

    # n = 2: two rows, each answering as a native request with its derived seed.
    assert [c["index"] for c in two["choices"]] == [0, 1]
    for choice in two["choices"]:
        seed = choice_seed(5, choice["index"])
        alone = native_answer(
            handler, tiny_models_dir, {"prompt": "import os", "max_new_tokens": 10, "temperature": 0.9, "seed": seed}
        )
        assert choice["text"] == alone["text"]
    assert two["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"], "the prompt counts once"

    assert models["data"][0]["id"] == MODEL
    assert bad["error"]["param"] == "presence_penalty" and bad["error"]["type"] == "invalid_request_error"
    assert unknown["error"]["code"] == "unknown_url"


def test_usage_of_n_choices_adds_up(handler, tiny_models_dir):
    body = {"prompt": "Hello", "max_tokens": 6, "temperature": 1.0, "seed": 1, "n": 3}
    (answer,), _, _ = call(handler, tiny_models_dir, [(COMPLETIONS, body)])
    (single,), _, _ = call(handler, tiny_models_dir, [(COMPLETIONS, {**body, "n": 1})])
    assert answer["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"], "the prompt counts once"
    assert answer["choices"][0]["text"] == single["choices"][0]["text"]
    lengths = [
        native_answer(
            handler,
            tiny_models_dir,
            {"prompt": "Hello", "max_new_tokens": 6, "temperature": 1.0, "seed": choice_seed(1, i)},
        )["usage"]["completion_tokens"]
        for i in range(3)
    ]
    assert answer["usage"]["completion_tokens"] == sum(lengths)
    assert answer["speculative"]["target_forward_passes"] >= 3


def token_counts(usage: dict) -> dict:
    """Usage without `prompt_tokens_details`: what the prefix cache held depends on the requests before."""
    return {key: value for key, value in usage.items() if key != "prompt_tokens_details"}


def sse_events(text: str) -> list:
    return [block[len("data: ") :] for block in text.split("\n\n") if block]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_streamed_events_join_to_the_plain_answer(handler, tiny_models_dir, monkeypatch, path):
    sent = []
    monkeypatch.setattr(
        spec_handler_module,
        "send_intermediate_predict_response",
        lambda ret, ids, message, code, context: sent.extend(ret.values()),
    )
    prompt = {"messages": [{"role": "user", "content": "Tell me"}]} if path == CHAT else {"prompt": "def add(a, b):"}
    body = {**prompt, "max_tokens": 24, "n": 2, "temperature": 0.8, "seed": 3}
    (plain,), _, _ = call(handler, tiny_models_dir, [(path, body)])
    (final,), statuses, context = call(
        handler, tiny_models_dir, [(path, {**body, "stream": True, "stream_options": {"include_usage": True}})]
    )
    assert statuses == [200] and context.get_response_content_type(0) == "text/event-stream"
    assert sent, "chunks go out while the rows run"
    events = sse_events("".join(sent) + final)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[-1]["choices"] == [] and token_counts(chunks[-1]["usage"]) == token_counts(plain["usage"])
    # The plain request finished first: the prefix cache held all its prompt but the last token (recomputed).
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == plain["usage"]["prompt_tokens"] - 1
    for choice in plain["choices"]:
        own = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == choice["index"]]
        if path == CHAT:
            assert "".join(c["delta"]["content"] for c in own) == choice["message"]["content"]
        else:
            assert "".join(c["text"] for c in own) == choice["text"]
        assert own[-1]["finish_reason"] == choice["finish_reason"]


def test_a_model_failure_is_an_openai_error_for_that_request_only(handler, tiny_models_dir, monkeypatch):
    fail_batches_holding(handler.engine, monkeypatch, max_new_tokens=13)
    answers, statuses, _ = call(
        handler,
        tiny_models_dir,
        [(COMPLETIONS, {"prompt": "a", "max_tokens": 5}), (COMPLETIONS, {"prompt": "b", "max_tokens": 13, "n": 2})],
    )
    assert statuses == [200, 500]
    assert answers[0]["choices"][0]["finish_reason"] in ("stop", "length")
    assert answers[1]["error"]["type"] == "server_error" and "generation failed" in answers[1]["error"]["message"]


def test_a_failure_mid_stream_ends_the_stream_with_an_error_event(handler, tiny_models_dir, monkeypatch):
    sent = []
    monkeypatch.setattr(
        spec_handler_module,
        "send_intermediate_predict_response",
        lambda ret, ids, message, code, context: sent.extend(ret.values()),
    )
    real_generate = handler.engine.generate

    def generate_then_fail(requests, on_tokens=None):
        def failing_on_tokens(n, tokens, row):
            on_tokens(n, tokens, row)
            # Once a chunk went out: a step's tokens may all be held back (text not yet complete).
            if sent:
                raise RuntimeError("simulated failure after the first chunk")

        return real_generate(requests, on_tokens=failing_on_tokens)

    monkeypatch.setattr(handler.engine, "generate", generate_then_fail)
    body = {"prompt": "def add(a, b):", "max_tokens": 24, "stream": True}
    (final,), statuses, _ = call(handler, tiny_models_dir, [(COMPLETIONS, body)])
    assert sent, "a chunk went out before the failure"
    assert statuses == [200], "the status was sent with the first chunk"
    events = sse_events(final)
    assert events[-1] == "[DONE]"
    assert json.loads(events[0])["error"]["message"] == "server: generation failed mid-stream"
