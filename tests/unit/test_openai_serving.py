"""The OpenAI routes through both schedules of handler.serving, over the fake step engine: no model, no server.

An OpenAI request runs as one engine row per choice; a stream sends SSE
chunks as its rows step and `data: [DONE]` at the end; the model list and
errors are complete responses in OpenAI's shape.
"""

from __future__ import annotations

import json

from handler.config import HandlerConfig
from handler.metrics import MetricsRecorder
from handler.serving import JSON_CONTENT_TYPE, Reply, StaticBatch
from tests.unit.fake_engine import FakeEngine
from tests.unit.test_serving import (
    MODEL,
    TOKENIZER,
    CachingEngine,
    FakeGenerateEngine,
    Harness,
    RecordingMetrics,
    answer_of,
    parse,
)

COMPLETIONS, MODELS = "v1/completions", "v1/models"
SSE_CONTENT_TYPE = "text/event-stream"
DONE = "[DONE]"


def sse_events(text: str) -> list:
    """The events of an SSE body: decoded JSON chunks, and "[DONE]"."""
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == DONE else json.loads(data))
    return events


def choice_chunks(events: list, index: int) -> list[dict]:
    return [e["choices"][0] for e in events if e != DONE and e["choices"] and e["choices"][0]["index"] == index]


def solo_text(engine: FakeEngine, body: dict) -> str:
    return engine.solo_text(parse(body, url_path=COMPLETIONS).generations[0])


def test_a_stream_of_n_choices_sends_each_steps_chunks_then_usage_and_done():
    harness = Harness()
    body = {"model": MODEL, "prompt": "x", "max_tokens": 7, "n": 2, "stream": True}
    harness.submit("s", {**body, "stream_options": {"include_usage": True}}, COMPLETIONS)
    harness.run_until_done()
    replies = harness.received["s"]
    assert harness.engine.rows_per_step == [2, 2, 2, 2], "one engine row per choice"
    assert [r.more for r in replies] == [True, True, True, False]
    assert replies[0].content_type == SSE_CONTENT_TYPE and all(r.content_type is None for r in replies[1:])
    # Each step's chunks go out in that step's reply: one per choice.
    assert [len(sse_events(r.body)) for r in replies] == [2, 2, 2, 2 + 2]

    events = sse_events(answer_of(replies)["chunks"])
    assert events[-1] == DONE
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 1,
        "completion_tokens": 14,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    for index in (0, 1):
        own = choice_chunks(events, index)
        assert "".join(c["text"] for c in own) == solo_text(harness.engine, body)
        assert [c["finish_reason"] for c in own] == [None, None, None, "length"]
    assert all(e["object"] == "text_completion" and e["model"] == MODEL for e in events[:-1])


