"""scripts.serving.loadtest without a server: the request mix, percentiles, the report."""

from __future__ import annotations

import dataclasses
import json

import pytest

from scripts.serving import loadtest


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


def test_open_loop_plan_has_poisson_arrivals_and_mixed_lengths():
    config = loadtest.LoadConfig(
        num_requests=2000, rate=4.0, long_fraction=0.25, max_new_tokens=8, long_max_new_tokens=128
    )
    planned = loadtest.plan_requests(config)
    assert planned == loadtest.plan_requests(config)
    gaps = [b.send_at - a.send_at for a, b in zip(planned, planned[1:])]
    assert planned[0].send_at == 0 and all(gap >= 0 for gap in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)  # mean gap 1 / rate
    longs = [p for p in planned if p.length == loadtest.LONG]
    assert len(longs) == pytest.approx(500, abs=60)
    assert all(p.body["max_new_tokens"] == (128 if p.length == loadtest.LONG else 8) for p in planned)
    # Adding arrivals and lengths leaves the decoding/stream mix of a seed as it was.
    closed = loadtest.plan_requests(loadtest.LoadConfig(num_requests=2000, max_new_tokens=8))
    assert [p.kind for p in closed] == [p.kind for p in planned]


def test_report_gives_ttft_tpot_per_length_and_compares_two_runs():
    config = loadtest.LoadConfig(num_requests=3, rate=1.0, long_fraction=0.5)

    def outcome(index, length, latency, first_chunk, tokens):
        return loadtest.Outcome(
            index,
            "greedy/stream",
            "ok",
            200,
            latency_s=latency,
            first_chunk_s=first_chunk,
            completion_tokens=tokens,
            length=length,
            num_lines=tokens,
        )

    outcomes = [outcome(0, "short", 1.0, 0.2, 9), outcome(1, "long", 9.0, 1.0, 81), outcome(2, "short", 2.0, 0.4, 9)]
    summary = loadtest.summarize(config, outcomes, wall_s=10.0)
    assert summary["by_length"]["short"]["latency_s"]["p50"] == 1.5
    assert summary["by_length"]["long"]["requests"] == 1
    assert summary["tpot_s"]["p50"] == pytest.approx(0.1)  # (1.0 - 0.2) / 8, (9 - 1) / 80, (2 - 0.4) / 8
    assert "open loop, Poisson at 1.0 req/s" in loadtest.format_table(summary)
    baseline = loadtest.summarize(
        dataclasses.replace(config, model="static"),
        [outcome(0, "short", 4.0, 0.2, 9), outcome(1, "long", 9.0, 1.0, 81), outcome(2, "short", 4.0, 0.4, 9)],
        wall_s=20.0,
    )
    comparison = loadtest.format_comparison(summary, baseline)
    assert "static" in comparison
    assert [line for line in comparison.splitlines() if line.startswith("short latency p50")][0].endswith("0.375")
    assert [line for line in comparison.splitlines() if line.startswith("tokens/s")][0].endswith("2.000")
