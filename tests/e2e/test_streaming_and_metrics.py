"""End-to-end: streamed answers through TorchServe, and Prometheus metrics that add up."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from handler.config import DEFAULT_LATENCY_BUCKETS_S
from handler.metrics import BUCKET_COUNTERS, LE_DIMENSION
from handler.schema import STREAM_CHUNK_KEYS

from .conftest import HTTP_TIMEOUT_S, metric_samples

STREAMED = [
    {"prompt": "def fibonacci(n):", "max_new_tokens": 20},
    {"prompt": "The weather today is", "max_new_tokens": 14, "temperature": 0.8, "seed": 11},
    {"messages": [{"role": "user", "content": "Tell me a story."}], "max_new_tokens": 12, "num_speculative_tokens": 2},
    {"prompt": "Hello!", "max_new_tokens": 16, "num_speculative_tokens": 6},
]


def stream(server, body: dict) -> tuple[list[dict], requests.Response]:
    response = requests.post(
        f"{server.inference_url}/predictions/{server.model_name}",
        json={**body, "stream": True},
        stream=True,
        timeout=HTTP_TIMEOUT_S,
    )
    assert response.status_code == 200, f"{response.status_code}: {response.text}\n{server.log_tail()}"
    lines = [json.loads(line) for line in response.iter_lines() if line.strip()]
    return lines, response


def check_stream_equals_plain(lines: list[dict], plain: dict) -> None:
    *chunks, final = lines
    assert all(set(chunk) == set(STREAM_CHUNK_KEYS) for chunk in chunks)
    assert {"finish_reason", "usage", "speculative"} <= set(final)
    assert "".join(line["text_delta"] for line in lines) == plain["text"]
    assert sum((line["token_ids"] for line in lines), []) == plain["token_ids"]
    assert final["finish_reason"] == plain["finish_reason"]
    # cached_tokens depends on what the prefix cache held when each was sent.
    for key in ("prompt_tokens", "completion_tokens"):
        assert final["usage"][key] == plain["usage"][key]


def test_stream_is_chunked_ndjson_equal_to_the_plain_answer(server):
    body = STREAMED[0]
    plain = server.predict_ok(body)
    lines, response = stream(server, body)
    assert response.headers.get("Transfer-Encoding", "").lower() == "chunked"
    assert len(lines) >= 2, "at least one chunk per verification step, then the final line"
    check_stream_equals_plain(lines, plain)


def test_concurrent_streams_in_shared_batches(server):
    plain = [server.predict_ok(body) for body in STREAMED]
    with ThreadPoolExecutor(len(STREAMED)) as pool:
        streamed = list(pool.map(lambda body: stream(server, body)[0], STREAMED))
    for lines, answer in zip(streamed, plain):
        check_stream_equals_plain(lines, answer)


def test_stop_strings_do_not_leak_into_the_stream(server):
    full = server.predict_ok({"prompt": "def fibonacci(n):", "max_new_tokens": 30})
    stop = full["text"][8:11]
    body = {"prompt": "def fibonacci(n):", "max_new_tokens": 30, "stop": [stop]}
    lines, _ = stream(server, body)
    assert "".join(line["text_delta"] for line in lines) == full["text"][: full["text"].index(stop)]
    assert lines[-1]["finish_reason"] == "stop"


def read_metrics(server) -> dict[str, float]:
    """Sums each Spec* series over its labels (TorchServe adds ModelName, Level, Hostname)."""
    totals: dict[str, float] = {}
    for name, _, value in metric_samples(server):
        if name.startswith("Spec"):
            totals[name] = totals.get(name, 0.0) + value
    return totals


def bucket_counts(server) -> dict[tuple[str, str], float]:
    """{(bucket counter, le): value} of handler.metrics.BUCKET_COUNTERS' series on /metrics."""
    return {
        (name, labels[LE_DIMENSION]): value
        for name, labels, value in metric_samples(server)
        if name in BUCKET_COUNTERS.values()
    }


