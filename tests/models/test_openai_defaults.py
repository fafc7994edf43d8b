"""The OpenAI routes' sampling defaults through the handler: a target whose generation_config.json sets a
temperature samples with it where a request leaves the field out, as vLLM does; the native route stays greedy.
"""

from __future__ import annotations

import json
import shutil

import pytest

from handler.api.openai.requests import OPENAI_SAMPLING_DEFAULTS
from handler.spec_handler import SpeculativeHandler
from tests.models.test_openai_routes import CHAT, COMPLETIONS, MODEL, call, make_context, native_answer

RESPONSES = "v1/responses"
GENERATION_CONFIG = {"do_sample": True, "temperature": 0.7, "top_p": 0.9}
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def tuned_models_dir(tiny_models_dir, tmp_path_factory):
    """The tiny pair, its target's generation_config.json setting a temperature and a top_p."""
    out = tmp_path_factory.mktemp("tuned-models")
    for name in ("target", "draft"):
        shutil.copytree(tiny_models_dir / name, out / name)
    path = out / "target" / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **GENERATION_CONFIG}))
    return out


@pytest.fixture(scope="module")
def handler(tuned_models_dir):
    handler = SpeculativeHandler()
    handler.initialize(make_context(tuned_models_dir, []))
    return handler


def test_the_handler_reads_the_generation_config_once_at_load(handler):
    assert handler.openai_defaults == {**OPENAI_SAMPLING_DEFAULTS, "temperature": 0.7, "top_p": 0.9}


def test_a_left_out_temperature_follows_the_generation_config(handler, tuned_models_dir):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "seed": 3}
    (completion,), statuses, _ = call(handler, tuned_models_dir, [(COMPLETIONS, body)])
    assert statuses == [200]
    tuned = native_answer(
        handler, tuned_models_dir, {"prompt": PROMPT, "max_new_tokens": 16, "seed": 3, "temperature": 0.7, "top_p": 0.9}
    )
    openai_s = native_answer(
        handler, tuned_models_dir, {"prompt": PROMPT, "max_new_tokens": 16, "seed": 3, "temperature": 1.0}
    )
    # A seeded answer depends on its settings: the generation config's, not OpenAI's (which differ here).
    assert tuned["text"] != openai_s["text"], "the check needs the two settings to answer differently"
    assert completion["choices"][0]["text"] == tuned["text"]

    messages = [{"role": "user", "content": "Hi"}]
    (chat,), _, _ = call(handler, tuned_models_dir, [(CHAT, {"messages": messages, "max_tokens": 12, "seed": 4})])
    native_chat = native_answer(
        handler,
        tuned_models_dir,
        {"messages": messages, "max_new_tokens": 12, "seed": 4, "temperature": 0.7, "top_p": 0.9},
    )
    assert chat["choices"][0]["message"]["content"] == native_chat["text"]

    (response,), _, _ = call(
        handler, tuned_models_dir, [(RESPONSES, {"input": "Hi", "max_output_tokens": 12, "seed": 4})]
    )
    assert (response["temperature"], response["top_p"]) == (0.7, 0.9)
    assert response["output_text"] == native_chat["text"]


def test_the_request_s_own_temperature_wins_and_the_native_route_stays_greedy(handler, tuned_models_dir):
    greedy = native_answer(handler, tuned_models_dir, {"prompt": PROMPT, "max_new_tokens": 16, "temperature": 0})
    left_out = native_answer(handler, tuned_models_dir, {"prompt": PROMPT, "max_new_tokens": 16, "seed": 3})
    assert left_out["text"] == greedy["text"], "the native route takes the config's sampling: greedy"
    body = {"prompt": PROMPT, "max_tokens": 16, "seed": 3, "temperature": 0}
    (completion,), _, _ = call(handler, tuned_models_dir, [(COMPLETIONS, body)])
    assert completion["choices"][0]["text"] == greedy["text"]
