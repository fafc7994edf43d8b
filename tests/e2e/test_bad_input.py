"""End-to-end: every bad request gets a clear 4xx, good neighbours are untouched, the worker lives.

Also: a model whose handler config is wrong fails its registration visibly
and promptly instead of hanging, and leaves the server serving.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import yaml

from tests.conftest import REPO_ROOT, run_module

from .conftest import HTTP_TIMEOUT_S

JSON = {"Content-Type": "application/json"}
TEXT = {"Content-Type": "text/plain"}

# (body bytes, headers, field the error must name)
RAW_BAD = [
    (b'{"prompt": "x", ', JSON, "not valid JSON"),
    (b"\xff\xfe\x00 broken", TEXT, "UTF-8"),
    (b"[1, 2, 3]", JSON, "must be an object"),
    (b"42", JSON, "must be an object"),
    (b'"just a string"', JSON, "must be an object"),
    (b'{"prompt": "x", "temperature": NaN}', JSON, "temperature"),
    (b'{"prompt": "x", "temperature": Infinity}', JSON, "temperature"),
]
BAD = [
    ({}, "prompt/messages"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", "list"]}, "prompt"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt": "x", "max_new_tokens": 2.5}, "max_new_tokens"),
    ({"prompt": "x", "max_new_tokens": 100_000}, "max_new_tokens"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -1}, "top_k"),
    ({"prompt": "x", "num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"prompt": "x", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"prompt": "x", "seed": "7"}, "seed"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": "x", "stop": "END"}, "stop"),
    ({"prompt": "x", "stop": [1, 2]}, "stop"),
]
GOOD = [
    {"prompt": "def fibonacci(n):", "max_new_tokens": 12},
    {"prompt": "The weather today is", "max_new_tokens": 10, "temperature": 0.9, "seed": 4},
]


def post(server, data: bytes, headers: dict) -> requests.Response:
    return requests.post(
        f"{server.inference_url}/predictions/{server.model_name}", data=data, headers=headers, timeout=HTTP_TIMEOUT_S
    )


def worker_pids(server) -> list[int]:
    return sorted(w["pid"] for w in server.workers() if w["status"] == "READY")


@pytest.mark.parametrize("data, headers, field", RAW_BAD, ids=[r[2] + str(i) for i, r in enumerate(RAW_BAD)])
def test_malformed_bodies_get_400(server, data, headers, field):
    response = post(server, data, headers)
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]


@pytest.mark.parametrize("body, field", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_invalid_fields_get_400_naming_the_field(server, body, field):
    response = server.predict(body)
    assert response.status_code == 400, response.text
    assert response.json()["error"].startswith(field)


def test_prompt_too_long_for_the_context_is_413(server):
    response = server.predict({"prompt": "word " * 2000, "max_new_tokens": 8})
    assert response.status_code == 413, response.text
    assert "context" in response.json()["error"]


def test_bad_and_good_requests_in_shared_batches(server):
    pids_before = worker_pids(server)
    alone = [server.predict_ok(body) for body in GOOD]
    sends = [
        lambda: post(server, RAW_BAD[0][0], JSON),
        lambda: server.predict(GOOD[0]),
        lambda: server.predict(BAD[5][0]),
        lambda: server.predict(GOOD[1]),
        lambda: post(server, RAW_BAD[1][0], TEXT),
        lambda: server.predict(BAD[9][0]),
        lambda: server.predict(GOOD[0]),
        lambda: server.predict({"prompt": "word " * 2000}),
    ]
    with ThreadPoolExecutor(len(sends)) as pool:
        responses = list(pool.map(lambda send: send(), sends))
    assert [r.status_code for r in responses] == [400, 200, 400, 200, 400, 400, 200, 413]
    assert responses[1].json()["token_ids"] == alone[0]["token_ids"]
    assert responses[3].json()["token_ids"] == alone[1]["token_ids"]
    assert responses[6].json()["token_ids"] == alone[0]["token_ids"]
    assert worker_pids(server) == pids_before, "the worker must survive bad input"


def test_bad_handler_config_fails_registration_promptly(server, tiny_models_dir, tmp_path):
    config = yaml.safe_load((REPO_ROOT / "model-config" / "model-config.yaml").read_text())
    # Valid YAML and keys, so packaging accepts it; the worker fails when it loads the draft.
    config["handler"]["draft_model"] = "/nonexistent/draft-model"
    config_path = tmp_path / "bad.yaml"
    config_path.write_text(yaml.safe_dump(config))
    store = server.model_store
    run_module(
        "scripts.model_tools.package_mar",
        *("--model-name", "broken", "--config", str(config_path), "--export-path", str(store), "--force"),
        *("--target", str(tiny_models_dir / "target"), "--draft", str(tiny_models_dir / "draft")),
        check=True,
    )
    started = time.monotonic()
    try:
        response = requests.post(
            f"{server.management_url}/models",
            params={"url": "broken.mar", "model_name": "broken", "initial_workers": 1, "synchronous": "true"},
            timeout=240,
        )
        elapsed = time.monotonic() - started
        assert response.status_code >= 400, response.text
        assert elapsed < 240
        log = (server.log_dir / "model_log.log").read_text(errors="replace")
        assert "handler.draft_model" in log, "the worker log names the bad key"
    finally:
        requests.delete(f"{server.management_url}/models/broken", timeout=60)
        (store / "broken.mar").unlink(missing_ok=True)
    # The good model still serves.
    assert server.predict_ok({"prompt": "Hello", "max_new_tokens": 4})["usage"]["completion_tokens"] >= 1
