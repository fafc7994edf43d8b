"""The prefix cache through the handler: a repeated prompt reports its cached tokens, and the metrics count them.

Both schedules, native and OpenAI routes, with TorchServe's own Context and the
tiny pair (the shipped default: the cache on, its budget automatic). Each
handler here is fresh, so the first time a prompt is sent nothing is cached.
"""

from __future__ import annotations

import pytest

from handler.spec_handler import SpeculativeHandler
from tests.models.test_spec_handler import RecordingMetrics
from tests.models.test_serving import Frontend
from tests.models.test_serving import make_context as continuous_context
from tests.models.test_openai_routes import CHAT, NATIVE, call
from tests.models.test_openai_routes import make_context as static_context

# Long enough that its prefill is most of the work, short enough for the tiny pair's context.
LONG_PROMPT = (
    "You are a careful code reviewer. Read the function below and list every bug you find, "
    "then propose a corrected version with tests.\n\n"
    "def median(values):\n    values.sort()\n    middle = len(values) / 2\n    return values[middle]\n"
)
NATIVE_BODY = {"prompt": LONG_PROMPT, "max_new_tokens": 6}
CHAT_BODY = {"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 6, "temperature": 0}


@pytest.fixture()
def static_handler(tiny_models_dir):
    handler = SpeculativeHandler()
    handler.initialize(static_context(tiny_models_dir, []))
    assert handler.engine.prefix_cache is not None, "on by default"
    return handler


def cached_tokens(path: str, answer: dict) -> int:
    usage = answer["usage"]
    return usage["cached_tokens"] if path == NATIVE else usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("path, body", [(NATIVE, NATIVE_BODY), (CHAT, CHAT_BODY)])
def test_a_repeated_prompt_is_served_from_the_cache_and_the_metrics_count_it(
    static_handler, tiny_models_dir, monkeypatch, path, body
):
    metrics = RecordingMetrics()
    sent = []
    for _ in range(2):  # the first request finishes before the second arrives
        context = static_context(tiny_models_dir, [path])
        context.metrics = metrics
        (answer,) = static_handler.handle([{"body": body}], context)
        assert context.get_response_status(0)[0] == 200, answer
        sent.append(answer)
    first, second = sent
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > 40 and second["usage"]["prompt_tokens"] == prompt_tokens
    assert cached_tokens(path, first) == 0
    # All the prompt but its last token, which the first verify pass computes.
    assert cached_tokens(path, second) == prompt_tokens - 1
    assert second["usage"]["completion_tokens"] == first["usage"]["completion_tokens"]

    assert sum(metrics.values["prefix_cache_queries"]) == 2 * prompt_tokens
    assert sum(metrics.values["prefix_cache_hits"]) == prompt_tokens - 1
    assert metrics.values["SpecPrefixCacheBytes"][-1] == static_handler.engine.prefix_cache_stats.num_bytes > 0
    assert "SpecPrefixCacheEvictions" not in metrics.values, "nothing to evict under the automatic budget"


def test_a_request_beside_a_cached_one_counts_only_its_own_hits(static_handler, tiny_models_dir):
    call(static_handler, tiny_models_dir, [(NATIVE, NATIVE_BODY)])
    context = static_context(tiny_models_dir, [NATIVE, NATIVE])
    context.metrics = metrics = RecordingMetrics()
    fresh = {"prompt": "import collections", "max_new_tokens": 4}
    repeated, new = static_handler.handle([{"body": NATIVE_BODY}, {"body": fresh}], context)
    assert repeated["usage"]["cached_tokens"] == repeated["usage"]["prompt_tokens"] - 1
    assert new["usage"]["cached_tokens"] == 0
    assert sum(metrics.values["prefix_cache_queries"]) == repeated["usage"]["prompt_tokens"] + new["usage"]["prompt_tokens"]
    assert sum(metrics.values["prefix_cache_hits"]) == repeated["usage"]["cached_tokens"]


def test_continuous_batching_reports_the_cache_per_request_and_records_it_per_step(tiny_models_dir):
    handler = SpeculativeHandler()
    handler.initialize(continuous_context(tiny_models_dir, True))
    frontend = Frontend(handler, tiny_models_dir)
    frontend.metrics = metrics = RecordingMetrics()
    for name in ("first", "second"):  # one after the other: the first has left the batch
        frontend.submit(f"native-{name}", NATIVE_BODY)
        frontend.run()
    for name in ("first", "second"):
        frontend.submit(f"chat-{name}", CHAT_BODY, CHAT)
        frontend.run()

    native = [frontend.answer(f"native-{name}")["usage"] for name in ("first", "second")]
    chat = [frontend.answer(f"chat-{name}")["usage"] for name in ("first", "second")]
    assert native[0]["cached_tokens"] == 0
    assert native[1]["cached_tokens"] == native[1]["prompt_tokens"] - 1
    assert chat[0]["prompt_tokens_details"]["cached_tokens"] == 0, "the chat template's prompt starts otherwise"
    assert chat[1]["prompt_tokens_details"]["cached_tokens"] == chat[1]["prompt_tokens"] - 1

    prompt_tokens = 2 * native[0]["prompt_tokens"] + 2 * chat[0]["prompt_tokens"]
    assert sum(metrics.values["prefix_cache_queries"]) == prompt_tokens
    assert sum(metrics.values["prefix_cache_hits"]) == native[1]["cached_tokens"] + chat[1]["prompt_tokens"] - 1
    # The gauge goes out when the bytes change (requests joining or leaving), not at every step.
    assert len(metrics.values["SpecPrefixCacheBytes"]) < frontend.steps
    assert metrics.values["SpecPrefixCacheBytes"][-1] == handler.engine.prefix_cache_stats.num_bytes > 0
    assert len(metrics.values["SpecTimeToFirstTokenSeconds"]) == 4, "every request, none of them streamed"


def test_with_the_cache_off_nothing_is_cached_or_recorded(tiny_models_dir):
    handler = SpeculativeHandler()
    context = static_context(tiny_models_dir, [])
    context.model_yaml_config["handler"]["prefix_cache"] = False
    handler.initialize(context)
    assert handler.engine.prefix_cache is None
    metrics = RecordingMetrics()
    for _ in range(2):
        context = static_context(tiny_models_dir, [NATIVE])
        context.metrics = metrics
        (answer,) = handler.handle([{"body": NATIVE_BODY}], context)
        assert answer["usage"]["cached_tokens"] == 0
    assert not {"prefix_cache_queries", "prefix_cache_hits", "SpecPrefixCacheBytes"} & set(metrics.values)