def test_prometheus_counters_agree_with_the_responses(server):
    before = read_metrics(server)
    buckets_before = bucket_counts(server)
    bodies = [
        {"prompt": "import numpy as np", "max_new_tokens": 12},
        {"prompt": "Once upon a time", "max_new_tokens": 9, "temperature": 0.9, "seed": 1},
        {"prompt": "x", "top_p": 7},  # rejected: counted apart
    ]
    answers = [server.predict(body) for body in bodies]
    assert [a.status_code for a in answers] == [200, 200, 400]
    stats = [a.json()["speculative"] for a in answers[:2]]
    streamed_lines, _ = stream(server, {"prompt": "Hello", "max_new_tokens": 6})
    stats.append(streamed_lines[-1]["speculative"])
    completions = [a.json()["usage"]["completion_tokens"] for a in answers[:2]] + [
        streamed_lines[-1]["usage"]["completion_tokens"]
    ]
    after = read_metrics(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("SpecRequests") == 3
    assert delta("SpecRejectedRequests") == 1
    assert delta("SpecDraftTokens") == sum(s["draft_tokens"] for s in stats)
    assert delta("SpecAcceptedTokens") == sum(s["accepted_tokens"] for s in stats)
    assert delta("SpecTargetForwardPasses") == sum(s["target_forward_passes"] for s in stats)
    assert delta("SpecGeneratedTokens") == sum(completions)
    assert delta("SpecRequestLatencySeconds_count") == 3
    assert delta("SpecTimeToFirstTokenSeconds_count") == 3  # every answered request, streamed or not
    assert delta("SpecRequestLatencySeconds_sum") > 0

    # The same latencies in the config's buckets (the defaults here), cumulative: +Inf counts them all.
    # Each bucket is a worker-log line that TorchServe parses in its own time: wait until the last
    # request's lines are all in.
    allowed = {f"{bound:g}" for bound in DEFAULT_LATENCY_BUCKETS_S} | {"+Inf"}
    ordered = sorted(allowed, key=float)  # float("+Inf") sorts last
    names = [BUCKET_COUNTERS[histogram] for histogram in ("SpecRequestLatencySeconds", "SpecTimeToFirstTokenSeconds")]
    deadline = time.monotonic() + HTTP_TIMEOUT_S
    while True:
        buckets_after = bucket_counts(server)
        counted = [buckets_after.get((name, "+Inf"), 0.0) - buckets_before.get((name, "+Inf"), 0.0) for name in names]
        if counted == [3, 3] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {le for _, le in buckets_after} <= allowed, buckets_after
    for histogram in ("SpecRequestLatencySeconds", "SpecTimeToFirstTokenSeconds"):
        name = BUCKET_COUNTERS[histogram]
        deltas = [buckets_after.get((name, le), 0.0) - buckets_before.get((name, le), 0.0) for le in ordered]
        assert deltas[-1] == delta(f"{histogram}_count") == 3, dict(zip(ordered, deltas))
        assert deltas == sorted(deltas), f"{name}: buckets not cumulative: {dict(zip(ordered, deltas))}"


# Series the Grafana dashboard (deploy/grafana/) reads that any answered request makes TorchServe
# export. The others come with their events: errors, evictions, the planner (adaptive_k is off in
# this server's config), stored responses, prefix-cache hits, TorchServe's system metrics.
EVERYDAY_DASHBOARD_SERIES = {
    "SpecRequests",
    "SpecGeneratedTokens",
    "SpecBatchOccupancy",
    "SpecAcceptedTokens",
    "SpecDraftTokens",
    "SpecTargetForwardPasses",
    "SpecDrafterAcceptedTokens",
    "SpecDrafterDraftTokens",
    "prefix_cache_queries",
    "SpecRequestLatencySecondsBucket",
    "SpecTimeToFirstTokenSecondsBucket",
    "SpecTimePerOutputTokenSeconds_bucket",
    "ts_queue_latency_microseconds",
    "ts_inference_requests_total",
}


def test_the_dashboard_reads_series_under_the_names_torchserve_exports(server):
    """tests/deploy holds the dashboard to the declared names; this holds the declared names to what a real
    TorchServe puts on /metrics (no suffix added to a counter, the le label kept)."""
    from tests.deploy.test_grafana_dashboard import queries, series_in

    used = {series for _, expr in queries() for series in series_in(expr)}
    assert EVERYDAY_DASHBOARD_SERIES <= used, EVERYDAY_DASHBOARD_SERIES - used
    server.predict_ok({"prompt": "def add(a, b):", "max_new_tokens": 8})
    exported = {name for name, _, _ in metric_samples(server)}
    assert not EVERYDAY_DASHBOARD_SERIES - exported, f"not on /metrics: {EVERYDAY_DASHBOARD_SERIES - exported}"
