"""Per-drafter counters, labelled by drafter; the prefix cache's counters sent as increments; latency buckets."""

from __future__ import annotations

from handler.api.openai.responses import ResponseStore
from handler.caches.prefix_cache import PrefixCacheStats
from handler.drafters.suffix import SuffixTreeStats
from handler.engine import SpeculativeStats
from handler.metrics import (
    BUCKET_COUNTERS,
    DRAFTER_DIMENSION,
    LE_DIMENSION,
    CostScaleTally,
    MetricsRecorder,
    PrefixCacheTally,
    ResponseStoreTally,
    SuffixTreeTally,
)


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
    stats.draft_passes = 4  # the model's 5 drafts, one of them guessed
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
    assert totals["SpecDraftPasses"] == 4
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


def test_prefix_cache_counters_go_out_as_increments_and_the_gauge_when_it_changes():
    tally, cache = PrefixCacheTally(), RecordingCache()
    recorder = MetricsRecorder(cache)

    def recorded() -> dict:
        values = {name: value for name, value, _ in cache.calls}
        cache.calls.clear()
        return values

    tally.record(recorder, PrefixCacheStats(queries=40, hits=0, num_bytes=4096, num_tokens=39))
    assert recorded() == {"prefix_cache_queries": 40, "SpecPrefixCacheBytes": 4096}
    tally.record(recorder, PrefixCacheStats(queries=80, hits=39, num_bytes=4096, num_tokens=39))
    assert recorded() == {"prefix_cache_queries": 40, "prefix_cache_hits": 39}, "same bytes: no gauge line"
    tally.record(recorder, PrefixCacheStats(queries=80, hits=39, num_bytes=4096, num_tokens=39))
    assert recorded() == {}, "nothing moved: nothing sent"
    tally.record(recorder, PrefixCacheStats(queries=90, hits=45, evictions=2, evicted_tokens=30, num_bytes=1024))
    assert recorded() == {
        "prefix_cache_queries": 10,
        "prefix_cache_hits": 6,
        "SpecPrefixCacheEvictions": 2,
        "SpecPrefixCacheBytes": 1024,
    }


def test_a_cache_that_is_off_records_nothing():
    cache = RecordingCache()
    PrefixCacheTally().record(MetricsRecorder(cache), None)
    assert cache.calls == []


def test_the_response_store_gauges_go_out_when_it_changes_and_evictions_as_increments():
    tally, cache, store = ResponseStoreTally(), RecordingCache(), ResponseStore(max_entries=1)
    recorder = MetricsRecorder(cache)
    tally.record(recorder, store)
    assert [(name, value) for name, value, _ in cache.calls] == [
        ("SpecResponsesStored", 0),
        ("SpecResponsesStoreBytes", 0),
    ]
    cache.calls.clear()
    tally.record(recorder, store)
    assert cache.calls == [], "unchanged: nothing sent"
    store.put("a", [{"role": "user", "content": "a"}], {"id": "a"})
    store.put("b", [{"role": "user", "content": "b"}], {"id": "b"})  # evicts a
    tally.record(recorder, store)
    assert [(name, value) for name, value, _ in cache.calls] == [
        ("SpecResponsesStored", 1),
        ("SpecResponsesStoreBytes", store.num_bytes),
        ("SpecResponsesEvicted", 1),
    ]


def test_the_suffix_tree_gauges_go_out_when_the_shared_tree_changes():
    tally, cache = SuffixTreeTally(), RecordingCache()
    recorder = MetricsRecorder(cache)
    tally.record(recorder, SuffixTreeStats(num_requests=0, num_tokens=0))
    assert [(name, value) for name, value, _ in cache.calls] == [
        ("SpecSuffixTreeRequests", 0),
        ("SpecSuffixTreeTokens", 0),
    ]
    cache.calls.clear()
    tally.record(recorder, SuffixTreeStats(num_requests=0, num_tokens=0))
    assert cache.calls == [], "unchanged: nothing sent"
    tally.record(recorder, SuffixTreeStats(num_requests=2, num_tokens=70))
    assert [(name, value) for name, value, _ in cache.calls] == [
        ("SpecSuffixTreeRequests", 2),
        ("SpecSuffixTreeTokens", 70),
    ]


def test_the_cost_gauges_go_out_when_the_correction_moves_by_a_few_points():
    tally, cache = CostScaleTally(), RecordingCache()
    recorder = MetricsRecorder(cache)
    tally.record(recorder, None)
    assert cache.calls == [], "a table that stands as measured: no gauge"
    tally.record(recorder, (1.0, 1.0))
    assert [(name, value) for name, value, _ in cache.calls] == [
        ("SpecTargetCostPercent", 100.0),
        ("SpecDraftCostPercent", 100.0),
    ]
    cache.calls.clear()
    tally.record(recorder, (1.02, 0.98))
    assert cache.calls == [], "within a few points: nothing sent"
    tally.record(recorder, (1.02, 1.6))
    assert [(name, value) for name, value, _ in cache.calls] == [
        ("SpecTargetCostPercent", 102.0),
        ("SpecDraftCostPercent", 160.0),
    ]


