"""End-to-end: the packaged handler behind a real TorchServe (see conftest.py).

The model config used here sets batchSize 4 and maxBatchDelay 200 ms, so
requests sent together from threads are decoded in shared batches.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from handler.schema import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, SPECULATIVE_KEYS

# Different lengths and budgets, so shared batches are ragged.
CONCURRENT_REQUESTS = [
    {"prompt": "The quick brown fox", "max_new_tokens": 16},
    {"prompt": "def fibonacci(n):", "max_new_tokens": 24},
    {"prompt": "Once upon a time there was a little robot", "max_new_tokens": 8},
    {"prompt": "Hello!", "max_new_tokens": 20},
    {"prompt": "import json\nimport os\n", "max_new_tokens": 12},
    {"prompt": "The weather today is", "max_new_tokens": 16, "num_speculative_tokens": 2},
    {"messages": [{"role": "user", "content": "Tell me a story."}], "max_new_tokens": 16},
    {"prompt": "A journey of a thousand miles", "max_new_tokens": 10, "num_speculative_tokens": 7},
]

BAD_REQUESTS = [
    {"prompt": "x", "temperature": -1},
    {"prompt": "x", "max_new_tokens": 0},
    {"prompt": "x", "num_speculative_tokens": 17},  # above max_num_speculative_tokens
    {"prompt": "x", "top_p": 0},
    {"prompt": ""},
    {"messages": "not a list"},
    {"prompt": "x", "no_such_field": 1},
]


def send_concurrently(server, bodies: list) -> list[requests.Response]:
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        return list(pool.map(server.predict, bodies))


def test_json_request(server):
    answer = server.predict_ok({"prompt": "The quick brown fox", "max_new_tokens": 16})

    assert isinstance(answer["text"], str)
    assert answer["finish_reason"] in {FINISH_LENGTH, FINISH_EOS, FINISH_STOP}
    assert all(isinstance(token_id, int) for token_id in answer["token_ids"])
    assert 1 <= len(answer["token_ids"]) <= 16
    if answer["finish_reason"] == "length":
        assert len(answer["token_ids"]) == 16
    assert answer["usage"]["completion_tokens"] == len(answer["token_ids"])
    assert answer["usage"]["prompt_tokens"] > 0
    stats = answer["speculative"]
    assert SPECULATIVE_KEYS <= set(stats), stats
    assert stats["num_speculative_tokens"] == 4  # the model-config default
    assert 0 <= stats["accepted_tokens"] <= stats["draft_tokens"]
    assert 0.0 <= stats["acceptance_rate"] <= 1.0
    assert stats["target_forward_passes"] >= 1


@pytest.mark.parametrize("content_type", ["text/plain; charset=utf-8", None])
def test_plain_text_body_is_the_prompt(server, content_type):
    prompt = "Once upon a time"
    headers = {"Content-Type": content_type} if content_type else {}
    as_text = server.predict_ok(prompt.encode("utf-8"), headers=headers)
    as_json = server.predict_ok({"prompt": prompt})
    assert as_text["token_ids"] == as_json["token_ids"]
    for key in ("prompt_tokens", "completion_tokens"):
        assert as_text["usage"][key] == as_json["usage"][key]
    # The same prompt again, after the first finished: all of it was cached but its last token (recomputed).
    assert as_json["usage"]["cached_tokens"] == as_json["usage"]["prompt_tokens"] - 1


def test_chat_messages(server):
    answer = server.predict_ok({"messages": [{"role": "user", "content": "Hello, who are you?"}], "max_new_tokens": 8})
    assert answer["usage"]["completion_tokens"] == len(answer["token_ids"]) >= 1


def test_concurrent_greedy_requests_match_solo(server):
    solo = [server.predict_ok(body)["token_ids"] for body in CONCURRENT_REQUESTS]

    responses = send_concurrently(server, CONCURRENT_REQUESTS)

    for body, response, expected in zip(CONCURRENT_REQUESTS, responses, solo):
        assert response.status_code == 200, (
            f"{body} -> HTTP {response.status_code}: {response.text}\n{server.log_tail()}"
        )
        assert response.json()["token_ids"] == expected, f"batched != solo for {body}"


def test_bad_requests_fail_alone(server):
    good = CONCURRENT_REQUESTS[:4]
    solo = [server.predict_ok(body)["token_ids"] for body in good]
    # Interleaved, so that bad and good requests share batches.
    bodies = [body for pair in zip(BAD_REQUESTS, good + good) for body in pair]

    responses = send_concurrently(server, bodies)

    for body, response in zip(bodies, responses):
        if body in BAD_REQUESTS:
            assert response.status_code == 400, f"{body} -> {response.status_code}: {response.text}"
            assert isinstance(response.json().get("error"), str), response.text
        else:
            assert response.status_code == 200, (
                f"{body} -> HTTP {response.status_code}: {response.text}\n{server.log_tail()}"
            )
            assert response.json()["token_ids"] == solo[good.index(body)]


def test_seeded_sampling_is_reproducible(server):
    body = {"prompt": "The quick brown fox", "temperature": 0.8, "seed": 7, "max_new_tokens": 24}
    first = server.predict_ok(body)
    second = server.predict_ok(body)
    assert first["token_ids"] == second["token_ids"]

    # The same seed gives the same tokens when the request shares a batch.
    responses = send_concurrently(server, [body] + CONCURRENT_REQUESTS[:3])
    assert all(response.status_code == 200 for response in responses), server.log_tail()
    assert responses[0].json()["token_ids"] == first["token_ids"]


def test_stop_string_ends_generation(server):
    full = server.predict_ok({"prompt": "The quick brown fox", "max_new_tokens": 24})
    text = full["text"]
    # Two ASCII letters from the middle of the answer; random models also
    # emit partial UTF-8, which makes poor stop strings.
    stop = next(
        (text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2].isascii() and text[i : i + 2].isalpha()),
        None,
    )
    if stop is None:
        pytest.skip(f"greedy output {text!r} has no usable stop string")

    stopped = server.predict_ok({"prompt": "The quick brown fox", "max_new_tokens": 24, "stop": [stop]})

    assert stopped["finish_reason"] == "stop", stopped
    assert text.startswith(stopped["text"])
    assert len(stopped["text"]) <= text.index(stop) + len(stop)


def test_model_config_reached_torchserve(server):
    response = server.get(f"{server.management_url}/models/{server.model_name}")
    assert response.status_code == 200, response.text
    description = response.json()[0]
    assert description["batchSize"] == 4
    assert description["maxBatchDelay"] == 200
    assert any(worker["status"] == "READY" for worker in description["workers"]), description


def test_prometheus_metrics(server):
    server.predict_ok({"prompt": "Hello", "max_new_tokens": 4})
    response = server.get(f"{server.metrics_url}/metrics")
    assert response.status_code == 200
    # TorchServe's own metrics and the handler's (declared in metrics.yaml).
    for name in ("ts_inference_requests_total", "SpecRequests", "SpecAcceptedTokens"):
        assert name in response.text, f"{name} missing from /metrics:\n{response.text[:3000]}"


@pytest.mark.parametrize("url", ["https://example.com/evil.mar", "file:///somewhere/else/evil.mar"])
def test_allowed_urls_refuse_outside_archives(server, url):
    # Refused by config.properties' allowed_urls before anything is fetched.
    response = requests.post(f"{server.management_url}/models", params={"url": url}, timeout=30)
    assert response.status_code == 404, response.text
    assert "does not match any allowed URL" in response.json()["message"]
