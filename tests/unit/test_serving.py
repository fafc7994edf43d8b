"""Continuous and static batching over a fake step engine: the TorchServe call protocol, no model, no server."""

from __future__ import annotations

import json

import pytest

from handler.api.native import ParsedRequest, RequestError
from handler.api.openai.routes import route_from_url_path
from handler.config import HandlerConfig
from handler.metrics import MetricsRecorder
from handler.serving import (
    JSON_CONTENT_TYPE,
    NDJSON_CONTENT_TYPE,
    ContinuousBatcher,
    SpeculationTally,
    StaticBatch,
    parse_entry,
)
from tests.unit.fake_engine import CharTokenizer, FakeEngine, FakeStepOutput

TOKENIZER = CharTokenizer()
CONFIG = HandlerConfig(max_new_tokens=8, max_new_tokens_limit=64)


class RecordingMetrics:
    def __init__(self):
        self.values: dict[str, list] = {}

    def add_metric(self, name, value, unit, idx=None, dimensions=None, metric_type=None):
        labels = tuple((d.name, d.value) for d in dimensions or [])
        self.values.setdefault(name, []).append((value, labels))

    def total(self, name: str) -> float:
        return sum(value for value, _ in self.values.get(name, []))


MODEL = "fake"


def parse(body: dict, config: HandlerConfig = CONFIG, url_path: str = ""):
    """The entry of a request; `url_path` is TorchServe's header ("" on the native route, e.g. "v1/completions")."""
    route = route_from_url_path(url_path)
    return parse_entry({"body": body}, "application/json", config, TOKENIZER, 256, route, MODEL, created=1)


class Harness:
    """Plays TorchServe's frontend: every job in flight in every call, new ones with their body."""

    def __init__(self, max_batch_tokens: int = 0, engine: FakeEngine | None = None):
        self.engine = engine or FakeEngine()
        self.now = 0.0  # seconds; one per call
        self.batcher = ContinuousBatcher(self.engine, TOKENIZER, max_batch_tokens, clock=lambda: self.now)
        self.recorded = RecordingMetrics()
        self.metrics = MetricsRecorder(self.recorded)
        self.in_flight: list[str] = []
        self.bodies: dict[str, dict] = {}
        self.url_paths: dict[str, str] = {}
        self.received: dict[str, list] = {}  # every reply per request

    def submit(self, request_id: str, body: dict, url_path: str = "") -> None:
        self.in_flight.append(request_id)
        self.bodies[request_id] = body
        self.url_paths[request_id] = url_path

    def disconnect(self, request_id: str) -> None:
        self.in_flight.remove(request_id)

    def call(self):
        self.now += 1.0
        new = {
            r: parse(self.bodies[r], url_path=self.url_paths[r]) for r in self.in_flight if not self.batcher.knows(r)
        }
        replies = self.batcher.run_call(list(self.in_flight), new, self.metrics)
        for request_id, reply in zip(list(self.in_flight), replies):
            self.received.setdefault(request_id, []).append(reply)
            if reply.more is False:
                self.in_flight.remove(request_id)  # the frontend's job is done
        return replies

    def run_until_done(self, max_calls: int = 100) -> None:
        for _ in range(max_calls):
            if not self.in_flight:
                return
            self.call()
        raise AssertionError("requests still in flight")


def answer_of(replies) -> dict:
    """What the client receives: a complete body, or the chunks joined."""
    bodies = [r.body for r in replies if r.body != ""]
    if len(bodies) == 1 and isinstance(bodies[0], dict):
        return bodies[0]
    assert all(isinstance(b, str) for b in bodies), bodies
    return {"chunks": "".join(bodies)}


def stream_lines(replies) -> list[dict]:
    return [json.loads(line) for line in answer_of(replies)["chunks"].splitlines()]


