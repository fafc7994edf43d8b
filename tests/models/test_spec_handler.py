"""The TorchServe handler with TorchServe's own Context, no server: loading, batches, per-request status."""

from __future__ import annotations

import pytest
from ts.context import Context, RequestProcessor

from handler.schema import ANSWER_KEYS, FINISH_EOS, FINISH_LENGTH, FINISH_STOP, SPECULATIVE_KEYS, STREAM_CHUNK_KEYS
from handler.spec_handler import SpeculativeHandler
from tests.models.conftest import fail_batches_holding

HANDLER_SECTION = {
    "target_model": "target",
    "draft_model": "draft",
    "dtype": "float32",
    "num_speculative_tokens": 4,
    "max_new_tokens": 16,
    "max_new_tokens_limit": 64,
    # Fixed k: these tests count drafts per step, which a cost table measured at start-up would plan.
    "adaptive_k": False,
}


def make_context(model_dir, handler_section=None) -> Context:
    yaml_config = {"batchSize": 4, "handler": dict(HANDLER_SECTION if handler_section is None else handler_section)}
    return Context(
        "tiny", str(model_dir), {"model": {"modelName": "tiny"}}, 4, None, "0.12.0", model_yaml_config=yaml_config
    )


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
    assert set(answer) == set(ANSWER_KEYS)
    assert answer["finish_reason"] in (FINISH_LENGTH, FINISH_EOS, FINISH_STOP)
    assert answer["usage"]["completion_tokens"] == len(answer["token_ids"]) <= 12
    assert set(answer["speculative"]) == SPECULATIVE_KEYS
    assert answer["speculative"]["num_speculative_tokens"] == 4
    assert answer["speculative"]["drafter"] == "model"


def test_bad_request_fails_alone_and_good_ones_match_their_solo_answers(handler, tiny_models_dir):
    good = [
        {"prompt": "import numpy as np", "max_new_tokens": 10},
        {"prompt": "Hello", "max_new_tokens": 14, "num_speculative_tokens": 2},
    ]
    solo = [call(handler, tiny_models_dir, [body])[0][0] for body in good]
    bodies = [good[0], {"prompt": "x", "top_p": 2}, b"\xff\xfe", good[1]]
    answers, statuses = call(
        handler, tiny_models_dir, bodies, ["application/json", "application/json", "text/plain", "application/json"]
    )
    assert statuses == [200, 400, 400, 200]
    assert "top_p" in answers[1]["error"] and "UTF-8" in answers[2]["error"]
    assert answers[0]["token_ids"] == solo[0]["token_ids"]
    assert answers[3]["token_ids"] == solo[1]["token_ids"]


def test_plain_text_body_is_the_prompt(handler, tiny_models_dir):
    answers, _ = call(handler, tiny_models_dir, [b"def add(a, b):"], ["text/plain"])
    json_answers, _ = call(handler, tiny_models_dir, [{"prompt": "def add(a, b):"}])
    assert answers[0]["token_ids"] == json_answers[0]["token_ids"]


def test_a_model_failure_mid_batch_fails_only_the_affected_request(handler, tiny_models_dir, monkeypatch):
    fail_batches_holding(handler.engine, monkeypatch, max_new_tokens=13)
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


class RecordingMetrics:
    def __init__(self):
        self.values = {}

    def add_metric(self, name, value, unit, idx=None, dimensions=None, metric_type=None):
        self.values.setdefault(name, []).append(value)


