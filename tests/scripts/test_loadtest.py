"""scripts.loadtest without a server: the request mix, percentiles, the report."""

from __future__ import annotations

import json

import pytest

from scripts import loadtest


def test_plan_mixes_requests_reproducibly():
    config = loadtest.LoadConfig(num_requests=400, stream_fraction=0.25, sampled_fraction=0.5, max_new_tokens=5)
    planned = loadtest.plan_requests(config)

    assert planned == loadtest.plan_requests(config)
    assert sum(bool(p.body.get("stream")) for p in planned) == pytest.approx(100, abs=30)
    sampled = [p for p in planned if p.body["temperature"] > 0]
    assert len(sampled) == pytest.approx(200, abs=40)
    assert all(p.body["seed"] == p.index for p in sampled)
    assert all(p.body["max_new_tokens"] == 5 for p in planned)
    assert {p.kind for p in planned} == {"greedy/plain", "greedy/stream", "sampled/plain", "sampled/stream"}


def test_percentile_interpolates():
    assert loadtest.percentile([], 50) is None
    assert loadtest.percentile([3.0], 99) == 3.0
    assert loadtest.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert loadtest.percentile(list(map(float, range(101))), 95) == 95.0


def test_summary_counts_errors_and_lost_requests():
    config = loadtest.LoadConfig(num_requests=4)
    outcomes = [
        loadtest.Outcome(
            0,
            "greedy/plain",
            "ok",
            200,
            latency_s=1.0,
            completion_tokens=10,
            acceptance_rate=0.5,
            mean_accepted_length=2.0,
        ),
        loadtest.Outcome(
            1,
            "greedy/stream",
            "ok",
            200,
            latency_s=2.0,
            first_chunk_s=0.5,
            completion_tokens=10,
            acceptance_rate=1.0,
            mean_accepted_length=3.0,
        ),
        loadtest.Outcome(2, "sampled/plain", "http_error", 507, "HTTP 507: Worker died"),
        loadtest.Outcome(3, "sampled/stream", "lost", None, "ChunkedEncodingError: Connection broken"),
    ]
    summary = loadtest.summarize(config, outcomes, wall_s=2.0)

    assert (summary["ok"], summary["errors"], summary["lost"], summary["malformed"]) == (2, 1, 1, 0)
    assert summary["errors_by_status"] == {"507": 1}
    assert summary["lost_by_error"] == {"ChunkedEncodingError": 1}
    assert summary["tokens_per_s"] == 10.0
    assert summary["latency_s"]["p50"] == 1.5
    assert summary["first_chunk_s"]["p50"] == 0.5
    assert summary["mean_acceptance_rate"] == 0.75
    table = loadtest.format_table(summary)
    assert "LOST" in table and "Worker died" in table
    json.dumps(summary)  # --json-out can write it