def test_a_non_streamed_request_is_one_json_answer_after_empty_chunks():
    harness = Harness()
    harness.submit("a", {"prompt": "x", "max_new_tokens": 7})
    harness.run_until_done()
    replies = harness.received["a"]
    assert [r.more for r in replies] == [True, True, True, False]
    assert replies[0].content_type == JSON_CONTENT_TYPE and all(r.content_type is None for r in replies[1:])
    assert all(r.body == "" for r in replies[:-1])
    answer = replies[-1].body
    assert answer["text"] == harness.engine.solo_text(parse(harness.bodies["a"]).generation)
    assert answer["usage"] == {"prompt_tokens": 1, "completion_tokens": 7, "cached_tokens": 0}


def test_a_stream_sends_each_steps_tokens_and_the_lines_join_to_the_answer():
    harness = Harness()
    harness.submit("s", {"prompt": "y", "max_new_tokens": 7, "stream": True})
    harness.run_until_done()
    replies = harness.received["s"]
    assert replies[0].content_type == NDJSON_CONTENT_TYPE
    lines = stream_lines(replies)
    *chunks, final = lines
    assert [len(c["token_ids"]) for c in chunks] == [2, 2, 2]
    assert final["finish_reason"] == "length" and len(final["token_ids"]) == 1
    expected = harness.engine.solo_text(parse(harness.bodies["s"]).generation)
    assert "".join(line["text_delta"] for line in lines) == expected


def test_requests_join_and_leave_at_every_step_with_unchanged_outputs():
    harness = Harness()
    harness.submit("long", {"prompt": "L", "max_new_tokens": 20, "stream": True})
    harness.call()
    harness.call()
    for name in ("s1", "s2", "s3"):
        harness.submit(name, {"prompt": name, "max_new_tokens": 4})
    harness.call()
    assert harness.engine.rows_per_step == [1, 1, 4], "the short ones joined the running batch"
    harness.call()
    assert harness.engine.rows_per_step[-1] == 4
    harness.call()
    assert harness.engine.rows_per_step[-1] == 1, "the finished short ones left at once"
    assert not any(r in harness.in_flight for r in ("s1", "s2", "s3"))
    harness.run_until_done()
    for name in ("s1", "s2", "s3", "long"):
        generation = parse(harness.bodies[name]).generation
        answer = answer_of(harness.received[name])
        text = (
            answer["text"]
            if "text" in answer
            else "".join(line["text_delta"] for line in stream_lines(harness.received[name]))
        )
        assert text == harness.engine.solo_text(generation)


def test_a_request_finished_in_its_first_call_gets_a_complete_response_then_an_empty_last_chunk():
    harness = Harness()
    harness.submit("one", {"prompt": "q", "max_new_tokens": 2})
    [reply] = harness.call()
    assert reply.more is None and reply.body["usage"]["completion_tokens"] == 2
    assert reply.content_type == JSON_CONTENT_TYPE
    assert harness.in_flight == ["one"], "the frontend keeps the job for one more call"
    [reply] = harness.call()
    assert (reply.body, reply.more) == ("", False)
    assert not harness.batcher.knows("one")


@pytest.mark.parametrize(
    "url_path, length_field", [("", "max_new_tokens"), ("v1/completions", "max_tokens")], ids=["native", "openai"]
)
def test_a_stream_that_ends_in_its_first_call_is_still_chunked(url_path, length_field):
    harness = Harness()
    harness.submit("short", {"prompt": "q", length_field: 1, "stream": True}, url_path=url_path)
    [reply] = harness.call()
    assert reply.more is True and reply.status == 200, "a first chunk: the frontend sends headers for a chunked body"
    assert reply.content_type.startswith("text/event-stream" if url_path else NDJSON_CONTENT_TYPE)
    assert reply.body, "the whole stream goes out at once"
    [last] = harness.call()
    assert (last.body, last.more) == ("", False)
    assert not harness.batcher.knows("short") and not harness.in_flight


