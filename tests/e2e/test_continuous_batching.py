"""Continuous batching through the real TorchServe of conftest.py (tiny pair, float32, batchSize 4).

- Staggered arrivals: a long greedy stream runs, then three short requests
  arrive. They join the running batch, finish while the long one still
  streams, and every output (greedy, and seeded sampled) equals its output
  alone. The latency ratio of the issue's target is printed, not asserted.
- A client that disconnects mid-stream has its row aborted at the next step.
- A bad request sent together with good ones fails alone.

kill -9 of the worker under load is test_load_and_faults.py's, which runs in
the same (continuous) mode.
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import requests

from .conftest import HTTP_TIMEOUT_S, counter, in_thread, send

# The tiny pair decodes this greedily to the length limit, without an EOS: a long request.
LONG_BODY = {"prompt": "import json", "max_new_tokens": 400, "temperature": 0.0, "stream": True}
SHORT_BODIES = [
    {"prompt": "def fibonacci(n):", "max_new_tokens": 8, "temperature": 0.0},
    {"prompt": "Hello!", "max_new_tokens": 8, "temperature": 0.0, "stream": True},
    {"prompt": "The weather today is", "max_new_tokens": 8, "temperature": 0.8, "seed": 77},
]


def test_staggered_arrivals_join_the_running_batch_with_outputs_equal_to_solo(server):
    solo_long = send(server, LONG_BODY)
    solo_short = [send(server, body) for body in SHORT_BODIES]
    assert solo_long.status == 200 and solo_long.finish_reason == "length", solo_long.error
    assert all(o.status == 200 for o in solo_short), [o.error for o in solo_short]

    results: dict = {}
    long_started = threading.Event()
    long_thread = in_thread(server, LONG_BODY, results, "long", long_started)
    assert long_started.wait(HTTP_TIMEOUT_S), f"the long stream never started\n{server.log_tail()}"
    short_threads = [in_thread(server, body, results, index) for index, body in enumerate(SHORT_BODIES)]
    for thread in short_threads + [long_thread]:
        thread.join(2 * HTTP_TIMEOUT_S)

    long, short = results["long"], [results[index] for index in range(len(SHORT_BODIES))]
    assert long.status == 200 and not long.error, f"{long.error}\n{server.log_tail()}"
    for outcome, alone, body in zip(short, solo_short, SHORT_BODIES):
        assert outcome.status == 200 and not outcome.error, outcome.error
        assert outcome.token_ids == alone.token_ids, f"{body} differs from its output alone"
        assert outcome.text == alone.text
    assert long.token_ids == solo_long.token_ids and long.text == solo_long.text
    # Joining and leaving at every step: the short ones were answered while the long one streamed.
    assert all(outcome.finished < long.finished for outcome in short)

    short_latency = statistics.mean(o.finished - o.started for o in short)
    long_latency = long.finished - long.started
    print(
        f"\nstaggered arrivals: long ({len(long.token_ids)} tokens) {long_latency:.2f} s, "
        f"short ({SHORT_BODIES[0]['max_new_tokens']} tokens) mean {short_latency:.3f} s, "
        f"ratio {short_latency / long_latency:.3f} (target <= 0.25)"
    )


def test_a_disconnected_stream_frees_its_row_at_the_next_step(server):
    aborted_before = counter(server, "SpecAbortedRequests")
    response = requests.post(
        f"{server.inference_url}/predictions/{server.model_name}", json=LONG_BODY, stream=True, timeout=HTTP_TIMEOUT_S
    )
    assert response.status_code == 200, response.text
    lines = response.iter_lines()
    assert json.loads(next(line for line in lines if line.strip()))["token_ids"]
    response.close()  # the client goes away mid-stream

    # The frontend stops sending the job; the handler notices at its next call, which the
    # next request starts (an idle worker is not called at all).
    after = send(server, SHORT_BODIES[0])
    assert after.status == 200, after.error
    deadline = time.monotonic() + HTTP_TIMEOUT_S
    while counter(server, "SpecAbortedRequests") == aborted_before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert counter(server, "SpecAbortedRequests") == aborted_before + 1, server.log_tail()
    # Nothing is left running: the gauge, sent when it changes, reads an idle batch.
    assert counter(server, "SpecBatchOccupancy") == 0


def test_a_bad_request_among_good_ones_fails_alone(server):
    good = [SHORT_BODIES[0], dict(SHORT_BODIES[2], stream=True)]
    alone = [send(server, body) for body in good]
    bodies = [good[0], {"prompt": "x", "top_p": 9}, good[1], {"prompt": "y", "max_new_tokens": 5000}]
    results: dict = {}
    threads = [in_thread(server, body, results, index) for index, body in enumerate(bodies)]
    for thread in threads:
        thread.join(2 * HTTP_TIMEOUT_S)
    assert [results[i].status for i in range(len(bodies))] == [200, 400, 200, 400]
    assert "top_p" in results[1].error and "max_new_tokens" in results[3].error
    assert results[0].token_ids == alone[0].token_ids
    assert results[2].token_ids == alone[1].token_ids and results[2].text == alone[1].text
    # The worker carries on.
    assert send(server, SHORT_BODIES[1]).status == 200


def test_vllm_speculation_counters_add_up(server):
    names = ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "SpecDraftTokens", "SpecAcceptedTokens")
    before = {name: counter(server, name) for name in names}
    drafts_before = counter(server, "spec_decode_num_drafts")
    per_position_before = counter(server, "spec_decode_num_accepted_tokens_per_pos")
    outcome = send(server, {"prompt": "def add(a, b):", "max_new_tokens": 24})
    assert outcome.status == 200
    time.sleep(1)  # metrics reach the frontend through the worker's log
    delta = {name: counter(server, name) - before[name] for name in names}
    assert delta["spec_decode_num_draft_tokens"] == delta["SpecDraftTokens"] > 0
    assert delta["spec_decode_num_accepted_tokens"] == delta["SpecAcceptedTokens"]
    num_drafts = counter(server, "spec_decode_num_drafts") - drafts_before
    per_position = counter(server, "spec_decode_num_accepted_tokens_per_pos") - per_position_before
    # Each draft proposes 1..k tokens; the accepted ones counted by position add up to the total.
    assert 0 < num_drafts <= delta["spec_decode_num_draft_tokens"]
    assert per_position == delta["spec_decode_num_accepted_tokens"]