def test_streamed_chunks_join_to_the_plain_answer_and_metrics_agree(handler, tiny_models_dir, monkeypatch):
    import json

    import handler.spec_handler as spec_handler_module

    sent = []
    monkeypatch.setattr(
        spec_handler_module,
        "send_intermediate_predict_response",
        lambda ret, req_id_map, message, code, context: sent.append((dict(req_id_map), dict(ret))),
    )
    bodies = [
        {"prompt": "def add(a, b):", "max_new_tokens": 24, "stream": True},
        {"prompt": "import os", "max_new_tokens": 20, "temperature": 0.8, "seed": 3, "stream": True},
        {"prompt": "Hello", "max_new_tokens": 10},
    ]
    plain = [call(handler, tiny_models_dir, [{k: v for k, v in b.items() if k != "stream"}])[0][0] for b in bodies]

    context = with_requests(make_context(tiny_models_dir), ["application/json"] * 3)
    context.request_ids = {0: "r0", 1: "r1", 2: "r2"}
    metrics = RecordingMetrics()
    context.metrics = metrics
    answers = handler.handle([{"body": b} for b in bodies], context)

    for index in (0, 1):
        chunks = [json.loads(ret[index]) for ids, ret in sent if index in ids]
        assert chunks, "a streamed request sends chunks while it runs"
        assert all(set(c) == set(STREAM_CHUNK_KEYS) for c in chunks)
        final = json.loads(answers[index])
        assert {"finish_reason", "usage", "speculative"} <= set(final) and "text" not in final
        assert "".join(c["text_delta"] for c in chunks) + final["text_delta"] == plain[index]["text"]
        assert sum((c["token_ids"] for c in chunks), []) + final["token_ids"] == plain[index]["token_ids"]
        assert context.get_response_content_type(index) == "application/x-ndjson"
    assert not any(2 in ids for ids, _ in sent), "the non-streamed request gets no chunks"
    assert answers[2]["token_ids"] == plain[2]["token_ids"]

    stats = [json.loads(answers[0])["speculative"], json.loads(answers[1])["speculative"], answers[2]["speculative"]]
    assert metrics.values["SpecRequests"] == [1, 1, 1]
    assert sum(metrics.values["SpecDraftTokens"]) == sum(s["draft_tokens"] for s in stats)
    assert sum(metrics.values["SpecAcceptedTokens"]) == sum(s["accepted_tokens"] for s in stats)
    assert sum(metrics.values["SpecTargetForwardPasses"]) == sum(s["target_forward_passes"] for s in stats)
    assert sum(metrics.values["SpecGeneratedTokens"]) == sum(p["usage"]["completion_tokens"] for p in plain)
    # Every request, streamed or not, and never later than its last token.
    assert len(metrics.values["SpecTimeToFirstTokenSeconds"]) == 3
    assert all(
        0 < first <= last
        for first, last in zip(
            metrics.values["SpecTimeToFirstTokenSeconds"], metrics.values["SpecRequestLatencySeconds"]
        )
    )
    assert all(v > 0 for v in metrics.values["SpecRequestLatencySeconds"])


def test_stop_string_does_not_leak_into_the_stream(handler, tiny_models_dir, monkeypatch):
    import json

    import handler.spec_handler as spec_handler_module

    sent = []
    monkeypatch.setattr(
        spec_handler_module, "send_intermediate_predict_response", lambda ret, ids, m, c, ctx: sent.append(ret)
    )
    full = call(handler, tiny_models_dir, [{"prompt": "def add(a, b):", "max_new_tokens": 30}])[0][0]
    stop = full["text"][10:13]
    answers, _ = call(
        handler, tiny_models_dir, [{"prompt": "def add(a, b):", "max_new_tokens": 30, "stop": [stop], "stream": True}]
    )
    streamed = "".join(json.loads(r[0])["text_delta"] for r in sent) + json.loads(answers[0])["text_delta"]
    assert streamed == full["text"][: full["text"].index(stop)]
    assert json.loads(answers[0])["finish_reason"] == "stop"


def test_entry_module_defines_exactly_one_class():
    """TorchServe refuses a handler file that defines more than one class ("Expected only one class")."""
    import inspect

    import handler.spec_handler as entry

    classes = [obj for _, obj in inspect.getmembers(entry, inspect.isclass) if obj.__module__ == entry.__name__]
    assert classes == [SpeculativeHandler]


def test_a_chat_template_error_is_a_400_for_that_request_only(handler, tiny_models_dir, monkeypatch):
    tokenizer = handler.models.tokenizer

    def strict_template(messages, **kwargs):
        if any(m["role"] not in ("system", "user", "assistant") for m in messages):
            raise ValueError("roles must be system, user or assistant")
        return "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    monkeypatch.setattr(tokenizer, "apply_chat_template", strict_template)
    answers, statuses = call(
        handler,
        tiny_models_dir,
        [{"messages": [{"role": "wizard", "content": "x"}]}, {"prompt": "Hello", "max_new_tokens": 3}],
    )
    assert statuses == [400, 200]
    assert answers[0]["error"].startswith("messages: the model's chat template rejected them")