def test_a_complete_response_the_frontend_does_not_send_again_is_forgotten():
    harness = Harness()
    harness.submit("one", {"prompt": "q", "max_new_tokens": 1})
    harness.call()
    harness.disconnect("one")
    harness.submit("two", {"prompt": "r", "max_new_tokens": 4})
    harness.call()
    assert not harness.batcher.knows("one")
    assert harness.recorded.total("SpecAbortedRequests") == 0


def test_a_bad_request_fails_alone_with_its_status():
    harness = Harness()
    harness.submit("good", {"prompt": "g", "max_new_tokens": 5})
    harness.submit("bad", {"prompt": "b", "top_p": 3})
    good_reply, bad_reply = harness.call()
    assert (bad_reply.status, bad_reply.more, bad_reply.content_type) == (400, None, JSON_CONTENT_TYPE)
    assert "top_p" in bad_reply.body["error"]
    assert good_reply.more is True
    harness.run_until_done()
    assert harness.received["bad"][-1].more is False
    assert answer_of(harness.received["good"])["usage"]["completion_tokens"] == 5
    assert harness.recorded.total("SpecRejectedRequests") == 1


def test_a_disconnected_client_frees_its_row_at_the_next_step():
    harness = Harness()
    harness.submit("gone", {"prompt": "a", "max_new_tokens": 30, "stream": True})
    harness.submit("stays", {"prompt": "b", "max_new_tokens": 10})
    harness.call()
    harness.disconnect("gone")
    harness.call()
    assert harness.engine.aborted == [("gone", 0)], "the engine knows rows by (request id, row)"
    assert harness.engine.rows_per_step == [2, 1]
    assert not harness.batcher.knows("gone")
    assert harness.recorded.total("SpecAbortedRequests") == 1
    harness.run_until_done()
    assert answer_of(harness.received["stays"])["usage"]["completion_tokens"] == 10


def test_max_batch_tokens_makes_a_request_wait_for_room_in_arrival_order():
    # Each request holds 1 prompt token + 7 new ones = 8; the bound fits two.
    harness = Harness(max_batch_tokens=17)
    for name in ("a", "b", "c"):
        harness.submit(name, {"prompt": name, "max_new_tokens": 7, "stream": True})
    replies = harness.call()
    assert harness.engine.rows_per_step == [2]
    assert [r.more for r in replies] == [True, True, True], "the waiting one gets an empty chunk"
    assert replies[2].body == ""
    harness.run_until_done()
    assert harness.engine.rows_per_step == [2, 2, 2, 2, 1, 1, 1, 1]
    waits = [value for value, _ in harness.recorded.values["SpecQueueWaitSeconds"]]
    assert waits == [0.0, 0.0, 4.0], "c waited four steps for a's and b's room"
    assert answer_of(harness.received["c"])["chunks"].count("\n") == 4


def test_a_request_that_can_never_fit_is_a_413():
    config = HandlerConfig(max_new_tokens=8, max_new_tokens_limit=64, max_batch_tokens=10)
    error = parse({"prompt": "abcd", "max_new_tokens": 7}, config)
    assert isinstance(error, RequestError) and error.status == 413
    assert "max_batch_tokens of 10" in str(error)
    assert isinstance(parse({"prompt": "abc", "max_new_tokens": 7}, config), ParsedRequest)


def test_a_failed_step_fails_its_requests_and_the_next_ones_are_served():
    harness = Harness()
    harness.submit("started", {"prompt": "s", "max_new_tokens": 9, "stream": True})
    harness.call()
    harness.engine.fail_next_step = True
    harness.submit("new", {"prompt": "n", "max_new_tokens": 9})
    started_reply, new_reply = harness.call()
    # The stream's status went out with its first chunk: the error is its last line.
    assert started_reply.more is False and "generation failed" in json.loads(started_reply.body)["error"]
    assert (new_reply.status, new_reply.more) == (500, None)
    assert harness.engine.resets == 1 and not harness.engine.has_unfinished_requests()
    harness.call()  # the frontend's last call for the complete 500
    harness.submit("after", {"prompt": "a", "max_new_tokens": 4})
    harness.run_until_done()
    assert answer_of(harness.received["after"])["usage"]["completion_tokens"] == 4