def test_usage_reports_cached_prompt_tokens_once_per_prompt_plain_and_streamed():
    harness = Harness(engine=CachingEngine())
    body = {"model": MODEL, "prompt": "abcd", "max_tokens": 3, "n": 2}
    harness.submit("plain", body, COMPLETIONS)
    harness.submit("stream", {**body, "stream": True, "stream_options": {"include_usage": True}}, COMPLETIONS)
    harness.run_until_done()
    expected = {
        "prompt_tokens": 4,
        "completion_tokens": 6,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    assert answer_of(harness.received["plain"])["usage"] == expected
    assert sse_events(answer_of(harness.received["stream"])["chunks"])[-2]["usage"] == expected


class ShortSecondChoice(FakeEngine):
    """Choice 1 of every request stops after 3 tokens, as a sampled choice may hit EOS early."""

    def length_of(self, request_id, request) -> int:
        _, row = request_id
        return 3 if row == 1 else request.max_new_tokens


def test_a_choice_that_finishes_first_sends_its_last_chunk_at_once():
    harness = Harness(engine=ShortSecondChoice())
    body = {"prompt": "x", "max_tokens": 8, "n": 2, "stream": True}
    harness.submit("s", body, COMPLETIONS)
    harness.run_until_done()
    assert harness.engine.rows_per_step == [2, 2, 1, 1], "the finished choice's row left the batch"
    finishing = [
        (call, chunk["index"])
        for call, reply in enumerate(harness.received["s"])
        for event in sse_events(reply.body)
        if event != DONE
        for chunk in event["choices"]
        if chunk["finish_reason"] is not None
    ]
    assert finishing == [(1, 1), (3, 0)]
    events = sse_events(answer_of(harness.received["s"])["chunks"])
    assert "".join(c["text"] for c in choice_chunks(events, 1)) == solo_text(harness.engine, body)[:3]
    assert "".join(c["text"] for c in choice_chunks(events, 0)) == solo_text(harness.engine, body)


def test_a_plain_request_of_n_choices_is_one_json_answer():
    harness = Harness()
    body = {"prompt": "y", "max_tokens": 5, "n": 3}
    harness.submit("p", body, COMPLETIONS)
    harness.run_until_done()
    replies = harness.received["p"]
    assert replies[0].content_type == JSON_CONTENT_TYPE and all(r.body == "" for r in replies[:-1])
    answer = answer_of(replies)
    assert answer["object"] == "text_completion" and answer["id"].startswith("cmpl-")
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert all(c["text"] == solo_text(harness.engine, body) for c in answer["choices"])
    assert answer["usage"] == {
        "prompt_tokens": 1,
        "completion_tokens": 15,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert answer["speculative"]["draft_tokens"] == 0  # the fake engine's stats are empty; they add up
    assert harness.recorded.total("SpecRequests") == 3, "figures per choice"
    assert len(harness.recorded.values["SpecTimeToFirstTokenSeconds"]) == 1, "but one first token per request"


def test_a_disconnected_client_aborts_all_its_choices_rows():
    harness = Harness()
    harness.submit("gone", {"prompt": "a", "max_tokens": 30, "n": 3, "stream": True}, COMPLETIONS)
    harness.submit("stays", {"prompt": "b", "max_new_tokens": 10})
    harness.call()
    harness.disconnect("gone")
    harness.call()
    assert sorted(harness.engine.aborted) == [("gone", 0), ("gone", 1), ("gone", 2)]
    assert harness.engine.rows_per_step == [4, 1]
    assert not harness.batcher.knows("gone")
    assert harness.recorded.total("SpecAbortedRequests") == 1, "one request, however many rows"
    harness.run_until_done()
    assert answer_of(harness.received["stays"])["usage"]["completion_tokens"] == 10


def test_the_model_list_is_answered_without_the_engine():
    harness = Harness()
    harness.submit("list", b"", MODELS)
    harness.submit("one", b"", f"{MODELS}/{MODEL}")
    harness.submit("other", b"", f"{MODELS}/gpt-4o")
    listing, one, other = harness.call()
    assert (listing.status, listing.more, listing.content_type) == (200, None, JSON_CONTENT_TYPE)
    assert [model["id"] for model in listing.body["data"]] == [MODEL]
    assert one.body == listing.body["data"][0]
    assert other.status == 404 and other.body["error"]["code"] == "model_not_found"
    assert [(r.body, r.more) for r in harness.call()] == [("", False)] * 3
    assert harness.engine.steps_run == 0


def test_openai_errors_are_complete_responses_with_openai_status_and_body():
    harness = Harness()
    harness.submit("good", {"prompt": "g", "max_tokens": 4}, COMPLETIONS)
    harness.submit("neutral", {"prompt": "x", "presence_penalty": 3}, COMPLETIONS)
    harness.submit("model", {"prompt": "x", "model": "gpt-4o"}, COMPLETIONS)
    harness.submit("route", {"input": "x"}, "v1/embeddings")
    harness.submit("native", {"prompt": "x", "top_p": 3})
    good, neutral, model, route, native = harness.call()
    assert good.more is True
    assert all(r.more is None and r.content_type == JSON_CONTENT_TYPE for r in (neutral, model, route, native))
    assert (neutral.status, neutral.body["error"]["param"]) == (400, "presence_penalty")
    assert neutral.body["error"]["type"] == "invalid_request_error"
    assert (model.status, model.body["error"]["code"]) == (404, "model_not_found")
    assert (route.status, route.body["error"]["code"]) == (404, "unknown_url")
    assert native.status == 400 and "top_p" in native.body["error"], "the native route keeps its own shape"
    harness.run_until_done()
    assert harness.recorded.total("SpecRejectedRequests") == 4


def test_all_choices_count_against_max_batch_tokens():
    config = HandlerConfig(max_new_tokens=8, max_new_tokens_limit=64, max_batch_tokens=24)
    # 2 choices x (3 prompt tokens + 7 new ones) = 20 fit; 3 choices = 30 never can.
    assert not isinstance(parse({"prompt": "abc", "max_tokens": 7, "n": 2}, config, COMPLETIONS), Reply)
    refused = parse({"prompt": "abc", "max_tokens": 7, "n": 3}, config, COMPLETIONS)
    assert refused.status == 400 and refused.body["error"]["param"] == "n"
    assert "max_batch_tokens of 24" in refused.body["error"]["message"]

    harness = Harness(max_batch_tokens=24)
    harness.submit("first", {"prompt": "a", "max_tokens": 7, "n": 2, "stream": True}, COMPLETIONS)
    harness.submit("second", {"prompt": "b", "max_tokens": 7, "n": 2, "stream": True}, COMPLETIONS)
    harness.run_until_done()
    # 16 tokens each: the second request's two rows wait, together, for the first's room.
    assert harness.engine.rows_per_step == [2, 2, 2, 2, 2, 2, 2, 2]


def test_a_failed_step_ends_a_started_openai_stream_with_an_error_event():
    harness = Harness()
    harness.submit("started", {"prompt": "s", "max_tokens": 9, "n": 2, "stream": True}, COMPLETIONS)
    harness.call()
    harness.engine.fail_next_step = True
    harness.submit("new", {"prompt": "n", "max_tokens": 9}, COMPLETIONS)
    started, new = harness.call()
    # The stream's 200 went out with its first chunk: an error event the client raises, then [DONE].
    events = sse_events(started.body)
    assert started.more is False and events[-1] == DONE
    assert events[0]["error"]["type"] == "server_error" and "generation failed" in events[0]["error"]["message"]
    assert (new.status, new.more, new.body["error"]["type"]) == (500, None, "server_error")


def test_a_static_batch_streams_openai_choices_through_the_callback():
    engine = FakeGenerateEngine()
    static = StaticBatch(engine, TOKENIZER)
    streamed = {"prompt": "a", "max_tokens": 5, "n": 2, "stream": True}
    entries = [
        parse(streamed, url_path=COMPLETIONS),
        parse({"prompt": "b", "max_new_tokens": 5}),
        parse(b"", url_path=MODELS),
        parse({"prompt": "x", "best_of": 3}, url_path=COMPLETIONS),
    ]
    sent = []
    recorded = RecordingMetrics()
    replies = static.run(
        entries, lambda index, text, content_type: sent.append((index, text, content_type)), MetricsRecorder(recorded)
    )
    assert engine.rows_per_step[0] == 3, "two choices and a native request in one engine batch"
    assert {(index, content_type) for index, _, content_type in sent} == {(0, SSE_CONTENT_TYPE)}
    # Each choice's last chunk went out when it finished: the final answer only ends the stream.
    assert replies[0].body == f"data: {DONE}\n\n"
    events = sse_events("".join(text for _, text, _ in sent) + replies[0].body)
    for index in (0, 1):
        own = choice_chunks(events, index)
        assert "".join(c["text"] for c in own) == solo_text(engine, streamed) and own[-1]["finish_reason"] == "length"
    assert replies[1].body["text"] == engine.solo_text(entries[1].generation)
    assert replies[2].body["object"] == "list"
    assert replies[3].status == 400 and replies[3].body["error"]["param"] == "best_of"
    assert recorded.total("SpecRequests") == 3 and recorded.total("SpecRejectedRequests") == 1