def test_requests_pick_a_drafter_the_archive_can_run(handler, tiny_models_dir):
    bodies = [
        {"prompt": "def add(a, b):", "max_new_tokens": 10, "drafter": "ngram"},
        {"prompt": "def add(a, b):", "max_new_tokens": 10, "drafter": "hybrid"},
        {"prompt": "def add(a, b):", "max_new_tokens": 10},
        {"prompt": "def add(a, b):", "max_new_tokens": 10, "drafter": "suffix", "suffix_share_across_requests": False},
        {"prompt": "def add(a, b):", "max_new_tokens": 10, "drafter": "eagle"},
    ]
    answers, statuses = call(handler, tiny_models_dir, bodies)
    assert statuses == [200, 200, 200, 200, 400]
    assert [a["speculative"]["drafter"] for a in answers[:4]] == ["ngram", "hybrid", "model", "suffix"]
    # Greedy output does not depend on who drafted it.
    assert len({tuple(a["token_ids"]) for a in answers[:4]}) == 1
    assert "drafter" in answers[4]["error"] and "suffix" in answers[4]["error"]


def test_an_ngram_archive_serves_without_a_draft_model(tiny_models_dir):
    section = {k: v for k, v in HANDLER_SECTION.items() if k != "draft_model"} | {"drafter": "ngram"}
    lookup = SpeculativeHandler()
    lookup.initialize(make_context(tiny_models_dir, section))
    assert lookup.models.draft is None
    answers, statuses = call(
        lookup, tiny_models_dir, [{"prompt": "x", "max_new_tokens": 8}, {"prompt": "x", "drafter": "model"}]
    )
    assert statuses == [200, 400]
    assert answers[0]["speculative"]["drafter"] == "ngram"
    assert "not available" in answers[1]["error"]


def test_a_tokenizer_the_grammar_engine_cannot_read_serves_all_but_structured_output(
    tiny_models_dir, monkeypatch, caplog
):
    """The worker starts, says why once, answers plain requests and gives structured ones a 400.

    The grammar engine is handed a WordLevel tokenizer with a Fuse decoder and a token without a byte
    spelling, which it cannot read (`tests/unit/test_constraints.py`: transformers serves that
    tokenizer); the models keep theirs.
    """
    import logging

    from handler import constraints
    from tests.unit.test_constraints import unspellable_tokenizer

    unreadable = unspellable_tokenizer()
    real_compiler = constraints.GrammarCompiler
    monkeypatch.setattr(constraints, "GrammarCompiler", lambda tokenizer: real_compiler(unreadable))
    fused = SpeculativeHandler()
    with caplog.at_level(logging.WARNING):
        fused.initialize(make_context(tiny_models_dir))
    assert caplog.text.count("grammar engine cannot read its tokenizer") == 1
    bodies = [
        {"prompt": "def add(a, b):", "max_new_tokens": 8},
        {"prompt": "x", "json_schema": {"type": "object"}},
        {"prompt": "def sub(a, b):", "max_new_tokens": 8, "drafter": "hybrid"},
    ]
    answers, statuses = call(fused, tiny_models_dir, bodies)
    assert statuses == [200, 400, 200]
    assert "structured output" in answers[1]["error"] and "Fuse" in answers[1]["error"]
    assert answers[0]["usage"]["completion_tokens"] == 8


def test_the_cost_table_is_cached_where_the_environment_says(tiny_models_dir, tmp_path, monkeypatch):
    """deploy/: a pod's model store is read-only and its .mar is unpacked anew at each start, so the
    manifests point SPEC_COST_TABLE_DIR at a volume that outlives the pod; a second start reads it back."""
    from handler.planning.measure import CACHE_FILE_PREFIX, COST_TABLE_DIR_ENV

    kept = tmp_path / "cost-tables"
    monkeypatch.setenv(COST_TABLE_DIR_ENV, str(kept))
    # A small grid (widths up to 5, one row) on one runner keeps the measurement short.
    section = dict(HANDLER_SECTION, adaptive_k=True, max_num_speculative_tokens=4, runner="dynamic")

    def start() -> None:
        context = make_context(tiny_models_dir, section)
        context.model_yaml_config["batchSize"] = 1
        SpeculativeHandler().initialize(context)

    start()
    [cached] = kept.glob(f"{CACHE_FILE_PREFIX}*.json")
    written = cached.stat().st_mtime_ns
    # A measured table is written anew (a temporary file renamed over it); a table read back is not.
    start()
    assert [path.name for path in kept.iterdir()] == [cached.name]
    assert cached.stat().st_mtime_ns == written