def test_metrics_count_steps_drafts_and_accepted_positions():
    harness = Harness(engine=FakeEngine(tokens_per_step=3, num_draft_tokens=4))
    harness.submit("a", {"prompt": "a", "max_new_tokens": 9})
    harness.submit("b", {"prompt": "b", "max_new_tokens": 6})
    harness.run_until_done()
    recorded = harness.recorded
    # a: 3 steps, b: 2 steps; each accepts 2 of 4 drafts.
    assert recorded.total("spec_decode_num_drafts") == 5
    assert recorded.total("spec_decode_num_draft_tokens") == 20
    assert recorded.total("spec_decode_num_accepted_tokens") == 10
    per_position = {labels: 0 for _, labels in recorded.values["spec_decode_num_accepted_tokens_per_pos"]}
    for value, labels in recorded.values["spec_decode_num_accepted_tokens_per_pos"]:
        per_position[labels] += value
    assert per_position == {(("position", "0"),): 5, (("position", "1"),): 5}
    # Sent when it changes: two rows, one, then an idle batch.
    assert [v for v, _ in recorded.values["SpecBatchOccupancy"]] == [2, 1, 0]
    assert recorded.total("SpecRequests") == 2


def test_the_tally_counts_each_steps_drafts_and_accepted_positions():
    from handler.types import StepOutput

    tally = SpeculationTally()
    for drafts, accepted in ((4, 2), (0, 0), (3, 3), (1, 0)):
        tally.add_step(StepOutput("r", [1], [1], None, None, drafts, accepted))
    recorded = RecordingMetrics()
    tally.record(MetricsRecorder(recorded))
    assert recorded.total("spec_decode_num_drafts") == 3
    assert recorded.total("spec_decode_num_draft_tokens") == 8
    assert recorded.total("spec_decode_num_accepted_tokens") == 5
    assert sorted(recorded.values["spec_decode_num_accepted_tokens_per_pos"]) == [
        (1, (("position", "2"),)),
        (2, (("position", "0"),)),
        (2, (("position", "1"),)),
    ]


def test_the_real_engine_and_the_fake_are_both_engines():
    from handler.engine import SpeculativeEngine
    from handler.types import Engine

    assert issubclass(SpeculativeEngine, Engine)
    assert isinstance(FakeEngine(), Engine)


def test_accepted_drafts_are_counted_as_a_prefix():
    tally = SpeculationTally()
    for accepted in (0, 3, 1):
        tally.add_step(FakeStepOutput("r", [], [], None, None, num_draft_tokens=3, num_accepted_tokens=accepted))
    tally.add_step(FakeStepOutput("r", [], [], None, None, num_draft_tokens=0, num_accepted_tokens=0))
    assert (tally.num_drafts, tally.num_draft_tokens, tally.num_accepted_tokens) == (3, 9, 4)
    assert tally.accepted_per_position == [2, 1, 1]


class FakeGenerateEngine(FakeEngine):
    """The fake engine, named for the tests that run it through `generate`."""


def test_static_batches_split_to_fit_max_batch_tokens_and_stream_through_the_callback():
    engine = FakeGenerateEngine()
    static = StaticBatch(engine, TOKENIZER, max_batch_tokens=17)
    parsed = [parse({"prompt": p, "max_new_tokens": 7, "stream": p == "b"}) for p in "abc"]
    parsed.insert(1, parse({"prompt": "x", "top_k": -1}))
    sent = []
    recorded = RecordingMetrics()
    replies = static.run(parsed, lambda index, line, _: sent.append((index, line)), MetricsRecorder(recorded))
    assert engine.rows_per_step == [2, 2, 2, 2, 1, 1, 1, 1]
    assert replies[1].status == 400 and "top_k" in replies[1].body["error"]
    assert {index for index, _ in sent} == {2}
    streamed = "".join(json.loads(line)["text_delta"] for _, line in sent) + json.loads(replies[2].body)["text_delta"]
    assert streamed == engine.solo_text(parsed[2].generation)
    assert replies[0].body["text"] == engine.solo_text(parsed[0].generation)
    assert all(r.more is None for r in replies)
    assert [v for v, _ in recorded.values["SpecBatchOccupancy"]] == [2, 1]


