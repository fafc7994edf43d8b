"""The TorchServe handler with TorchServe's own Context, no server: loading, batches, per-request status."""

from __future__ import annotations

import pytest
from ts.context import Context, RequestProcessor

from handler.spec_handler import SpeculativeHandler

HANDLER_SECTION = {
    "target_model": "target",
    "draft_model": "draft",
    "dtype": "float32",
    "num_speculative_tokens": 4,
    "max_new_tokens": 16,
    "max_new_tokens_limit": 64,
}


def make_context(model_dir, handler_section=None) -> Context:
    yaml_config = {"batchSize": 4, "handler": dict(HANDLER_SECTION if handler_section is None else handler_section)}
    return Context("tiny", str(model_dir), {"model": {"modelName": "tiny"}}, 4, None, "0.12.0", model_yaml_config=yaml_config)


def with_requests(context: Context, content_types) -> Context:
    context.request_processor = [RequestProcessor({"body": {"content-type": ct}}) for ct in content_types]
    return context


@pytest.fixture(scope="module")
def handler(tiny_models_dir):
    handler = SpeculativeHandler()
    handler.initialize(make_context(tiny_models_dir))
    return handler


def call(handler, tiny_models_dir, bodies, content_types=None):
    content_types = content_types or ["application/json"] * len(bodies)
    context = with_requests(make_context(tiny_models_dir), content_types)
    answers = handler.handle([{"body": body} for body in bodies], context)
    statuses = [context.get_response_status(i)[0] for i in range(len(bodies))]
    return answers, statuses


def test_answer_has_the_documented_fields(handler, tiny_models_dir):
    answers, statuses = call(handler, tiny_models_dir, [{"prompt": "def add(a, b):", "max_new_tokens": 12}])
    answer = answers[0]
    assert statuses == [200]
    assert set(answer) == {"text", "token_ids", "finish_reason", "usage", "speculative"}
    assert answer["finish_reason"] in ("length", "eos", "stop")
    assert answer["usage"]["completion_tokens"] == len(answer["token_ids"]) <= 12
    assert set(answer["speculative"]) == {
        "num_speculative_tokens",
        "draft_tokens",
        "accepted_tokens",
        "acceptance_rate",
        "target_forward_passes",
        "mean_accepted_length",
        "fell_back_to_target_only",
    }
    assert answer["speculative"]["num_speculative_tokens"] == 4


def test_bad_request_fails_alone_and_good_ones_match_their_solo_answers(handler, tiny_models_dir):
    good = [{"prompt": "import numpy as np", "max_new_tokens": 10}, {"prompt": "Hello", "max_new_tokens": 14, "num_speculative_tokens": 2}]
    solo = [call(handler, tiny_models_dir, [body])[0][0] for body in good]
    bodies = [good[0], {"prompt": "x", "top_p": 2}, b"\xff\xfe", good[1]]
    answers, statuses = call(handler, tiny_models_dir, bodies, ["application/json", "application/json", "text/plain", "application/json"])
    assert statuses == [200, 400, 400, 200]
    assert "top_p" in answers[1]["error"] and "UTF-8" in answers[2]["error"]
    assert answers[0]["token_ids"] == solo[0]["token_ids"]
    assert answers[3]["token_ids"] == solo[1]["token_ids"]


def test_plain_text_body_is_the_prompt(handler, tiny_models_dir):
    answers, _ = call(handler, tiny_models_dir, [b"def add(a, b):"], ["text/plain"])
    json_answers, _ = call(handler, tiny_models_dir, [{"prompt": "def add(a, b):"}])
    assert answers[0]["token_ids"] == json_answers[0]["token_ids"]


def test_a_model_failure_mid_batch_fails_only_the_affected_request(handler, tiny_models_dir, monkeypatch):
    real_generate = handler.engine.generate

    def flaky_generate(requests, *args, **kwargs):
        if any(r.max_new_tokens == 13 for r in requests):
            raise RuntimeError("simulated kernel failure")
        return real_generate(requests, *args, **kwargs)

    monkeypatch.setattr(handler.engine, "generate", flaky_generate)
    answers, statuses = call(
        handler, tiny_models_dir, [{"prompt": "a", "max_new_tokens": 5}, {"prompt": "b", "max_new_tokens": 13}]
    )
    assert statuses == [200, 500]
    assert len(answers[0]["token_ids"]) > 0 and "generation failed" in answers[1]["error"]


@pytest.mark.parametrize(
    "section, message",
    [
        ({**HANDLER_SECTION, "draft_modle": "draft"}, "handler.draft_modle"),
        ({**HANDLER_SECTION, "draft_model": "/nonexistent/draft"}, "handler.draft_model"),
    ],
)
def test_bad_config_stops_initialize_with_a_message_naming_the_key(tiny_models_dir, section, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeHandler().initialize(make_context(tiny_models_dir, section))
