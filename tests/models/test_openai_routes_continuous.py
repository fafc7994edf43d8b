"""The OpenAI routes through the handler in continuous-batching mode (tiny pair, float32, TorchServe's Context).

OpenAI requests join a running batch, one row per choice, and each answers
as the static handler answers the same request alone: the same choices, usage
and target logprobs, streamed (SSE) or not.
"""

from __future__ import annotations

import json

import pytest

from tests.models.test_serving import Frontend, handlers  # noqa: F401 (a fixture)
from tests.models.test_openai_routes import (
    CHAT,
    COMPLETIONS,
    MODEL,
    MODELS,
    NATIVE,
    call,
    sse_events,
    token_counts,
)

ATOL = 1e-4  # float32 logprobs, batched differently
MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def static_answer(static, model_dir, path: str, body: dict) -> dict:
    """The static handler's plain answer to the request alone."""
    plain = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
    (answer,), statuses, _ = call(static, model_dir, [(path, plain)])
    assert statuses == [200], answer
    return answer


def streamed_choices(text: str) -> tuple[dict, dict | None]:
    """An SSE body ending in [DONE] -> {index: {"text", "finish_reason", "logprobs"}}, and the usage chunk."""
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    choices: dict[int, dict] = {}
    usage = None
    for chunk in map(json.loads, events[:-1]):
        if not chunk["choices"]:
            usage = chunk["usage"]
        for part in chunk["choices"]:
            own = choices.setdefault(part["index"], {"text": "", "finish_reason": None, "logprobs": []})
            own["text"] += part["delta"]["content"] if "delta" in part else part["text"]
            own["finish_reason"] = part["finish_reason"] or own["finish_reason"]
            if part["logprobs"]:
                own["logprobs"] += part["logprobs"]["content"]
    return choices, usage


def assert_same_logprobs(entries: list[dict], expected: list[dict]) -> None:
    assert [e["token"] for e in entries] == [e["token"] for e in expected]
    assert [e["logprob"] for e in entries] == pytest.approx([e["logprob"] for e in expected], abs=ATOL)


def test_openai_requests_join_the_running_batch_and_answer_as_alone(handlers, tiny_models_dir):  # noqa: F811
    continuous, static = handlers
    # The tiny pair decodes this greedily to the length limit, without an EOS: a long request.
    long = {
        "prompt": "import json",
        "max_tokens": 60,
        "temperature": 0,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    later = {
        "native": (NATIVE, {"prompt": "def add(a, b):", "max_new_tokens": 8}),
        "completion": (COMPLETIONS, {"prompt": "def add(a, b):", "max_tokens": 8, "logprobs": 2, "temperature": 0}),
        "sampled": (COMPLETIONS, {"prompt": "Once upon", "max_tokens": 8, "temperature": 0.9, "seed": 5, "n": 2}),
        "chat-stream": (
            CHAT,
            {"messages": MESSAGES, "max_tokens": 8, "stream": True, "logprobs": True, "temperature": 0},
        ),
        "models": (MODELS, b""),
        "bad": (COMPLETIONS, {"prompt": "x", "presence_penalty": 3}),
    }
    frontend = Frontend(continuous, tiny_models_dir)
    frontend.submit("long", long, COMPLETIONS)
    frontend.call()
    frontend.call()
    for name, (path, body) in later.items():
        frontend.submit(name, body, path)
    frontend.run()

    choices, usage = streamed_choices(frontend.text("long"))
    alone = static_answer(static, tiny_models_dir, COMPLETIONS, long)
    assert [(c["text"], c["finish_reason"]) for _, c in sorted(choices.items())] == [
        (c["text"], c["finish_reason"]) for c in alone["choices"]
    ]
    assert token_counts(usage) == token_counts(alone["usage"])

    assert frontend.answer("native")["text"] == static_answer(static, tiny_models_dir, *later["native"])["text"]
    for name in ("completion", "sampled"):
        answer, expected = frontend.answer(name), static_answer(static, tiny_models_dir, *later[name])
        assert [c["text"] for c in answer["choices"]] == [c["text"] for c in expected["choices"]]
        assert token_counts(answer["usage"]) == token_counts(expected["usage"])
        if name == "completion":
            logprobs, expected_logprobs = answer["choices"][0]["logprobs"], expected["choices"][0]["logprobs"]
            assert logprobs["tokens"] == expected_logprobs["tokens"]
            assert logprobs["token_logprobs"] == pytest.approx(expected_logprobs["token_logprobs"], abs=ATOL)

    chat_choices, _ = streamed_choices(frontend.text("chat-stream"))
    expected = static_answer(static, tiny_models_dir, *later["chat-stream"])["choices"][0]
    assert chat_choices[0]["text"] == expected["message"]["content"]
    assert chat_choices[0]["finish_reason"] == expected["finish_reason"]
    assert_same_logprobs(chat_choices[0]["logprobs"], expected["logprobs"]["content"])

    assert frontend.answer("models")["data"][0]["id"] == MODEL
    assert frontend.statuses.pop("bad") == 400 and frontend.answer("bad")["error"]["param"] == "presence_penalty"
    assert set(frontend.statuses.values()) == {200}
    # The later requests left long before the long one finished.
    assert all(len(frontend.received[name]) < len(frontend.received["long"]) - 2 for name in later)
    assert not continuous.engine.has_unfinished_requests()


def test_a_vanished_client_has_all_its_choices_rows_aborted(handlers, tiny_models_dir):  # noqa: F811
    continuous, _ = handlers
    frontend = Frontend(continuous, tiny_models_dir)
    gone = {"prompt": "import json", "max_tokens": 60, "n": 3, "stream": True, "temperature": 0}
    frontend.submit("gone", gone, COMPLETIONS)
    # Long enough to outlive its first step: its later calls are where "gone" is found missing.
    frontend.submit("good", {"prompt": "Hello", "max_tokens": 16, "temperature": 0}, COMPLETIONS)
    frontend.call()
    assert continuous.engine.num_active_requests == 4
    del frontend.in_flight["gone"]  # its client disconnected: the frontend stops sending it
    frontend.run()
    assert not continuous.batcher.knows("gone")
    assert not continuous.engine.has_unfinished_requests(), "the three rows were freed"
    assert frontend.answer("good")["usage"]["completion_tokens"] > 0