def test_a_static_stream_with_nothing_sent_before_its_end_still_goes_out_as_a_chunk():
    class SilentEngine(FakeGenerateEngine):
        def generate(self, requests, on_tokens=None):
            return super().generate(requests)  # no step reaches the callback

    static = StaticBatch(SilentEngine(), TOKENIZER)
    parsed = [parse({"prompt": "s", "max_new_tokens": 3, "stream": True}), parse({"prompt": "t", "max_new_tokens": 3})]
    sent = []
    send = lambda index, text, content_type: sent.append((index, text, content_type))  # noqa: E731
    replies = static.run(parsed, send, MetricsRecorder(RecordingMetrics()))
    [(index, text, content_type)] = sent
    assert index == 0 and content_type == NDJSON_CONTENT_TYPE and json.loads(text.splitlines()[-1])["finish_reason"]
    assert replies[0].body == "" and replies[0].content_type is None, "the last chunk, empty"
    assert isinstance(replies[1].body, dict), "a request that does not stream stays one JSON answer"


class CachingEngine(FakeEngine):
    """Reports every prompt token but the last as found in the prefix cache, as for a repeated prompt."""

    def step(self):
        outputs = super().step()
        for output in outputs:
            if output.result is not None:
                output.result.cached_tokens = output.result.prompt_tokens - 1
        return outputs


def test_native_usage_reports_the_cached_prompt_tokens():
    harness = Harness(engine=CachingEngine())
    harness.submit("plain", {"prompt": "abcd", "max_new_tokens": 3})
    harness.submit("stream", {"prompt": "abcdef", "max_new_tokens": 3, "stream": True})
    harness.run_until_done()
    assert answer_of(harness.received["plain"])["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "cached_tokens": 3,
    }
    assert stream_lines(harness.received["stream"])[-1]["usage"]["cached_tokens"] == 5


def test_time_to_first_token_is_recorded_for_every_request_streamed_or_not():
    # Each request holds 1 prompt token + 7 new ones = 8; the bound fits two: c waits for room.
    harness = Harness(max_batch_tokens=17)
    harness.submit("a", {"prompt": "a", "max_new_tokens": 7, "stream": True})
    harness.submit("b", {"prompt": "b", "max_new_tokens": 7})
    harness.submit("c", {"prompt": "c", "max_new_tokens": 7})
    harness.run_until_done()
    # One value per request, when it finishes: a and b had a token in their first call, c in its fifth.
    first_tokens = [value for value, _ in harness.recorded.values["SpecTimeToFirstTokenSeconds"]]
    assert first_tokens == [0.0, 0.0, 4.0]
    assert [value for value, _ in harness.recorded.values["SpecRequestLatencySeconds"]] == [3.0, 3.0, 7.0]


class ClockedEngine(FakeGenerateEngine):
    """Each step takes one second of the clock the static batch reads."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def step(self):
        self.now += 1.0
        return super().step()


def test_a_static_batch_records_time_to_first_token_for_every_request():
    engine = ClockedEngine()
    static = StaticBatch(engine, TOKENIZER, max_batch_tokens=8, clock=lambda: engine.now)
    parsed = [parse({"prompt": "a", "max_new_tokens": 7, "stream": True}), parse({"prompt": "b", "max_new_tokens": 7})]
    recorded = RecordingMetrics()
    static.run(parsed, lambda index, line, _: None, MetricsRecorder(recorded))
    assert engine.rows_per_step == [1] * 8, "one group after the other"
    # The second group's first token came in the fifth step; it is not streamed, and counts too.
    assert [value for value, _ in recorded.values["SpecTimeToFirstTokenSeconds"]] == [1.0, 5.0]
    assert [value for value, _ in recorded.values["SpecRequestLatencySeconds"]] == [4.0, 8.0]


@pytest.mark.parametrize("body", [{"prompt": "x", "max_new_tokens": 0}, {"prompt": ""}])
def test_parse_entry_turns_problems_into_errors(body):
    assert isinstance(parse(body), RequestError)


class TimedEngine(FakeEngine):
    """A fake engine whose steps take `step_s` on the harness's clock."""

    def __init__(self, harness_clock: list[float], step_s: float) -> None:
        super().__init__(tokens_per_step=1, num_draft_tokens=1)
        self.clock, self.step_s, self.num_steps = harness_clock, step_s, 0

    def step(self):
        self.clock[0] += self.step_s
        self.num_steps += 1
        return super().step()