def test_tree_counters_go_out_only_for_requests_that_verified_trees():
    stats = SpeculativeStats(num_speculative_tokens=4, drafter="suffix")
    stats.record("suffix", 4, 1)
    cache = RecordingCache()
    MetricsRecorder(cache).record_result(stats, latency_seconds=1.0)
    assert not any(name.startswith("SpecTree") for name, _, _ in cache.calls)
    stats.record_tree(6, 3, first_choice=False)
    stats.record_tree(4, 1, first_choice=True)
    cache = RecordingCache()
    MetricsRecorder(cache).record_result(stats, latency_seconds=1.0)
    trees = {name: value for name, value, _ in cache.calls if name.startswith("SpecTree")}
    assert trees == {"SpecTreeSteps": 2, "SpecTreeNodes": 10, "SpecTreeAcceptedDepth": 4, "SpecTreeOtherBranch": 1}


def test_the_plan_goes_out_as_a_sample_of_steps_by_batch_size_and_a_drafting_share():
    from handler.engine import StepRecord
    from handler.metrics import PLAN_SAMPLE_EVERY, PlanTally

    def step(ks):
        return StepRecord(len(ks), tuple(ks), 0, 0.1, 0.0, 0.0, 0.1)

    tally, cache = PlanTally(), RecordingCache()
    recorder = MetricsRecorder(cache)
    tally.record(recorder, 0, [])
    assert cache.calls == []
    steps = [step([4, 0])] * PLAN_SAMPLE_EVERY + [step([0, 0, 0, 0])] * PLAN_SAMPLE_EVERY
    tally.record(recorder, len(steps), steps)
    plans = [(value, dims) for name, value, dims in cache.calls if name == "SpecPlannedDraftsPerRow"]
    assert plans == [(2.0, [("batch_size", "2")]), (0.0, [("batch_size", "4")])]
    assert [(n, v) for n, v, _ in cache.calls if n == "SpecDraftingRowsPercent"] == [
        ("SpecDraftingRowsPercent", round(100.0 / 6, 1))
    ]
    cache.calls.clear()
    tally.record(recorder, len(steps), steps)
    assert cache.calls == [], "no new step: nothing sent"
    tally.record(recorder, len(steps) + 2, [*steps, step([1, 1, 1, 1]), step([1, 1, 1, 1])])
    # Step 16 is sampled, step 17 is not; the share moved from 17 % to 100 %.
    assert [(n, v) for n, v, _ in cache.calls] == [("SpecPlannedDraftsPerRow", 1.0), ("SpecDraftingRowsPercent", 100.0)]


def test_latencies_also_go_out_into_the_configured_buckets_cumulatively():
    cache = RecordingCache()
    recorder = MetricsRecorder(cache, latency_buckets_s=(1.0, 30.0, 120.0))
    recorder.record_result(SpeculativeStats(num_speculative_tokens=4, drafter="model"), latency_seconds=42.0)
    recorder.record_time_to_first_token(0.5)
    recorder.record_queue_wait(30.0)  # a bound is inclusive, as Prometheus' le is

    def buckets(name: str) -> list[str]:
        return [dims[0][1] for call_name, value, dims in cache.calls if call_name == name and value == 1]

    assert buckets("SpecRequestLatencySecondsBucket") == ["120", "+Inf"]
    assert buckets("SpecTimeToFirstTokenSecondsBucket") == ["1", "30", "120", "+Inf"]
    assert buckets("SpecQueueWaitSecondsBucket") == ["30", "120", "+Inf"]
    labels = {dims[0][0] for name, _, dims in cache.calls if name in BUCKET_COUNTERS.values()}
    assert labels == {LE_DIMENSION}
    # TorchServe's own histograms still get every latency.
    histograms = {name: value for name, value, _ in cache.calls if name in BUCKET_COUNTERS}
    assert histograms == {
        "SpecRequestLatencySeconds": 42.0,
        "SpecTimeToFirstTokenSeconds": 0.5,
        "SpecQueueWaitSeconds": 30.0,
    }


def test_the_default_buckets_reach_minutes():
    from handler.config import DEFAULT_LATENCY_BUCKETS_S, HandlerConfig

    assert HandlerConfig().metrics_latency_buckets_s == DEFAULT_LATENCY_BUCKETS_S
    assert max(DEFAULT_LATENCY_BUCKETS_S) >= 300 and min(DEFAULT_LATENCY_BUCKETS_S) <= 0.1
    cache = RecordingCache()
    MetricsRecorder(cache).record_queue_wait(200.0)
    assert [dims[0][1] for _, _, dims in cache.calls if dims] == ["300", "600", "+Inf"]
