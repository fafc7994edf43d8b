"""Per-drafter counters: each proposer's drafted and accepted tokens, labelled by drafter."""

from __future__ import annotations

from handler.engine import SpeculativeStats
from handler.metrics import DRAFTER_DIMENSION, MetricsRecorder


class RecordingCache:
    def __init__(self) -> None:
        self.calls = []

    def add_metric(self, name, value, unit, dimensions, metric_type):
        self.calls.append((name, value, [(d.name, d.value) for d in dimensions]))


def test_hybrid_request_counts_each_proposer_under_its_label():
    stats = SpeculativeStats(num_speculative_tokens=4, drafter="hybrid")
    stats.record("ngram", 4, 4)
    stats.record("model", 3, 1)
    stats.record("model", 2, 0)
    cache = RecordingCache()
    MetricsRecorder(cache).record_result(stats, latency_seconds=1.0)
    labelled = {
        (name, dims[0][1]): value for name, value, dims in cache.calls if dims[:1] and dims[0][0] == DRAFTER_DIMENSION
    }
    assert labelled == {
        ("SpecDrafterDraftTokens", "ngram"): 4,
        ("SpecDrafterAcceptedTokens", "ngram"): 4,
        ("SpecDrafterDraftTokens", "model"): 5,
        ("SpecDrafterAcceptedTokens", "model"): 1,
    }
    totals = {name: value for name, value, dims in cache.calls if not dims}
    assert totals["SpecDraftTokens"] == 9 and totals["SpecAcceptedTokens"] == 5
    assert stats.accepted_per_position == [2, 1, 1, 1]
    assert stats.num_drafts == 3 and stats.rejections == 2


def test_a_constrained_request_counts_once_with_its_mask_time_per_step():
    stats = SpeculativeStats(num_speculative_tokens=4, drafter="model", constrained=True, mask_seconds=0.004)
    stats.record("grammar", 6, 6)
    stats.record("model", 4, 2)
    cache = RecordingCache()
    MetricsRecorder(cache).record_result(stats, latency_seconds=1.0)
    values = {(name, dims[0][1] if dims else None): value for name, value, dims in cache.calls}
    assert values[("SpecConstrainedRequests", None)] == 1
    assert values[("SpecGrammarMaskSecondsPerStep", None)] == 0.002
    assert values[("SpecDrafterDraftTokens", "grammar")] == 6


def test_an_unconstrained_request_records_no_grammar_metrics():
    stats = SpeculativeStats(num_speculative_tokens=4)
    stats.record("model", 4, 2)
    cache = RecordingCache()
    MetricsRecorder(cache).record_result(stats, latency_seconds=1.0)
    assert not {"SpecConstrainedRequests", "SpecGrammarMaskSecondsPerStep"} & {name for name, _, _ in cache.calls}