def timed_batcher(step_s: float, max_call_s: float):
    clock = [0.0]
    engine = TimedEngine(clock, step_s)
    batcher = ContinuousBatcher(engine, TOKENIZER, clock=lambda: clock[0], max_call_s=max_call_s)
    return batcher, engine, clock


def call(batcher, request_ids, bodies):
    new = {r: parse(bodies[r]) for r in request_ids if not batcher.knows(r)}
    return batcher.run_call(list(request_ids), new, MetricsRecorder(RecordingMetrics()))


def steps_per_call(step_s: float, turnaround_s: float, max_call_s: float, max_new_tokens: int = 64) -> list[int]:
    batcher, engine, clock = timed_batcher(step_s, max_call_s)
    bodies = {"a": {"prompt": "x", "max_new_tokens": max_new_tokens}}
    counts = []
    for _ in range(4):
        before = engine.num_steps
        [reply] = call(batcher, ["a"], bodies)
        counts.append(engine.num_steps - before)
        if reply.more is not True:  # answered whole
            break
        clock[0] += turnaround_s  # the frontend's share, between calls
    return counts


def test_a_call_steps_until_the_frontends_turnaround_is_a_twentieth_of_it():
    # 1 ms steps of a token, a 2.05 ms turnaround: a call of up to 38.95 ms keeps the turnaround at 5%
    # (38 steps). The first call has seen no turnaround yet and runs one step; the third ends with the
    # request's 64th token.
    assert steps_per_call(step_s=0.001, turnaround_s=0.00205, max_call_s=0.05) == [1, 38, 25]


def test_max_call_bounds_a_call_and_zero_means_one_step_a_call():
    assert steps_per_call(step_s=0.001, turnaround_s=0.010, max_call_s=0.0205) == [1, 20, 20, 20]
    assert steps_per_call(step_s=0.001, turnaround_s=0.002, max_call_s=0.0) == [1, 1, 1, 1]


def test_a_step_longer_than_the_budget_is_not_started():
    # 30 ms steps against a 38 ms budget: a second step would end the call at 60 ms.
    assert steps_per_call(step_s=0.030, turnaround_s=0.002, max_call_s=0.05) == [1, 1, 1, 1]


def test_a_call_that_admits_runs_one_step_and_a_call_ends_when_a_request_finishes():
    batcher, engine, clock = timed_batcher(step_s=0.001, max_call_s=0.05)
    bodies = {"a": {"prompt": "x", "max_new_tokens": 64}, "b": {"prompt": "y", "max_new_tokens": 5}}
    call(batcher, ["a"], bodies)
    clock[0] += 0.00205
    counts, replies = [], []
    for _ in range(2):
        before = engine.num_steps
        replies.append(call(batcher, ["a", "b"], bodies))
        counts.append(engine.num_steps - before)
        clock[0] += 0.00205
    # b joins and its first token goes out after one step; the next call stops at the step that
    # finishes b (4 more tokens, 1 a step), not at the budget, and b's answer is whole.
    assert counts == [1, 4]
    assert replies[0][1].more is True and replies[1][1].more is False
    assert len(replies[1][1].body["token_ids"]) == 5
